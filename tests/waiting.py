"""The one way a test waits: poll a condition until it holds, or fail naming what never came.

``eventually`` is awaited on the event loop (the condition may be a coroutine function, such
as a provider's ``status``); ``eventually_blocking`` is its twin for code off the loop (a
thread, a test that drives subprocesses). Both return the condition's first truthy value and
raise ``AssertionError`` naming ``what`` and the last value seen once ``timeout`` seconds
have passed. The timeout only stops a broken test: tests wait for a state (a request held, a
record exported, a process gone), never for an amount of time, so it is generous.

A wait that needs no polling, because something signals the change (an ``asyncio.Event``
set by a server's handler, a process's exit), waits on that signal instead.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class _Deadline:
    """The bound of one wait, and the failure that says what never came."""

    def __init__(self, what: str, timeout: float) -> None:
        self.what = what
        self.timeout = timeout
        self._end = time.monotonic() + timeout

    def check(self, last: object) -> None:
        if time.monotonic() > self._end:
            raise AssertionError(
                f"not reached within {self.timeout:g} s: {self.what} (last: {last!r})"
            )


async def eventually(
    condition: Callable[[], T | Awaitable[T]],
    what: str,
    timeout: float = 30.0,  # noqa: ASYNC109 - bounds the polling, not one await
    interval: float = 0.001,
) -> T:
    """Yield to the loop (``interval`` seconds) until ``condition()`` is truthy; return it."""
    deadline = _Deadline(what, timeout)
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        deadline.check(value)
        await asyncio.sleep(interval)


def eventually_blocking(
    condition: Callable[[], T],
    what: str,
    timeout: float = 30.0,
    interval: float = 0.1,
) -> T:
    """Sleep ``interval`` seconds between calls until ``condition()`` is truthy; return it."""
    deadline = _Deadline(what, timeout)
    while True:
        value = condition()
        if value:
            return value
        deadline.check(value)
        time.sleep(interval)


async def settled(timeout: float = 30.0) -> None:  # noqa: ASYNC109 - bounds the wait for others
    """Let every other task on this loop run to its end before a test asserts that nothing
    happened: the sandbox records and samplers run beside their caller, so one ``sleep(0)``
    proves nothing about what they would have recorded. A task still running at ``timeout``
    is left running (the assertion that follows then judges)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=timeout)
