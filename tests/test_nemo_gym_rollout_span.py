"""One span per NeMo Gym rollout: ``ServerClient``'s ``POST /run`` of a row NeMo Gym stamped
with ``_ng_task_index`` and ``_ng_rollout_index`` runs inside a ``rollout`` span naming both,
the root of the rollout's trace, and the agent receives that trace's context.

Imports ``nemo_gym.server_utils`` (NeMo Gym's heavy stack), so marked ``nemo_gym_server``
like ``test_nemo_gym_server_client.py``: run in ``.venv-nemo-gym-server``
(``scripts/nemo-gym-server-env.sh``) and on NeMo Gym main. A real loopback aiohttp server is
the agent; the real aiohttp-client instrumentation makes the HTTP span and the
``traceparent`` header; the real SDK with an in-memory exporter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from conftest import serve_on_loopback
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._rollout_span import (
    ATTR_AGENT,
    ATTR_ROLLOUT_INDEX,
    ATTR_TASK_INDEX,
    SPAN_NAME,
)

with contextlib.suppress(ImportError):  # the main virtualenv only collects this module
    from nemo_gym import server_utils
    from nemo_gym.config_types import BaseServerConfig
    from omegaconf import OmegaConf

pytestmark = [pytest.mark.nemo_gym_server, pytest.mark.nemo_gym]

AGENT = "example_single_tool_call_simple_agent"


class Agent:
    """A loopback agent that records each request's path and ``traceparent`` header."""

    def __init__(self) -> None:
        self.received: list[tuple[str, str | None]] = []
        self.port = 0
        self.entered = asyncio.Event()
        self.hold: asyncio.Event | None = None  # set: each request waits for it

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append((request.path, request.headers.get("traceparent")))
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        return web.json_response({"reward": 1.0})


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    made = Agent()
    runner, made.port = await serve_on_loopback("127.0.0.1", made.handle)
    yield made
    await runner.cleanup()


@pytest.fixture
def traced(
    instrumentor: NemoGymInstrumentor, tracer_provider: TracerProvider
) -> Iterator[TracerProvider]:
    """The plugin (rollout spans) and the aiohttp client, both on ``tracer_provider``."""
    instrumentor.instrument(
        tracer_provider=tracer_provider,
        connection_pool=False,
        sandbox_resources=False,
        pressure=False,
    )
    client = AioHttpClientInstrumentor()
    client.instrument(tracer_provider=tracer_provider)
    yield tracer_provider
    client.uninstrument()


@contextlib.asynccontextmanager
async def server_client_for(agent: Agent) -> AsyncIterator[Any]:
    """A ServerClient naming the loopback agent, over NeMo Gym's global aiohttp client."""
    session = server_utils.set_global_aiohttp_client(server_utils.GlobalAIOHTTPAsyncClientConfig())
    config = {AGENT: {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": 0}}}}
    config[AGENT]["responses_api_agents"]["simple_agent"]["port"] = agent.port
    try:
        yield server_utils.ServerClient(
            head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
            global_config_dict=OmegaConf.create(config),
        )
    finally:
        await session.close()
        server_utils._GLOBAL_AIOHTTP_CLIENT = None


@pytest.fixture
async def client(traced: TracerProvider, agent: Agent) -> AsyncIterator[Any]:
    """A ServerClient naming the loopback agent, with the plugin's rollout spans on."""
    async with server_client_for(agent) as made:
        yield made


def row(task: int, repeat: int) -> dict[str, Any]:
    """A row as NeMo Gym's rollout collection posts it to the agent."""
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "weather?"}]},
        "agent_ref": {"name": AGENT},
        "_ng_task_index": task,
        "_ng_rollout_index": repeat,
    }


