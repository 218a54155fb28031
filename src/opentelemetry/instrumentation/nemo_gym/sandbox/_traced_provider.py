"""The traced provider wrapper: one class per provider shape, holding exactly its members.

NeMo Gym asks for a provider's optional capabilities with ``isinstance`` against
runtime-checkable protocols (an endpoint, PTY sessions, re-attaching them, serialize and
connect). From Python 3.12 that check reads attributes with ``inspect.getattr_static``, which
never calls ``__getattr__``: a wrapper that forwards through ``__getattr__`` alone loses every
capability, and one that defines them all claims capabilities its provider lacks. So
``TracedSandboxProvider(provider)`` is an instance of a subclass made for the provider's class
and member names (made once, cached) whose class dictionary holds exactly the members the
provider has: a traced call for each lifecycle and capability method it has, and a property
that forwards to the provider for every other member. ``isinstance`` against any
runtime-checkable protocol then answers for the wrapper what it answers for the provider: on
3.12 and later through the class dictionary, on 3.11 (``hasattr``) through it and
``__getattr__``, which still forwards whatever the class does not hold.

Dunder methods are not forwarded (``async with provider`` was never proxied), and ``name``
is always there: the provider's name, or its class name.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import Attribute
from opentelemetry.instrumentation.nemo_gym.sandbox._calls import (
    HANDLE_SPANS,
    RESULT_DESCRIPTIONS,
    provider_name,
    traced_aclose,
    traced_call,
    traced_close,
    traced_connect,
    traced_create,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._log import log_failure
from opentelemetry.instrumentation.nemo_gym.sandbox._state import SandboxState, current_state
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxHandle,
    SandboxSpec,
)

logger = logging.getLogger(__name__)


class TracedSandboxProvider:
    """A sandbox provider whose lifecycle and capability calls are spans.

    Constructing one gives an instance of a subclass with exactly the wrapped provider's
    members (see the module docstring); ``isinstance(x, TracedSandboxProvider)`` holds for
    every wrapper. Results and exceptions of the wrapped provider pass through unchanged.
    Calls belong to ``state`` when given, else to ``current_state()`` at the time of the call.
    """

    wrapped: Any
    _state: SandboxState | None

    def __new__(cls, *args: Any, **kwargs: Any) -> TracedSandboxProvider:
        # Called with the provider by construction, and with nothing by copy and pickle,
        # which recreate an instance of a made class.
        if cls is TracedSandboxProvider:
            provider = args[0] if args else kwargs.get("provider")
            cls = _class_for(provider)
        return object.__new__(cls)

    def __init__(self, provider: Any, state: SandboxState | None = None) -> None:
        self.wrapped = provider
        self._state = state

    @property
    def name(self) -> str:
        return provider_name(self.wrapped)

    @property
    def state(self) -> SandboxState:
        """The sandbox state this wrapper's calls belong to right now."""
        return self._state if self._state is not None else current_state()

    def __getattr__(self, item: str) -> Any:
        # Only for names the class does not hold: attributes the provider gained after it
        # was wrapped, or that its own __getattr__ provides.
        if item in ("wrapped", "_state"):  # not set yet (mid-construction, or unpickling)
            raise AttributeError(item)
        return getattr(self.wrapped, item)

    def __repr__(self) -> str:
        return f"traced_provider({self.wrapped!r})"


# --- the traced members, put into a wrapper class when the provider has them ---------------


async def _create(self: TracedSandboxProvider, spec: SandboxSpec) -> SandboxHandle:
    p = self.wrapped
    result: SandboxHandle = await traced_create(self.state, p, lambda: p.create(spec), spec)
    return result


async def _close(self: TracedSandboxProvider, handle: SandboxHandle) -> None:
    p = self.wrapped
    await traced_close(self.state, p, handle, lambda: p.close(handle))


async def _aclose(self: TracedSandboxProvider) -> None:
    p = self.wrapped
    await traced_aclose(self.state, p, lambda: p.aclose())


