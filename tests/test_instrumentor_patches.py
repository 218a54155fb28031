"""The instrumentor owns every patch it applies: made by ``instrument()``, taken off by
``uninstrument()``, one instrumentor's never another's.

``BaseInstrumentor.__new__`` hands out one object per ``_instance`` attribute, looked up through
the class hierarchy: ``NemoGymInstrumentor()`` anywhere in a process (the auto-loader's, the
application's) is one object, whose second ``instrument()`` changes nothing, and so is a
subclass's unless it declares an ``_instance`` of its own. Such a subclass is the one way to
hold two instrumentor objects; each must keep and take off only its own wrappers and send
spans to its own providers. The targets are real: uvicorn's ``Server.startup`` and the
installed NeMo Gym wheel's ``create_provider`` (in the four modules that bind it). Ray's
patches, which need Ray, are checked on a real cluster (tests/test_ray_cluster.py); NeMo Gym's
``ServerClient``, which needs its server stack, in tests/test_nemo_gym_rollout_span.py.
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import socket
import sys
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import uvicorn
import wrapt
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import eventually
from nemo_gym_support import nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._providers import (
    PATCHED_MODULES,
)
from opentelemetry.instrumentation.nemo_gym.integrations.uvicorn._request_context import (
    FreshTraceContextApp,
)

pytestmark = pytest.mark.nemo_gym

# What each target holds before anything of ours: read at import, before any test instruments.
STARTUP = uvicorn.Server.__dict__["startup"]
OFF = {"connection_pool": False, "pressure": False}
LIFECYCLE = ("sandbox.create", "sandbox.close")


class SecondInstrumentor(NemoGymInstrumentor):
    """A second instrumentor object: a subclass with a singleton slot of its own."""

    _instance = None


class SameInstrumentor(NemoGymInstrumentor):
    """A subclass without one: ``BaseInstrumentor`` finds the base class's object."""


class EchoProvider:
    """A sandbox provider of the test's own, of NeMo Gym's shape: sandboxes are ids."""

    name = "echo"

    async def create(self, spec: Any) -> Any:
        from nemo_gym.sandbox import SandboxHandle

        return SandboxHandle(sandbox_id=uuid.uuid4().hex, provider_name=self.name, raw=None)

    async def close(self, handle: Any) -> None:
        return None


def spans_to(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def create_provider_bindings() -> dict[str, Any]:
    """What each module that binds NeMo Gym's ``create_provider`` holds now."""
    return {name: vars(sys.modules[name])["create_provider"] for name in PATCHED_MODULES}


@pytest.fixture
def nemo_gym(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """NeMo Gym's sandbox package; no periodic usage samples (nothing here waits for them)."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0")
    return nemo_gym_sandbox()


@pytest.fixture
def second() -> Iterator[SecondInstrumentor]:
    """The subclass's instrumentor, uninstrumented before and after the test."""
    instance = SecondInstrumentor()
    if instance.is_instrumented_by_opentelemetry:
        instance.uninstrument()
    yield instance
    if instance.is_instrumented_by_opentelemetry:
        instance.uninstrument()


async def sandbox_spans(nemo_gym: ModuleType, exporter: InMemorySpanExporter) -> list[str]:
    """Create and close a sandbox through NeMo Gym's ``create_provider``; the span names the
    exporter received for it."""
    exporter.clear()
    name = f"echo_{uuid.uuid4().hex[:12]}"
    nemo_gym.register_provider(name, EchoProvider)
    provider = nemo_gym.create_provider({name: {}})
    handle = await provider.create(nemo_gym.SandboxSpec())
    await provider.close(handle)
    # The sandbox's resource records are written beside its calls: only the calls' spans.
    return sorted(span.name for span in exporter.get_finished_spans() if span.name in LIFECYCLE)


def test_instrumentor_one_object_unless_a_subclass_has_its_own_slot(
    instrumentor: NemoGymInstrumentor, second: SecondInstrumentor
) -> None:
    """``NemoGymInstrumentor()`` is one object per process, and so is a plain subclass's; a
    subclass with its own ``_instance`` is a second object."""
    assert NemoGymInstrumentor() is instrumentor
    assert SameInstrumentor() is instrumentor
    assert SecondInstrumentor() is second
    assert second is not instrumentor


async def test_instrument_again_elsewhere_in_the_process_changes_nothing(
    instrumentor: NemoGymInstrumentor, nemo_gym: ModuleType
) -> None:
    """The application's ``NemoGymInstrumentor().instrument(tracer_provider=...)`` after the
    auto-loader's is the same object: nothing is wrapped twice and spans stay on the first
    provider; one ``uninstrument()`` takes everything off."""
    first_spans, later_spans = InMemorySpanExporter(), InMemorySpanExporter()
    first_provider, later_provider = spans_to(first_spans), spans_to(later_spans)
    bindings = create_provider_bindings()
    instrumentor.instrument(tracer_provider=first_provider, **OFF)
    startup = uvicorn.Server.__dict__["startup"]
    NemoGymInstrumentor().instrument(tracer_provider=later_provider, **OFF)
    assert uvicorn.Server.__dict__["startup"] is startup
    assert startup.__wrapped__ is STARTUP  # one wrapper of ours, not two
    assert await sandbox_spans(nemo_gym, first_spans) == ["sandbox.close", "sandbox.create"]
    assert later_spans.get_finished_spans() == ()
    NemoGymInstrumentor().uninstrument()
    assert uvicorn.Server.__dict__["startup"] is STARTUP
    assert create_provider_bindings() == bindings
    first_provider.shutdown()
    later_provider.shutdown()


async def test_instrument_uninstrument_instrument_restores_then_wraps_again(
    instrumentor: NemoGymInstrumentor, nemo_gym: ModuleType
) -> None:
    """Each target is its own object again after ``uninstrument()``, and wrapped (and
    working) again after a second ``instrument()``."""
    exporter = InMemorySpanExporter()
    tracer_provider = spans_to(exporter)
    bindings = create_provider_bindings()
    for round_ in range(2):
        instrumentor.instrument(tracer_provider=tracer_provider, **OFF)
        assert isinstance(uvicorn.Server.__dict__["startup"], wrapt.FunctionWrapper), round_
        wrapped = create_provider_bindings()
        assert all(wrapped[name] is not bindings[name] for name in bindings), round_
        assert await sandbox_spans(nemo_gym, exporter) == ["sandbox.close", "sandbox.create"]
        instrumentor.uninstrument()
        assert uvicorn.Server.__dict__["startup"] is STARTUP, round_
        assert create_provider_bindings() == bindings, round_
        assert await sandbox_spans(nemo_gym, exporter) == [], round_
    tracer_provider.shutdown()


async def test_two_instrumentors_each_takes_off_only_its_own(
    instrumentor: NemoGymInstrumentor, second: SecondInstrumentor, nemo_gym: ModuleType
) -> None:
    """Two instrumentor objects with explicit tracer providers: the first one's
    ``uninstrument()`` leaves the second's wrappers and state working, spans on the second's
    provider only; the second's ``uninstrument()`` then restores every target exactly."""
    first_spans, second_spans = InMemorySpanExporter(), InMemorySpanExporter()
    first_provider, second_provider = spans_to(first_spans), spans_to(second_spans)
    bindings = create_provider_bindings()
    instrumentor.instrument(tracer_provider=first_provider, **OFF)
    second.instrument(tracer_provider=second_provider, **OFF)
    instrumentor.uninstrument()

    assert await sandbox_spans(nemo_gym, second_spans) == ["sandbox.close", "sandbox.create"]
    assert first_spans.get_finished_spans() == ()
    assert isinstance(uvicorn.Server.__dict__["startup"], wrapt.FunctionWrapper)

    second.uninstrument()
    assert uvicorn.Server.__dict__["startup"] is STARTUP
    assert create_provider_bindings() == bindings
    assert await sandbox_spans(nemo_gym, second_spans) == []
    first_provider.shutdown()
    second_provider.shutdown()


async def serve_once(app: Any) -> Any:
    """Start and stop a real uvicorn server on loopback; the app it served, as loaded."""
    listening = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[listening]))
    await eventually(lambda: server.started or serving.done(), "uvicorn started")
    server.should_exit = True
    await serving
    return server.config.loaded_app


