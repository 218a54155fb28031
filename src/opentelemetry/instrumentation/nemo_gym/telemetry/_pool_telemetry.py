"""The connection-pool telemetry of one meter provider: its instruments and everything they read.

``PoolTelemetry`` owns, for one meter provider, the instruments (made once, in its
constructor), the destination-label cap, the live timed connectors (weakly) and the buffer of
queue-wait samples. There is exactly one per meter provider (``PoolTelemetry.of``), because the
SDK de-duplicates instruments by name per meter: a second set of observable instruments on the
same provider would silently lose its callbacks.

What a request pays is kept to the minimum (``benchmarks/instruction_count.py`` measures it):

* a connect adds one to a plain dictionary on its own connector (no lock, no OpenTelemetry
  call); the observable counter sums the live connectors' dictionaries at collection time, and
  a connector's counts are folded into the total when it is garbage-collected;
* a queued wait appends one tuple to a deque; labels, attribute dictionaries, the
  ``suppress_instrumentation`` check and the SDK ``record`` calls all happen in ``flush()``, in
  batches, where the SDK's code is warm. The SDK runs observable callbacks at the start of every
  collection, before it reads the histograms' storages, so flushing there makes each export
  include every wait that ended before the collection began;
* pool state (open, idle, waiting connections, limits, connections created) is read from the
  live connectors at collection time only.

Threading: the event loop appends samples and bumps counts; an exporter's thread collects. The
deque's ``append``/``popleft`` and one-call dictionary copies are atomic under the GIL, so each
sample is recorded exactly once and a collection never sees a half-updated dictionary. The two
locks guard only collection-side merges and label admission, never a request; they are made
anew in a forked child (``os.register_at_fork``), so a fork while one was held cannot hang it.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Histogram, MeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._otel_private import private_name
from opentelemetry.instrumentation.nemo_gym._shared._per_provider import PerProvider
from opentelemetry.instrumentation.nemo_gym._shared._settings import DEFAULT_MAX_DESTINATIONS
from opentelemetry.instrumentation.nemo_gym.telemetry import _instruments as names
from opentelemetry.instrumentation.nemo_gym.telemetry._aiohttp_compat import (
    Destination,
    PoolState,
    destination,
    gil_disabled,
    pool_state,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._destination_budget import (
    OVERFLOW_ATTRIBUTE,
    DestinationBudget,
    StickyBudget,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_observations import (
    add_into,
    destination_attributes,
    limit_observations,
    open_connection_observations,
    semconv_wait_attributes,
    waiting_observations,
)

logger = logging.getLogger(__name__)

OTHER_LABEL: Final = _names.OVERFLOW_LABEL_VALUE
DEFAULT_BATCH_SIZE: Final = 128
_MAX_CACHED_ATTRIBUTE_SETS: Final = 4096

# A queue-wait sample as the hot path leaves it: seconds waited, binding constraint, the
# exception type that ended the wait (None when it ended with a slot), destination label,
# aiohttp's pool key, and the OpenTelemetry context current at the wait (for exemplars and
# suppress_instrumentation).
WaitSample = tuple[float, str, type[BaseException] | None, str, Any, Context]

# The API's private context keys; where a release renamed one, that form of suppression is not
# seen (ctx.get(None) is None) and a warning at import says so.
_SUPPRESS: Final = private_name(
    "opentelemetry.context",
    "_SUPPRESS_INSTRUMENTATION_KEY",
    "suppress_instrumentation() for connection-pool telemetry",
)
_SUPPRESS_HTTP: Final = private_name(
    "opentelemetry.context",
    "_SUPPRESS_HTTP_INSTRUMENTATION_KEY",
    "suppress_http_instrumentation() for connection-pool telemetry",
)
# The plain string key contrib's older instrumentations set, still honoured by
# opentelemetry.instrumentation.utils.is_instrumentation_enabled.
_SUPPRESS_PLAIN: Final = "suppress_instrumentation"


def suppressed(ctx: Context) -> bool:
    """Whether ``ctx`` carries OpenTelemetry's ``suppress_instrumentation`` (or its HTTP form)."""
    # Written out, not any() over a generator: this runs once per buffered wait.
    return bool(
        ctx.get(_SUPPRESS)  # type: ignore[call-overload]
        or ctx.get(_SUPPRESS_HTTP)  # type: ignore[call-overload]
        or ctx.get(_SUPPRESS_PLAIN)
    )


