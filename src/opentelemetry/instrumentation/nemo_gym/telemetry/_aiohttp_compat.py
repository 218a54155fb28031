"""The one module that reads aiohttp's private connector state and checks its private methods.

aiohttp exposes no public question for "which limit is making this request wait?", "how many
connections are idle?" or "who is queued?", so the answers come from ``BaseConnector``'s
private attributes (``_limit``, ``_acquired``, ``_conns``, ``_waiters``). They have changed
shape across 3.x releases (lists became deques, dicts became defaultdicts, placeholders gained
arguments), so every read here survives any exception: when aiohttp changes, these helpers
answer "unknown" (or nothing) and the telemetry degrades while the application keeps working.
``tests/test_aiohttp_compat.py`` runs them on the oldest and newest supported aiohttp.

The timed connector also overrides private methods (``_wait_for_available_connection``,
``_create_connection``) and ``connect``, calling aiohttp's own with the same arguments. A
release that changed one of those signatures would make the override raise ``TypeError``
inside every request, so ``override_mismatch`` compares them once, before any connector is
timed, and the connector stays plain where they differ.

Everything here is synchronous, never blocks and never raises. ``pool_state`` may run on an
exporter's thread while the event loop changes the connector: it copies each container in
one C-level call (atomic under the GIL) before looking inside.

**Free-threaded Python.** Without the GIL (CPython 3.13+ built free-threaded, where
``sys._is_gil_enabled()`` is false) that copy is no longer one step no other thread can enter,
and this package has not been run on such an interpreter. So there ``pool_state`` refuses:
it reads nothing and answers an empty state (``gil_disabled()`` is asked at each read, since
importing an extension module that needs the GIL turns it back on). The pool-state gauges
(open connections, waiting requests) then report nothing, with one warning from the pool
telemetry; the queue waits and connect counts, recorded on the event loop's own thread, are
unaffected.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

CONSTRAINT_TOTAL: Final = "total"
CONSTRAINT_PER_HOST: Final = "per_host"
CONSTRAINT_UNKNOWN: Final = "unknown"

# (server.address, server.port, url.scheme) of a pool key.
Destination = tuple[str, int, str]


def queue_constraint(connector: object) -> str:
    """Name the limit that binds when a queue wait starts: ``total``, ``per_host`` or ``unknown``.

    aiohttp only waits when no slot is free, so when the total limit is finite and exhausted
    the total limit is binding; otherwise it must be the per-host limit. ``unknown`` means the
    connector could not be read, whatever went wrong while reading it.
    """
    try:
        limit = connector._limit  # type: ignore[attr-defined]
        if type(limit) is not int or limit < 0:
            return CONSTRAINT_UNKNOWN
        if limit == 0:
            return CONSTRAINT_PER_HOST
        return CONSTRAINT_TOTAL if len(connector._acquired) >= limit else CONSTRAINT_PER_HOST  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - any surprise in aiohttp's internals means "unknown"
        return CONSTRAINT_UNKNOWN


def destination(key: Any) -> Destination | None:
    """``(server.address, server.port, url.scheme)`` of a ``ConnectionKey``; ``None`` if odd."""
    try:
        host = key.host
        port = key.port
        scheme = "https" if key.is_ssl else "http"
    except Exception:  # noqa: BLE001 - an unreadable key has no destination
        return None
    if not isinstance(host, str):
        return None
    if type(port) is not int:
        port = 443 if scheme == "https" else 80
    return (host, port, scheme)


@dataclass(slots=True)
class PoolState:
    """What one connector holds right now, per destination."""

    active: dict[Destination, int] = field(default_factory=dict)
    idle: dict[Destination, int] = field(default_factory=dict)
    waiting: dict[Destination, int] = field(default_factory=dict)


def gil_disabled() -> bool:
    """Whether this interpreter runs without the GIL now (free-threaded CPython)."""
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)  # CPython 3.13+
    try:
        return callable(is_gil_enabled) and not is_gil_enabled()
    except Exception:  # noqa: BLE001 - an answer we cannot get counts as "with the GIL"
        return False


def _add(counts: dict[Destination, int], where: Destination | None, amount: int) -> None:
    if where is not None and amount:
        counts[where] = counts.get(where, 0) + amount


def _items(mapping: object) -> Iterable[tuple[Any, Any]]:
    # list(dict.items()) is one C call: no other thread runs while it copies.
    return list(mapping.items()) if isinstance(mapping, Mapping) else ()


def pool_state(connector: object, destinations: Mapping[object, Destination]) -> PoolState:
    """Count ``connector``'s active, idle and waiting slots per destination.

    ``destinations`` maps each connection (protocol) the connector created to its destination,
    because aiohttp's set of handed-out connections does not say where they go. Connections
    still being established (aiohttp's placeholders) are in no map and so are not active.
    Never raises: a part that cannot be read is left out. Without the GIL, nothing is read
    (see the module's docstring).
    """
    state = PoolState()
    if gil_disabled():
        return state
    try:
        for key, idle in _items(getattr(connector, "_conns", None)):
            _add(state.idle, destination(key), len(idle))
        for key, waiters in _items(getattr(connector, "_waiters", None)):
            _add(state.waiting, destination(key), len(waiters))
        acquired = getattr(connector, "_acquired", None)
        for connection in list(acquired) if isinstance(acquired, set) else ():
            try:
                where = destinations.get(connection)
            except TypeError:
                # aiohttp's placeholders cannot be weakly referenced: a connection being
                # established, which is not active yet.
                continue
            _add(state.active, where, 1)
    except Exception:  # noqa: BLE001, S110 - a changed aiohttp leaves parts of the state out
        pass
    return state


# The private state pool_state and queue_constraint read, and the type each must have.
_STATE: Final = (("_limit", int), ("_acquired", set), ("_conns", Mapping), ("_waiters", Mapping))


def unreadable_state(connector: object) -> str | None:
    """Which private attribute ``connector`` lacks, or has in another shape, or ``None``.

    Where one is unreadable, ``pool_state`` and ``queue_constraint`` leave it out: the pool
    gauges and the queue-wait ``constraint`` degrade while requests are unaffected. Ask it once
    per connector construction, to say so once. Never raises.
    """
    for name, kind in _STATE:
        try:
            value = getattr(connector, name)
        except Exception:  # noqa: BLE001 - gone, or unreadable: the same to the readers
            return f"the connector has no {name}"
        if not isinstance(value, kind):
            return f"the connector's {name} is a {type(value).__name__}, not a {kind.__name__}"
    return None


def _shape(function: object) -> tuple[tuple[str, object, object], ...]:
    parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    return tuple((p.name, p.kind, p.default) for p in parameters)


def _spelled(function: object) -> str:
    # Names, kinds and defaults, as compared; annotations differ between releases anyway.
    parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
    return str(inspect.Signature(bare))


def override_mismatch(base: type, subclass: type, overridden: Mapping[str, bool]) -> str | None:
    """Why ``subclass``'s overrides do not fit ``base``'s methods, or ``None`` when they all do.

    ``overridden`` maps each method name to whether the override awaits ``base``'s method
    (which must then be a coroutine function). A method fits when ``base`` still has it with
    the same parameters: names, kinds and defaults. The answer names the first method that
    does not fit, both signatures, and nothing else; never raises. Costs a few ``inspect``
    calls: ask it once per installation, not per request.
    """
    for name, awaited in overridden.items():
        where = f"{base.__qualname__}.{name}"
        try:
            theirs = getattr(base, name, None)
            if not callable(theirs):
                return f"{where} is gone"
            ours = getattr(subclass, name)
            if _shape(theirs) != _shape(ours):
                return f"{where} takes {_spelled(theirs)}, the override takes {_spelled(ours)}"
            if awaited and not inspect.iscoroutinefunction(theirs):
                return f"{where} is no longer a coroutine function"
        except Exception as error:  # noqa: BLE001 - an unreadable method does not fit
            return f"{where} cannot be inspected ({type(error).__name__}: {error})"
    return None
