"""The pool's breaks under module-global state, one test each: every one of these failed on
the module-global design.

Explicit meter providers report only their own connectors; a copied connector works; an
introspection error never reaches a request; a fork while a telemetry lock is held does not
hang the child; ``suppress_instrumentation`` is honoured.
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import (
    GatedServer,
    connect_counts,
    eventually,
    queue_waits,
    queued,
)
from conftest import timed_connector as make_timed
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)


@pytest.fixture
def second_reader() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    """A second SDK meter provider with its own in-memory reader."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield provider, reader
    provider.shutdown()


async def get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        return await response.text()


async def saturate(connector: aiohttp.TCPConnector, server: GatedServer, requests: int) -> None:
    """``requests`` requests through ``connector`` (limit 1): one held, the others queued."""
    async with aiohttp.ClientSession(connector=connector, connector_owner=False) as session:
        held_before = server.held
        tasks = [asyncio.create_task(get(session, f"{server.url}/hold")) for _ in range(requests)]
        await eventually(
            lambda: server.held == held_before + 1 and queued(connector) == requests - 1,
            f"one of {requests} requests held, the others queued",
        )
        server.open()
        assert await asyncio.gather(*tasks) == ["ok"] * requests


# --- 1: explicit meter providers -------------------------------------------------------------


