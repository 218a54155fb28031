"""Telemetry failures of the sandbox half, logged once per kind, never with their text.

A failure inside sandbox telemetry repeats at the rate of the sandboxes that trigger it, and
its exception text may hold user data (a command, an environment, provider options, a
credential the caller passed by mistake). So the first occurrence of each key is logged at
warning level with the exception's type only; the full text goes to debug level, which an
operator turns on deliberately.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog

# resource_telemetry's documented logger: the sandbox half logs under one name.
logger = logging.getLogger("opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry")

_FAILURES = OnceLog(logger, repeats_at_debug=True)


def log_once(key: Hashable, message: str, *args: object) -> None:
    """Log ``message`` at warning level the first time ``key`` is seen, then at debug."""
    _FAILURES(key, logging.WARNING, message, *args)


def log_failure(what: str, exc: BaseException, *key: Hashable) -> None:
    """Log that ``what`` failed: once at warning level naming only the exception's type, and
    every time at debug level with its text."""
    name = type(exc).__name__
    _FAILURES(("failure", what, name, *key), logging.WARNING, "%s failed (%s)", what, name)
    logger.debug("%s failed: %r", what, exc)
