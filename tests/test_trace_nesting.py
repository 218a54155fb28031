"""A resources server's sandbox spans nest under its handling of the request, in the caller's
trace: contrib's aiohttp-client and FastAPI instrumentations carry the context over HTTP, and
the plugin's ``sandbox.*`` spans start in it.

A real FastAPI app served by uvicorn on loopback, instrumented by
``opentelemetry-instrumentation-fastapi``; a real aiohttp client instrumented by
``opentelemetry-instrumentation-aiohttp-client``; NeMo Gym's ``AsyncSandbox`` with our process
provider; the real SDK with an in-memory exporter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvicorn
from fastapi import FastAPI
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from conftest import eventually
from nemo_gym_support import nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

LEAKED = "another request"  # the span current where the server's task was made
LIFECYCLE = ("sandbox.create", "sandbox.exec", "sandbox.close")  # AsyncSandbox start, exec, exit


@pytest.fixture
def traced(
    instrumentor: NemoGymInstrumentor,
    tracer_provider: TracerProvider,
    meter_provider: MeterProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[TracerProvider]:
    """The plugin (its sandbox half and its uvicorn start, with the pressure metrics) and the
    aiohttp client on ``tracer_provider``."""
    nemo_gym_sandbox()
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0")
    instrumentor.instrument(
        tracer_provider=tracer_provider, meter_provider=meter_provider, connection_pool=False
    )
    client = AioHttpClientInstrumentor()
    client.instrument(tracer_provider=tracer_provider)
    yield tracer_provider
    client.uninstrument()


def resources_app(base_dir: Path) -> FastAPI:
    """A resources server whose tool runs a command in a sandbox."""
    nemo_gym = nemo_gym_sandbox()
    app = FastAPI()

    @app.post("/get_weather")
    async def get_weather() -> dict[str, str]:
        config = {"otel_process": {"cgroups": False, "base_dir": str(base_dir)}}
        async with nemo_gym.AsyncSandbox(config, nemo_gym.SandboxSpec()) as sandbox:
            await sandbox.start()
            result = await sandbox.exec("echo sunny")
        return {"weather": result.stdout.strip()}

    return app


@pytest.fixture
async def served(traced: TracerProvider, sandbox_base_dir: Path) -> AsyncIterator[str]:
    """The resources app, FastAPI-instrumented, served by uvicorn on 127.0.0.1; its serving
    task made while a span of the test is current, as a context uvicorn leaks into a request's
    task would be (see ``_trace_context``)."""
    app = resources_app(sandbox_base_dir)
    FastAPIInstrumentor.instrument_app(app, tracer_provider=traced)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on")
    server = uvicorn.Server(config)
    with traced.get_tracer("test").start_as_current_span(LEAKED):
        task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done(), "uvicorn started")
    assert server.started
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    await task
    FastAPIInstrumentor.uninstrument_app(app)


def _parents(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[ReadableSpan]:
    chain = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        chain.append(span)
    return chain


async def test_trace_sandbox_spans_nest_under_server_handling(
    served: str, span_exporter: InMemorySpanExporter
) -> None:
    """One request to a resources server whose handler runs a sandbox is one trace: the
    client's span is its root, the server's span its child (not the leaked context's), and
    every sandbox.* span (and the sandbox's resource records) descends from the server's
    span."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{served}/get_weather") as response,
    ):
        assert await response.json() == {"weather": "sunny"}

    def finished(name: str) -> list[ReadableSpan]:
        return [s for s in span_exporter.get_finished_spans() if s.name == name]

    # The sandbox's final resource record is written beside the request; wait for it.
    await eventually(lambda: bool(finished("sandbox.resources")), "resource records", 60)
    spans = [s for s in span_exporter.get_finished_spans() if s.name != LEAKED]
    assert len({s.context.trace_id for s in spans}) == 1, [s.name for s in spans]
    by_id: dict[int, Any] = {s.context.span_id: s for s in spans}
    (client,) = [s for s in spans if s.kind is SpanKind.CLIENT]
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert client.parent is None
    assert server.parent is not None
    assert server.parent.span_id == client.context.span_id
    sandbox_spans = [s for s in spans if s.name.startswith("sandbox.")]
    assert sorted({s.name for s in sandbox_spans}) == sorted({*LIFECYCLE, "sandbox.resources"})
    for span in sandbox_spans:
        assert server in _parents(span, by_id), (span.name, [p.name for p in _parents(span, by_id)])


async def test_trace_pressure_off_request_not_nested_in_leaked_context(
    instrumentor: NemoGymInstrumentor,
    tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``OTEL_PYTHON_NEMO_GYM_PRESSURE=false`` (so no pressure hook on uvicorn), a request
    served from a task made inside another span still gets the client's span as its parent,
    not the leaked one: the fresh request context is a hook of its own."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_PRESSURE", "false")
    instrumentor.instrument(
        tracer_provider=tracer_provider, connection_pool=False, sandbox_resources=False
    )
    client = AioHttpClientInstrumentor()
    client.instrument(tracer_provider=tracer_provider)
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    FastAPIInstrumentor.instrument_app(app, tracer_provider=tracer_provider)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on")
    )
    try:
        with tracer_provider.get_tracer("test").start_as_current_span(LEAKED):
            task = asyncio.create_task(server.serve())
        await eventually(lambda: server.started or task.done(), "uvicorn started")
        assert server.started
        port = server.servers[0].sockets[0].getsockname()[1]
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/ping") as response,
        ):
            assert await response.json() == {"pong": "yes"}
    finally:
        server.should_exit = True
        await task
        FastAPIInstrumentor.uninstrument_app(app)
        client.uninstrument()
    spans = span_exporter.get_finished_spans()
    (leaked,) = [s for s in spans if s.name == LEAKED]
    (client_span,) = [s for s in spans if s.kind is SpanKind.CLIENT]
    (server_span,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server_span.parent is not None
    assert server_span.parent.span_id == client_span.context.span_id
    assert server_span.context.trace_id != leaked.context.trace_id
