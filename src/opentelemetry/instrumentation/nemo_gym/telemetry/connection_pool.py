"""aiohttp connection-pool capacity diagnostics and queue-wait metrics.

Two halves share this module. ``QueueTimedTCPConnector`` measures, on the event loop, how
long requests wait for a free pool slot and counts connects per destination; it records into
the ``PoolTelemetry`` of one meter provider (``_pool_telemetry``) and never changes a
request's result, timing out or cancellation. The capacity functions are plain arithmetic
over a connector configuration, run once at start-up, that log the per-worker limits and warn
when intended demand cannot fit.

Destination labels come from ``set_server_name`` and are capped at
``OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES`` distinct values per meter provider; later names are
recorded as ``other``.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from time import perf_counter
from typing import Any, Final

import aiohttp
from aiohttp.client import ClientTimeout as _ClientTimeout
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from opentelemetry import metrics
from opentelemetry.context import get_current

from opentelemetry.instrumentation.nemo_gym._shared import _exporting, _settings
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym.telemetry import _aiohttp_compat
from opentelemetry.instrumentation.nemo_gym.telemetry._aiohttp_compat import destination

# The documented names live in the pure-arithmetic module; they are re-exported here, where
# the documented API (nemo_gym.telemetry.connection_pool) has them (the redundant aliases mark
# the private ones as re-exports).
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
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import (
    ConnectorCounts,
    PoolTelemetry,
    WaitSample,
    is_api_proxy,
)
from opentelemetry.instrumentation.nemo_gym.version import __version__

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

_TCPConnector = aiohttp.TCPConnector

_SERVER_NAME: contextvars.ContextVar[str] = contextvars.ContextVar(
    "nemo_gym_http_server_name", default="external"
)
# Bound once: read on every connect.
_current_server_name = _SERVER_NAME.get

# Distinct configurations report_connection_pool_capacity() remembers (and so logs) per
# process: a service that builds connectors with ever-new limits must not log forever. The
# memo is the public function's, whoever calls it (the instrumentor, an application, the
# CLI), so it lives as long as the process: "logged once per distinct configuration".
_MAX_REPORTED_CAPACITIES: Final = 256
_REPORTED_CAPACITIES: set[tuple[object, ...]] = set()
_REPORTED_CAPACITIES_LOCK = threading.Lock()

_PORT_RANGE_PATH = "/proc/sys/net/ipv4/ip_local_port_range"


class _InstrumentedTelemetry:
    """Where connectors constructed directly (``QueueTimedTCPConnector(...)``, or
    ``build_connection_pool_connector()``) record: the telemetry of the instrumentation that
    is on (it may hold an explicit meter provider), else the global meter provider's.

    Its lifetime is the instrumentor's: ``bind`` when its pool patch is installed, ``unbind``
    when it is taken off; an instrumentor unbinds only what it bound, so a second one (a
    subclass) taking its patch off leaves the first's in place.
    """

    def __init__(self) -> None:
        self._source: Callable[[], PoolTelemetry | None] | None = None

    def bind(self, source: Callable[[], PoolTelemetry | None] | None) -> None:
        self._source = source

    def unbind(self, source: Callable[[], PoolTelemetry | None] | None) -> None:
        if self._source is source:
            self._source = None

    def current(self) -> PoolTelemetry | None:
        source = self._source
        return source() if source is not None else global_pool_telemetry()


_INSTRUMENTED: Final = _InstrumentedTelemetry()


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


def global_pool_telemetry() -> PoolTelemetry | None:
    """The ``PoolTelemetry`` of the current global meter provider, made on first use.

    ``None`` while no provider is set (the API's proxy): nothing is counted until one is, and
    asking early never ties the telemetry to the proxy (see ``is_api_proxy``), so connectors
    built once a provider is set record into it. Settings come from the environment
    (``OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES``, ``OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS``,
    ``OTEL_SEMCONV_STABILITY_OPT_IN``) the first time a provider is seen.
    """
    provider = metrics.get_meter_provider()
    if is_api_proxy(provider):
        return None
    return PoolTelemetry.of(
        provider,
        version=__version__,
        max_server_names=_settings.max_server_names(),
        semconv_mode=_settings.semconv_http_mode(),
        max_destinations=_settings.max_destinations(),
    )


def _telemetry_for_direct_construction() -> PoolTelemetry | None:
    return _INSTRUMENTED.current()


# Stands in for the global telemetry's lock while no meter provider is set.
_NO_TELEMETRY_LOCK = threading.Lock()


def _connect_count_snapshot() -> dict[str, int]:
    """Connect counts per destination label of the global meter provider's telemetry.

    Empty while no meter provider is set. Safe from any thread. Connectors that record into
    an explicit meter provider's telemetry (``instrument(meter_provider=...)``) are counted
    there, not here.
    """
    telemetry = global_pool_telemetry()
    return telemetry.connect_counts() if telemetry is not None else {}


def __getattr__(name: str) -> Any:
    # nemo_gym.telemetry.connection_pool documents module data _CONNECT_COUNTS and
    # _CONNECT_COUNTS_LOCK. Connect counts
    # now belong to each meter provider's telemetry (and to each connector, lock-free), so
    # these are views of the global provider's: a snapshot dictionary and the lock that
    # guards folding collected connectors' counts into it.
    if name == "_CONNECT_COUNTS":
        return _connect_count_snapshot()
    if name == "_CONNECT_COUNTS_LOCK":
        telemetry = global_pool_telemetry()
        return telemetry._collect_lock if telemetry is not None else _NO_TELEMETRY_LOCK
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _connector_queue_constraint(connector: Any) -> str:
    """Classify the binding connector limit when aiohttp reports a queue wait.

    ``total`` when the total limit is finite and exhausted, otherwise ``per_host``;
    ``unknown`` when the connector cannot be introspected. Never raises.
    """
    return _aiohttp_compat.queue_constraint(connector)


_queue_constraint = _aiohttp_compat.queue_constraint


class QueueTimedTCPConnector(aiohttp.TCPConnector):
    """TCPConnector that measures how long connections wait for a free pool slot.

    Every ``connect()`` call increments ``connect_total`` for the current destination. Each
    queued acquisition records one ``queue_duration_ms`` sample (and/or
    ``http.client.request.time_in_queue``, per ``OTEL_SEMCONV_STABILITY_OPT_IN``), labelled
    with the limit that was binding when the wait started and whether it ended ``ok`` or
    ``abandoned``. The wait is timed by overriding aiohttp's private
    ``_wait_for_available_connection``; new TCP connections are counted in
    ``_create_connection``. Where the installed aiohttp's signatures of those or of
    ``connect`` differ from the overrides (``timed_connector_mismatch``), constructing one
    gives a plain ``aiohttp.TCPConnector`` and a warning, once. Subclasses are built as asked.

    Records into the instrumentor's telemetry while instrumented, else the global meter
    provider's. Use it on the event loop, like any aiohttp connector.
    """

    _nemo_gym_pool: PoolTelemetry | None
    _nemo_gym_counts: ConnectorCounts
    # Shortcuts into the two, read on every request: one attribute lookup, not two.
    _nemo_gym_connects: dict[str, int]
    _nemo_gym_pending: deque[WaitSample]
    _nemo_gym_batch_size: int

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if type(self) is QueueTimedTCPConnector and timed_connector_mismatch() is not None:
            # This aiohttp's methods do not fit the overrides, which would fail every request:
            # a plain TCPConnector instead (same layout, built by aiohttp's own __init__).
            self.__class__ = _TCPConnector  # type: ignore[assignment]
            return
        try:
            telemetry = _telemetry_for_direct_construction()
        except Exception as error:  # noqa: BLE001 - the connector itself must still work
            _log_setup_failure_once(error)
            telemetry = None
        self._nemo_gym_attach(telemetry)

    def _nemo_gym_attach(self, telemetry: PoolTelemetry | None) -> None:
        """Bind this connector to ``telemetry`` (``None``: count nothing anywhere).

        Binding again moves the connector: the telemetry it was bound to keeps what it counted
        so far and stops reading it, so no meter provider reports a connector twice. Also how
        the instrumentor turns a just-built ``TCPConnector`` into one of these.
        """
        previous = getattr(self, "_nemo_gym_pool", None)
        if previous is not None:
            if previous is telemetry:
                return
            previous.detach(self)
        counts = telemetry.attach(self) if telemetry is not None else ConnectorCounts()
        if telemetry is not None:
            _warn_if_state_unreadable(self)
        self._nemo_gym_pool = telemetry
        self._nemo_gym_counts = counts
        self._nemo_gym_connects = counts.connects
        if telemetry is not None:
            self._nemo_gym_pending = telemetry.pending
            self._nemo_gym_batch_size = telemetry.batch_size
        else:  # waits go to a deque that keeps nothing
            self._nemo_gym_pending = deque(maxlen=0)
            self._nemo_gym_batch_size = 1

    # Counted first so that failed, timed-out and cancelled connects are counted too; then the
    # next ``connect`` in the MRO (aiohttp's), called with the caller's arguments, so
    # ``await connector.connect(...)`` behaves exactly as before, exceptions and cancellation
    # included. aiohttp's own parameters rather than ``*args, **kwargs``: this runs for every
    # request, and packing and re-spreading the arguments would cost more than everything else
    # a connect adds (benchmarks/instruction_count.py). Where aiohttp changes the parameters,
    # ``timed_connector_mismatch`` keeps connectors plain, and
    # ``test_queue_timed_tcp_connector_connect_takes_aiohttp_parameters`` fails.
    if sys.version_info >= (3, 12):
        # Not ``async def``: a coroutine frame of our own would cost more than the counting.
        # It returns aiohttp's coroutine, and 3.12's ``inspect.markcoroutinefunction`` (below)
        # makes introspection see a coroutine function, as aiohttp's is.
        def connect(
            self, req: ClientRequest, traces: list[Trace], timeout: _ClientTimeout
        ) -> Coroutine[Any, Any, Connection]:
            """Count the destination, then get a connection exactly as aiohttp would."""
            try:
                try:
                    self._nemo_gym_connects[_current_server_name()] += 1
                except KeyError:
                    self._nemo_gym_count_first(_current_server_name())
            except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
                _log_setup_failure_once(error)
            if type(self) is QueueTimedTCPConnector:
                # What super() resolves to for this exact class, looked up at each call as
                # super() does (so a patch of TCPConnector.connect applies), for less than
                # super() costs.
                return _TCPConnector.connect(self, req, traces, timeout)
            return super().connect(req, traces, timeout)  # cooperative subclasses: the MRO

    else:
        # Python 3.11 has no way to mark a plain function as a coroutine function, and code
        # that introspects (``inspect.iscoroutinefunction``, ``mock.patch(autospec=True)``,
        # frameworks choosing a sync or an async path) must see aiohttp's ``async def``: one
        # coroutine frame more per request is the price of telling the truth there. The body
        # is the 3.12 one's, written out: a call from here to a shared helper would be a
        # second frame of ours per request, a third of the instructions an unqueued request
        # adds (benchmarks/instruction_count.py; test_connect_introspection checks both).
        async def connect(
            self,
            req: ClientRequest,
            traces: list[Trace],
            timeout: _ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature, forwarded as is
        ) -> Connection:
            """Count the destination, then get a connection exactly as aiohttp would."""
            try:
                try:
                    self._nemo_gym_connects[_current_server_name()] += 1
                except KeyError:
                    self._nemo_gym_count_first(_current_server_name())
            except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
                _log_setup_failure_once(error)
            if type(self) is QueueTimedTCPConnector:
                return await _TCPConnector.connect(self, req, traces, timeout)
            return await super().connect(req, traces, timeout)

    def _nemo_gym_count_first(self, label: str) -> None:
        # A label this connector has not counted yet: admit it under the provider's cap.
        telemetry = self._nemo_gym_pool
        bounded = telemetry.admit(label) if telemetry is not None else label
        connects = self._nemo_gym_connects
        connects[bounded] = connects.get(bounded, 0) + 1

    async def _wait_for_available_connection(self, key: ConnectionKey, traces: list[Trace]) -> None:
        # Classified before waiting: by the time the wait ends the slot that freed up has
        # changed the counts, and the question is what made us wait. The sample is one tuple
        # appended to the telemetry's buffer; labels, attributes and the SDK record come later,
        # in batches (PoolTelemetry.flush).
        constraint = _queue_constraint(self)
        started = perf_counter()
        try:
            await super()._wait_for_available_connection(key, traces)
        except BaseException as error:
            # Timeout and cancellation land here: buffer the sample, then re-raise the very
            # same exception so the caller sees what a plain TCPConnector would raise.
            seconds = perf_counter() - started
            sample = (seconds, constraint, type(error), _SERVER_NAME.get(), key, get_current())
            self._nemo_gym_buffer(sample)
            raise
        seconds = perf_counter() - started
        # Written out rather than through _nemo_gym_buffer: one call less on every queued wait.
        try:
            pending = self._nemo_gym_pending
            pending.append((seconds, constraint, None, _SERVER_NAME.get(), key, get_current()))
            if len(pending) >= self._nemo_gym_batch_size:
                self._nemo_gym_flush()
        except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
            _log_setup_failure_once(error)

    def _nemo_gym_buffer(self, sample: WaitSample) -> None:
        try:
            pending = self._nemo_gym_pending
            pending.append(sample)
            if len(pending) >= self._nemo_gym_batch_size:
                self._nemo_gym_flush()
        except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
            _log_setup_failure_once(error)

    def _nemo_gym_flush(self) -> None:
        telemetry = self._nemo_gym_pool
        if telemetry is not None:
            telemetry.flush()  # never raises

    async def _create_connection(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: _ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature, forwarded as is
    ) -> ResponseHandler:
        # Once per new TCP connection, not per request: count it, and remember where it goes
        # so the open-connections gauge can say which destination an active connection serves.
        connection = await super()._create_connection(req, traces, timeout)
        try:
            where = destination(req.connection_key)
            if where is not None:
                counts = self._nemo_gym_counts
                counts.created[where] = counts.created.get(where, 0) + 1
                counts.destinations[connection] = where
        except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
            _log_setup_failure_once(error)
        return connection


if sys.version_info >= (3, 12):
    # Tell inspect.iscoroutinefunction the truth about what connect() returns.
    inspect.markcoroutinefunction(QueueTimedTCPConnector.connect)

# aiohttp's methods that QueueTimedTCPConnector overrides, each with whether the override
# awaits aiohttp's own (which must then stay a coroutine function).
_OVERRIDDEN: Final = {
    "connect": False,
    "_wait_for_available_connection": True,
    "_create_connection": True,
}
# (aiohttp's overridden methods, why they do not fit or None) as last compared.
_fit: tuple[tuple[object, ...], str | None] = ((), None)
_MISMATCH = OnceLog(logger)


def _warn_if_state_unreadable(connector: aiohttp.TCPConnector) -> None:
    """Say once, per reason, that this aiohttp's pool state cannot be read (requests are fine)."""
    reason = _aiohttp_compat.unreadable_state(connector)
    if reason is not None:
        _MISMATCH(
            reason,
            logging.WARNING,
            "nemo_gym: connection-pool state (open, idle and waiting connections, the queue "
            "constraint) partly off: %s (aiohttp %s)",
            reason,
            aiohttp.__version__,
        )


def timed_connector_mismatch() -> str | None:
    """Why ``QueueTimedTCPConnector`` does not fit the installed aiohttp, or ``None``.

    The signatures are compared once per set of aiohttp methods (another patch of
    ``TCPConnector`` makes a new set), so asking at each construction costs three attribute
    reads. A mismatch is logged once, as a warning that names the capability turned off and
    the method that differs. Never raises.
    """
    global _fit
    methods = tuple(getattr(_TCPConnector, name, None) for name in _OVERRIDDEN)
    known, reason = _fit
    if known != methods:
        reason = _aiohttp_compat.override_mismatch(
            _TCPConnector, QueueTimedTCPConnector, _OVERRIDDEN
        )
        _fit = (methods, reason)
    if reason is not None:
        _MISMATCH(
            reason,
            logging.WARNING,
            "nemo_gym: connection-pool timing off, aiohttp.TCPConnector stays plain: %s "
            "(aiohttp %s)",
            reason,
            aiohttp.__version__,
        )
    return reason


_FAILURES = OnceLog(logger)


def _log_setup_failure_once(error: BaseException) -> None:
    """Log a failure of our own on a connector once per exception type, at debug level."""
    _FAILURES(
        type(error).__name__,
        logging.DEBUG,
        "connection-pool telemetry failed; carrying on",
        exc_info=error,
    )


def build_connection_pool_connector(**kwargs: Any) -> aiohttp.TCPConnector:
    """Build the timed connector only while this process exports metrics.

    Exporting means the global meter provider is an SDK ``MeterProvider``, not disabled by
    ``OTEL_SDK_DISABLED``, with at least one metric reader. Otherwise, or where the installed
    aiohttp does not fit the timed connector (``timed_connector_mismatch``), a plain
    ``aiohttp.TCPConnector`` with the same ``kwargs``. Call it where the connector would be
    made (inside a running event loop).
    """
    if _exporting.metrics_exported() and timed_connector_mismatch() is None:
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
    With ``visible=True`` the line and the warnings are also printed to standard output, as
    NeMo Gym prints its own report. Reads the FD soft limit and the ephemeral-port range;
    never raises for an unreadable system value.
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
        if len(_REPORTED_CAPACITIES) >= _MAX_REPORTED_CAPACITIES:
            first_over = len(_REPORTED_CAPACITIES) == _MAX_REPORTED_CAPACITIES
            # One marker entry, so the notice below is logged once.
            _REPORTED_CAPACITIES.add(("nemo_gym.capacity_reports_capped",))
            if first_over:
                logger.info(
                    "more than %d distinct connection-pool configurations reported; "
                    "further ones are not logged",
                    _MAX_REPORTED_CAPACITIES,
                )
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
        # Standard output, like NeMo Gym's own report: a deployment that collects NeMo Gym's
        # startup output finds ours in the same stream.
        print(line)
        for warning in warnings:
            print(f"warning: {warning}")
