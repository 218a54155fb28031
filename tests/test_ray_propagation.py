"""The worker's side of carrying a trace context into Ray tasks, without Ray.

``_run_with_context`` is what runs each task in a worker that ran ``setup_worker``; the
caller's side, and both together on a real cluster, are tests/test_ray_cluster.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.ray import (
    SETUP_HOOK,
    _runs_setup_worker,
    _takes_context,
)
from opentelemetry.instrumentation.nemo_gym.ray._propagation import (
    CARRIER,
    RayPropagation,
    _run_with_context,
)

HOOK_VARIABLE = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
RAY_PROPAGATION = "OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION"


def received(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    """What a task got, and the trace id current while it ran."""
    return args, kwargs, f"{trace.get_current_span().get_span_context().trace_id:032x}"


def carrier_of(tracer_provider: TracerProvider) -> tuple[dict[str, str], str]:
    with tracer_provider.get_tracer("test").start_as_current_span("caller") as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    return carrier, f"{span.get_span_context().trace_id:032x}"


def test_run_with_context_takes_the_carrier_off_and_runs_in_its_trace(
    tracer_provider: TracerProvider,
) -> None:
    """The task gets exactly its own arguments and runs in the caller's trace."""
    carrier, trace_id = carrier_of(tracer_provider)
    args, kwargs, current = _run_with_context(received, None, (1,), {"b": 2, CARRIER: carrier})
    assert (args, kwargs, current) == ((1,), {"b": 2}, trace_id)
    assert not trace.get_current_span().get_span_context().is_valid  # detached after


def test_run_with_context_in_a_coroutine_attaches_while_it_runs(
    tracer_provider: TracerProvider,
) -> None:
    """An async actor method's coroutine runs in the caller's trace when awaited."""
    carrier, trace_id = carrier_of(tracer_provider)

    async def method(value: int) -> tuple[int, str]:
        return value, f"{trace.get_current_span().get_span_context().trace_id:032x}"

    coroutine = _run_with_context(method, None, (7,), {CARRIER: carrier})
    assert asyncio.run(coroutine) == (7, trace_id)


def test_run_with_context_bad_or_absent_carrier_runs_the_task_plainly() -> None:
    """A carrier that is no mapping is still taken off; no carrier leaves the call as it is."""
    assert _run_with_context(received, None, (), {CARRIER: "junk", "a": 1})[:2] == ((), {"a": 1})
    assert _run_with_context(received, None, (3,), {})[:2] == ((3,), {})


def test_run_with_context_exception_propagates_unchanged(tracer_provider: TracerProvider) -> None:
    """The task's own exception reaches Ray as it was raised."""
    carrier, _ = carrier_of(tracer_provider)
    error = ValueError("boom")

    def failing() -> None:
        raise error

    with pytest.raises(ValueError, match="boom") as raised:
        _run_with_context(failing, None, (), {CARRIER: carrier})
    assert raised.value is error


@pytest.mark.parametrize(
    ("runtime_env", "runs"),
    [
        ({"env_vars": {HOOK_VARIABLE: SETUP_HOOK}}, True),
        ({"env_vars": {HOOK_VARIABLE: "my.own.hook"}}, False),
        ({"env_vars": {}}, False),
        ({"pip": ["x"]}, False),
        ({"env_vars": "not a mapping"}, False),
        (None, False),
    ],
)
def test_runs_setup_worker_reads_rays_hook_variable(runtime_env: object, runs: bool) -> None:
    """Only a runtime_env whose hook variable names ours has workers that take the carrier off."""
    assert _runs_setup_worker(runtime_env) is runs


@pytest.mark.parametrize(
    ("switch", "takes"),
    [(None, True), ("true", True), ("false", False), ("0", False), ("junk", True)],
)
def test_takes_context_follows_the_workers_switch(switch: str | None, takes: bool) -> None:
    """A runtime_env whose workers run setup_worker takes the context unless its own
    OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION turns propagation off (a bad value is the default)."""
    variables = {HOOK_VARIABLE: SETUP_HOOK}
    if switch is not None:
        variables[RAY_PROPAGATION] = switch
    assert _takes_context({"env_vars": variables}) is takes
    assert _takes_context({"env_vars": {**variables, HOOK_VARIABLE: "my.own.hook"}}) is False


def _ray_patches(instrumentor: NemoGymInstrumentor) -> list[RayPropagation]:
    return [patch for patch in instrumentor._patches if isinstance(patch, RayPropagation)]


@pytest.mark.parametrize("worker", [False, True])
def test_instrument_ray_propagation_off_patches_nothing_of_rays(
    instrumentor: NemoGymInstrumentor, monkeypatch: pytest.MonkeyPatch, worker: bool
) -> None:
    """With the switch off, neither the caller's side nor (in a worker that runs
    setup_worker) the worker's side is made; on, both are (the control)."""
    if worker:
        monkeypatch.setenv(HOOK_VARIABLE, SETUP_HOOK)
    instrumentor.instrument(ray_propagation=False)
    assert _ray_patches(instrumentor) == []
    instrumentor.uninstrument()
    instrumentor.instrument(ray_propagation=True)
    [patch] = _ray_patches(instrumentor)
    assert (patch.caller is not None, patch.worker is not None) == (True, worker)
    instrumentor.uninstrument()
