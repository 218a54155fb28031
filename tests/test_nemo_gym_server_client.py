"""NeMo Gym's global aiohttp client and ``ServerClient``, labelled by target server.

These tests import ``nemo_gym.server_utils``, which needs NeMo Gym's heavy stack (ray,
fastapi, wandb, ...). They run in their own virtualenvs: 0.4.0's, built by
``scripts/nemo-gym-server-env.sh``, and NeMo Gym main's, built by
``scripts/nemo-gym-main-env.sh``. Marked ``nemo_gym_server``, which the main suite leaves out
(``SECTIONS`` in ``conftest.py``), they run in ``.ci/run``'s sections with ``-m``, where a
``server_utils`` that does not import fails them.

Real loopback servers (127.0.0.1 and 127.0.0.2) hold each request until the test releases it,
so a queued wait is produced deterministically: one request holds the only per-host slot,
a second waits for it, then the first is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import connect_counts
from conftest import queued as waiting_for_a_slot
from nemo_gym_support import nemo_gym_main
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym import (
    _server_client,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    ATTR_QUEUE_CONSTRAINT,
    ATTR_QUEUE_OUTCOME,
    ATTR_SERVER_NAME,
    QUEUE_DURATION,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)
from waiting import eventually

# Not importable in the light main virtualenv, which collects this module only to leave it
# out; where the section is selected, conftest.SECTIONS fails the tests with the import error.
with contextlib.suppress(ImportError):
    from nemo_gym import server_utils
    from nemo_gym.config_types import BaseServerConfig
    from omegaconf import OmegaConf

# Also run on NeMo Gym main, whose virtualenv has server_utils' stack.
pytestmark = [pytest.mark.nemo_gym_server, pytest.mark.nemo_gym]


class HeldServer:
    """A loopback aiohttp server whose requests wait until ``release()`` (``/stream``: its
    headers at once, its body then)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.in_flight = 0
        self.paths: list[str] = []
        self.released = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        self.in_flight += 1
        try:
            if request.path == "/stream":
                streamed = web.StreamResponse()
                await streamed.prepare(request)
                await self.released.wait()
                await streamed.write(b"ok")
                await streamed.write_eof()
                return streamed
            await self.released.wait()
            return web.Response(text="ok")
        finally:
            self.in_flight -= 1

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def release(self) -> None:
        self.released.set()

    async def stop(self) -> None:
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def servers() -> AsyncIterator[dict[str, HeldServer]]:
    started = {"policy_model": HeldServer("127.0.0.1"), "math_resources": HeldServer("127.0.0.2")}
    for server in started.values():
        await server.start()
    yield started
    for server in started.values():
        await server.stop()


@pytest.fixture
def instrumented(meter_provider: MeterProvider) -> Iterator[NemoGymInstrumentor]:
    """The instrumentor with an explicit meter provider that is not the global one."""
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    yield instrumentor
    instrumentor.uninstrument()


@pytest.fixture
async def global_client(
    instrumented: NemoGymInstrumentor, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    """NeMo Gym's global aiohttp client, built by NeMo Gym with one slot per host."""
    monkeypatch.delenv("NEMO_GYM_FASTAPI_NUM_WORKERS", raising=False)
    config = server_utils.GlobalAIOHTTPAsyncClientConfig(
        global_aiohttp_connector_limit=100, global_aiohttp_connector_limit_per_host=1
    )
    session = server_utils.set_global_aiohttp_client(config)
    yield session
    await session.close()
    # NeMo Gym's exit hook closes the client with asyncio.run(); ours is closed already.
    server_utils._GLOBAL_AIOHTTP_CLIENT = None


def server_client(servers: dict[str, HeldServer]) -> Any:
    """A ServerClient whose global config names the loopback servers as NeMo Gym does."""
    config = {
        name: {"resources_servers": {name: {"host": server.host, "port": server.port}}}
        for name, server in servers.items()
    }
    return server_utils.ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
        global_config_dict=OmegaConf.create(config),
    )


def queue_samples(reader: InMemoryMetricReader) -> list[tuple[dict[str, Any], int]]:
    data = reader.get_metrics_data()
    assert data is not None
    return sorted(
        (
            (dict(point.attributes or {}), point.count)
            for resource_metrics in data.resource_metrics
            for scope_metrics in resource_metrics.scope_metrics
            for metric in scope_metrics.metrics
            if metric.name == QUEUE_DURATION
            for point in metric.data.data_points
            if point.count
        ),
        key=repr,
    )


async def queue_behind_holder(
    session: Any, server: HeldServer, holder: Callable[[], Any], queued: Callable[[], Any]
) -> None:
    """``holder()`` takes the only slot to ``server``; ``queued()`` waits for it; release."""
    first = asyncio.create_task(holder())
    await eventually(lambda: server.in_flight == 1, "one request in flight at the server")
    second = asyncio.create_task(queued())
    await eventually(
        lambda: waiting_for_a_slot(session.connector) == 1, "one request waiting for a slot"
    )
    server.release()
    for response in await asyncio.gather(first, second):
        assert await response.text() == "ok"


