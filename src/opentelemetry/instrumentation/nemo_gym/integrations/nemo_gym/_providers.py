"""Every provider NeMo Gym builds passes through a wrapping function while instrumented.

NeMo Gym builds providers in one place, ``nemo_gym.sandbox.providers.registry.create_provider``
(whatever the provider's origin: registered, built-in or entry point). The function is then
bound by name in three more modules: ``nemo_gym.sandbox.providers`` and ``nemo_gym.sandbox``
re-export it, and ``nemo_gym.sandbox.api`` imports it, and that module global is what
``AsyncSandbox(config, spec)`` calls (``Sandbox`` builds an ``AsyncSandbox``). ``install(wrap)``
replaces the function in each of those modules with one wrapper that passes the returned
provider through ``wrap`` (the tracing layer gives ``traced_provider``).

NeMo Gym may be imported before or after ``install``: modules already imported are patched at
once, the others by a post-import hook (wrapt's, as contrib instrumentations use). Patching the
defining module as soon as it is imported means the re-exporting modules, imported after it,
bind the wrapper themselves. ``uninstall()`` puts the original functions back in every module
that still holds the wrapper; a hook left pending for a module not yet imported does nothing.

Telemetry never changes NeMo Gym's behaviour: ``create_provider``'s result and exceptions pass
through unchanged, and a provider that ``wrap`` cannot wrap is returned as it is, logged once
per provider class.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog

__all__ = ["DEFINING_MODULE", "FUNCTION", "PATCHED_MODULES", "install", "installed", "uninstall"]

LOGGER = logging.getLogger(__name__)
_ONCE = OnceLog(LOGGER)

FUNCTION = "create_provider"
DEFINING_MODULE = "nemo_gym.sandbox.providers.registry"
# The defining module first: the others are patched by identity with what it held.
PATCHED_MODULES = (
    DEFINING_MODULE,
    "nemo_gym.sandbox.providers",
    "nemo_gym.sandbox",
    "nemo_gym.sandbox.api",
)


@dataclass(eq=False)
class _Installation:
    """One ``install``: the wrapping function, the wrapper, and what it replaced where."""

    wrap: Callable[[Any], Any]
    active: bool = True
    original: Callable[..., Any] | None = None
    wrapper: Callable[..., Any] | None = None
    # Module -> the value it held before the wrapper went in, for uninstall.
    replaced: dict[str, tuple[ModuleType, Any]] = field(default_factory=dict)
    # Providers already passed through ``wrap``, and what it returned: never wrapped twice.
    seen: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    def call(
        self,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The wrapper around ``create_provider``: its result, through ``wrap`` while active."""
        provider = wrapped(*args, **kwargs)
        if not self.active:
            return provider
        return self.wrap_once(provider)

    def wrap_once(self, provider: Any) -> Any:
        try:
            if provider in self.seen:
                return provider
        except TypeError:  # not weak-referenceable: ``wrap`` itself must be idempotent
            pass
        try:
            result = self.wrap(provider)
        except Exception as exc:  # noqa: BLE001 - an unwrappable provider still works, untraced
            kind = type(provider)
            _ONCE(
                ("unwrappable", kind.__module__, kind.__qualname__),
                logging.WARNING,
                "nemo_gym: sandbox provider %s.%s cannot be traced (%r); it is used untraced",
                kind.__module__,
                kind.__qualname__,
                exc,
            )
            return provider
        for value in (provider, result):
            with contextlib.suppress(TypeError):
                self.seen.add(value)
        return result

    def patch(self, module: ModuleType) -> None:
        """Put the wrapper in ``module`` where it holds NeMo Gym's function (idempotent)."""
        name = module.__name__
        current = getattr(module, FUNCTION, None)
        if current is None or name in self.replaced or current is self.wrapper:
            return
        if name == DEFINING_MODULE:
            if not callable(current):
                return
            self.original = current
            self.wrapper = wrapt.FunctionWrapper(current, self.call)
        elif self.original is None or not _same_function(current, self.original):
            # Something else sits there (another patcher's function): leave it alone.
            return
        self.replaced[name] = (module, current)
        setattr(module, FUNCTION, self.wrapper)

    def restore(self) -> None:
        """Put back what each module held, where the wrapper is still in place."""
        self.active = False
        for module, previous in self.replaced.values():
            if getattr(module, FUNCTION, None) is self.wrapper:
                setattr(module, FUNCTION, previous)
        self.replaced.clear()


def _same_function(candidate: Any, original: Any) -> bool:
    """``candidate`` is ``original`` or what ``original`` wraps (another patcher went first)."""
    seen = 0
    while original is not None and seen < 16:  # bounded: a wrapper chain is short
        if candidate is original:
            return True
        original = getattr(original, "__wrapped__", None)
        seen += 1
    return False


_LOCK = threading.RLock()
_CURRENT: _Installation | None = None
# Modules whose post-import hook is registered and has not fired yet: one hook per module,
# however often install() runs before the import.
_PENDING_HOOKS: set[str] = set()


def _on_import(module: ModuleType) -> None:
    """wrapt's post-import hook: patch ``module`` if an installation is active."""
    try:
        with _LOCK:
            _PENDING_HOOKS.discard(module.__name__)
            installation = _CURRENT
            if installation is not None and installation.active:
                installation.patch(module)
    except Exception as exc:  # noqa: BLE001 - an import must never fail because of telemetry
        _ONCE(("hook", module.__name__), logging.WARNING, "nemo_gym: patch failed: %r", exc)


def install(wrap: Callable[[Any], Any]) -> None:
    """Pass every provider NeMo Gym's ``create_provider`` returns through ``wrap``.

    Works whether ``nemo_gym`` is imported yet or not; installing again only replaces
    ``wrap``. ``wrap`` receives the provider and returns what the caller gets; an exception
    from it leaves the provider unwrapped (logged once per provider class). Never raises for
    a missing or unusual ``nemo_gym``; call on any thread.
    """
    global _CURRENT
    with _LOCK:
        if _CURRENT is not None:
            _CURRENT.wrap = wrap
            return
        _CURRENT = _Installation(wrap)
        installation = _CURRENT
        for name in PATCHED_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                installation.patch(module)
            elif name not in _PENDING_HOOKS:
                _PENDING_HOOKS.add(name)
                wrapt.register_post_import_hook(_on_import, name)


def uninstall() -> None:
    """Put NeMo Gym's ``create_provider`` back in every module patched; idempotent.

    Providers already wrapped stay wrapped (their owners hold them); new ones are not.
    """
    global _CURRENT
    with _LOCK:
        installation, _CURRENT = _CURRENT, None
        if installation is not None:
            installation.restore()


def installed() -> bool:
    """Whether ``install`` is in effect."""
    return _CURRENT is not None
