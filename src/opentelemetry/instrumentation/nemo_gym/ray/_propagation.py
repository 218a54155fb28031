"""The caller's trace context into Ray tasks and actor methods, so they join its trace.

Ray carries nothing per task that a worker can read besides the task's arguments (a task's
``_labels`` reach only the state API; its ``name`` and ``runtime_env`` are the user's and
a different ``runtime_env`` means a different worker process). Ray's own tracing
(``ray.util.tracing``) adds a ``_ray_trace_ctx`` keyword, but only where its process-wide
switch was on when a function was first called and an actor class decorated, it rewrites the
user's ``__signature__``, and a worker whose switch is off fails the task inside Ray's wrapper.
So the context travels as one extra keyword argument, ``CARRIER``, that Ray serializes with
the others, and only to a worker that takes it off again before the task runs:

* **caller** (``RayPropagation(caller=True)``): ``RemoteFunction._remote`` and
  ``ActorMethod._remote``, inside a valid span, inject the current context (the global
  propagator: W3C ``traceparent``) and mark the call; Ray's ``flatten_args``, called by both
  after it has checked the user's arguments against the function's signature (and
  initialized Ray, if the call did), appends
  ``CARRIER`` to a marked call's arguments only when its worker runs ``setup_worker``: the
  task's own ``runtime_env`` sets Ray's setup-hook variable to ours, or the task sets none
  and the job's (or calling worker's, which a task inherits) does; for an actor method, the
  actor was created so. A task or actor without it, an actor created before the patch was
  installed or whose handle came from elsewhere (``ray.get_actor``, a handle passed in),
  cross-language and Ray-client calls get nothing.
* **worker** (``RayPropagation(worker=True)``, in a worker whose environment names
  ``setup_worker`` as Ray's setup hook): ``FunctionActorManager.get_execution_info`` hands
  Ray the function to run wrapped; the wrapper takes ``CARRIER`` out of the keywords and runs
  the task with the extracted context attached (inside the coroutine for an ``async`` actor
  method; a generator's body runs later, outside it, and starts its own trace).

The instrumentor makes a ``RayPropagation`` in ``instrument()``, keeps it, and takes both
sides off in ``uninstrument()``. ``setup_worker`` checks, once OpenTelemetry is configured,
that a worker side is in place (``worker_side_in_place``); where no instrumentor put one there
(``nemo_gym`` disabled in that worker, or OpenTelemetry's start failing before instrumentors
load) it installs one of its own (``take_carrier_off_here``), since callers send the keyword
to every worker that runs the hook.

The task sees exactly the arguments it was given; its result, exception and cancellation are
unchanged. A failure of ours is logged once and the call made as it would have been.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Coroutine, Mapping
from types import ModuleType
from typing import Any, Final

import wrapt
from opentelemetry import context, propagate, trace

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import (
    Patch,
    Wrapper,
    is_live_wrapper,
)

__all__ = ["CARRIER", "RayPropagation", "take_carrier_off_here", "worker_side_in_place"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

CARRIER: Final = "__nemo_gym_otel_context__"
"""The keyword argument the context travels in (taken off before the task runs)."""

# Ray's modules: flatten_args is in ray._common.signature in Ray 2.60, in
# ray._private.signature in older releases (where both exist, Ray calls one of them).
_RAY_CALLER_MODULES: Final = (
    "ray.remote_function",
    "ray.actor",
    "ray._common.signature",
    "ray._private.signature",
)
_RAY_WORKER_MODULES: Final = ("ray._private.function_manager",)
# Actors created here that run setup_worker, by actor id; bounded (a long-lived driver that
# creates actors without end stops recording: their methods then carry nothing).
_MAX_ACTORS: Final = 65536

# For the next flatten_args of this call (set by a _remote wrapper around it): the carrier,
# whether its worker takes it off (asked there, once Ray is initialized: _remote may start
# Ray itself), and what is called, for the log.
_PENDING: contextvars.ContextVar[tuple[dict[str, str], Callable[[], bool], str] | None] = (
    contextvars.ContextVar("nemo_gym_ray_pending_carrier", default=None)
)

RunsOurHook = Callable[[Any], bool]
"""Whether a ``runtime_env`` (a mapping, or ``None`` for none) runs ``setup_worker``."""


class _CallerState:
    def __init__(self, runs_our_hook: RunsOurHook) -> None:
        self.runs_our_hook = runs_our_hook
        self.hooked_actors: set[bytes] = set()
        self.lock = threading.Lock()
        # The job's runtime_env as Ray holds it (a JSON string) and whether it runs our hook.
        self.job_env: tuple[str, bool] | None = None


def _current_carrier() -> dict[str, str] | None:
    """The current context as W3C headers, or ``None`` outside a valid span."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def _job_runs_our_hook(state: _CallerState) -> bool:
    """Whether a task without a ``runtime_env`` of its own runs ``setup_worker``: what it
    inherits is this job's (in a driver) or this worker's (in a task) ``runtime_env``."""
    import ray  # imported: a _remote of Ray's is running

    runtime_context: Any = ray.get_runtime_context()
    raw = runtime_context.get_runtime_env_string()
    cached = state.job_env
    if cached is not None and cached[0] == raw:
        return cached[1]
    runs = state.runs_our_hook(runtime_context.runtime_env)
    state.job_env = (raw, runs)
    return runs


