"""Our wrappers on other libraries' functions and methods: put on with wrapt, taken off exactly.

Every patch the plugin makes goes through here, the way contrib's instrumentations patch:
wrapt's ``wrap_function_wrapper`` puts a ``FunctionWrapper`` on an attribute, and wrapt's
post-import hook (``register_post_import_hook``) applies it when the application imports a
module the plugin must not import itself (NeMo Gym's stack, uvicorn). Contrib's
``opentelemetry.instrumentation.utils.unwrap`` takes off whatever wrapper is on top; ours must
survive another library wrapping after us, so ``unwrap`` here takes off exactly ours: where
ours is on top, the attribute gets back what it held; where a later wrapt wrapper sits above
ours, that wrapper is pointed past ours and stays. A wrapper of ours that cannot be reached
(under something that is no wrapt wrapper) is left in place, passing calls straight through.

``Patch`` is one capability's set of wrappers over some modules: ``install()`` applies them to
each module now if it is imported, else from the post-import hook (one hook per module however
often ``install`` runs); ``uninstall()`` takes every wrapper off, and a hook still pending then
does nothing. Both are idempotent and thread-safe, and a failure inside the hook is logged
once, never raised into the application's import.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import wrapt

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog

__all__ = ["Patch", "Wrapped", "Wrapper", "is_live_wrapper", "methods_of", "unwrap", "wrap"]

logger = logging.getLogger(__name__)

# wrapt's wrapper signature: (wrapped, instance, args, kwargs) -> what the call returns.
Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

# What an attribute held when it was not in the owner's own namespace (a class inheriting it).
_ABSENT: Any = object()
# wrapt's proxies, FunctionWrapper among them: wrapt 2 derives FunctionWrapper from
# BaseObjectProxy, no longer from ObjectProxy.
_PROXY: type[wrapt.ObjectProxy[Any]] = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


class Wrapped:
    """One wrapper of ours on ``owner.name``, ``previous`` being what ``owner`` held there.

    ``live`` is true from ``wrap`` to ``unwrap``; a wrapper left behind passes calls through.
    """

    def __init__(self, owner: Any, name: str, previous: Any) -> None:
        self.owner = owner
        self.name = name
        self.previous = previous
        self.live = True
        self.ours: Any = None

    def gated(self, wrapper: Wrapper) -> Wrapper:
        """``wrapper`` while this wrapper is live, a plain call once it is taken off."""

        def call(
            wrapped: Callable[..., Any],
            instance: Any,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
        ) -> Any:
            if not self.live:
                return wrapped(*args, **kwargs)
            return wrapper(wrapped, instance, args, kwargs)

        call.__wrapped__ = wrapper  # type: ignore[attr-defined]  # what is_live_wrapper reads
        call.record = self  # type: ignore[attr-defined]
        return call


def wrap(owner: Any, name: str, wrapper: Wrapper) -> Wrapped:
    """Wrap ``owner.name`` (a class's method, a module's function) with ``wrapper`` (wrapt)."""
    record = Wrapped(owner, name, vars(owner).get(name, _ABSENT))
    record.ours = wrapt.wrap_function_wrapper(owner, name, record.gated(wrapper))
    return record


def is_live_wrapper(node: Any, wrapper: Wrapper) -> bool:
    """Whether ``node`` (an attribute's value, or a link of its wrapper chain) is a live
    wrapper of ours made by ``wrap`` with ``wrapper``."""
    gated = getattr(node, "_self_wrapper", None) if isinstance(node, _PROXY) else None
    record = getattr(gated, "record", None)
    return (
        isinstance(record, Wrapped)
        and record.live
        and getattr(gated, "__wrapped__", None) is wrapper
    )


def _past_removed(value: Any) -> Any:
    """``value``, or where it is a wrapper of ours already taken off (another installation's,
    which stood below this one when it was made), what that wrapper wraps: restoring it would
    put a dead wrapper back."""
    for _ in range(16):  # bounded: wrapper chains are short
        record = getattr(getattr(value, "_self_wrapper", None), "record", None)
        if not isinstance(value, _PROXY) or not isinstance(record, Wrapped) or record.live:
            return value
        value = value.__wrapped__
    return value


def unwrap(record: Wrapped) -> bool:
    """Take ``record``'s wrapper off exactly; ``False`` when it could not be reached."""
    record.live = False
    owner, name, ours = record.owner, record.name, record.ours
    restored = _past_removed(ours.__wrapped__ if record.previous is _ABSENT else record.previous)
    node = vars(owner).get(name, _ABSENT)
    if node is ours:
        if record.previous is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, restored)
        return True
    seen = 0
    while isinstance(node, _PROXY) and seen < 16:  # bounded: wrapper chains are short
        inner = node.__wrapped__
        if inner is ours:
            node.__wrapped__ = restored  # the later wrapper stays, now around what we wrapped
            return True
        node = inner
        seen += 1
    logger.debug("%r.%s no longer holds our wrapper; left in place, inert", owner, name)
    return False


