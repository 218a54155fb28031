"""Every provider NeMo Gym builds passes through a wrapping function while instrumented.

NeMo Gym builds providers in one place, ``nemo_gym.sandbox.providers.registry.create_provider``
(whatever the provider's origin: registered, built-in or entry point). The function is then
bound by name in three more modules: ``nemo_gym.sandbox.providers`` and ``nemo_gym.sandbox``
re-export it, and ``nemo_gym.sandbox.api`` imports it, and that module global is what
``AsyncSandbox(config, spec)`` calls (``Sandbox`` builds an ``AsyncSandbox``).
``provider_patch(wrap)``, once installed, replaces the function in each of those modules with
one wrapper that passes the returned provider through ``wrap`` (the tracing layer gives
``traced_provider``). The instrumentor makes that patch and keeps it.

NeMo Gym may be imported before or after the patch is installed: modules already imported are
patched at once, the others by a post-import hook (``_patching.Patch``, on wrapt's, as contrib
instrumentations use). Patching the defining module as soon as it is imported means the
re-exporting modules, imported after it, bind the wrapper themselves. Uninstalling puts the
original function back in every module that holds the wrapper; a hook left pending for a
module not yet imported does nothing.

Telemetry never changes NeMo Gym's behaviour: ``create_provider``'s result and exceptions pass
through unchanged, and a provider that ``wrap`` cannot wrap is returned as it is, logged once
per provider class.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch

__all__ = ["DEFINING_MODULE", "FUNCTION", "PATCHED_MODULES", "provider_patch"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

FUNCTION = "create_provider"
DEFINING_MODULE = "nemo_gym.sandbox.providers.registry"
# The defining module first: the others are patched by identity with what it held.
PATCHED_MODULES = (
    DEFINING_MODULE,
    "nemo_gym.sandbox.providers",
    "nemo_gym.sandbox",
    "nemo_gym.sandbox.api",
)


class _Wrapping:
    """One installation's ``wrap`` and the providers already passed through it (never
    wrapped twice), kept by the patch's wrapper, not by this module."""

    def __init__(self, wrap: Callable[[Any], Any]) -> None:
        self.wrap = wrap
        self.seen: weakref.WeakSet[Any] = weakref.WeakSet()

    def call(
        self,
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The wrapper around ``create_provider``: its result, through ``wrap``."""
        return self.wrap_once(wrapped(*args, **kwargs))

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


def _applier(wrapping: _Wrapping) -> Callable[[Patch, ModuleType], None]:
    def apply(patch: Patch, module: ModuleType) -> None:
        _apply(patch, module, wrapping)

    return apply


def _apply(patch: Patch, module: ModuleType, wrapping: _Wrapping) -> None:
    """Put the wrapper in ``module`` where it holds NeMo Gym's function."""
    current = getattr(module, FUNCTION, None)
    if module.__name__ == DEFINING_MODULE:
        if callable(current):
            patch.wrap(module, FUNCTION, wrapping.call)
        return
    defining = sys.modules.get(DEFINING_MODULE)
    ours = patch.ours(defining, FUNCTION) if defining is not None else None
    if ours is None or current is None:
        return
    if current is ours or _same_function(current, ours.__wrapped__):
        patch.bind(module, FUNCTION, ours)
    # Anything else sits there (another patcher's function): left alone.


def _same_function(candidate: Any, original: Any) -> bool:
    """``candidate`` is ``original`` or what ``original`` wraps (another patcher went first)."""
    seen = 0
    while original is not None and seen < 16:  # bounded: a wrapper chain is short
        if candidate is original:
            return True
        original = getattr(original, "__wrapped__", None)
        seen += 1
    return False


def provider_patch(wrap: Callable[[Any], Any]) -> Patch:
    """A new ``Patch`` that passes every provider NeMo Gym's ``create_provider`` returns
    through ``wrap`` while installed (the instrumentor makes one per ``instrument()``).

    Works whether ``nemo_gym`` is imported yet or not. ``wrap`` receives the provider and
    returns what the caller gets; an exception from it leaves the provider unwrapped (logged
    once per provider class). ``install()`` never raises for a missing or unusual
    ``nemo_gym``; ``uninstall()`` puts NeMo Gym's ``create_provider`` back in every module
    patched. Providers already wrapped stay wrapped (their owners hold them); new ones are not.
    """
    return Patch(PATCHED_MODULES, _applier(_Wrapping(wrap)), _ONCE)
