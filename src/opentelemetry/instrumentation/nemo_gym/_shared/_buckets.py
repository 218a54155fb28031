"""Histogram bucket boundaries: the 1-2.5-5 ladder every latency histogram here is built on.

The connection pool's queue waits, the event loop's lag and the garbage collector's pauses
span different ranges of the same ladder (…, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, …); each names its
range here once instead of spelling the steps out again. Pure values, nothing else.
"""

from __future__ import annotations

import math

__all__ = ["ladder"]

_STEPS = (1.0, 2.5, 5.0)


def ladder(first: float, last: float) -> tuple[float, ...]:
    """The 1-2.5-5 boundaries from ``first`` to ``last``, both included (each a power of ten
    times 1, 2.5 or 5); ``ValueError`` if either is not one of them or ``first > last``.

    Each value is parsed from its decimal form, so ``ladder(0.1, 1)[1]`` is exactly the float
    ``0.25`` would be, as the literal lists it replaces were.
    """
    if not 0 < first <= last:
        raise ValueError(f"ladder(first={first!r}, last={last!r}): need 0 < first <= last")
    # Bounded by the exponents of the ends, so a bound off the ladder cannot loop forever.
    exponents = range(math.floor(math.log10(first)) - 1, math.floor(math.log10(last)) + 2)
    values = [
        value
        for exponent in exponents
        for value in (float(f"{step}e{exponent}") for step in _STEPS)
        if first <= value <= last
    ]
    if not values or values[0] != first or values[-1] != last:
        raise ValueError(f"ladder(first={first!r}, last={last!r}): not both on the 1-2.5-5 ladder")
    return tuple(values)
