"""How many destinations (``server.address``/``server.port``) get series of their own.

A client that meets ever-new destinations (sandboxes expose endpoints on their own ports)
must not grow the series of one process without end. The budget is the SDK's cardinality
limit applied by us, per instrument family: the first ``limit`` destinations get their own
series, the rest share one series marked ``otel.metric.overflow=true`` (the attribute the
OpenTelemetry specification gives the SDK's overflow series), and destinations that are gone
are forgotten when a new destination needs their place.

Gone means: at a collection, the destination's connection count has not grown since the
previous collection and no connection to it is open. While the budget has room nothing is
forgotten (a closed pool's counts stay, as before). When it is full, a new destination takes
the place of the longest-admitted gone one, whose own series then ends; a later connection to
it starts it again from 1 (Prometheus reads that as a counter reset). Counts of a destination
that went to the overflow series stay in it, so every series stays monotonic.

Pure computation: the caller passes what it read; no locks, no I/O, no OpenTelemetry calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from opentelemetry.instrumentation.nemo_gym._aiohttp_compat import Destination

OVERFLOW_ATTRIBUTE: Final = "otel.metric.overflow"
DEFAULT_MAX_DESTINATIONS: Final = 100


@dataclass(frozen=True)
class CreatedReport:
    """One collection's ``connections_created``: per admitted destination, and the overflow."""

    own: dict[Destination, int]
    overflow: int | None  # None until some destination has overflowed


class DestinationBudget:
    """Admits destinations to series of their own, at most ``limit`` at a time."""

    def __init__(self, limit: int = DEFAULT_MAX_DESTINATIONS) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"max_destinations={limit!r} must be an integer >= 1")
        self.limit = limit
        # Insertion-ordered: admitted destinations, with the count last reported for each.
        self._admitted: dict[Destination, int] = {}
        # Destinations whose counts go to the overflow series, with the count last added.
        self._overflowed: dict[Destination, int] = {}
        self._overflow_total = 0
        self._overflow_seen = False
        # Counts already forgotten, subtracted from the running totals the caller passes.
        self._baseline: dict[Destination, int] = {}

    def created(
        self, totals: Mapping[Destination, int], busy: Iterable[Destination]
    ) -> CreatedReport:
        """``connections_created`` for one collection.

        ``totals`` are the running connection counts per destination (they only grow while a
        destination is known); ``busy`` the destinations with a connection open now.
        """
        busy_now = set(busy)
        # Forgotten destinations that no connector remembers need no baseline any more.
        for where in [w for w in self._baseline if w not in totals]:
            del self._baseline[where]
        values = {where: totals[where] - self._baseline.get(where, 0) for where in sorted(totals)}
        # Idle: no new connection since the last collection and none open now.
        idle = [
            where
            for where, previous in self._admitted.items()
            if values.get(where, 0) == previous and where not in busy_now
        ]
        for where, value in values.items():
            if value <= 0 or where in self._admitted:
                continue
            if where in self._overflowed:
                previous = self._overflowed[where]
                self._overflow_total += value - previous
                if value == previous and where not in busy_now:
                    # Its count stays in the overflow series; it needs no tracking.
                    self._forget(where, totals[where])
                    del self._overflowed[where]
                else:
                    self._overflowed[where] = value
                continue
            if len(self._admitted) >= self.limit and idle:
                # A gone destination gives its place to a new one; its own series ends.
                gone = idle.pop(0)
                self._forget(gone, totals.get(gone, 0))
                del self._admitted[gone]
            if len(self._admitted) < self.limit:
                self._admitted[where] = value
            else:
                self._overflowed[where] = value
                self._overflow_total += value
                self._overflow_seen = True
        own: dict[Destination, int] = {}
        for where in self._admitted:
            own[where] = self._admitted[where] = values.get(where, self._admitted[where])
        return CreatedReport(own, self._overflow_total if self._overflow_seen else None)

    def tracks(self, where: Destination) -> bool:
        """Whether ``where`` still has a series (its own or a share of the overflow)."""
        return where in self._admitted or where in self._overflowed

    def dropped(self, where: Destination, amount: int) -> None:
        """The caller dropped ``amount`` of a forgotten destination's running total."""
        left = self._baseline.get(where, 0) - amount
        if left > 0:
            self._baseline[where] = left
        else:
            self._baseline.pop(where, None)

    def _forget(self, where: Destination, total: int) -> None:
        self._baseline[where] = total

    def split(self, counts: Mapping[Destination, int]) -> tuple[dict[Destination, int], int | None]:
        """Per-destination gauge values within the budget, and the rest summed (None: no rest).

        Admitted destinations first, then others in order, up to ``limit`` series.
        """
        own: dict[Destination, int] = {}
        rest: int | None = None
        ordered = [w for w in sorted(counts) if w in self._admitted]
        ordered += [w for w in sorted(counts) if w not in self._admitted]
        for where in ordered:
            if len(own) < self.limit:
                own[where] = counts[where]
            else:
                rest = (rest or 0) + counts[where]
        return own, rest


class StickyBudget:
    """For histograms, whose series the SDK keeps for good: the first ``limit`` destinations."""

    def __init__(self, limit: int = DEFAULT_MAX_DESTINATIONS) -> None:
        self.limit = limit
        self._kept: set[Destination] = set()

    def admits(self, where: Destination) -> bool:
        """Whether ``where`` keeps its own attributes (else it is recorded as overflow)."""
        if where in self._kept:
            return True
        if len(self._kept) < self.limit:
            self._kept.add(where)
            return True
        return False
