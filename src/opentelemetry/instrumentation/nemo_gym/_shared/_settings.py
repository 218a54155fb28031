"""Typed, forgiving reads of the ``OTEL_PYTHON_NEMO_GYM_*`` environment variables.

Each reader returns the documented default when the variable is unset. A value that does not
parse is logged once per (variable, value) with both named, and the default is used: a typo in
a deployment's environment must never stop the application or raise at import.
"""

from __future__ import annotations

import logging
import os
from typing import Final

from opentelemetry.instrumentation.nemo_gym import environment_variables as env
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog, shown_value

logger = logging.getLogger(__name__)

_ONCE = OnceLog(logger)

# The sandbox sampling interval's default, and the shortest interval the environment can ask
# for. Each sample is a provider call (a cgroup read, a Docker API request) and a span, per
# sandbox: at 1e-9 one idle sandbox took 4,428 samples and 1.99 s of CPU in 2 s. At 0.1 s that
# is 10 spans a second per sandbox, still fine enough to see a short code-execution sandbox's
# peak.
DEFAULT_INTERVAL_S: Final = 10.0
MIN_INTERVAL_S: Final = 0.1
# Distinct destinations a pool's instruments label before the rest share the overflow label.
DEFAULT_MAX_DESTINATIONS: Final = 100

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _warn_once(
    name: str, raw: str, expected: str, default: object, *, unset: str = "no check"
) -> None:
    # A default of None means "not configured": say what that leaves in place (``unset``),
    # which is what the user needs to read, not Python's spelling of it.
    fallback = (
        f"treating it as unset: {unset}" if default is None else f"using the default {default!r}"
    )
    _ONCE(
        (name, raw),
        logging.WARNING,
        "%s=%s is not %s; %s",
        name,
        shown_value(raw),
        expected,
        fallback,
    )


def parse_bool(raw: str) -> bool | None:
    """``True`` or ``False`` for true/false, 1/0, yes/no, on/off (any case); else ``None``."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def read_bool(name: str, default: bool) -> bool:
    """Return the boolean value of ``name``: true/false, 1/0, yes/no, on/off."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    parsed = parse_bool(raw)
    if parsed is None:
        _warn_once(name, raw, "a boolean (true or false)", default)
        return default
    return parsed


def read_int(name: str, default: int | None, *, minimum: int) -> int | None:
    """Return the integer value of ``name``, which must be at least ``minimum``."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        _warn_once(name, raw, f"an integer >= {minimum}", default)
        return default
    return value


def read_float(name: str, default: float, *, minimum: float) -> float:
    """Return the finite float value of ``name``, which must be at least ``minimum``."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        value = None
    if value is None or not (minimum <= value < float("inf")):
        _warn_once(name, raw, f"a finite number >= {minimum}", default)
        return default
    return value


def validate_all() -> None:
    """Read every ``OTEL_PYTHON_NEMO_GYM_*`` variable now, so each bad value warns at start-up.

    Called at the start of ``instrument()``: a typo in a variable that is only read later
    (the sampling interval, at the first sandbox) would otherwise stay silent until then, or
    forever. Each bad value warns once; the readers used later repeat nothing.
    """
    for read in (
        connection_pool_enabled,
        sandbox_resources_enabled,
        sandbox_resource_interval,
        sandbox_cgroup_parent,
        workers,
        intended_concurrency,
        intended_concurrency_per_host,
        max_server_names,
        max_destinations,
        log_level,
        pressure_enabled,
        loop_lag_interval_s,
        rollout_span_enabled,
        ray_propagation_enabled,
        fresh_request_context_enabled,
    ):
        read()


def connection_pool_enabled() -> bool:
    return read_bool(env.OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL, True)


def sandbox_resources_enabled() -> bool:
    return read_bool(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES, True)


