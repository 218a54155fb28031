"""The one module that reads aiohttp's private connector state.

aiohttp exposes no public question for "which limit is making this request wait?" or "is
anyone still queued?", so the answers come from ``BaseConnector``'s private attributes
(``_limit``, ``_limit_per_host``, ``_acquired``, ``_acquired_per_host``, ``_waiters``). They
have changed shape across 3.x releases, so every read goes through ``getattr`` with a default
and a type check: when aiohttp changes, these helpers answer "unknown" (or ``None``) instead
of raising, and the telemetry degrades while the application keeps working.

The queue timer overrides ``TCPConnector._wait_for_available_connection``, which first
appeared in aiohttp 3.10.11 (3.10.0 to 3.10.10 waited inline in ``connect()``); that is why
the package's aiohttp floor is 3.10.11. ``QUEUE_WAIT_HOOK_AVAILABLE`` says whether the running
aiohttp has it.

Everything here is synchronous, cheap, never blocks and never raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any, Final

import aiohttp

CONSTRAINT_TOTAL: Final = "total"
CONSTRAINT_PER_HOST: Final = "per_host"
CONSTRAINT_UNKNOWN: Final = "unknown"


def has_queue_wait_hook(connector_class: type[Any] = aiohttp.TCPConnector) -> bool:
    """Whether ``connector_class`` has the ``_wait_for_available_connection`` coroutine hook."""
    return callable(getattr(connector_class, "_wait_for_available_connection", None))


QUEUE_WAIT_HOOK_AVAILABLE: Final = has_queue_wait_hook()


def _int_attribute(obj: object, name: str) -> int | None:
    value = getattr(obj, name, None)
    # Exactly int: a bool (an int subclass) where a limit belongs means the shape changed.
    return value if type(value) is int else None


def total_limit(connector: object) -> int | None:
    """The connector's total connection limit (0 means unlimited); ``None`` if unreadable."""
    return _int_attribute(connector, "_limit")


def per_host_limit(connector: object) -> int | None:
    """The connector's per-host connection limit (0 means unlimited); ``None`` if unreadable."""
    return _int_attribute(connector, "_limit_per_host")


def acquired_total(connector: object) -> int | None:
    """How many connections the connector has handed out right now; ``None`` if unreadable."""
    acquired = getattr(connector, "_acquired", None)
    # len() under try rather than isinstance(..., Sized): an ABC check costs more than the
    # rest of a queue sample, and this runs once per queued wait.
    try:
        return len(acquired)  # type: ignore[arg-type]
    except TypeError:
        return None


def waiter_count(connector: object) -> int | None:
    """How many acquisitions are queued on the connector, all keys; ``None`` if unreadable."""
    waiters = getattr(connector, "_waiters", None)
    if not isinstance(waiters, Mapping):
        return None
    count = 0
    for keyed in waiters.values():
        if not isinstance(keyed, Sized):
            return None
        count += len(keyed)
    return count


def queue_constraint(connector: object) -> str:
    """Name the limit that binds when a queue wait starts: ``total``, ``per_host`` or ``unknown``.

    aiohttp only waits when no slot is free, so when the total limit is finite and exhausted
    the total limit is binding; otherwise it must be the per-host limit. ``unknown`` means the
    connector's limits could not be read.
    """
    # Written out rather than through total_limit()/acquired_total(): this runs once per
    # queued wait, on aiohttp's request path, where each extra call is measurable.
    limit = getattr(connector, "_limit", None)
    if type(limit) is not int or limit < 0:
        return CONSTRAINT_UNKNOWN
    if limit == 0:
        return CONSTRAINT_PER_HOST
    try:
        acquired = len(getattr(connector, "_acquired", None))  # type: ignore[arg-type]
    except TypeError:
        return CONSTRAINT_UNKNOWN
    return CONSTRAINT_TOTAL if acquired >= limit else CONSTRAINT_PER_HOST
