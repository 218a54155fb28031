"""``OnceLog``: one line per distinct telemetry problem, however often it repeats."""

from __future__ import annotations

import logging

import pytest

from opentelemetry.instrumentation.nemo_gym._shared._once import (
    MAX_SHOWN_CHARS,
    OnceLog,
    shown_value,
)

LOGGER = logging.getLogger("nemo_gym.test_once")


def test_once_log_drops_repeats_of_a_key(caplog: pytest.LogCaptureFixture) -> None:
    """Each key is logged at its level once; repeats are dropped; ``reset`` forgets keys."""
    once = OnceLog(LOGGER)
    with caplog.at_level(logging.DEBUG, logger=LOGGER.name):
        for _ in range(3):
            once("a", logging.WARNING, "problem %s", "a")
        once("b", logging.WARNING, "problem %s", "b")
        once.reset()
        once("a", logging.WARNING, "problem %s", "a")
    assert [r.getMessage() for r in caplog.records] == ["problem a", "problem b", "problem a"]


def test_once_log_repeats_at_debug_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    """With ``repeats_at_debug`` the first is at its level and the rest at debug."""
    once = OnceLog(LOGGER, repeats_at_debug=True)
    with caplog.at_level(logging.DEBUG, logger=LOGGER.name):
        for _ in range(3):
            once(("k",), logging.WARNING, "provider failed")
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_shown_value_cuts_long_values_and_names_their_length() -> None:
    """Short values are their repr; long ones keep 64 characters, balanced quotes, and a length."""
    assert shown_value("debug") == "'debug'"
    assert shown_value("x" * MAX_SHOWN_CHARS) == repr("x" * MAX_SHOWN_CHARS)
    assert shown_value("7" * 5000) == f"{'7' * 64!r}... (5000 characters)"
    assert shown_value(42) == "42"
    assert shown_value(ValueError("9" * 100)) == f"ValueError('{'9' * 52}... (114 characters)"
