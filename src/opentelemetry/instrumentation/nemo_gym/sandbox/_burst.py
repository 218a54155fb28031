"""Sandbox creates in flight, so that our reads yield to a burst of them.

A NeMo Gym run starts its sandboxes in bursts (every rollout of a batch asks for one at once),
and each create is the application waiting on the engine. The allocation records read the
same engine: read while the burst is in flight, they compete with it for the engine and the
CPUs. So every traced create counts itself in (``creating()``), and an allocation read first
waits (``settled()``) until no create is in flight on its event loop, within a bound: the
reads of one burst then wake together and are served by one engine request
(``readers._engine``), after the burst.

Per event loop (a create on one loop says nothing about another's engine calls), kept only
while the loop lives. Event-loop only.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SETTLE_BOUND_S", "creating", "in_flight", "settled"]

# The longest an allocation read waits for creates to settle: a run that creates without
# pause still gets its records, this late at most.
SETTLE_BOUND_S = 30.0


class _Creates:
    """One loop's creates in flight, and an event set while there are none."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()


# Event loop -> its creates, dropped with the loop.
_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Creates]
_LOOPS = weakref.WeakKeyDictionary()


def _creates() -> _Creates:
    loop = asyncio.get_running_loop()
    creates = _LOOPS.get(loop)
    if creates is None:
        creates = _LOOPS[loop] = _Creates()
    return creates


@contextmanager
def creating() -> Iterator[None]:
    """Count one create in flight on the running loop for the block."""
    creates = _creates()
    creates.count += 1
    creates.idle.clear()
    try:
        yield
    finally:
        creates.count -= 1
        if creates.count == 0:
            creates.idle.set()


def in_flight() -> int:
    """The creates in flight on the running loop."""
    return _creates().count


async def settled(bound_s: float, until: asyncio.Event | None = None) -> None:
    """Return once no create is in flight on the running loop, after ``bound_s`` seconds at
    most, or as soon as ``until`` is set (the sandbox is closing: its read must not wait
    longer). Never raises but for cancellation."""
    creates = _creates()
    if creates.idle.is_set() or (until is not None and until.is_set()):
        return
    waits = [asyncio.ensure_future(creates.idle.wait())]
    if until is not None:
        waits.append(asyncio.ensure_future(until.wait()))
    try:
        await asyncio.wait(waits, timeout=bound_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