_PROXY_METER_PROVIDER: Final = private_name(
    "opentelemetry.metrics._internal",
    "_ProxyMeterProvider",
    "recording into a global meter provider that is not an SDK MeterProvider",
)


def is_api_proxy(meter_provider: object) -> bool:
    """Whether ``meter_provider`` is the API's global proxy (no provider set yet).

    The proxy hands the instruments made through it to whichever provider is set later, and
    the SDK keeps the first instruments of a name and drops a later set's callbacks. Telemetry
    made over the proxy would therefore own the real provider's pool instruments for good,
    with no connector of its own to report: the global telemetry waits for the real provider.
    Where this API no longer has the proxy's class (a warning at import said so), anything
    but an SDK ``MeterProvider`` counts as the proxy.
    """
    if isinstance(_PROXY_METER_PROVIDER, type):
        return isinstance(meter_provider, _PROXY_METER_PROVIDER)
    return not isinstance(meter_provider, SdkMeterProvider)


class SemconvMode:
    """Which queue-wait histogram names to emit (``OTEL_SEMCONV_STABILITY_OPT_IN``, as contrib)."""

    DEFAULT: Final = "default"  # NeMo Gym's gym.http.connection_pool.queue_duration_ms
    HTTP: Final = "http"  # http.client.request.time_in_queue, in seconds
    HTTP_DUP: Final = "http/dup"  # both


class ConnectorCounts:
    """What one timed connector counted: connects per label, connections created per destination.

    Lives on the connector (``_nemo_gym_counts``); plain dictionaries written only by the event
    loop the connector runs on.
    """

    __slots__ = ("connects", "created", "destinations")

    def __init__(self) -> None:
        self.connects: dict[str, int] = {}
        self.created: dict[Destination, int] = {}
        # Each connection the connector established, to its destination: aiohttp's set of
        # handed-out connections does not say where they go.
        self.destinations: weakref.WeakKeyDictionary[object, Destination] = (
            weakref.WeakKeyDictionary()
        )