def sample(server_name: str) -> tuple[dict[str, Any], int]:
    return (
        {
            ATTR_QUEUE_CONSTRAINT: "per_host",
            ATTR_QUEUE_OUTCOME: "ok",
            ATTR_SERVER_NAME: server_name,
        },
        1,
    )


async def test_server_client_queue_wait_labelled_by_server(
    servers: dict[str, HeldServer], global_client: Any, metric_reader: InMemoryMetricReader
) -> None:
    """Waits of ServerClient.post/get/request carry the NeMo Gym server name they target."""
    assert isinstance(global_client.connector, QueueTimedTCPConnector)
    client = server_client(servers)
    await queue_behind_holder(
        global_client,
        servers["policy_model"],
        lambda: client.post("policy_model", "/v1/responses", json={"input": "hi"}),
        lambda: client.get(server_name="policy_model", url_path="/health"),
    )
    await queue_behind_holder(
        global_client,
        servers["math_resources"],
        lambda: client.request("math_resources", "/verify", "POST"),
        lambda: client.request(server_name="math_resources", url_path="/verify", method="GET"),
    )
    assert queue_samples(metric_reader) == sorted(
        [sample("policy_model"), sample("math_resources")], key=repr
    )


async def test_global_client_direct_request_stays_external(
    servers: dict[str, HeldServer], global_client: Any, metric_reader: InMemoryMetricReader
) -> None:
    """A request through NeMo Gym's module-level request() names no server: ``external``."""
    server = servers["policy_model"]
    url = f"http://{server.host}:{server.port}/x"
    await queue_behind_holder(
        global_client,
        server,
        lambda: server_utils.request("GET", url),
        lambda: server_utils.request("GET", url),
    )
    assert queue_samples(metric_reader) == [sample("external")]


def test_uninstrument_restores_server_client(meter_provider: MeterProvider) -> None:
    """uninstrument puts ServerClient's own methods back, identical objects."""
    before = {name: server_utils.ServerClient.__dict__[name] for name in ("request", "get", "post")}
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(meter_provider=meter_provider, sandbox_resources=False)
    try:
        assert all(server_utils.ServerClient.__dict__[n] is not f for n, f in before.items())
    finally:
        instrumentor.uninstrument()
    assert all(server_utils.ServerClient.__dict__[n] is f for n, f in before.items())


def test_capacity_workers_from_nemo_gym_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """NeMo Gym's worker count is used when OTEL_PYTHON_NEMO_GYM_WORKERS is unset."""
    monkeypatch.delenv("OTEL_PYTHON_NEMO_GYM_WORKERS", raising=False)
    monkeypatch.setenv("NEMO_GYM_FASTAPI_NUM_WORKERS", "4")
    assert _server_client.nemo_gym_worker_count() == 4
    assert _server_client.capacity_workers() == 4
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_WORKERS", "2")
    assert _server_client.capacity_workers() == 2
    monkeypatch.delenv("OTEL_PYTHON_NEMO_GYM_WORKERS")
    monkeypatch.setenv("NEMO_GYM_FASTAPI_NUM_WORKERS", "0")
    assert _server_client.capacity_workers() == 1


@pytest.mark.nemo_gym_main
async def test_global_client_keeps_nemo_gym_mains_socket_options(
    servers: dict[str, HeldServer], instrumented: NemoGymInstrumentor
) -> None:
    """NeMo Gym main builds its global connector with a socket factory (TCP keepalive); our
    timed connector in its place opens its sockets with exactly those options."""
    nemo_gym_main()
    config = server_utils.GlobalAIOHTTPAsyncClientConfig(
        global_aiohttp_tcp_keepalive_idle_seconds=61,
        global_aiohttp_tcp_keepalive_interval_seconds=11,
        global_aiohttp_tcp_keepalive_probes=4,
    )
    session = server_utils.set_global_aiohttp_client(config)
    server = servers["policy_model"]
    try:
        assert isinstance(session.connector, QueueTimedTCPConnector)
        async with session.get(f"http://{server.host}:{server.port}/stream") as response:
            # The body is held back, so the connection is still the response's.
            assert response.connection is not None
            transport = response.connection.transport
            assert transport is not None
            sock = transport.get_extra_info("socket")
            options = [
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            ]
            server.release()
            assert await response.text() == "ok"
    finally:
        await session.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None
    assert options == [1, 61, 11, 4]


@pytest.mark.nemo_gym_main
async def test_server_client_rollout_path_labelled_by_server(
    servers: dict[str, HeldServer], global_client: Any, metric_reader: InMemoryMetricReader
) -> None:
    """With NeMo Gym main's rollout observability on, ServerClient prefixes a resources
    server's path with the rollout; the request is still labelled by the server's name."""
    nemo_gym_main()
    from nemo_gym.rollout_correlation import rollout_context

    client = server_client(servers)
    client.global_config_dict["observability_enabled"] = True
    server = servers["math_resources"]
    server.release()
    with rollout_context("r-1"):
        response = await client.post("math_resources", "/verify", json={})
    assert await response.text() == "ok"
    assert server.paths == ["/ng-rollout/r-1/verify"]
    assert connect_counts(metric_reader) == {"math_resources": 1}
