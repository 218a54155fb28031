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
from typing import Any, NamedTuple, Protocol

import aiohttp
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from opentelemetry.metrics import Histogram

from opentelemetry.instrumentation.nemo_gym import _aiohttp_compat, _exporting, _settings
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
_label_cap_warned = False
# Attribute dictionaries per (constraint, outcome, label), built once and never mutated, so a
# queue sample costs a dictionary lookup rather than a dictionary build. Keys are admitted
# labels only, which bounds it at 3 x 2 x (cap + 1) entries.
_WAIT_ATTRIBUTES: dict[tuple[str, str, str], dict[str, str]] = {}
_failure_logged = False
_no_hook_warned = False

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
    global _label_cap, _label_cap_warned
    with _LABELS_LOCK:
        if label in _SEEN_LABELS:
            return label
        if _label_cap is None:
            _label_cap = _settings.max_server_names()
        if len(_SEEN_LABELS) < _label_cap:
            _SEEN_LABELS.add(label)
            return label
        warn = not _label_cap_warned
        _label_cap_warned = True
    if warn:
        logger.warning(
            "more than %d distinct destination names (set_server_name); %r and later new "
            "names are recorded as %r. Raise OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES if these "
            "names are bounded.",
            _label_cap,
            label,
            _OTHER,
        )
    return _OTHER


def _log_failure_once(what: str, error: Exception) -> None:
    global _failure_logged
    if _failure_logged:
        return
    _failure_logged = True
    logger.debug("connection-pool telemetry failed while %s; carrying on", what, exc_info=error)


