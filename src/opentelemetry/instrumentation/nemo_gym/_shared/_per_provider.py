"""One object per OpenTelemetry provider, for as long as the provider lives.

The SDK de-duplicates instruments by name per meter: asking a provider twice for the same
instruments returns the first ones and silently drops a second set's observable callbacks.
So whatever owns instruments (the pool telemetry, the sandbox fleet counters) must exist once
per provider, whoever asks for it and however often ``instrument()`` runs. ``PerProvider``
keeps that one object, weakly keyed by the provider so that it goes when the provider goes.
The sandbox resource readers (``sandbox.readers``) use it the same way, one reader per
sandbox provider object.

Thread-safe; the lock is made anew in a forked child, so a fork while another thread held it
cannot hang the child's first lookup.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")


class PerProvider(Generic[_T]):
    """The objects made for each provider, made on first use and reused after."""

    def __init__(self) -> None:
        self._objects: weakref.WeakKeyDictionary[object, _T] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        _REGISTRIES.add(self)

    def get(self, provider: object, create: Callable[[], _T]) -> _T:
        """``provider``'s object, made by ``create()`` the first time.

        A provider that cannot be weakly referenced gets a new object each time (it cannot be
        remembered without keeping it alive). ``create``'s exceptions propagate.
        """
        with self.lock:
            try:
                existing = self._objects.get(provider)
            except TypeError:
                existing = None
            if existing is not None:
                return existing
            created = create()
            with contextlib.suppress(TypeError):
                self._objects[provider] = created
            return created

    def _after_fork_in_child(self) -> None:
        self.lock = threading.Lock()


_REGISTRIES: weakref.WeakSet[PerProvider[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for registry in list(_REGISTRIES):
        registry._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
