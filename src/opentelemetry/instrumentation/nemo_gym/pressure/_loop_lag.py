"""How late an asyncio event loop runs a callback it was asked to run at a known time.

A Gym server answers every request on one loop; synchronous work that holds it (validation,
serialisation, a blocking call, a long garbage collection) makes every request wait while no
single request looks slow. ``LoopLagProbe`` asks the loop, with ``loop.call_later``, to run
its tick ``interval_s`` from now, and at the tick records how much later than that it ran, in
milliseconds, then asks again. No thread and no task: one timer handle on the loop, and
nothing on the path of a request.

A loop may run a timer up to its clock resolution early (asyncio's ``_run_once`` takes every
handle due within it); such a tick records 0, not a negative lag.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog

__all__ = ["LoopLagProbe"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)


class LoopLagProbe:
    """Record the scheduling lag of ``loop`` every ``interval_s`` seconds through ``record``.

    ``record(lag_ms)`` runs on the loop at each tick; if it raises, the failure is logged once
    and the probe carries on. ``start()`` and ``stop()`` must be called on the loop's thread.
    The probe stops by itself when the loop closes (no handle is left behind).
    """

    __slots__ = ("__weakref__", "_due", "_handle", "_interval_s", "_loop", "_record")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        interval_s: float,
        record: Callable[[float], None],
    ) -> None:
        self._loop = loop
        self._interval_s = interval_s
        self._record = record
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        """Whether a tick is scheduled."""
        return self._handle is not None

    def start(self) -> None:
        """Schedule the first tick; a probe already running is left as it is."""
        if self._handle is None:
            self._schedule()

    def stop(self) -> None:
        """Cancel the next tick."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        self._due = self._loop.time() + self._interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        lag_ms = (self._loop.time() - self._due) * 1000.0
        try:
            self._record(lag_ms if lag_ms > 0.0 else 0.0)
        except Exception as exc:  # noqa: BLE001 - a failed record never stops the loop's work
            _ONCE(("record", type(exc).__name__), logging.WARNING, "nemo_gym: loop lag: %r", exc)
        if self._loop.is_closed():
            self._handle = None
            return
        self._schedule()
