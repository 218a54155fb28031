"""The application's sandbox calls in flight, so that our reads yield to a burst of them.

A NeMo Gym run starts its sandboxes in bursts (every rollout of a batch asks for one at once)
and then runs their first commands, again all at once; each is the application waiting on the
engine. The allocation records read the same engine: read during the burst, they compete with
it for the engine and the CPUs. So every traced call counts itself in flight (``calling()``:
creates, and the calls on a sandbox: exec, upload, download, ...), and an allocation read
made while creates are in flight, or just after a burst of them (more than one at a time; a
sandbox created on its own is read at once), first waits (``settled()``) until no create is
in flight on its event loop (at most
``CREATES_BOUND_S``), then until no call at all is and none began or ended for ``QUIET_S``
(the application's next round, its first commands, begins a moment after its creates end; at
most ``CALLS_BOUND_S`` more: a command that runs for minutes delays the records that long, no
longer). The reads of one burst then
wake together and are served by one batch of engine requests (``readers._engine``), after
the burst. A sandbox that closes ends its read's wait at once, so the record is still taken
while the sandbox lives.

Per event loop (a call on one loop says nothing about another's), kept only while the loop
lives. Event-loop only.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CALLS_BOUND_S", "CREATES_BOUND_S", "QUIET_S", "calling", "settled"]

# The longest an allocation read waits for creates to settle: a run that creates without
# pause still gets its records, this late at most.
CREATES_BOUND_S = 30.0
# Then the longest it waits for the other calls in flight (the burst's first commands).
CALLS_BOUND_S = 5.0
# How long no call must begin or end for the application to count as quiet.
QUIET_S = 0.2


class _InFlight:
    """One loop's calls in flight: creates and all, each with an event set at zero."""

    def __init__(self) -> None:
        self.creates = 0
        self.calls = 0
        self.no_creates = asyncio.Event()
        self.no_calls = asyncio.Event()
        self.no_creates.set()
        self.no_calls.set()
        self.last_change = -math.inf  # the loop's time a call last began or ended
        # The most creates in flight at once since the last create began with none in
        # flight: above 1, the latest creates were a burst.
        self.peak_creates = 0


# Event loop -> its calls in flight, dropped with the loop.
_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _InFlight]
_LOOPS = weakref.WeakKeyDictionary()


def _in_flight() -> _InFlight:
    loop = asyncio.get_running_loop()
    in_flight = _LOOPS.get(loop)
    if in_flight is None:
        in_flight = _LOOPS[loop] = _InFlight()
    return in_flight


@contextmanager
def calling(*, create: bool = False) -> Iterator[None]:
    """Count one application call (``create``: a sandbox create) in flight on the running
    loop for the block."""
    in_flight = _in_flight()
    loop = asyncio.get_running_loop()
    in_flight.last_change = loop.time()
    in_flight.calls += 1
    in_flight.no_calls.clear()
    if create:
        if in_flight.creates == 0:
            in_flight.peak_creates = 0
        in_flight.creates += 1
        in_flight.peak_creates = max(in_flight.peak_creates, in_flight.creates)
        in_flight.no_creates.clear()
    try:
        yield
    finally:
        in_flight.last_change = loop.time()
        in_flight.calls -= 1
        if in_flight.calls == 0:
            in_flight.no_calls.set()
        if create:
            in_flight.creates -= 1
            if in_flight.creates == 0:
                in_flight.no_creates.set()


async def settled(until: asyncio.Event | None = None) -> None:
    """Return at once unless creates are in flight on the running loop or the latest ones
    were a burst (more than one at a time); else once no create is in flight (at most
    ``CREATES_BOUND_S``), then no call is and none began or ended for ``QUIET_S`` (at most
    ``CALLS_BOUND_S`` more), or as soon as ``until`` is set (the sandbox is closing: its read
    must not wait longer). Never raises but for cancellation."""
    in_flight = _in_flight()
    if in_flight.creates == 0 and in_flight.peak_creates <= 1:
        return  # a sandbox created on its own: no burst to yield to
    closing = until if until is not None else asyncio.Event()
    if not in_flight.no_creates.is_set():
        await _first(in_flight.no_creates, closing, CREATES_BOUND_S)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CALLS_BOUND_S
    while not closing.is_set() and loop.time() < deadline:
        if not in_flight.no_calls.is_set():
            await _first(in_flight.no_calls, closing, deadline - loop.time())
            continue
        quiet_for = loop.time() - in_flight.last_change
        if quiet_for >= QUIET_S:
            return
        await _first(closing, closing, min(QUIET_S - quiet_for, deadline - loop.time()))


async def _first(event: asyncio.Event, closing: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``event`` or ``closing`` is set, ``timeout_s`` at most."""
    waits = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(closing.wait())}
    try:
        await asyncio.wait(waits, timeout=max(timeout_s, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