def _workers_can_take_it_off() -> bool:
    """Whether this Ray has the method the worker side wraps (workers run the same
    Ray release as their caller; Ray refuses a mismatch)."""
    manager = getattr(sys.modules.get(_RAY_WORKER_MODULES[0]), "FunctionActorManager", None)
    return callable(getattr(manager, "get_execution_info", None))


def _task_runs_our_hook(state: _CallerState, runtime_env: object) -> bool:
    if not _workers_can_take_it_off():
        return False
    # A runtime_env of the task's own: only its variables are trusted (whether Ray merges the
    # job's into it is Ray's business; missing a context is safe, a stray keyword is not).
    if runtime_env:
        return state.runs_our_hook(runtime_env)
    return _job_runs_our_hook(state)


def _carried_call(
    wrapped: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    what: str,
    worker_takes_it_off: Callable[[], bool],
) -> Any:
    """``wrapped(*args, **kwargs)`` with the current context pending for its flatten_args."""
    carrier = None
    try:
        carrier = _current_carrier()
    except Exception as exc:  # noqa: BLE001 - the task is submitted whatever happens here
        _ONCE(("inject", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)
    if carrier is None:
        return wrapped(*args, **kwargs)
    token = _PENDING.set((carrier, worker_takes_it_off, what))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _PENDING.reset(token)


def _checked(what: str, decide: Callable[[], bool]) -> bool:
    try:
        return decide()
    except Exception as exc:  # noqa: BLE001 - deciding must never fail the submission
        _ONCE(
            ("decide", what, type(exc).__name__),
            logging.WARNING,
            "nemo_gym: deciding whether a Ray %s carries the trace context failed: %r",
            what,
            exc,
        )
        return False


def _remote_function_call(state: _CallerState) -> Wrapper:
    def remote(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        def worker_takes_it_off() -> bool:
            return _task_runs_our_hook(state, kwargs.get("runtime_env"))

        return _carried_call(wrapped, args, kwargs, "task", worker_takes_it_off)

    return remote


def _actor_method_call(state: _CallerState) -> Wrapper:
    def remote(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        def worker_takes_it_off() -> bool:
            handle = getattr(instance, "_actor", None)  # Ray 2.60; a weak reference before
            if handle is None and callable(getattr(instance, "_actor_ref", None)):
                handle = instance._actor_ref()
            return handle is not None and handle._ray_actor_id.binary() in state.hooked_actors

        return _carried_call(wrapped, args, kwargs, "actor method", worker_takes_it_off)

    return remote


def _record_actor(state: _CallerState, handle: Any, runtime_env: object) -> bool:
    """Remember an actor just created whose worker runs ``setup_worker``."""
    runs = _task_runs_our_hook(state, runtime_env)
    if runs:
        with state.lock:
            if len(state.hooked_actors) < _MAX_ACTORS:
                state.hooked_actors.add(handle._ray_actor_id.binary())
    return runs


def _actor_creation(state: _CallerState) -> Wrapper:
    def remote(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        handle = wrapped(*args, **kwargs)
        # get_if_exists may hand back an actor created elsewhere, with another runtime_env.
        if not kwargs.get("get_if_exists"):
            _checked("actor", lambda: _record_actor(state, handle, kwargs.get("runtime_env")))
        return handle

    return remote


def _flatten_with_carrier(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    flattened = wrapped(*args, **kwargs)  # the user's arguments, checked as Ray checks them
    pending = _PENDING.get()
    if pending is not None and isinstance(flattened, list):
        # One task per _remote: nothing nested picks it up, and where two instrumentors'
        # wrappers are stacked, the innermost adds the keyword and the others see none pending.
        _PENDING.set(None)
        carrier, worker_takes_it_off, what = pending
        if CARRIER not in flattened[0::2] and _checked(what, worker_takes_it_off):
            flattened += [CARRIER, carrier]
    return flattened


def _caller_applier(state: _CallerState) -> Callable[[Patch, ModuleType], None]:
    def apply(patch: Patch, module: ModuleType) -> None:
        if module.__name__ == "ray.remote_function":
            patch.wrap(module.RemoteFunction, "_remote", _remote_function_call(state))
        elif module.__name__ == "ray.actor":
            patch.wrap(module.ActorMethod, "_remote", _actor_method_call(state))
            patch.wrap(module.ActorClass, "_remote", _actor_creation(state))
        elif callable(getattr(module, "flatten_args", None)):
            patch.wrap(module, "flatten_args", _flatten_with_carrier)

    return apply


# --- the worker's side -----------------------------------------------------------------


def _extracted(carrier: object) -> context.Context | None:
    if not isinstance(carrier, Mapping):
        return None
    try:
        return propagate.extract({str(k): str(v) for k, v in carrier.items()})
    except Exception as exc:  # noqa: BLE001 - the task runs without the context then
        _ONCE(("extract", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)
        return None


async def _awaited_in(parent: context.Context, awaitable: Coroutine[Any, Any, Any]) -> Any:
    token = context.attach(parent)
    try:
        return await awaitable
    finally:
        context.detach(token)


def _run_with_context(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if CARRIER not in kwargs:
        return wrapped(*args, **kwargs)
    parent = _extracted(kwargs.pop(CARRIER))
    if parent is None:
        return wrapped(*args, **kwargs)
    token = context.attach(parent)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        context.detach(token)
    if inspect.iscoroutine(result):  # an async actor method: it runs when Ray awaits it
        return _awaited_in(parent, result)
    return result


def _execution_info(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    info = wrapped(*args, **kwargs)
    try:
        function = info.function
        if getattr(function, "_self_wrapper", None) is _run_with_context:
            return info  # already ours
        return info._replace(function=wrapt.FunctionWrapper(function, _run_with_context))
    except Exception as exc:  # noqa: BLE001 - Ray gets its own function back
        _ONCE(("worker", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)
        return info


def _apply_worker(patch: Patch, module: ModuleType) -> None:
    patch.wrap(module.FunctionActorManager, "get_execution_info", _execution_info)


def _worker_patch() -> Patch:
    return Patch(_RAY_WORKER_MODULES, _apply_worker, _ONCE)


def worker_side_in_place() -> bool:
    """Whether a live wrapper of ours takes ``CARRIER`` off the tasks this process runs: a
    read of Ray's ``FunctionActorManager`` (``False`` where Ray's module is not imported)."""
    manager = getattr(sys.modules.get(_RAY_WORKER_MODULES[0]), "FunctionActorManager", None)
    node = vars(manager).get("get_execution_info") if isinstance(manager, type) else None
    for _ in range(16):  # bounded: wrapper chains are short
        if node is None:
            return False
        if is_live_wrapper(node, _execution_info):
            return True
        node = getattr(node, "__wrapped__", None)
    return False


class RayPropagation:
    """One instrumentor's Ray patches: the caller's side (``caller=True``) and, in a Ray worker
    whose callers send ``CARRIER`` (``worker=True``), the worker's side.

    Made by ``instrument()``, kept on the instrumentor, and taken off by its
    ``uninstrument()``: ``install()`` and ``uninstall()`` are idempotent and never raise for a
    missing Ray (its modules are patched when imported).
    """

    def __init__(self, runs_our_hook: RunsOurHook, *, caller: bool, worker: bool) -> None:
        self.caller = (
            Patch(_RAY_CALLER_MODULES, _caller_applier(_CallerState(runs_our_hook)), _ONCE)
            if caller
            else None
        )
        self.worker = _worker_patch() if worker else None

    def install(self) -> None:
        for patch in (self.worker, self.caller):
            if patch is not None:
                patch.install()

    def uninstall(self) -> None:
        for patch in (self.caller, self.worker):
            if patch is not None:
                patch.uninstall()


def take_carrier_off_here() -> Patch | None:
    """Where no instrumentor took ``CARRIER`` off the tasks of this Ray worker (``nemo_gym``
    disabled here, or OpenTelemetry's start failing before instrumentors load), a worker side
    that nobody uninstalls, so a task its caller sent the context to still gets exactly its
    own arguments; ``None`` where one is in place. Called by ``setup_worker``."""
    if worker_side_in_place():
        return None
    patch = _worker_patch()
    patch.install()
    return patch
