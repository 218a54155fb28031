"""OpenTelemetry instrumentation for RL-environment infrastructure.

``NemoGymInstrumentor().instrument()`` (or ``opentelemetry-instrument``, through the
``nemo_gym`` entry point) turns on two things:

* **connection-pool telemetry**: every ``aiohttp.TCPConnector(...)`` constructed afterwards,
  directly or inside ``aiohttp.ClientSession()``/``aiohttp.request()``, is a
  ``QueueTimedTCPConnector`` while the process exports metrics. It records how long each
  request waited for a pool slot and which limit was binding, counts connects per
  destination, and reports each connector configuration's sizing once.
* **sandbox resource telemetry**: a span processor that stamps sandbox identity on spans
  started inside ``sandbox_scope(handle)``, and tracing of the bundled sandbox providers.

Usage::

    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    NemoGymInstrumentor().instrument(
        meter_provider=None,       # default: the global meter provider
        tracer_provider=None,      # default: the global tracer provider
        connection_pool=True,      # default: OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL
        sandbox_resources=True,    # default: OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES
    )

Connectors constructed before ``instrument()`` and subclasses of ``TCPConnector`` are left
alone. ``uninstrument()`` restores construction exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)

from opentelemetry.instrumentation.nemo_gym import _settings, _status
from opentelemetry.instrumentation.nemo_gym._connector_patch import (
    patch_tcp_connector,
    unpatch_tcp_connector,
)
from opentelemetry.instrumentation.nemo_gym._exporting import metrics_exported
from opentelemetry.instrumentation.nemo_gym.package import _instruments

# The two functions, not the module: pydoc lists a module-valued attribute that is not a
# direct submodule under "SUBMODULES", as if `...nemo_gym.sandbox_tracing` could be imported.
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    disable as _disable_sandbox_tracing,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    enable as _enable_sandbox_tracing,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    bind_instruments,
    instruments_for,
)
from opentelemetry.instrumentation.nemo_gym.version import __version__

__all__ = ["NemoGymInstrumentor", "__version__"]

logger = logging.getLogger(__name__)


class NemoGymInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instrument aiohttp connection pools and sandbox providers for OpenTelemetry.

    ``instrument()`` never raises: ``opentelemetry-instrument`` skips every later
    instrumentor after one that does, so a failure here is logged and the rest carries on.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    # --- first5 (issue 11): `instrument` spelled out so help() shows its keywords -----------
    def instrument(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        connection_pool: bool | None = None,
        sandbox_resources: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Turn the instrumentation on; a failure inside is logged, never raised.

        ``meter_provider`` / ``tracer_provider``: default the global providers, resolved at
        each connector construction. ``connection_pool`` / ``sandbox_resources``: default
        ``OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL`` / ``..._SANDBOX_RESOURCES`` (true). Other
        keywords (``skip_dep_check``, ...) go to ``BaseInstrumentor.instrument``. Logs one
        INFO line saying which capabilities are active and, for one that is not, why.
        """
        super().instrument(
            meter_provider=meter_provider,
            tracer_provider=tracer_provider,
            connection_pool=connection_pool,
            sandbox_resources=sandbox_resources,
            **kwargs,
        )

    # --- end first5 ---------------------------------------------------------------------------

    def _instrument(self, **kwargs: Any) -> None:
        _settings.validate_all()  # first5 (issue 11): every bad variable warns now, once
        connection_pool = kwargs.get("connection_pool")
        if connection_pool is None:
            connection_pool = _settings.connection_pool_enabled()
        sandbox_resources = kwargs.get("sandbox_resources")
        if sandbox_resources is None:
            sandbox_resources = _settings.sandbox_resources_enabled()

        if connection_pool:
            try:
                self._instrument_connection_pool(kwargs.get("meter_provider"))
            except Exception:
                logger.exception("nemo_gym: connection-pool instrumentation failed; skipped")
        if sandbox_resources:
            try:
                self._instrument_sandbox(kwargs.get("tracer_provider"))
            except Exception:
                logger.exception("nemo_gym: sandbox instrumentation failed; skipped")
        _status.log_status(kwargs)  # first5 (issue 11): the one INFO line, on/off and why

    @staticmethod
    def _instrument_connection_pool(meter_provider: metrics.MeterProvider | None) -> None:
        if meter_provider is not None:
            # Instruments are made here, once per instrument(), never per connector or session.
            bind_instruments(instruments_for(meter_provider))

            def should_time() -> bool:
                return metrics_exported(meter_provider)

        else:
            # The global provider may be set after instrument() (or replaced in tests), so it
            # is resolved per construction; instruments_for() makes instruments once per
            # provider, and a dictionary hit afterwards.
            def should_time() -> bool:
                provider = metrics.get_meter_provider()
                if not metrics_exported(provider):
                    return False
                bind_instruments(instruments_for(provider))
                return True

        patch_tcp_connector(should_time)

    @staticmethod
    def _instrument_sandbox(tracer_provider: trace.TracerProvider | None) -> None:
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        _enable_sandbox_tracing(provider)

    def _uninstrument(self, **kwargs: Any) -> None:
        try:
            unpatch_tcp_connector()
            bind_instruments(None)
        except Exception:
            logger.exception("nemo_gym: restoring aiohttp.TCPConnector failed")
        try:
            _disable_sandbox_tracing()
        except Exception:
            logger.exception("nemo_gym: disabling sandbox instrumentation failed")
