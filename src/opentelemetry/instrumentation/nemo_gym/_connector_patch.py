"""Swap ``aiohttp.TCPConnector(...)`` for the queue-timed connector at construction time.

The patch is a ``__new__`` installed on ``TCPConnector`` itself, not a replacement of the
``aiohttp.TCPConnector`` name: code that imported the class before ``instrument()``, and
aiohttp's own ``ClientSession()``/``aiohttp.request()`` (which build a ``TCPConnector`` from
inside ``aiohttp.client``), all go through the class, so all of them are covered, and
``isinstance(connector, aiohttp.TCPConnector)`` stays true. When ``__new__`` returns an
instance of a subclass, Python runs that subclass's ``__init__`` with the caller's arguments,
so the queue-timed connector is initialised exactly as the plain one would have been.

Only ``TCPConnector(...)`` itself is redirected: subclasses (including ours) are somebody's
deliberate choice and construct as they always did.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import aiohttp

from opentelemetry.instrumentation.nemo_gym import _settings
from opentelemetry.instrumentation.nemo_gym._once import OnceLog
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import _PoolConfig
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    connection_pool_capacity,
    report_connection_pool_capacity,
)

logger = logging.getLogger(__name__)

# ``__new__`` defined on TCPConnector's own class dict before we patched it, if any; restored
# exactly on unpatch. ``_MISSING`` means "there was none: delete ours".
_MISSING = object()
_original_new: object = _MISSING
_patched = False
_lock = threading.Lock()
_ONCE = OnceLog(logger)


def _keyword_default(name: str, fallback: int) -> int:
    parameter = inspect.signature(aiohttp.TCPConnector.__init__).parameters.get(name)
    if parameter is None or not isinstance(parameter.default, int):
        return fallback
    return parameter.default


# aiohttp's own defaults, read once, for constructions that leave the limits out.
_DEFAULT_LIMIT = _keyword_default("limit", 100)
_DEFAULT_LIMIT_PER_HOST = _keyword_default("limit_per_host", 0)


def report_connector_capacity(kwargs: dict[str, Any]) -> None:
    """Report the pool sizing of a ``TCPConnector(**kwargs)`` construction.

    Called before ``__init__`` runs, so the limits come from the arguments and aiohttp's
    defaults. The capacity report logs each distinct configuration once.
    """
    limit = kwargs.get("limit", _DEFAULT_LIMIT)
    limit_per_host = kwargs.get("limit_per_host", _DEFAULT_LIMIT_PER_HOST)
    if not isinstance(limit, int) or not isinstance(limit_per_host, int):
        return
    workers = _settings.workers()
    # A connector's limit is what *this* process may use; the report takes budgets for the
    # whole process group and divides them across workers. Multiplying back keeps that
    # division exact, while intended demand stays what the operator set for the group.
    cfg = _PoolConfig(
        global_aiohttp_connector_limit=limit * workers,
        global_aiohttp_connector_limit_per_host=limit_per_host * workers,
        global_aiohttp_intended_concurrency=_settings.intended_concurrency(),
        global_aiohttp_intended_concurrency_per_host=_settings.intended_concurrency_per_host(),
    )
    report_connection_pool_capacity(cfg, connection_pool_capacity(cfg, workers))


def _log_failure_once(error: Exception) -> None:
    _ONCE(
        "choosing-connector",
        logging.WARNING,
        "nemo_gym connection-pool instrumentation failed while choosing a connector; "
        "using a plain aiohttp.TCPConnector",
        exc_info=error,
    )


def _plain_new(cls: type[aiohttp.TCPConnector], *args: Any, **kwargs: Any) -> Any:
    """Construct exactly as the inherited ``object.__new__`` does for ``TCPConnector``.

    CPython cannot hand a class back its inherited ``object.__new__`` once ``__new__`` has
    been assigned on it: after ``del`` the type keeps the slot that forwards the constructor's
    arguments, and ``object.__new__`` then refuses them (``TCPConnector(limit=4)`` would raise
    ``TypeError``). So uninstrumenting installs this instead: same instance, same ``__init__``
    call with the caller's arguments, for ``TCPConnector`` and every subclass.
    """
    return object.__new__(cls)


def _unwrap_new(new: object) -> Callable[..., Any]:
    """The callable behind a ``__new__`` found in a class dictionary (maybe a staticmethod)."""
    if new is _MISSING:
        return _plain_new
    function = new.__func__ if isinstance(new, staticmethod) else new
    return function if callable(function) else _plain_new


def patch_tcp_connector(should_time: Callable[[], bool]) -> None:
    """Make ``TCPConnector(...)`` build a ``QueueTimedTCPConnector`` while ``should_time()``.

    ``should_time`` is asked once per construction (cheap: it checks whether metrics are
    exported). Idempotent; any failure in our choice falls back to the plain connector.
    """
    global _original_new, _patched
    with _lock:
        if _patched:
            return
        _original_new = aiohttp.TCPConnector.__dict__.get("__new__", _MISSING)
        construct = _unwrap_new(_original_new)

        def __new__(cls: type[aiohttp.TCPConnector], *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            target: type[aiohttp.TCPConnector] = cls
            if cls is aiohttp.TCPConnector:
                try:
                    if should_time():
                        target = QueueTimedTCPConnector
                except Exception as error:  # noqa: BLE001 - construction must never fail for us
                    _log_failure_once(error)
                try:
                    report_connector_capacity(kwargs)
                except Exception:
                    # A limit aiohttp itself will refuse, or a report that cannot be made:
                    # the application's own construction decides what happens next.
                    logger.debug("nemo_gym could not report connector capacity", exc_info=True)
            # type.__call__ then runs target.__init__ with the caller's arguments.
            return construct(target, *args, **kwargs)

        aiohttp.TCPConnector.__new__ = __new__  # type: ignore[method-assign,assignment]
        _patched = True


def unpatch_tcp_connector() -> None:
    """Restore ``TCPConnector`` construction: the original ``__new__``, or ``_plain_new``."""
    global _original_new, _patched
    with _lock:
        if not _patched:
            return
        restored = _plain_new if _original_new is _MISSING else _original_new
        aiohttp.TCPConnector.__new__ = restored  # type: ignore[method-assign,assignment]
        _original_new = _MISSING
        _patched = False


def is_patched() -> bool:
    return _patched