async def _connect(self: TracedSandboxProvider, descriptor: Any, *args: Any, **kwargs: Any) -> Any:
    p = self.wrapped
    return await traced_connect(self.state, p, lambda: p.connect(descriptor, *args, **kwargs))


def _handle_call(
    method: str, span_name: str, describe: Callable[[Any], dict[str, Attribute]] | None = None
) -> Callable[..., Any]:
    """A traced call of the handle-first provider ``method``, arguments passed as given;
    ``describe`` says what its span records about the result."""

    async def call(self: TracedSandboxProvider, handle: Any, *args: Any, **kwargs: Any) -> Any:
        p = self.wrapped
        bound = getattr(p, method)
        return await traced_call(
            self.state, p, span_name, handle, lambda: bound(handle, *args, **kwargs), describe
        )

    call.__name__ = call.__qualname__ = method
    return call


_LIFECYCLE_MEMBERS: dict[str, Callable[..., Any]] = {
    "create": _create,
    "close": _close,
    "aclose": _aclose,
    "connect": _connect,
}
for _member_name, _member in _LIFECYCLE_MEMBERS.items():
    _member.__name__ = _member.__qualname__ = _member_name
del _member_name, _member

_TRACED_MEMBERS: dict[str, Callable[..., Any]] = {
    **_LIFECYCLE_MEMBERS,
    **{
        method: _handle_call(method, span, RESULT_DESCRIPTIONS.get(method))
        for method, span in HANDLE_SPANS.items()
    },
}

# Names the wrapper itself defines or uses: never replaced by a forwarding property.
_OWN = frozenset(vars(TracedSandboxProvider)) | {"wrapped", "_state"}


def _forwarding(member: str) -> property:
    """A property reading (and setting) ``member`` on the wrapped provider."""

    def get(self: TracedSandboxProvider) -> Any:
        return getattr(self.wrapped, member)

    def set_(self: TracedSandboxProvider, value: Any) -> None:
        setattr(self.wrapped, member, value)

    return property(get, set_, doc=f"The wrapped provider's ``{member}``.")


# --- one class per provider class and member names ------------------------------------------

_Shape = tuple[frozenset[str], frozenset[str]]
_CLASSES: weakref.WeakKeyDictionary[type, dict[_Shape, type[TracedSandboxProvider]]] = (
    weakref.WeakKeyDictionary()
)


def _shape(provider: object) -> _Shape:
    """The provider's member names as a runtime-checkable protocol sees them, and those of
    them that are ``None`` (which such a protocol counts as absent for a method)."""
    members: set[str] = set()
    nones: set[str] = set()
    for member in dir(provider):
        if (member.startswith("__") and member.endswith("__")) or member in _OWN:
            continue
        try:
            value = inspect.getattr_static(provider, member)
        except AttributeError:  # listed by a custom __dir__ only: reached through __getattr__
            continue
        members.add(member)
        if value is None:
            nones.add(member)
    return frozenset(members), frozenset(nones)


def _build(shape: _Shape) -> type[TracedSandboxProvider]:
    members, nones = shape
    namespace: dict[str, Any] = {"__module__": TracedSandboxProvider.__module__}
    for member in members:
        if member in nones:
            namespace[member] = None
        elif member in _TRACED_MEMBERS:
            namespace[member] = _TRACED_MEMBERS[member]
        else:
            namespace[member] = _forwarding(member)
    made = type("TracedSandboxProvider", (TracedSandboxProvider,), namespace)
    made.__qualname__ = TracedSandboxProvider.__qualname__
    return made


def _class_for(provider: object) -> type[TracedSandboxProvider]:
    """The wrapper class for ``provider``: made once per provider class and shape."""
    try:
        shape = _shape(provider)
        per_class = _CLASSES.setdefault(type(provider), {})
    except Exception as exc:  # noqa: BLE001 - an odd provider is still wrapped, forwarding only
        log_failure("shaping a traced sandbox provider", exc, provider_name(provider))
        return _build((frozenset(), frozenset()))
    made = per_class.get(shape)
    if made is None:
        made = per_class[shape] = _build(shape)
    return made