async def test_explicit_providers_each_report_only_their_connectors(
    server: GatedServer,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    second_reader: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    """Two providers, two connectors: each provider counts exactly its own connector's connects."""
    other_provider, other_reader = second_reader
    first = make_timed(PoolTelemetry.of(meter_provider, version="t", max_server_names=5))
    second = make_timed(PoolTelemetry.of(other_provider, version="t", max_server_names=5))
    async with (
        aiohttp.ClientSession(connector=first) as one,
        aiohttp.ClientSession(connector=second) as two,
    ):
        for _ in range(3):
            assert await get(one, server.url) == "ok"
        for _ in range(5):
            assert await get(two, server.url) == "ok"
        assert connect_counts(metric_reader) == {"external": 3}
        assert connect_counts(other_reader) == {"external": 5}


async def test_instrument_explicit_provider_not_global_one(
    instrumentor: NemoGymInstrumentor,
    server: GatedServer,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    second_reader: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    """instrument(meter_provider=p) records into p only, even beside an exporting global one."""
    explicit_provider, explicit_reader = second_reader
    instrumentor.instrument(meter_provider=explicit_provider, sandbox_resources=False)
    patched = aiohttp.TCPConnector(limit=1)
    direct = QueueTimedTCPConnector(limit=1)
    try:
        assert type(patched) is QueueTimedTCPConnector
        await saturate(patched, server, 3)
        async with aiohttp.ClientSession(connector=direct, connector_owner=False) as session:
            assert await get(session, server.url) == "ok"
        assert connect_counts(explicit_reader) == {"external": 4}
        assert queue_waits(explicit_reader) == {("total", "ok", "external"): 2}
        assert connect_counts(metric_reader) == {}
        assert queue_waits(metric_reader) == {}
    finally:
        await patched.close()
        await direct.close()


async def test_connector_keeps_provider_it_was_built_under(
    instrumentor: NemoGymInstrumentor,
    server: GatedServer,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    second_reader: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    """A connector records into the provider of the instrument() it was built under, for good."""
    later_provider, later_reader = second_reader
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    connector = aiohttp.TCPConnector(limit=1)
    instrumentor.uninstrument()
    instrumentor.instrument(meter_provider=later_provider, sandbox_resources=False)
    try:
        await saturate(connector, server, 2)
        assert queue_waits(metric_reader) == {("total", "ok", "external"): 1}
        assert connect_counts(metric_reader) == {"external": 2}
        assert queue_waits(later_reader) == {}
        assert connect_counts(later_reader) == {}
    finally:
        await connector.close()


async def test_connector_bound_again_is_reported_by_new_telemetry_only(
    server: GatedServer,
    global_meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
    second_reader: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    """Rebinding a connector moves it: counts so far stay where they were, later ones move."""
    other_provider, other_reader = second_reader
    connector = QueueTimedTCPConnector()
    async with aiohttp.ClientSession(connector=connector) as session:
        assert await get(session, server.url) == "ok"
        connector._nemo_gym_attach(
            PoolTelemetry.of(other_provider, version="t", max_server_names=5)
        )
        assert await get(session, server.url) == "ok"
        assert await get(session, server.url) == "ok"
        assert connect_counts(metric_reader) == {"external": 1}
        assert connect_counts(other_reader) == {"external": 2}


# --- 5: copy.copy ----------------------------------------------------------------------------


async def test_copied_connector_while_instrumented_serves_queued_requests(
    instrumentor: NemoGymInstrumentor,
    server: GatedServer,
    meter_provider: MeterProvider,
    metric_reader: InMemoryMetricReader,
) -> None:
    """copy.copy() of a timed connector is a working connector: queued requests complete."""
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    original = aiohttp.TCPConnector(limit=1)
    copied = copy.copy(original)
    try:
        assert type(copied) is QueueTimedTCPConnector
        assert copied.limit == 1
        await saturate(copied, server, 3)
        assert queue_waits(metric_reader) == {("total", "ok", "external"): 2}
    finally:
        await copied.close()
        await original.close()


# --- 6: introspection errors -----------------------------------------------------------------


class _Uncountable(set[object]):
    """A set whose size cannot be asked, as a changed aiohttp's container might be."""

    def __len__(self) -> int:
        raise RuntimeError("cannot count")


class _UnreadableConnector(QueueTimedTCPConnector):
    """Keeps aiohttp working while ``len(connector._acquired)`` raises for any other reader."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._acquired = _Uncountable()

    def _available_connections(self, key: Any) -> int:
        # aiohttp's own arithmetic for the total limit, counting without len().
        acquired = sum(1 for _ in self._acquired)
        return self._limit - acquired if self._limit else 1


async def test_introspection_error_classifies_wait_unknown_and_request_succeeds(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """An exception while reading the connector makes the wait `unknown`; requests succeed."""
    connector = _UnreadableConnector(limit=1)
    connector._nemo_gym_attach(pool_telemetry)
    with pytest.raises(RuntimeError):
        len(connector._acquired)
    await saturate(connector, server, 3)
    await connector.close()
    assert queue_waits(metric_reader) == {("unknown", "ok", "external"): 2}


# --- 8: fork ---------------------------------------------------------------------------------

_FORK_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, select, signal, sys, threading

    import aiohttp
    from aiohttp import web
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from opentelemetry.instrumentation.nemo_gym.telemetry import _pool_telemetry, connection_pool

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    telemetry = connection_pool.global_pool_telemetry()

    # Another thread holds every lock the telemetry has when the fork happens.
    holding, release = threading.Event(), threading.Event()

    def hold_locks():
        with (
            telemetry._labels_lock,
            telemetry._collect_lock,
            telemetry._failures._lock,
            _pool_telemetry._BY_PROVIDER.lock,
        ):
            holding.set()
            release.wait(60)

    threading.Thread(target=hold_locks, daemon=True).start()
    assert holding.wait(60)

    async def child_main():
        app = web.Application()

        async def ok(request):
            return web.Response(text="ok")

        app.router.add_get("/", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            connector = connection_pool.QueueTimedTCPConnector()
            texts = []
            async with aiohttp.ClientSession(connector=connector) as session:
                # The first new label is admitted; the second is over the cap of one, which
                # logs a warning once: both take locks the parent's thread holds.
                for label in ("from-child", "over-the-cap"):
                    token = connection_pool.set_server_name(label)
                    async with session.get(f"http://127.0.0.1:{port}/") as response:
                        texts.append(await response.text())
                    connection_pool.reset_server_name(token)
            reader.get_metrics_data()  # a collection takes the collect lock
            return "+".join(texts), connection_pool._connect_count_snapshot()
        finally:
            await runner.cleanup()

    pid = os.fork()
    if pid == 0:
        try:
            text, counts = asyncio.run(child_main())
            print("child:", text, counts, flush=True)
            expected = ("ok+ok", {"from-child": 1, "other": 1})
            os._exit(0 if (text, counts) == expected else 3)
        except BaseException as error:
            print("child failed:", repr(error), flush=True)
            os._exit(4)

    # Wait on the child's exit itself, no polling: its pidfd turns readable once it has ended
    # (bounded, because a hung child is the failure this test looks for).
    ended, _, _ = select.select([os.pidfd_open(pid)], [], [], 60)
    if ended:
        _, status = os.waitpid(pid, 0)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("child hung", flush=True)
        sys.exit(2)
    release.set()
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.fork and os.pidfd_open")
def test_fork_while_telemetry_locks_held_child_still_works() -> None:
    """A child forked while another thread holds the telemetry's locks requests, logs, collects."""
    environment = {**os.environ, "OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "child: ok+ok {'from-child': 1, 'other': 1}" in result.stdout


# --- 9: suppress_instrumentation -------------------------------------------------------------


async def test_suppress_instrumentation_connector_built_inside_stays_plain(
    instrumentor: NemoGymInstrumentor, meter_provider: MeterProvider
) -> None:
    """A TCPConnector constructed inside suppress_instrumentation() is a plain one."""
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    with suppress_instrumentation():
        suppressed = aiohttp.TCPConnector()
    outside = aiohttp.TCPConnector()
    try:
        assert type(suppressed) is aiohttp.TCPConnector
        assert type(outside) is QueueTimedTCPConnector
    finally:
        await suppressed.close()
        await outside.close()


async def test_suppress_instrumentation_queue_waits_inside_not_recorded(
    server: GatedServer,
    pool_telemetry: PoolTelemetry,
    metric_reader: InMemoryMetricReader,
) -> None:
    """Waits that happen inside suppress_instrumentation() are dropped; the others recorded."""
    connector = make_timed(pool_telemetry, limit=1)

    async def get_suppressed(label: str) -> str:
        token = set_server_name(label)
        try:
            with suppress_instrumentation():
                return await get(session, server.url)
        finally:
            reset_server_name(token)

    async with aiohttp.ClientSession(connector=connector) as session:
        holder = asyncio.create_task(get(session, f"{server.url}/hold"))
        await server.until_held(1)
        hidden = [asyncio.create_task(get_suppressed("hidden")) for _ in range(2)]
        await eventually(lambda: queued(connector) == 2, "two suppressed requests queued")
        visible = asyncio.create_task(get(session, server.url))
        await eventually(lambda: queued(connector) == 3, "a visible request queued")
        server.open()
        assert await asyncio.gather(holder, *hidden, visible) == ["ok"] * 4
    assert queue_waits(metric_reader) == {("total", "ok", "external"): 1}
