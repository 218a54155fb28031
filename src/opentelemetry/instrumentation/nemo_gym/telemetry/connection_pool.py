"""aiohttp connection-pool capacity diagnostics and queue-wait metrics.

Two halves share this module. ``QueueTimedTCPConnector`` measures, on the event loop, how
long requests wait for a free pool slot and counts connects per destination; it only records
into instruments captured when it was constructed and never changes a request's result,
timing out or cancellation. The capacity functions are plain arithmetic over a connector
configuration, run once at start-up, that log the per-worker limits and warn when intended
demand cannot fit.

Destination labels come from ``set_server_name`` and are capped at
``OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES`` distinct values per process; later names are
recorded as ``other``.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
from time import perf_counter
from typing import Any

import aiohttp
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from opentelemetry.metrics import Histogram

from opentelemetry.instrumentation.nemo_gym import _aiohttp_compat, _exporting, _settings
from opentelemetry.instrumentation.nemo_gym._once import OnceLog

# The documented names live in the pure-arithmetic module; they are re-exported here, where
# page 004 documents them (the redundant aliases mark the private ones as re-exports).
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import (
    ConnectionPoolCapacity,
    ConnectionPoolConfig,
    capacity_line,
    capacity_warnings,
    connection_pool_capacity,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import (
    _display_limit as _display_limit,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import (
    _effective_per_host_limit as _effective_per_host_limit,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    ATTR_QUEUE_CONSTRAINT,
    ATTR_QUEUE_OUTCOME,
    ATTR_SERVER_NAME,
    OUTCOME_ABANDONED,
    OUTCOME_OK,
    active_instruments,
)

__all__ = [
    "ConnectionPoolCapacity",
    "ConnectionPoolConfig",
    "QueueTimedTCPConnector",
    "build_connection_pool_connector",
    "connection_pool_capacity",
    "report_connection_pool_capacity",
    "reset_server_name",
    "set_server_name",
]

logger = logging.getLogger(__name__)

# Connect counts per bounded destination label, read by the observable counter's callback.
# Guarded by _CONNECT_COUNTS_LOCK because collection may run on the exporter's thread.
_CONNECT_COUNTS: dict[str, int] = {}
_CONNECT_COUNTS_LOCK = threading.Lock()
# (workers, limit, limit_per_host, intended, intended_per_host) already reported.
_REPORTED_CAPACITIES: set[tuple[object, ...]] = set()
_REPORTED_CAPACITIES_LOCK = threading.Lock()
_SERVER_NAME: contextvars.ContextVar[str] = contextvars.ContextVar(
    "nemo_gym_http_server_name", default="external"
)

_OTHER = "other"
# Labels admitted under the cap. Only ever grows (to at most the cap) under _LABELS_LOCK, so
# the lock-free membership test on the hot path is safe: a stale "absent" only means taking
# the slow path once more.
_SEEN_LABELS: set[str] = set()
_LABELS_LOCK = threading.Lock()
_label_cap: int | None = None
# Attribute dictionaries per (constraint, outcome, label), built once and never mutated, so a
# queue sample costs a dictionary lookup rather than a dictionary build. Keys are admitted
# labels only, which bounds it at 3 x 2 x (cap + 1) entries.
_WAIT_ATTRIBUTES: dict[tuple[str, str, str], dict[str, str]] = {}
_ONCE = OnceLog(logger)

_PORT_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"


def set_server_name(server_name: str) -> contextvars.Token[str]:
    """Set the bounded destination label while one logical request and its retries run.

    The label applies to connects and queue waits in the current context (task) until the
    returned token is passed to ``reset_server_name``. Raises ``ValueError`` for an empty or
    non-string name.
    """
    if not isinstance(server_name, str) or not server_name:
        raise ValueError(f"server_name={server_name!r} must be a non-empty string")
    return _SERVER_NAME.set(server_name)


def reset_server_name(token: contextvars.Token[str]) -> None:
    """Restore the caller's destination label."""
    _SERVER_NAME.reset(token)


