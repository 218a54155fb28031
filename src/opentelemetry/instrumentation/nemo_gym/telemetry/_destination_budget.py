"""How many destinations (``server.address``/``server.port``) get series of their own.

A client that meets ever-new destinations (sandboxes expose endpoints on their own ports)
must not grow the series of one process without end. The budget is the SDK's cardinality
limit applied by us, per instrument family: at most ``limit`` destinations have series of
their own at a time, the rest share one series marked ``otel.metric.overflow=true`` (the
attribute the OpenTelemetry specification gives the SDK's overflow series), and destinations
that are gone give their places to new ones.

``connections_created`` stays exact under any churn: every collection takes only the new
connections of each destination (its running total minus the part already counted) and adds
them to exactly one series, the destination's own or the overflow. No series ever decreases,
so a reader's sum of increases is the number of connections made.

Gone means: at a collection, the destination had no new connection since the previous
collection and none is open to it. While the budget has room nothing is evicted. When it is
full, a new destination with connections takes the place of the longest-admitted gone one,
whose series then ends (it is no longer observed). A destination that comes back and gets a
place again continues its series from the value it ended with, rather than restarting it: the
SDK keeps one start time per attribute set for the provider's life, so a restarted series
would carry its old start time, a reader could not tell the restart from growth whenever the
new count reached the old one, and a delta-temporality reader would get a negative delta. The
cost is one number per destination whose series ended, beside the series state the SDK itself
keeps for every attribute set it has seen.

Pure computation: the caller passes what it read; no locks, no I/O, no OpenTelemetry calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from opentelemetry.instrumentation.nemo_gym._shared._settings import DEFAULT_MAX_DESTINATIONS
from opentelemetry.instrumentation.nemo_gym.telemetry._aiohttp_compat import Destination

OVERFLOW_ATTRIBUTE: Final = "otel.metric.overflow"


@dataclass(frozen=True)
class CreatedReport:
    """One collection's ``connections_created``: per admitted destination, and the overflow."""

    own: dict[Destination, int]
    overflow: int | None  # None until some destination has overflowed


class DestinationBudget:
    """Admits destinations to series of their own, at most ``limit`` at a time.

    Used from collection only (the caller serialises calls); never on a request's path.
    """

    def __init__(self, limit: int = DEFAULT_MAX_DESTINATIONS) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"max_destinations={limit!r} must be an integer >= 1")
        self.limit = limit
        # Per destination, how much of the caller's running total is already in some series.
        # Raised only by growth, lowered only by ``dropped``: a total that reads lower for one
        # collection (a connector retired between two reads) is not taken for a restart.
        self._counted: dict[Destination, int] = {}
        # Admitted destinations, oldest admission first, with the value of their series.
        self._series: dict[Destination, int] = {}
        # Destinations whose series ended, with its last value: a readmitted one continues it.
        self._ended: dict[Destination, int] = {}
        self._overflow: int | None = None

    def created(
        self, totals: Mapping[Destination, int], busy: Iterable[Destination]
    ) -> CreatedReport:
        """``connections_created`` for one collection.

        ``totals`` are the running connection counts per destination (they only grow, but
        for what the caller gives up through ``dropped``); ``busy`` the destinations with a
        connection open now.
        """
        new: dict[Destination, int] = {}
        for where, total in totals.items():
            counted = self._counted.get(where, 0)
            if total > counted:
                new[where] = total - counted
                self._counted[where] = total
        busy_now = set(busy)
        gone = iter([w for w in self._series if w not in new and w not in busy_now])
        for where in sorted(new):
            count = new[where]
            if where in self._series:
                self._series[where] += count
                continue
            if len(self._series) >= self.limit:
                # A gone destination gives its place to this one; its series ends.
                evicted = next(gone, None)
                if evicted is not None:
                    self._ended[evicted] = self._series.pop(evicted)
            if len(self._series) < self.limit:
                self._series[where] = self._ended.pop(where, 0) + count
            else:
                self._overflow = (self._overflow or 0) + count
        return CreatedReport(dict(self._series), self._overflow)

    def tracks(self, where: Destination) -> bool:
        """Whether ``where`` has a series of its own now."""
        return where in self._series

    def dropped(self, where: Destination, amount: int) -> None:
        """The caller dropped ``amount``, already passed to ``created``, from ``where``'s total."""
        left = self._counted.get(where, 0) - amount
        if left > 0:
            self._counted[where] = left
        else:
            self._counted.pop(where, None)

    def split(self, counts: Mapping[Destination, int]) -> tuple[dict[Destination, int], int | None]:
        """Per-destination gauge values within the budget, and the rest summed (None: no rest).

        Admitted destinations first, then others in order, up to ``limit`` series.
        """
        own: dict[Destination, int] = {}
        rest: int | None = None
        ordered = [w for w in sorted(counts) if w in self._series]
        ordered += [w for w in sorted(counts) if w not in self._series]
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