async def test_uninstrument_under_another_librarys_wrapper_keeps_theirs(
    instrumentor: NemoGymInstrumentor, nemo_gym: ModuleType
) -> None:
    """Another library's wrapt wrappers below and above ours on ``Server.startup`` and
    ``create_provider``: after ``uninstrument()`` both of theirs still run, ours is gone from
    the chain, and the app uvicorn serves is not wrapped by us."""
    calls: list[str] = []

    def theirs(label: str) -> Any:
        def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            calls.append(label)
            return wrapped(*args, **kwargs)

        return wrapper

    registry = sys.modules[PATCHED_MODULES[0]]
    original = registry.create_provider
    try:
        wrapt.wrap_function_wrapper(uvicorn.server.Server, "startup", theirs("startup-below"))
        wrapt.wrap_function_wrapper(registry, "create_provider", theirs("create-below"))
        instrumentor.instrument(**OFF)
        wrapt.wrap_function_wrapper(uvicorn.server.Server, "startup", theirs("startup-above"))
        wrapt.wrap_function_wrapper(registry, "create_provider", theirs("create-above"))
        instrumentor.uninstrument()

        for top, bottom in (
            (uvicorn.Server.__dict__["startup"], STARTUP),
            (registry.create_provider, original),
        ):
            chain = [top.__wrapped__, top.__wrapped__.__wrapped__]
            assert chain[1] is bottom  # above -> below -> the original: nothing of ours
        app = await serve_once(lambda scope, receive, send: None)
        assert not isinstance(app, FreshTraceContextApp)
        name = f"echo_{uuid.uuid4().hex[:12]}"
        nemo_gym.register_provider(name, EchoProvider)
        assert type(registry.create_provider({name: {}})) is EchoProvider
        assert calls == ["startup-above", "startup-below", "create-above", "create-below"]
    finally:
        uvicorn.server.Server.startup = STARTUP
        registry.create_provider = original


def test_package_modules_hold_no_patch() -> None:
    """No module of the package holds a ``Patch`` at module level: every patch belongs to the
    instrumentor that made it."""
    import opentelemetry.instrumentation.nemo_gym as package
    from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch

    held = []
    for found in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        module = importlib.import_module(found.name)
        held += [
            f"{found.name}.{attribute}"
            for attribute, value in vars(module).items()
            if isinstance(value, Patch)
        ]
    assert held == []