def _count_connect(label: str) -> None:
    bounded = _bounded_label(label)
    with _CONNECT_COUNTS_LOCK:
        _CONNECT_COUNTS[bounded] = _CONNECT_COUNTS.get(bounded, 0) + 1


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
        try:
            _count_connect(_SERVER_NAME.get())
        except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
            _log_failure_once("counting a connect", error)
        return await super().connect(req, *args, **kwargs)

    async def _wait_for_available_connection(self, key: ConnectionKey, traces: list[Trace]) -> None:
        # Classified before waiting: by the time the wait ends the slot that freed up has
        # changed the counts, and the question is what made us wait.
        constraint = _connector_queue_constraint(self)
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
    global _no_hook_warned
    if _no_hook_warned:
        return
    _no_hook_warned = True
    logger.warning(
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


class ConnectionPoolConfig(Protocol):
    """Connector budgets and optional demand estimates for one server or rollout CLI.

    Configured limits apply to one server process group before division across its workers,
    not the whole deployment. An explicit limit of zero is unlimited. Intended concurrency is
    optional expected outbound demand for that same group; ``None`` disables the
    corresponding sizing check.
    """

    global_aiohttp_connector_limit: int
    global_aiohttp_connector_limit_per_host: int
    global_aiohttp_intended_concurrency: int | None
    global_aiohttp_intended_concurrency_per_host: int | None


class ConnectionPoolCapacity(NamedTuple):
    """Per-process connector limits and demand after division across ``workers``.

    ``workers`` is the size of one server's process group, or one for the CLI. Positive
    ``total`` and ``per_host`` limits are rounded down; zero means explicitly unlimited.
    ``per_host`` is the divided configured value, before a finite ``total`` constrains
    effective per-host capacity. ``intended`` and ``intended_per_host`` are expected demand
    rounded up per worker, or ``None`` when the estimate is not configured.
    """

    workers: int
    total: int
    per_host: int
    intended: int | None
    intended_per_host: int | None


def _display_limit(limit: int) -> str:
    return "unlimited" if limit == 0 else str(limit)


def _effective_per_host_limit(total: int, per_host: int) -> int:
    # 0 is unlimited, so min() only applies where both limits are finite.
    if total == 0:
        return per_host
    if per_host == 0:
        return total
    return min(total, per_host)


def _divided_limit(name: str, limit: object, workers: int) -> int:
    # bool is an int subclass; True as a limit is a configuration mistake, not 1.
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(
            f"{name}={limit!r} is invalid: a connector limit is an integer >= 0; "
            "use 0 for unlimited"
        )
    per_worker = limit // workers
    if limit > 0 and per_worker == 0:
        raise ValueError(
            f"{name}={limit} divided across workers={workers} leaves 0 connections per "
            f"worker; set it to at least {workers}, or to 0 for unlimited"
        )
    return per_worker


def _divided_demand(name: str, intended: object, workers: int) -> int | None:
    if intended is None:
        return None
    if not isinstance(intended, int) or isinstance(intended, bool) or intended <= 0:
        raise ValueError(
            f"{name}={intended!r} is invalid: intended concurrency is a positive integer, "
            "or None to skip the check; for unlimited connections set the connector "
            "limit to 0 instead"
        )
    # Demand rounds up: a worker that may get one more request than the average must fit it.
    return -(-intended // workers)


def connection_pool_capacity(cfg: ConnectionPoolConfig, workers: int) -> ConnectionPoolCapacity:
    """Calculate aiohttp limits for one process, preserving explicit unlimited values.

    Limits divide across ``workers`` rounding down, intended demand rounding up; 0 stays 0
    (unlimited). Raises ``ValueError`` naming the values for ``workers < 1``, a negative
    limit, a non-positive intended value, or a positive limit that floors to 0.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(
            f"workers={workers!r} is invalid: a server process group has at least 1 worker "
            "(limits use 0 for unlimited, workers cannot)"
        )
    return ConnectionPoolCapacity(
        workers=workers,
        total=_divided_limit(
            "global_aiohttp_connector_limit", cfg.global_aiohttp_connector_limit, workers
        ),
        per_host=_divided_limit(
            "global_aiohttp_connector_limit_per_host",
            cfg.global_aiohttp_connector_limit_per_host,
            workers,
        ),
        intended=_divided_demand(
            "global_aiohttp_intended_concurrency",
            cfg.global_aiohttp_intended_concurrency,
            workers,
        ),
        intended_per_host=_divided_demand(
            "global_aiohttp_intended_concurrency_per_host",
            cfg.global_aiohttp_intended_concurrency_per_host,
            workers,
        ),
    )


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


def _optional(value: int | None, missing: str) -> str:
    return missing if value is None else str(value)


def _capacity_line(
    cfg: ConnectionPoolConfig,
    capacity: ConnectionPoolCapacity,
    fd_soft_limit: int | None,
    ephemeral_ports: int | None,
) -> str:
    effective = _effective_per_host_limit(capacity.total, capacity.per_host)
    pairs = (
        ("workers", str(capacity.workers)),
        ("limit", _display_limit(cfg.global_aiohttp_connector_limit)),
        ("limit_per_host", _display_limit(cfg.global_aiohttp_connector_limit_per_host)),
        ("limit_per_worker", _display_limit(capacity.total)),
        ("limit_per_host_per_worker", _display_limit(capacity.per_host)),
        ("effective_limit_per_host_per_worker", _display_limit(effective)),
        ("intended_per_worker", _optional(capacity.intended, "unset")),
        ("intended_per_host_per_worker", _optional(capacity.intended_per_host, "unset")),
        ("fd_soft_limit", _optional(fd_soft_limit, "unlimited")),
        ("ephemeral_ports", _optional(ephemeral_ports, "unknown")),
    )
    return "connection_pool_capacity " + " ".join(f"{key}={value}" for key, value in pairs)


def _capacity_warnings(
    cfg: ConnectionPoolConfig,
    capacity: ConnectionPoolCapacity,
    fd_soft_limit: int | None,
    ephemeral_ports: int | None,
) -> list[str]:
    """The unsafe mismatches between intended demand and capacity; limits alone never warn."""
    warnings: list[str] = []
    effective = _effective_per_host_limit(capacity.total, capacity.per_host)
    if capacity.intended is not None and capacity.total and capacity.intended > capacity.total:
        warnings.append(
            f"intended concurrency per worker {capacity.intended} exceeds the connector "
            f"limit per worker {capacity.total} ({capacity.workers} workers); the excess "
            "requests queue for a pool slot and the wait looks like server latency"
        )
    if (
        capacity.intended_per_host is not None
        and effective
        and capacity.intended_per_host > effective
    ):
        warnings.append(
            f"intended per-host concurrency per worker {capacity.intended_per_host} exceeds "
            f"the effective per-host limit per worker {effective} "
            f"({capacity.workers} workers); requests to one destination will queue"
        )
    aggregate_per_host = cfg.global_aiohttp_intended_concurrency_per_host
    if (
        aggregate_per_host is not None
        and ephemeral_ports is not None
        and aggregate_per_host > ephemeral_ports
    ):
        warnings.append(
            f"intended per-host concurrency {aggregate_per_host} across all workers exceeds "
            f"the ephemeral-port budget {ephemeral_ports} ({_PORT_RANGE_PATH}); new "
            "connections to one destination can fail with EADDRNOTAVAIL"
        )
    if (
        capacity.intended is not None
        and fd_soft_limit is not None
        and capacity.intended >= fd_soft_limit
    ):
        warnings.append(
            f"intended concurrency per worker {capacity.intended} is at or above the "
            f"open-file soft limit {fd_soft_limit}; sockets will fail with EMFILE "
            "(raise ulimit -n)"
        )
    return warnings


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
    line = _capacity_line(cfg, capacity, fd_soft_limit, ephemeral_ports)
    warnings = _capacity_warnings(cfg, capacity, fd_soft_limit, ephemeral_ports)
    logger.info("%s", line)
    for warning in warnings:
        logger.warning("connection pool capacity mismatch: %s", warning)
    if visible:
        print(line, file=sys.stderr)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)


def _reset_for_tests() -> None:
    """Forget connect counts, admitted labels, reported capacities and once-only flags."""
    global _label_cap, _label_cap_warned, _failure_logged, _no_hook_warned
    with _CONNECT_COUNTS_LOCK:
        _CONNECT_COUNTS.clear()
    with _LABELS_LOCK:
        _SEEN_LABELS.clear()
        _WAIT_ATTRIBUTES.clear()
        _label_cap = None
        _label_cap_warned = False
    with _REPORTED_CAPACITIES_LOCK:
        _REPORTED_CAPACITIES.clear()
    _failure_logged = False
    _no_hook_warned = False
