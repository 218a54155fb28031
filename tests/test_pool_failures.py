"""Telemetry failures never reach the application: broken histograms and meter providers."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from opentelemetry import context as otel_context
from opentelemetry import metrics
from opentelemetry.metrics import Histogram, Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.test.globals_test import reset_metrics_globals
from opentelemetry.util.types import Attributes

from conftest import (
    GatedServerFactory,
    eventually,
    fetch,
    queued,
    same_failure,
    through_pool,
    timed_connector,
    timeout_while_queued,
)
from opentelemetry.instrumentation.nemo_gym.telemetry import _pool_telemetry
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

TELEMETRY_LOGGER = _pool_telemetry.__name__


class _ExplodingHistogram(Histogram):
    """An API histogram whose ``record`` fails, as a broken pipeline might."""

    def __init__(self) -> None:
        # The API's abstract __init__ has nothing worth calling.
        self.calls = 0

    def record(
        self,
        amount: int | float,
        attributes: Attributes = None,
        context: otel_context.Context | None = None,
    ) -> None:
        self.calls += 1
        raise RuntimeError("histogram exploded")


class _ExplodingHistogramMeter:
    """A real SDK meter except that the histograms it makes fail on ``record``."""

    def __init__(self, meter: Meter, histogram: _ExplodingHistogram) -> None:
        self._meter = meter
        self._histogram = histogram

    def create_histogram(self, *_args: Any, **_kwargs: Any) -> Histogram:
        return self._histogram

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)


class _ExplodingHistogramMeterProvider(MeterProvider):
    """An SDK meter provider whose histograms raise on every ``record``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.histogram = _ExplodingHistogram()

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        return _ExplodingHistogramMeter(super().get_meter(*args, **kwargs), self.histogram)


class _BrokenMeterProvider(MeterProvider):
    """An SDK meter provider that cannot hand out meters."""

    def get_meter(self, *args: Any, **kwargs: Any) -> metrics.Meter:
        raise RuntimeError("no meters today")


@pytest.mark.parametrize("batch_size", [1, 128])
async def test_queue_timed_connector_exploding_histogram_changes_nothing(
    gated_server: GatedServerFactory, caplog: pytest.LogCaptureFixture, batch_size: int
) -> None:
    """Histograms that raise on record, inline (batch of 1) or at collection, change nothing."""
    reader = InMemoryMetricReader()
    provider = _ExplodingHistogramMeterProvider(metric_readers=[reader])
    try:
        telemetry = PoolTelemetry(
            provider, version="test", max_server_names=10, batch_size=batch_size
        )
        caplog.set_level(logging.DEBUG, logger=TELEMETRY_LOGGER)
        server = await gated_server("127.0.0.1")
        plain = aiohttp.TCPConnector(limit=1)
        timed = timed_connector(telemetry, limit=1)
        plain_error, plain_session, plain_holder = await timeout_while_queued(plain, server)
        timed_error, timed_session, timed_holder = await timeout_while_queued(timed, server)
        try:
            same_failure(plain_error, timed_error)
            queued_ok = asyncio.create_task(fetch(timed_session, server.url))
            await eventually(lambda: queued(timed) == 1, "a request queued")
            server.open()
            assert await asyncio.gather(plain_holder, timed_holder, queued_ok) == ["ok"] * 3
        finally:
            await plain_session.close()
            await timed_session.close()
        reader.get_metrics_data()
        assert provider.histogram.calls == 2
        failures = [r for r in caplog.records if r.name == TELEMETRY_LOGGER]
        assert [r.levelno for r in failures] == [logging.DEBUG]
        assert "recording a queue wait" in failures[0].getMessage()
    finally:
        provider.shutdown()


async def test_queue_timed_connector_broken_global_meter_provider_changes_nothing(
    gated_server: GatedServerFactory,
) -> None:
    """A global SDK meter provider that cannot make meters still leaves a working connector."""

    provider = _BrokenMeterProvider(metric_readers=[InMemoryMetricReader()])
    reset_metrics_globals()
    metrics.set_meter_provider(provider)
    try:
        server = await gated_server("127.0.0.1")
        connector = QueueTimedTCPConnector(limit=1)
        assert connector._nemo_gym_pool is None
        await through_pool(connector, server, requests=2, slots=1)
        with pytest.raises(RuntimeError, match="no meters today"):
            PoolTelemetry.of(provider, version="test", max_server_names=1)
    finally:
        reset_metrics_globals()
        provider.shutdown()
