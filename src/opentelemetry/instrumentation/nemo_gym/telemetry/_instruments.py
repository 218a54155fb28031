"""Connection-pool instrument names, units and buckets, and the instruments made from them.

The names and attribute keys are a contract (dashboards depend on them). Instruments are
created once per meter provider and cached weakly by provider, so constructing many
connectors (or sessions) never registers instruments again or leaks meters.

The connect counter is asynchronous: ``connect()`` only bumps a plain counter dictionary, and
the SDK reads a snapshot of it when it collects, so no OpenTelemetry call happens per connect.

Threading: every function here may be called from any thread; the cache has its own lock.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Histogram, ObservableCounter, Observation

from opentelemetry.instrumentation.nemo_gym.telemetry._batched_histogram import BatchedHistogram
from opentelemetry.instrumentation.nemo_gym.version import __version__

METER_NAME: Final = "opentelemetry.instrumentation.nemo_gym"

QUEUE_DURATION: Final = "gym.http.connection_pool.queue_duration_ms"
QUEUE_DURATION_UNIT: Final = "ms"
QUEUE_DURATION_DESCRIPTION: Final = (
    "Time an aiohttp request waited for a free connection-pool slot, one sample per queued wait."
)
# Sub-millisecond buckets show a pool that is only just saturated; 30 s covers the longest
# connect timeouts rollout servers use.
QUEUE_DURATION_BUCKETS: Final[tuple[float, ...]] = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    5000.0,
    30000.0,
)

CONNECT_TOTAL: Final = "gym.http.connection_pool.connect_total"
CONNECT_TOTAL_UNIT: Final = "{connection}"
CONNECT_TOTAL_DESCRIPTION: Final = (
    "Connection acquisitions (connect() calls) per destination, failed and abandoned included."
)

ATTR_QUEUE_CONSTRAINT: Final = "nemo.gym.http.connection_pool.queue_constraint"
ATTR_QUEUE_OUTCOME: Final = "nemo.gym.http.connection_pool.queue_outcome"
ATTR_SERVER_NAME: Final = "nemo.gym.http.destination.server.name"

OUTCOME_OK: Final = "ok"
OUTCOME_ABANDONED: Final = "abandoned"


@dataclass(frozen=True, slots=True)
class ConnectionPoolInstruments:
    """The connection-pool instruments of one meter provider."""

    queue_duration: Histogram
    connect_total: ObservableCounter


def _observe_connects(_options: CallbackOptions) -> Iterable[Observation]:
    # Imported here because connection_pool imports this module; by the time the SDK
    # collects, both modules are loaded and the import is a dictionary lookup.
    from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
        _connect_count_snapshot,
    )

    return [
        Observation(count, {ATTR_SERVER_NAME: label})
        for label, count in _connect_count_snapshot().items()
    ]


def _create(meter_provider: metrics.MeterProvider) -> ConnectionPoolInstruments:
    meter = meter_provider.get_meter(METER_NAME, __version__)
    # Queue waits are buffered and recorded in batches: a record made once per request, in
    # the middle of aiohttp's request path, costs about three times one made back to back
    # (benchmarks/pool_overhead.py, mode "record"). Every wait still reaches the SDK through
    # the public record(), with its own value, attributes and context.
    queue_duration = BatchedHistogram(
        meter.create_histogram(
            QUEUE_DURATION,
            unit=QUEUE_DURATION_UNIT,
            description=QUEUE_DURATION_DESCRIPTION,
            explicit_bucket_boundaries_advisory=QUEUE_DURATION_BUCKETS,
        )
    )

    def observe_connects(options: CallbackOptions) -> Iterable[Observation]:
        # The SDK runs observable callbacks at the start of every collection, before it
        # reads the synchronous instruments' storages: flushing here makes each export
        # include every wait that ended before the collection began.
        queue_duration.flush()
        return _observe_connects(options)

    return ConnectionPoolInstruments(
        queue_duration=queue_duration,
        connect_total=meter.create_observable_counter(
            CONNECT_TOTAL,
            callbacks=[observe_connects],
            unit=CONNECT_TOTAL_UNIT,
            description=CONNECT_TOTAL_DESCRIPTION,
        ),
    )


_CACHE: weakref.WeakKeyDictionary[metrics.MeterProvider, ConnectionPoolInstruments] = (
    weakref.WeakKeyDictionary()
)
_CACHE_LOCK = threading.Lock()
_BOUND: ConnectionPoolInstruments | None = None


def instruments_for(meter_provider: metrics.MeterProvider) -> ConnectionPoolInstruments:
    """Return ``meter_provider``'s connection-pool instruments, creating them on first use.

    Repeated calls with the same provider return the same object, so the observable counter's
    callback is registered once per provider. Raises whatever the provider raises when it
    cannot create instruments; callers on a request path must catch ``Exception``.
    """
    with _CACHE_LOCK:
        try:
            cached = _CACHE.get(meter_provider)
        except TypeError:
            # A provider that cannot be weakly referenced cannot be cached either.
            return _create(meter_provider)
        if cached is None:
            cached = _create(meter_provider)
            _CACHE[meter_provider] = cached
        return cached


def bind_instruments(instruments: ConnectionPoolInstruments | None) -> None:
    """Make connectors constructed from now on record into ``instruments``.

    ``None`` unbinds, so new connectors fall back to the global meter provider's instruments.
    Connectors that already exist keep the instruments they captured when constructed.
    """
    global _BOUND
    _BOUND = instruments


def active_instruments() -> ConnectionPoolInstruments:
    """The bound instruments if any, else those of the current global meter provider."""
    bound = _BOUND
    if bound is not None:
        return bound
    return instruments_for(metrics.get_meter_provider())