def sandbox_resource_interval() -> float:
    """Seconds between usage samples; 0 turns periodic sampling off.

    A positive value below ``MIN_INTERVAL_S`` is raised to it, with one warning: sampling
    is a provider call and a span per sandbox, and a tiny interval turns it into a busy loop.
    """
    name = env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL
    value = read_float(name, DEFAULT_INTERVAL_S, minimum=0.0)
    if 0 < value < MIN_INTERVAL_S:
        _ONCE(
            (name, os.environ.get(name), "floor"),
            logging.WARNING,
            "%s=%s is below the floor of %g s; sampling every %g s",
            name,
            shown_value(os.environ.get(name, "")),
            MIN_INTERVAL_S,
            MIN_INTERVAL_S,
        )
        return MIN_INTERVAL_S
    return value


def sandbox_cgroup_parent() -> str | None:
    """The cgroup path under which ``otel_process`` makes sandbox cgroups, normalised
    (``/a//b/`` is ``/a/b``); ``None`` when unset or not an absolute path (one warning), which
    means the server's own cgroup. Whether the cgroup exists is the provider's to check."""
    name = env.OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    path = raw.strip()
    parts = [part for part in path.split("/") if part]
    if not path.startswith("/") or "\n" in path or any(p in (".", "..") for p in parts):
        _warn_once(
            name,
            raw,
            "an absolute cgroup path without . or .. (such as /gym.slice/sandboxes)",
            None,
            unset="sandbox cgroups go under the server's own cgroup",
        )
        return None
    return "/" + "/".join(parts)


def workers() -> int:
    value = read_int(env.OTEL_PYTHON_NEMO_GYM_WORKERS, 1, minimum=1)
    return 1 if value is None else value


def intended_concurrency() -> int | None:
    return read_int(env.OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY, None, minimum=1)


def intended_concurrency_per_host() -> int | None:
    return read_int(env.OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST, None, minimum=1)


def max_server_names() -> int:
    value = read_int(env.OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES, 100, minimum=1)
    return 100 if value is None else value


def max_destinations() -> int:
    value = read_int(env.OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS, DEFAULT_MAX_DESTINATIONS, minimum=1)
    return DEFAULT_MAX_DESTINATIONS if value is None else value


def pressure_enabled() -> bool:
    return read_bool(env.OTEL_PYTHON_NEMO_GYM_PRESSURE, True)


def rollout_span_enabled() -> bool:
    return read_bool(env.OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN, True)


def ray_propagation_enabled() -> bool:
    return read_bool(env.OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION, True)


def fresh_request_context_enabled() -> bool:
    return read_bool(env.OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT, True)


DEFAULT_LOOP_LAG_INTERVAL_MS = 100.0
# Below 10 ms the probe's own wake-ups would start to show in an idle server's CPU.
MIN_LOOP_LAG_INTERVAL_MS = 10.0


def loop_lag_interval_s() -> float:
    """Seconds between two event-loop lag measurements (the variable is in milliseconds)."""
    name = env.OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS
    return read_float(name, DEFAULT_LOOP_LAG_INTERVAL_MS, minimum=MIN_LOOP_LAG_INTERVAL_MS) / 1000


# The names Python's logging takes for a level, WARN and FATAL included (NOTSET is no level
# to print at). Matched in any case.
_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def log_level() -> int | None:
    """The level of ``OTEL_PYTHON_NEMO_GYM_LOG_LEVEL``; ``None`` when unset (or not a level)."""
    name = env.OTEL_PYTHON_NEMO_GYM_LOG_LEVEL
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    level = _LOG_LEVELS.get(raw.strip().lower())
    if level is None:
        _warn_once(
            name,
            raw,
            f"a log level ({', '.join(_LOG_LEVELS)}; any case)",
            None,
            unset="the application's logging configuration decides",
        )
    return level


_SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"


def semconv_http_mode() -> str:
    """``default``, ``http`` or ``http/dup`` from ``OTEL_SEMCONV_STABILITY_OPT_IN``.

    Read as opentelemetry-python-contrib reads it: a comma-separated list in which
    ``http/dup`` wins over ``http``; other entries (``database``, ...) are not ours to judge.
    """
    entries = {part.strip().lower() for part in os.environ.get(_SEMCONV_OPT_IN, "").split(",")}
    if "http/dup" in entries:
        return "http/dup"
    if "http" in entries:
        return "http"
    return "default"