def _bounded_label(label: str) -> str:
    """Return ``label`` while under the distinct-label cap, else ``other`` (warning once)."""
    if label in _SEEN_LABELS:
        return label
    global _label_cap
    with _LABELS_LOCK:
        if label in _SEEN_LABELS:
            return label
        if _label_cap is None:
            _label_cap = _settings.max_server_names()
        if len(_SEEN_LABELS) < _label_cap:
            _SEEN_LABELS.add(label)
            return label
    _ONCE(
        "label-cap",
        logging.WARNING,
        "more than %d distinct destination names (set_server_name); %r and later new "
        "names are recorded as %r. Raise OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES if these "
        "names are bounded.",
        _label_cap,
        label,
        _OTHER,
    )
    return _OTHER


def _log_failure_once(what: str, error: Exception) -> None:
    _ONCE(
        "failure",
        logging.DEBUG,
        "connection-pool telemetry failed while %s; carrying on",
        what,
        exc_info=error,
    )


def _connect_count_snapshot() -> dict[str, int]:
    """Return a copy of the connect counts per destination label; safe from any thread."""
    with _CONNECT_COUNTS_LOCK:
        return dict(_CONNECT_COUNTS)


def _wait_attributes(constraint: str, outcome: str, label: str) -> dict[str, str]:
    bounded = _bounded_label(label)
    key = (constraint, outcome, bounded)
    attributes = _WAIT_ATTRIBUTES.get(key)
    if attributes is None:
        attributes = {
            ATTR_QUEUE_CONSTRAINT: constraint,
            ATTR_QUEUE_OUTCOME: outcome,
            ATTR_SERVER_NAME: bounded,
        }
        _WAIT_ATTRIBUTES[key] = attributes
    return attributes


def _connector_queue_constraint(connector: Any) -> str:
    """Classify the binding connector limit when aiohttp reports a queue wait.

    ``total`` when the total limit is finite and exhausted, otherwise ``per_host``;
    ``unknown`` when the connector cannot be introspected. Never raises.
    """
    return _aiohttp_compat.queue_constraint(connector)


class QueueTimedTCPConnector(aiohttp.TCPConnector):
    """TCPConnector that measures how long connections wait for a free pool slot.

    Every ``connect()`` call increments ``connect_total`` for the current destination. Each
    queued acquisition records one ``queue_duration_ms`` sample, labelled with the limit that
    was binding when the wait started and whether it ended ``ok`` or ``abandoned``. The wait
    is timed by overriding aiohttp's private ``_wait_for_available_connection``;
    ``test_queue_wait_override_matches_aiohttp_signature`` fails if aiohttp changes it.

    The instruments are those active (``_instruments.active_instruments()``) at construction.
    Use it on the event loop, like any aiohttp connector.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        histogram: Histogram | None
        try:
            histogram = active_instruments().queue_duration
        except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
            # No instruments means no samples; the connector itself must still work.
            _log_failure_once("creating instruments", error)
            histogram = None
        self._nemo_gym_queue_duration = histogram
        if not _aiohttp_compat.QUEUE_WAIT_HOOK_AVAILABLE:
            _warn_no_hook_once()

    async def connect(self, req: ClientRequest, *args: Any, **kwargs: Any) -> Connection:
        """Count the destination, then get a connection exactly as aiohttp would.

        Counted first so that failed, timed-out and cancelled connects are counted too.
        """
        # The counting is written out, not delegated: this runs for every request, inside
        # aiohttp's request path, where every extra call shows in benchmarks/pool_overhead.py.
        try:
            label = _SERVER_NAME.get()
            if label not in _SEEN_LABELS:
                label = _bounded_label(label)
            with _CONNECT_COUNTS_LOCK:
                _CONNECT_COUNTS[label] = _CONNECT_COUNTS.get(label, 0) + 1
        except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
            _log_failure_once("counting a connect", error)
        return await super().connect(req, *args, **kwargs)

    async def _wait_for_available_connection(self, key: ConnectionKey, traces: list[Trace]) -> None:
        # Classified before waiting: by the time the wait ends the slot that freed up has
        # changed the counts, and the question is what made us wait.
        constraint = _aiohttp_compat.queue_constraint(self)
        label = _SERVER_NAME.get()
        started = perf_counter()
        try:
            await super()._wait_for_available_connection(key, traces)
        except BaseException:
            # Timeout and cancellation land here; record, then re-raise the very same
            # exception so the caller sees what a plain TCPConnector would raise.
            self._record_wait(started, constraint, OUTCOME_ABANDONED, label)
            raise
        self._record_wait(started, constraint, OUTCOME_OK, label)

    def _record_wait(self, started: float, constraint: str, outcome: str, label: str) -> None:
        elapsed_ms = (perf_counter() - started) * 1000.0
        histogram = self._nemo_gym_queue_duration
        if histogram is None:
            return
        try:
            attributes = _WAIT_ATTRIBUTES.get((constraint, outcome, label))
            if attributes is None:
                attributes = _wait_attributes(constraint, outcome, label)
            histogram.record(elapsed_ms, attributes)
        except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
            _log_failure_once("recording a queue wait", error)


def _warn_no_hook_once() -> None:
    _ONCE(
        "no-hook",
        logging.WARNING,
        "aiohttp %s has no TCPConnector._wait_for_available_connection (added in 3.10.11); "
        "connects are counted but queue waits are not timed",
        aiohttp.__version__,
    )


def build_connection_pool_connector(**kwargs: Any) -> aiohttp.TCPConnector:
    """Build the timed connector only while this process exports metrics.

    Exporting means the global meter provider is an SDK ``MeterProvider``, not disabled by
    ``OTEL_SDK_DISABLED``, with at least one metric reader. Otherwise, and with the same
    ``kwargs``, a plain ``aiohttp.TCPConnector``. Call it where the connector would be made
    (inside a running event loop).
    """
    if _exporting.metrics_exported():
        return QueueTimedTCPConnector(**kwargs)
    return aiohttp.TCPConnector(**kwargs)


def _ephemeral_port_capacity() -> int | None:
    """Return Linux's approximate per-destination ephemeral-port budget when available.

    The size of ``ip_local_port_range`` (reserved ports are not subtracted), or ``None``
    where the file cannot be read or parsed.
    """
    try:
        with open(_PORT_RANGE_PATH, encoding="ascii") as handle:
            low, high = (int(part) for part in handle.read().split())
    except (OSError, ValueError):
        return None
    return high - low + 1 if high >= low else None


def _fd_soft_limit() -> int | None:
    """The process's soft open-file limit, or ``None`` when unlimited or unknown."""
    try:
        # Imported here: the module is Unix-only, and its absence just means "unknown".
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    return soft


