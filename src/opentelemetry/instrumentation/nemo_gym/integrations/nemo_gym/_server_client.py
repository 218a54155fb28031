"""NeMo Gym's own HTTP client, labelled by the NeMo Gym server each request targets.

NeMo Gym servers call each other through ``nemo_gym.server_utils.ServerClient``:
``request(server_name, url_path, method, ...)`` and its ``get``/``post`` shorthands, all going
through the process's global aiohttp client (a plain ``TCPConnector``, so timed by the
connector patch). While the instrumentor's ``label_patch()`` is installed, each of those
calls runs with ``set_server_name(server_name)``, so its queue waits and connects carry the
NeMo Gym server name as ``nemo.gym.http.destination.server.name`` instead of ``external``.
The application sees no difference: arguments, results, exceptions and cancellation pass
through unchanged.

``server_utils`` imports a heavy stack (ray, fastapi, wandb, ...), so nothing here imports
it: a post-import hook patches ``ServerClient`` when the application imports it, or at once
if it already has. Uninstalling the patch restores the methods exactly.

``capacity_workers()`` is the worker count for the capacity report: the
``OTEL_PYTHON_NEMO_GYM_WORKERS`` variable when set, else NeMo Gym's own
(``get_nemo_gym_fastapi_num_workers``) when ``server_utils`` is loaded, else 1.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from opentelemetry.instrumentation.nemo_gym._shared import _settings
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog, shown_value
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch, methods_of
from opentelemetry.instrumentation.nemo_gym.environment_variables import (
    OTEL_PYTHON_NEMO_GYM_WORKERS,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    reset_server_name,
    set_server_name,
)

__all__ = ["MODULE", "capacity_workers", "label_patch", "nemo_gym_worker_count"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

MODULE = "nemo_gym.server_utils"
_CLASS = "ServerClient"
# ``get`` and ``post`` call ``self.request``; each is wrapped anyway, so a subclass that
# overrides one of them is still labelled (nested labels of the same name are harmless).
_METHODS = ("request", "get", "post")

_T = TypeVar("_T")


def _server_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    name = args[0] if args else kwargs.get("server_name")
    return name if isinstance(name, str) and name else None


async def _labelled(call: Callable[[], Awaitable[_T]], server_name: str) -> _T:
    try:
        token = set_server_name(server_name)
    except Exception as exc:  # noqa: BLE001 - an unlabelled request is still made
        _ONCE(("set", type(exc).__name__), logging.WARNING, "nemo_gym: no server label: %r", exc)
        return await call()
    try:
        return await call()
    finally:
        try:
            reset_server_name(token)
        except Exception as exc:  # noqa: BLE001 - never hide the request's own outcome
            _ONCE(("reset", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)


def _wrapper(
    wrapped: Callable[..., Awaitable[Any]],
    instance: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Awaitable[Any]:
    """Run a ``ServerClient`` method with its target server's name as the destination label."""
    server_name = _server_name(args, kwargs)
    if server_name is None:
        return wrapped(*args, **kwargs)
    return _labelled(lambda: wrapped(*args, **kwargs), server_name)


def label_patch() -> Patch:
    """A new ``Patch`` that labels ``ServerClient`` requests by target server while installed
    (the instrumentor makes one per ``instrument()`` and keeps it); ``install()`` never raises
    for a missing or different ``nemo_gym``, ``uninstall()`` restores the methods where our
    wrappers still sit."""
    return Patch((MODULE,), methods_of(_CLASS, _METHODS, _wrapper, _ONCE), _ONCE)


def nemo_gym_worker_count() -> int | None:
    """NeMo Gym's FastAPI worker count, when ``server_utils`` is loaded and answers with a
    positive integer; ``None`` otherwise (logged once). Never imports ``server_utils``."""
    module = sys.modules.get(MODULE)
    read = getattr(module, "get_nemo_gym_fastapi_num_workers", None)
    if read is None:
        return None
    try:
        workers = read()
    except Exception as exc:  # noqa: BLE001 - a bad NeMo Gym setting falls back to the default
        _ONCE(
            ("workers", type(exc).__name__),
            logging.WARNING,
            "nemo_gym workers: %s",
            shown_value(exc),  # NeMo Gym's error quotes the variable's value
        )
        return None
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        _ONCE(
            ("workers", repr(workers)),
            logging.WARNING,
            "nemo_gym workers=%s ignored",
            shown_value(workers),
        )
        return None
    return workers


def capacity_workers() -> int:
    """Workers to divide connector limits by in the capacity report:
    ``OTEL_PYTHON_NEMO_GYM_WORKERS`` when set, else NeMo Gym's count, else 1."""
    if os.environ.get(OTEL_PYTHON_NEMO_GYM_WORKERS, "").strip():
        return _settings.workers()
    return nemo_gym_worker_count() or 1