def methods_of(
    class_name: str, methods: tuple[str, ...], wrapper: Wrapper, once: OnceLog
) -> Callable[[Patch, ModuleType], None]:
    """The ``apply`` that wraps ``methods`` of the module's ``class_name`` (those it defines)
    with ``wrapper``; a module without the class is left alone, said once at debug level."""

    def apply(patch: Patch, module: ModuleType) -> None:
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type):
            once(
                ("no-class", module.__name__),
                logging.DEBUG,
                "nemo_gym: %s has no %s; left alone",
                module.__name__,
                class_name,
            )
            return
        for method in methods:
            if method in vars(cls):
                patch.wrap(cls, method, wrapper)

    return apply


class Patch:
    """Wrappers that ``apply(patch, module)`` puts on each of ``modules``, while installed.

    ``apply`` is called once per module per installation, with the module imported, and calls
    ``patch.wrap`` (a new wrapper) or ``patch.bind`` (ours again, where a module imported the
    wrapped function by name). ``once`` logs a failure of the hook.
    """

    def __init__(
        self,
        modules: tuple[str, ...],
        apply: Callable[[Patch, ModuleType], None],
        once: OnceLog,
    ) -> None:
        self.modules = modules
        self.active = False
        self._apply = apply
        self._once = once
        self._lock = threading.RLock()
        self._hooks_pending: set[str] = set()
        self._wrapped: list[Wrapped] = []

    def install(self) -> None:
        """Apply the wrappers from now on (now, or when each module is imported)."""
        with self._lock:
            if self.active:
                return
            self.active = True
            for name in self.modules:
                module = sys.modules.get(name)
                if module is not None:
                    self._apply(self, module)
                elif name not in self._hooks_pending:
                    self._hooks_pending.add(name)
                    wrapt.register_post_import_hook(self._on_import, name)

    def uninstall(self) -> None:
        """Take every wrapper off, exactly (``unwrap``)."""
        with self._lock:
            self.active = False
            for record in reversed(self._wrapped):
                unwrap(record)
            self._wrapped.clear()

    def wrap(self, owner: Any, name: str, wrapper: Wrapper) -> Any:
        """Wrap ``owner.name`` with ``wrapper`` unless ours is already there; returns ours."""
        existing = self.ours(owner, name)
        if existing is not None:
            return existing
        record = wrap(owner, name, wrapper)
        self._wrapped.append(record)
        return record.ours

    def bind(self, owner: Any, name: str, ours: Any) -> None:
        """Put ``ours`` (from ``wrap``) in ``owner.name`` too, taken off with the rest.

        A module that already holds ``ours`` (it imported the name after we wrapped it) gets
        back what ``ours`` wraps.
        """
        if self.ours(owner, name) is ours:
            return
        current = vars(owner).get(name, _ABSENT)
        record = Wrapped(owner, name, ours.__wrapped__ if current is ours else current)
        record.ours = ours
        setattr(owner, name, ours)
        self._wrapped.append(record)

    def ours(self, owner: Any, name: str) -> Any:
        """The wrapper this installation put on ``owner.name``, or ``None``."""
        for record in self._wrapped:
            if record.owner is owner and record.name == name:
                return record.ours
        return None

    def _on_import(self, module: ModuleType) -> None:
        try:
            with self._lock:
                self._hooks_pending.discard(module.__name__)
                if self.active:
                    self._apply(self, module)
        except Exception as exc:  # noqa: BLE001 - an import must never fail because of telemetry
            self._once(
                ("hook", module.__name__, type(exc).__name__),
                logging.WARNING,
                "nemo_gym: patching %s failed: %r",
                module.__name__,
                exc,
            )