def report_connection_pool_capacity(
    cfg: ConnectionPoolConfig, capacity: ConnectionPoolCapacity, visible: bool = False
) -> None:
    """Report one server/CLI process group's pool sizing and unsafe capacity mismatches.

    Logs one ``key=value`` line at INFO and each mismatch at WARNING, once per distinct
    (workers, configuration) in this process; later calls with the same values do nothing.
    With ``visible=True`` the line and the warnings are also printed to stderr. Reads the FD
    soft limit and the ephemeral-port range; never raises for an unreadable system value.
    """
    key: tuple[object, ...] = (
        capacity.workers,
        cfg.global_aiohttp_connector_limit,
        cfg.global_aiohttp_connector_limit_per_host,
        cfg.global_aiohttp_intended_concurrency,
        cfg.global_aiohttp_intended_concurrency_per_host,
    )
    with _REPORTED_CAPACITIES_LOCK:
        if key in _REPORTED_CAPACITIES:
            return
        _REPORTED_CAPACITIES.add(key)
    fd_soft_limit = _fd_soft_limit()
    ephemeral_ports = _ephemeral_port_capacity()
    line = capacity_line(cfg, capacity, fd_soft_limit, ephemeral_ports)
    warnings = capacity_warnings(cfg, capacity, fd_soft_limit, ephemeral_ports)
    logger.info("%s", line)
    for warning in warnings:
        logger.warning("connection pool capacity mismatch: %s", warning)
    if visible:
        print(line, file=sys.stderr)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)


def _reset_for_tests() -> None:
    """Forget connect counts, admitted labels, reported capacities and once-only flags."""
    global _label_cap
    with _CONNECT_COUNTS_LOCK:
        _CONNECT_COUNTS.clear()
    with _LABELS_LOCK:
        _SEEN_LABELS.clear()
        _WAIT_ATTRIBUTES.clear()
        _label_cap = None
    with _REPORTED_CAPACITIES_LOCK:
        _REPORTED_CAPACITIES.clear()
    _ONCE.reset()
