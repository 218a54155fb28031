"""The 1-2.5-5 bucket ladder every latency histogram's boundaries are built on."""

from __future__ import annotations

import pytest

from opentelemetry.instrumentation.nemo_gym._shared._buckets import ladder
from opentelemetry.instrumentation.nemo_gym.pressure._pressure import (
    GC_PAUSE_BUCKETS_MS,
    LOOP_LAG_BUCKETS_MS,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import QUEUE_DURATION_BUCKETS


def test_ladder_spans_first_to_last_exactly() -> None:
    """Each step of the ladder is the float its decimal literal is, both ends included."""
    assert ladder(0.1, 10.0) == (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    assert ladder(2.5, 2.5) == (2.5,)


@pytest.mark.parametrize(("first", "last"), [(0.3, 10.0), (1.0, 7.0), (10.0, 1.0), (0.0, 1.0)])
def test_ladder_off_the_ladder_raises_naming_both(first: float, last: float) -> None:
    """A bound that is no step of the ladder, or bounds the wrong way round, are refused."""
    with pytest.raises(ValueError, match=rf"ladder\(first={first!r}, last={last!r}\)"):
        ladder(first, last)


def test_ladder_gives_the_documented_boundaries() -> None:
    """The boundaries the names table documents (docs/names.md) are unchanged."""
    assert QUEUE_DURATION_BUCKETS == (
        0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
        1000.0, 5000.0, 30000.0,
    )  # fmt: skip
    assert LOOP_LAG_BUCKETS_MS[0] == 1.0
    assert LOOP_LAG_BUCKETS_MS[-1] == 10_000.0
    assert len(LOOP_LAG_BUCKETS_MS) == 13
    assert (0.05, *ladder(0.1, 1_000.0)) == GC_PAUSE_BUCKETS_MS
