"""Turn ``aiohttp.TCPConnector(...)`` into the queue-timed connector as it is constructed.

The patch wraps ``TCPConnector.__init__`` with wrapt (``_patching.Patch``), as contrib
instrumentations patch the libraries they instrument. After aiohttp's own ``__init__`` has run
with the caller's arguments, a connector whose class is exactly ``TCPConnector`` is switched to
``QueueTimedTCPConnector`` (a subclass that adds no slots, so ``__class__`` assignment is
allowed) and bound to the instrumentation's telemetry. Everything that constructs a
``TCPConnector`` goes through the class, so code that imported it before ``instrument()`` and
aiohttp's own ``ClientSession()``/``aiohttp.request()`` are covered, and
``isinstance(connector, aiohttp.TCPConnector)`` stays true. Construction itself is aiohttp's:
its errors, its ``inspect.signature`` and ``copy.copy`` behave as without us.

Where the installed aiohttp's ``connect``, ``_wait_for_available_connection`` or
``_create_connection`` no longer has the signature the timed connector overrides
(``timed_connector_mismatch``, compared at ``install()``), nothing is switched: the connector
stays plain and a warning says why, once.

Only ``TCPConnector(...)`` itself is switched: subclasses are somebody's deliberate choice,
and NeMo Gym's own connection-pool telemetry (``nemo_gym.telemetry.connection_pool``, meter
scope ``nemo.lens``) times its pools with a
``QueueTimedTCPConnector`` subclass of its own, which must never be timed twice.
``uninstall()`` puts aiohttp's ``__init__`` back exactly; if another library wrapped it after
us, its wrapper stays, pointed past ours.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import aiohttp
from opentelemetry.context import get_current

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import _PoolConfig
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import (
    PoolTelemetry,
    suppressed,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    connection_pool_capacity,
    report_connection_pool_capacity,
    timed_connector_mismatch,
)

logger = logging.getLogger(__name__)


class TCPConnectorPatch:
    """The construction patch of one instrumentor.

    ``choose()`` is asked at each ``TCPConnector(...)`` construction for the telemetry to
    record into, ``None`` for a plain connector (nothing exported); ``report(connector)`` is
    told about every ``TCPConnector`` constructed (the capacity report). Neither may make
    construction fail: their exceptions are logged once and the connector stays plain.
    """

    def __init__(
        self,
        choose: Callable[[], PoolTelemetry | None],
        report: Callable[[aiohttp.TCPConnector], None],
    ) -> None:
        self._choose = choose
        self._report = report
        self._failures = OnceLog(logger)
        self._patch = Patch(("aiohttp",), self._wrap_init, self._failures)

    @property
    def installed(self) -> bool:
        return self._patch.active

    def install(self) -> None:
        """Wrap ``TCPConnector.__init__``; re-enable our wrapper if it is still in place.

        Checks once, now, that the timed connector fits the installed aiohttp (a warning says
        why not); where it does not, every connector stays plain and is still reported.
        """
        if self._patch.active:
            return
        timed_connector_mismatch()
        self._patch.install()

    def uninstall(self) -> None:
        """Restore ``TCPConnector.__init__`` exactly; a later wrapper stays, past ours."""
        self._patch.uninstall()

    def _wrap_init(self, patch: Patch, module: ModuleType) -> None:
        patch.wrap(module.TCPConnector, "__init__", self._construct)

    def _construct(
        self,
        wrapped: Callable[..., None],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        wrapped(*args, **kwargs)  # aiohttp's own __init__: its exceptions are the caller's
        if type(instance) is aiohttp.TCPConnector:
            self._upgrade(instance)

    def _upgrade(self, connector: aiohttp.TCPConnector) -> None:
        try:
            # The fit is compared at install(); asked again here, it is a cached answer that
            # still notices aiohttp's methods patched since.
            unfit = suppressed(get_current()) or timed_connector_mismatch() is not None
            telemetry = None if unfit else self._choose()
            if telemetry is not None:
                # Bound first, switched after: a failure leaves a plain, working connector.
                QueueTimedTCPConnector._nemo_gym_attach(connector, telemetry)  # type: ignore[arg-type]
                connector.__class__ = QueueTimedTCPConnector
        except Exception as error:  # noqa: BLE001 - construction never fails because of us
            self._failures(
                "choose",
                logging.WARNING,
                "nemo_gym connection-pool instrumentation failed while choosing a connector; "
                "using a plain aiohttp.TCPConnector",
                exc_info=error,
            )
        try:
            self._report(connector)
        except Exception as error:  # noqa: BLE001 - a report that cannot be made is skipped
            self._failures(
                "report",
                logging.DEBUG,
                "nemo_gym could not report connector capacity",
                exc_info=error,
            )


# NeMo Gym's own implementation of this API (nemo_gym.telemetry.connection_pool). Where it is
# loaded, NeMo Gym reports its servers' pool sizing itself, with the same line prefix and keys
# as ours.
NEMO_GYM_POOL_MODULE = "nemo_gym.telemetry.connection_pool"


def nemo_gym_reports_capacity() -> bool:
    """Whether NeMo Gym's own connection-pool module, which reports capacity, is loaded."""
    module = sys.modules.get(NEMO_GYM_POOL_MODULE)
    return callable(getattr(module, "report_connection_pool_capacity", None))


def capacity_reporter(
    workers: Callable[[], int], intended: int | None, intended_per_host: int | None
) -> Callable[[aiohttp.TCPConnector], None]:
    """Report each constructed connector's pool sizing through the capacity report.

    ``workers()`` is asked at each report, not when the reporter is made: under
    ``opentelemetry-instrument`` the instrumentor runs before the application imports NeMo
    Gym, whose worker count (``NEMO_GYM_FASTAPI_NUM_WORKERS``, set by its server launcher) is
    only known once its ``server_utils`` is loaded, which is by the time its client builds a
    connector. A connector's limits are what *this* process may use; the report takes budgets
    for the whole process group and divides them, so they are multiplied back here, which
    keeps that division exact. Intended demand is the operator's, for the group.
    ``report_connection_pool_capacity`` logs each distinct (workers, configuration) once.
    Nothing is reported while NeMo Gym's own connection-pool module is loaded: NeMo Gym reports
    its pool sizing itself, in the same words, and the line must appear once.
    """

    def report(connector: aiohttp.TCPConnector) -> None:
        if nemo_gym_reports_capacity():
            return
        group = workers()
        limit, limit_per_host = connector.limit, connector.limit_per_host
        cfg = _PoolConfig(
            global_aiohttp_connector_limit=limit * group,
            global_aiohttp_connector_limit_per_host=limit_per_host * group,
            global_aiohttp_intended_concurrency=intended,
            global_aiohttp_intended_concurrency_per_host=intended_per_host,
        )
        report_connection_pool_capacity(cfg, connection_pool_capacity(cfg, group))

    return report
