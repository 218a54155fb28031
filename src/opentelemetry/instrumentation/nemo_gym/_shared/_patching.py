"""Methods of a class in a module we must not import, wrapped while installed.

The plugin wraps classes of libraries it never imports itself (NeMo Gym's ``ServerClient``,
uvicorn's ``Server``): a heavy stack, or not installed at all. ``MethodPatch.install()``
wraps the class's methods at once when its module is already imported, else from wrapt's
post-import hook (as contrib instrumentations do) when the application imports it.
``uninstall()`` puts each method back where our wrapper still sits; a hook left pending for a
module not yet imported then does nothing. Both are idempotent and thread-safe, and a failure
inside the hook is logged once, never raised into the application's import.

The wrapper stays in place for the class's life once applied; it checks ``active`` itself,
so calls after ``uninstall()`` from a class that kept it pass straight through.
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

__all__ = ["MethodPatch"]

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class MethodPatch:
    """``methods`` of ``module``'s ``class_name``, wrapped by ``wrapper`` while installed."""

    def __init__(
        self,
        module: str,
        class_name: str,
        methods: tuple[str, ...],
        wrapper: Wrapper,
        once: OnceLog,
    ) -> None:
        self.module = module
        self.class_name = class_name
        self.methods = methods
        self.active = False
        self._wrapper = wrapper
        self._once = once
        self._lock = threading.RLock()
        self._hook_pending = False
        # (class, method name) -> what the class held before our wrapper, for uninstall.
        self._replaced: dict[tuple[type, str], Any] = {}

    def install(self) -> None:
        """Wrap the methods from now on (now, or when the module is imported)."""
        with self._lock:
            if self.active:
                return
            self.active = True
            module = sys.modules.get(self.module)
            if module is not None:
                self._patch(module)
            elif not self._hook_pending:
                self._hook_pending = True
                wrapt.register_post_import_hook(self._on_import, self.module)

    def uninstall(self) -> None:
        """Restore each method where our wrapper still sits."""
        with self._lock:
            self.active = False
            for (cls, method), previous in list(self._replaced.items()):
                current = cls.__dict__.get(method)
                if isinstance(current, wrapt.FunctionWrapper) and current.__wrapped__ is previous:
                    setattr(cls, method, previous)
            self._replaced.clear()

    def _patch(self, module: ModuleType) -> None:
        cls = getattr(module, self.class_name, None)
        if not isinstance(cls, type):
            self._once(
                ("no-class", self.module),
                logging.DEBUG,
                "nemo_gym: %s has no %s; left alone",
                self.module,
                self.class_name,
            )
            return
        for method in self.methods:
            current = cls.__dict__.get(method)
            if current is None or (cls, method) in self._replaced:
                continue
            self._replaced[(cls, method)] = current
            setattr(cls, method, wrapt.FunctionWrapper(current, self._wrapper))

    def _on_import(self, module: ModuleType) -> None:
        try:
            with self._lock:
                self._hook_pending = False
                if self.active:
                    self._patch(module)
        except Exception as exc:  # noqa: BLE001 - an import must never fail because of telemetry
            self._once(
                ("hook", self.module, type(exc).__name__),
                logging.WARNING,
                "nemo_gym: patching %s failed: %r",
                self.module,
                exc,
            )
