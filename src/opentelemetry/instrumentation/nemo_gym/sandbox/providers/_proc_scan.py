"""The ``/proc`` process table, and one scan of it shared by the samples of a tick.

Without cgroups, a process sandbox's usage is the sum over the processes in its commands'
sessions, which only a scan of every process on the machine can find. Scanning once per
sample makes 200 sandboxes cost 200 scans; ``ProcScan`` makes it one scan per tick for all
the sandboxes of a provider.

Freshness is by construction, not by age: a sample waits for a scan that *starts after the
sample was asked for*, never for one already running or done. So a process started before
the sample was asked for (an ``exec`` that returned, a child it forked) is in the table the
sample reads, and a sample right after an ``exec`` cannot miss it. Samples that arrive
while a scan is pending join it. Scans are spaced so that they take at most
``SCAN_SHARE`` of the event loop's time (the gap after a scan is its duration divided by
that share, at most ``MAX_GAP_S``): a sample waits at most one gap plus one scan.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import read_file

__all__ = ["MAX_GAP_S", "SCAN_SHARE", "ProcRow", "ProcScan", "proc_table"]

# Scans run on the event loop (they are many small reads that a thread would only contend
# for the GIL with); this bounds their share of it.
SCAN_SHARE = 0.04
MAX_GAP_S = 0.5

# (pid, session, start time in clock ticks, CPU seconds, RSS bytes)
ProcRow = tuple[int, int, int, float, int]


def proc_table() -> list[ProcRow]:
    """Every live process as (pid, session, start time, CPU seconds, RSS bytes), from ``/proc``.

    Zombies are left out: they are dead, hold no memory, and wait only for their parent (for
    orphans, whatever init this machine has) to reap them.
    """
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    table = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = read_file(Path(entry.path) / "stat")
        if stat is None:
            continue
        # Fields after the command name, which is in parentheses and may hold spaces.
        rest = stat.rpartition(")")[2].split()
        if not rest or rest[0] == "Z":
            continue
        try:
            table.append(
                (
                    int(entry.name),
                    int(rest[3]),
                    int(rest[19]),
                    (int(rest[11]) + int(rest[12])) / tick,
                    int(rest[21]) * page,
                )
            )
        except (IndexError, ValueError):
            continue
    return table


def by_session(table: list[ProcRow]) -> dict[int, list[ProcRow]]:
    """The rows of a process table grouped by session id. Pure."""
    sessions: dict[int, list[ProcRow]] = {}
    for row in table:
        sessions.setdefault(row[1], []).append(row)
    return sessions


class ProcScan:
    """One process-table scan per tick, shared by every sample asked for before it starts.

    ``sessions()`` is awaited on one event loop (a provider's). ``scans`` counts the scans
    made, for tests and benchmarks.
    """

    def __init__(self) -> None:
        self.scans = 0
        # The scan not started yet, weakly: its loop's schedule holds it until it runs, and a
        # loop closed before then clears that schedule, so neither the scan nor the loop it
        # belongs to is kept by this (long-lived) object.
        self._next: weakref.ref[asyncio.Future[dict[int, list[ProcRow]]]] | None = None
        self._not_before = 0.0  # loop time before which the next scan may not start

    async def sessions(self) -> Mapping[int, list[ProcRow]]:
        """The process table by session, from a scan that starts after this call.

        Cancelling the call abandons only this caller's wait; the scan still serves the
        others. A failed scan raises its error to every caller that waited for it.
        """
        loop = asyncio.get_running_loop()
        future = self._next() if self._next is not None else None
        if future is None or future.get_loop() is not loop:
            future = loop.create_future()
            self._next = weakref.ref(future)
            loop.call_at(max(loop.time(), self._not_before), self._scan, future)
        return await asyncio.shield(future)

    def _scan(self, future: asyncio.Future[dict[int, list[ProcRow]]]) -> None:
        # From here on, a new caller needs a newer scan: this one may have read its
        # processes' /proc entries already.
        if self._next is not None and self._next() is future:
            self._next = None
        self.scans += 1
        started = time.perf_counter()
        try:
            table = by_session(proc_table())
        except Exception as exc:  # noqa: BLE001 - handed to the waiting samples
            if not future.done():
                future.set_exception(exc)
                # Waiters that were all cancelled never read it; do not warn about that.
                future.exception()
            return
        finally:
            took = time.perf_counter() - started
            loop = future.get_loop()
            self._not_before = loop.time() + min(MAX_GAP_S, took / SCAN_SHARE)
        if not future.done():
            future.set_result(table)
