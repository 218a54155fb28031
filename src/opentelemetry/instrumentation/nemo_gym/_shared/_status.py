"""The one line ``instrument()`` logs: which capabilities are active, and why one is not.

Installed, instrumented, and nothing happens is the worst first five minutes: with no SDK
provider, no metric reader or an exporter set to ``none``, connectors stay plain by design.
This line says so, once per ``instrument()``, at INFO level. The decisions themselves live in
``_exporting`` and ``_settings``, and in the capabilities themselves, which the instrumentor
passes in (``pool_unfit``, ``own_span_processors``); this module only words them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from opentelemetry.instrumentation.nemo_gym import environment_variables as env
from opentelemetry.instrumentation.nemo_gym._shared import _exporting, _settings
from opentelemetry.instrumentation.nemo_gym._shared._once import shown_value

logger = logging.getLogger("opentelemetry.instrumentation.nemo_gym")


def _switched_off(kwargs: Mapping[str, Any], argument: str, variable: str) -> str | None:
    """Why a capability was turned off by the caller or the environment, or None if it was not.

    Mirrors ``_instrument``: an argument that is a bool or a boolean string wins, anything
    else (``None`` included) leaves the decision to the variable.
    """
    value = kwargs.get(argument)
    chosen = _settings.parse_bool(value) if isinstance(value, str) else value
    if isinstance(chosen, bool):
        return None if chosen else f"{argument}={value!r} was passed to instrument()"
    enabled = _FROM_ENVIRONMENT[argument]()
    return None if enabled else f"{variable}={shown_value(os.environ.get(variable, ''))}"


# Each switch's reader of its variable, by instrument()'s argument.
_FROM_ENVIRONMENT: dict[str, Callable[[], bool]] = {
    "connection_pool": _settings.connection_pool_enabled,
    "sandbox_resources": _settings.sandbox_resources_enabled,
    "rollout_span": _settings.rollout_span_enabled,
    "ray_propagation": _settings.ray_propagation_enabled,
}


def _rollout_status(kwargs: Mapping[str, Any]) -> str:
    off = _switched_off(kwargs, "rollout_span", env.OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN)
    if off is not None:
        return f"rollout_span=off ({off}; ServerClient.request is not wrapped)"
    return "rollout_span=on"


def _ray_status(kwargs: Mapping[str, Any]) -> str:
    off = _switched_off(kwargs, "ray_propagation", env.OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION)
    if off is not None:
        return f"ray_propagation=off ({off}; nothing added to the Ray tasks this process starts)"
    return "ray_propagation=on"


def _connection_pool_status(kwargs: Mapping[str, Any], pool_unfit: Callable[[], object]) -> str:
    off = _switched_off(kwargs, "connection_pool", env.OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL)
    if off is not None:
        return f"connection_pool=off ({off})"
    if pool_unfit() is not None:
        # The warning logged with it names the method and both signatures.
        return (
            f"connection_pool=off (aiohttp {aiohttp.__version__} does not fit the timed "
            "connector; aiohttp.TCPConnector stays plain)"
        )
    exporting, reason = _exporting.metrics_export_status(kwargs.get("meter_provider"))
    if exporting:
        return f"connection_pool=on ({reason}: new aiohttp.TCPConnector pools are timed)"
    # Decided again at each construction: a provider set up after instrument() still counts.
    return (
        f"connection_pool=off for now ({reason}; aiohttp.TCPConnector stays plain, "
        "checked again at each construction)"
    )


def _sandbox_status(kwargs: Mapping[str, Any], own_span_processors: tuple[type, ...]) -> str:
    off = _switched_off(kwargs, "sandbox_resources", env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES)
    if off is not None:
        # Off means the instrumentor traces no provider by itself; a provider the application
        # wraps (traced_provider) still records, as the quickstart's sandbox half does.
        wrapped = "only providers wrapped with traced_provider() are traced"
        return f"sandbox_resources=off ({off}; {wrapped})"
    exporting, reason = _exporting.traces_export_status(
        kwargs.get("tracer_provider"), ignore=own_span_processors
    )
    if not exporting:
        return f"sandbox_resources=off ({reason}; sandbox records are not exported)"
    interval = _settings.sandbox_resource_interval()
    sampling = (
        f"usage sampled every {interval:g} s"
        if interval > 0
        else f"periodic usage sampling off ({env.OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL}=0)"
    )
    return f"sandbox_resources=on ({reason}; {sampling})"


def status_line(
    kwargs: Mapping[str, Any],
    *,
    pool_unfit: Callable[[], object],
    own_span_processors: tuple[type, ...],
) -> str:
    """The summary for ``instrument(**kwargs)``: each capability, on or off and why.

    ``pool_unfit()`` says why the timed connector does not fit the installed aiohttp (``None``
    when it fits), asked only while the pool capability is on; ``own_span_processors`` are the
    span processors of ours that export nothing themselves.
    """
    pool = _connection_pool_status(kwargs, pool_unfit)
    sandbox = _sandbox_status(kwargs, own_span_processors)
    rollout = _rollout_status(kwargs)
    ray = _ray_status(kwargs)
    return f"nemo_gym instrumentation: {pool}; {sandbox}; {rollout}; {ray}"


def log_status(
    kwargs: Mapping[str, Any],
    *,
    pool_unfit: Callable[[], object],
    own_span_processors: tuple[type, ...],
) -> None:
    """Log ``status_line(...)`` at INFO. Called at the end of ``_instrument``; never raises."""
    try:
        line = status_line(kwargs, pool_unfit=pool_unfit, own_span_processors=own_span_processors)
        logger.info("%s", line)
    except Exception:
        logger.debug("nemo_gym could not summarise its instrumentation", exc_info=True)