class PoolTelemetry:
    """Instruments, connect counts, label cap and sample buffer of one meter provider.

    Build it with ``PoolTelemetry.of(meter_provider, ...)``. ``admit`` (each connect's
    destination label) and ``flush`` (once a connector's batch of waits is full) are the only
    methods on a request's path; the rest run at connector construction or at collection.
    """

    def __init__(
        self,
        meter_provider: MeterProvider,
        *,
        version: str,
        max_server_names: int,
        semconv_mode: str = SemconvMode.DEFAULT,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_destinations: int = DEFAULT_MAX_DESTINATIONS,
    ) -> None:
        if semconv_mode not in (SemconvMode.DEFAULT, SemconvMode.HTTP, SemconvMode.HTTP_DUP):
            raise ValueError(
                f"semconv_mode={semconv_mode!r} must be 'default', 'http' or 'http/dup'"
            )
        if type(max_server_names) is not int or max_server_names < 1:
            raise ValueError(f"max_server_names={max_server_names!r} must be an integer >= 1")
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
        self.semconv_mode = semconv_mode
        self.batch_size = batch_size
        # Series per server.address/server.port, bounded (see _destination_budget): the state
        # instruments share one budget; the queue histogram keeps its first destinations.
        self._destinations = DestinationBudget(max_destinations)
        self._histogram_destinations = StickyBudget(max_destinations)
        self.pending: deque[WaitSample] = deque()
        self._max_server_names = max_server_names
        self._labels: set[str] = set()
        self._labels_lock = threading.Lock()
        # Live timed connectors by id, each behind a weak reference whose callback retires it.
        # A plain dictionary, not a WeakSet: copying its values is one atomic call, while a
        # WeakSet iterated on the exporter's thread fails if the loop adds a connector meanwhile.
        self._connectors: dict[int, weakref.ref[Any]] = {}
        # Counts of connectors already garbage-collected, appended by their weak reference's
        # callback (no lock: it may run inside any code, holding any lock), merged at collection.
        self._retired: deque[ConnectorCounts] = deque()
        self._folded_connects: dict[str, int] = {}
        self._folded_created: dict[Destination, int] = {}
        self._collect_lock = threading.Lock()
        self._default_attributes: dict[tuple[str, str, str], dict[str, str]] = {}
        self._semconv_attributes: dict[tuple[Any, ...], dict[str, str | int | bool]] = {}
        self._failures = OnceLog(logger)

        meter = meter_provider.get_meter(_names.METER_NAME, version)
        self._queue_duration: Histogram | None = None
        self._time_in_queue: Histogram | None = None
        if semconv_mode != SemconvMode.HTTP:
            self._queue_duration = meter.create_histogram(
                names.QUEUE_DURATION,
                unit=names.QUEUE_DURATION_UNIT,
                description=names.QUEUE_DURATION_DESCRIPTION,
                explicit_bucket_boundaries_advisory=names.QUEUE_DURATION_BUCKETS,
            )
        if semconv_mode != SemconvMode.DEFAULT:
            self._time_in_queue = meter.create_histogram(
                names.TIME_IN_QUEUE,
                unit=names.TIME_IN_QUEUE_UNIT,
                description=names.TIME_IN_QUEUE_DESCRIPTION,
                explicit_bucket_boundaries_advisory=names.TIME_IN_QUEUE_BUCKETS,
            )
        # Registered in this order: the SDK runs callbacks in registration order, and the first
        # flushes the buffered waits before anything reads the histograms.
        counter, up_down = meter.create_observable_counter, meter.create_observable_up_down_counter
        observed = (
            (counter, names.CONNECT_TOTAL, self._observe_connects),
            (counter, names.CONNECTIONS_CREATED, self._observe_created),
            (up_down, names.OPEN_CONNECTIONS, self._observe_open_connections),
            (up_down, names.WAITING_REQUESTS, self._observe_waiting),
            (up_down, names.LIMIT, self._observe_limits),
        )
        for create, name, observe in observed:
            unit, description = names.UNITS_AND_DESCRIPTIONS[name]
            create(name, callbacks=[observe], unit=unit, description=description)
        _LIVE.add(self)

    # --- one per meter provider ---------------------------------------------------------------

    @classmethod
    def of(
        cls,
        meter_provider: MeterProvider,
        *,
        version: str,
        max_server_names: int,
        semconv_mode: str = SemconvMode.DEFAULT,
        max_destinations: int = DEFAULT_MAX_DESTINATIONS,
    ) -> PoolTelemetry:
        """The telemetry of ``meter_provider``, created with these settings on first use.

        Later calls return the same object whatever settings they pass: instruments exist once
        per provider. Raises whatever the provider raises when it cannot create instruments.
        """
        return _BY_PROVIDER.get(
            meter_provider,
            lambda: cls(
                meter_provider,
                version=version,
                max_server_names=max_server_names,
                semconv_mode=semconv_mode,
                max_destinations=max_destinations,
            ),
        )

    # --- connectors ---------------------------------------------------------------------------

    def attach(self, connector: Any) -> ConnectorCounts:
        """Start counting for ``connector``; returns the counts it must write into."""
        counts = ConnectorCounts()
        key = id(connector)
        connectors = self._connectors
        retired = self._retired

        def retire(_gone: weakref.ref[Any]) -> None:
            connectors.pop(key, None)
            retired.append(counts)

        connectors[key] = weakref.ref(connector, retire)
        return counts

    def detach(self, connector: Any) -> None:
        """Stop reading ``connector``; what it counted so far stays in this telemetry's totals."""
        # Dropping the weak reference also drops its callback, so the counts are retired here.
        if self._connectors.pop(id(connector), None) is not None:
            counts = getattr(connector, "_nemo_gym_counts", None)
            if isinstance(counts, ConnectorCounts):
                self._retired.append(counts)

    def admit(self, label: str) -> str:
        """``label`` while under the distinct-label cap, else ``other`` (warning once)."""
        if label in self._labels:
            return label
        with self._labels_lock:
            if label in self._labels:
                return label
            if len(self._labels) < self._max_server_names:
                self._labels.add(label)
                return label
        self._failures(
            "label-cap",
            logging.WARNING,
            "more than %d distinct destination names (set_server_name); %r and later new "
            "names are recorded as %r. Raise OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES if these "
            "names are bounded.",
            self._max_server_names,
            label,
            OTHER_LABEL,
        )
        return OTHER_LABEL

    def log_failure(self, what: str, error: BaseException) -> None:
        """Log a telemetry failure once, at debug level; the request carries on."""
        self._failures(
            ("failure", what),
            logging.DEBUG,
            "connection-pool telemetry failed while %s; carrying on",
            what,
            exc_info=error,
        )

    # --- queue waits ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Record every buffered wait into the histograms, oldest first. Never raises."""
        pending = self.pending
        while True:
            try:
                sample = pending.popleft()
            except IndexError:
                return
            try:
                self._record(sample)
            except Exception as error:  # noqa: BLE001 - telemetry never breaks a request
                self.log_failure("recording a queue wait", error)

    def _record(self, sample: WaitSample) -> None:
        seconds, constraint, error_type, label, key, ctx = sample
        if suppressed(ctx):
            return
        label = self.admit(label)
        outcome = names.OUTCOME_OK if error_type is None else names.OUTCOME_ABANDONED
        if self._queue_duration is not None:
            cache_key = (constraint, outcome, label)
            attributes = self._default_attributes.get(cache_key)
            if attributes is None:
                attributes = {
                    names.ATTR_QUEUE_CONSTRAINT: constraint,
                    names.ATTR_QUEUE_OUTCOME: outcome,
                    names.ATTR_SERVER_NAME: label,
                }
                self._default_attributes[cache_key] = attributes
            self._queue_duration.record(seconds * 1000.0, attributes, ctx)
        if self._time_in_queue is not None:
            where = destination(key)
            semconv_key = (where, constraint, error_type, label)
            semconv = self._semconv_attributes.get(semconv_key)
            if semconv is None:
                overflow = where is not None and not self._histogram_destinations.admits(where)
                semconv = semconv_wait_attributes(where, constraint, error_type, label, overflow)
                # server.address is not bounded like the labels are: a client that talks to
                # ever-new hosts must not grow this cache without end.
                if len(self._semconv_attributes) >= _MAX_CACHED_ATTRIBUTE_SETS:
                    self._semconv_attributes.clear()
                self._semconv_attributes[semconv_key] = semconv
            self._time_in_queue.record(seconds, semconv, ctx)

    # --- collection (any thread) ------------------------------------------------------------

    def _live(self) -> list[Any]:
        alive = (reference() for reference in list(self._connectors.values()))
        return [connector for connector in alive if connector is not None]

    def _fold_retired(self) -> None:
        # Under _collect_lock. Counts of collected connectors move into the folded totals.
        while True:
            try:
                counts = self._retired.popleft()
            except IndexError:
                return
            add_into(self._folded_connects, counts.connects)
            add_into(self._folded_created, counts.created)

    def connect_counts(self) -> dict[str, int]:
        """Connects per destination label so far, live and collected connectors together."""
        with self._collect_lock:
            self._fold_retired()
            total = dict(self._folded_connects)
        for connector in self._live():
            counts = getattr(connector, "_nemo_gym_counts", None)
            if counts is not None:
                add_into(total, counts.connects.copy())
        return total

    def created_counts(self) -> dict[Destination, int]:
        """New TCP connections per destination so far, live and collected connectors together."""
        with self._collect_lock:
            return self._created_totals()

    def _created_totals(self) -> dict[Destination, int]:
        # Under _collect_lock.
        self._fold_retired()
        total = dict(self._folded_created)
        for connector in self._live():
            counts = getattr(connector, "_nemo_gym_counts", None)
            if counts is not None:
                add_into(total, counts.created.copy())
        return total

    def pool_states(self) -> Iterator[PoolState]:
        """What each live timed connector holds right now (nothing without the GIL, said once:
        ``_aiohttp_compat`` says why)."""
        if gil_disabled():
            self._failures(
                "free-threaded",
                logging.WARNING,
                "nemo_gym: the connection-pool state gauges (%s, %s) report nothing: this "
                "Python runs without the GIL, and they would read aiohttp's pools from the "
                "exporter's thread while the event loop changes them",
                names.OPEN_CONNECTIONS,
                names.WAITING_REQUESTS,
            )
            return
        for connector in self._live():
            counts = getattr(connector, "_nemo_gym_counts", None)
            if counts is not None:
                yield pool_state(connector, counts.destinations)

    def _observe(
        self, what: str, observe: Callable[[], Iterable[Observation]]
    ) -> Iterable[Observation]:
        try:
            return list(observe())
        except Exception as error:  # noqa: BLE001 - a failing callback must not fail collection
            self.log_failure(what, error)
            return []

    def _observe_connects(self, _options: CallbackOptions) -> Iterable[Observation]:
        self.flush()
        return self._observe(
            "observing connects",
            lambda: (
                Observation(count, {names.ATTR_SERVER_NAME: label})
                for label, count in self.connect_counts().items()
            ),
        )

    def _observe_created(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._observe("observing connections created", self._created_observations)

    def _created_observations(self) -> Iterator[Observation]:
        busy: set[Destination] = set()
        for state in self.pool_states():
            busy.update(where for where, count in state.active.items() if count)
            busy.update(where for where, count in state.idle.items() if count)
        # One hold from reading the totals to dropping counts: a fold in between (another
        # reader collecting) would drop counts the budget has not yet taken.
        with self._collect_lock:
            report = self._destinations.created(self._created_totals(), busy)
            # Counts of collected connectors to a destination without a series of its own are
            # in some series already and go, so a client that met 10,000 destinations does
            # not keep 10,000 totals.
            for where in [w for w in self._folded_created if not self._destinations.tracks(w)]:
                self._destinations.dropped(where, self._folded_created.pop(where))
        for where, count in report.own.items():
            yield Observation(count, destination_attributes(where))
        if report.overflow is not None:
            yield Observation(report.overflow, {OVERFLOW_ATTRIBUTE: True})

    def _observe_open_connections(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._observe(
            "observing open connections",
            lambda: open_connection_observations(self.pool_states(), self._destinations),
        )

    def _observe_waiting(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._observe(
            "observing waiting requests",
            lambda: waiting_observations(self.pool_states(), self._destinations),
        )

    def _observe_limits(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._observe("observing limits", lambda: limit_observations(self._live()))

    def _reinit_locks_after_fork(self) -> None:
        self._labels_lock = threading.Lock()
        self._collect_lock = threading.Lock()
        # The log-once memory has a lock of its own (taken when the label cap is first hit);
        # the child starts with a fresh one, and so may log each problem once more.
        self._failures = OnceLog(logger)


_BY_PROVIDER: PerProvider[PoolTelemetry] = PerProvider()
# Every PoolTelemetry alive, so a forked child can replace locks a parent thread held.
_LIVE: weakref.WeakSet[PoolTelemetry] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for telemetry in list(_LIVE):
        telemetry._reinit_locks_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