def by_name(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def test_rollout_span_is_root_named_by_task_and_repeat(
    client: Any, agent: Agent, span_exporter: InMemorySpanExporter
) -> None:
    """Each POST /run of a rollout is one trace: the rollout span (task and repeat index, the
    agent) is its root, the HTTP client span its child, and the agent gets that context."""
    for task, repeat in ((0, 0), (0, 1), (3, 59)):
        response = await client.post(server_name=AGENT, url_path="/run", json=row(task, repeat))
        assert await response.json() == {"reward": 1.0}
    rollouts = by_name(span_exporter, SPAN_NAME)
    assert [dict(s.attributes or {}) for s in rollouts] == [
        {ATTR_TASK_INDEX: task, ATTR_ROLLOUT_INDEX: repeat, ATTR_AGENT: AGENT}
        for task, repeat in ((0, 0), (0, 1), (3, 59))
    ]
    clients = [s for s in span_exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert len(clients) == 3
    for rollout, http, (path, traceparent) in zip(rollouts, clients, agent.received, strict=True):
        assert rollout.parent is None
        assert rollout.kind is SpanKind.INTERNAL
        assert http.parent is not None
        assert http.parent.span_id == rollout.context.span_id
        assert path == "/run"
        assert traceparent is not None
        # version-trace id-parent id-flags (sampled; the SDK may add its random-id flag)
        _version, trace_id, parent_id, _flags = traceparent.split("-")
        assert (trace_id, parent_id) == (
            f"{rollout.context.trace_id:032x}",
            f"{http.context.span_id:016x}",
        )
    assert len({s.context.trace_id for s in rollouts}) == 3


async def test_rollout_span_only_for_rollouts(
    client: Any, agent: Agent, span_exporter: InMemorySpanExporter
) -> None:
    """Other paths, and a /run body without NeMo Gym's two indices, get no rollout span."""
    await client.post(server_name=AGENT, url_path="/v1/responses", json=row(0, 0))
    unstamped = {k: v for k, v in row(0, 0).items() if k != "_ng_rollout_index"}
    await client.post(server_name=AGENT, url_path="/run", json=unstamped)
    await client.post(server_name=AGENT, url_path="/run", json={**row(0, 0), "_ng_task_index": "0"})
    await client.get(server_name=AGENT, url_path="/run")
    assert by_name(span_exporter, SPAN_NAME) == []
    assert len(agent.received) == 4


async def test_rollout_span_failed_request_same_exception(
    client: Any, span_exporter: InMemorySpanExporter
) -> None:
    """A rollout ServerClient cannot send (an agent its configuration lacks) raises what it
    raises uninstrumented, and its span ends with an error status naming the exception."""
    # OmegaConf's ConfigKeyError (a KeyError) on 0.4.0; whatever it is, the same uninstrumented.
    with pytest.raises(KeyError, match="no_such_agent") as raised:
        await client.post(server_name="no_such_agent", url_path="/run", json=row(1, 2))
    instrumentor = NemoGymInstrumentor()
    instrumentor.uninstrument()
    with pytest.raises(KeyError, match="no_such_agent") as plain:
        await client.post(server_name="no_such_agent", url_path="/run", json=row(1, 2))
    assert (type(raised.value), str(raised.value)) == (type(plain.value), str(plain.value))
    (rollout,) = by_name(span_exporter, SPAN_NAME)
    assert rollout.status.status_code is StatusCode.ERROR
    assert rollout.status.description == type(raised.value).__name__
    assert dict(rollout.attributes or {})[ATTR_TASK_INDEX] == 1


async def test_rollout_span_cancelled_rollout_propagates(
    client: Any, agent: Agent, span_exporter: InMemorySpanExporter
) -> None:
    """A rollout cancelled while the agent holds it raises CancelledError to its caller, and
    its span ends, without an error status."""
    agent.hold = asyncio.Event()
    sent = asyncio.create_task(client.post(server_name=AGENT, url_path="/run", json=row(4, 7)))
    await agent.entered.wait()
    sent.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sent
    agent.hold.set()
    (rollout,) = by_name(span_exporter, SPAN_NAME)
    assert rollout.status.status_code is StatusCode.UNSET
    assert dict(rollout.attributes or {})[ATTR_ROLLOUT_INDEX] == 7


def test_rollout_span_uninstrument_restores_request(tracer_provider: TracerProvider) -> None:
    """uninstrument() puts ServerClient.request back, the identical object."""
    before = server_utils.ServerClient.__dict__["request"]
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, connection_pool=False)
    try:
        assert server_utils.ServerClient.__dict__["request"] is not before
    finally:
        instrumentor.uninstrument()
    assert server_utils.ServerClient.__dict__["request"] is before


ROLLOUT_ONLY = {"connection_pool": False, "sandbox_resources": False, "pressure": False}


class SecondInstrumentor(NemoGymInstrumentor):
    """A second instrumentor object: a subclass with a singleton slot of its own."""

    _instance = None


async def test_rollout_span_switched_off_request_unwrapped_no_span(
    instrumentor: NemoGymInstrumentor,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    agent: Agent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``rollout_span=False``, or ``OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN=false``: ServerClient's
    ``request`` is NeMo Gym's own and a rollout gets no span."""
    before = server_utils.ServerClient.__dict__["request"]
    for how in ("argument", "variable"):
        if how == "argument":
            instrumentor.instrument(
                tracer_provider=tracer_provider, rollout_span=False, **ROLLOUT_ONLY
            )
        else:
            monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN", "false")
            instrumentor.instrument(tracer_provider=tracer_provider, **ROLLOUT_ONLY)
        try:
            assert server_utils.ServerClient.__dict__["request"] is before, how
            async with server_client_for(agent) as made:
                response = await made.post(server_name=AGENT, url_path="/run", json=row(1, 0))
                assert await response.json() == {"reward": 1.0}
        finally:
            instrumentor.uninstrument()
        tracer_provider.force_flush()
        assert by_name(span_exporter, SPAN_NAME) == [], how


async def test_rollout_span_two_instrumentors_each_on_its_own_provider(
    instrumentor: NemoGymInstrumentor, agent: Agent
) -> None:
    """Two instrumentor objects, each with its own tracer provider: a rollout is a span on
    each; after the first one's ``uninstrument()`` only the second's provider gets one, and
    after the second's, ``request`` is NeMo Gym's own again."""
    before = server_utils.ServerClient.__dict__["request"]
    exporters = (InMemorySpanExporter(), InMemorySpanExporter())
    providers = tuple(TracerProvider() for _ in exporters)
    for provider, exporter in zip(providers, exporters, strict=True):
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    second = SecondInstrumentor()
    instrumentor.instrument(tracer_provider=providers[0], **ROLLOUT_ONLY)
    second.instrument(tracer_provider=providers[1], **ROLLOUT_ONLY)
    try:
        async with server_client_for(agent) as made:
            await made.post(server_name=AGENT, url_path="/run", json=row(2, 0))
            instrumentor.uninstrument()
            await made.post(server_name=AGENT, url_path="/run", json=row(2, 1))
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        second.uninstrument()
    indices = [
        [dict(s.attributes or {})[ATTR_ROLLOUT_INDEX] for s in by_name(exporter, SPAN_NAME)]
        for exporter in exporters
    ]
    assert indices == [[0], [0, 1]]
    assert server_utils.ServerClient.__dict__["request"] is before
    for provider in providers:
        provider.shutdown()
