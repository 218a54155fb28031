"""OpenTelemetry instrumentation for RL-environment infrastructure.

``NemoGymInstrumentor().instrument()`` (or ``opentelemetry-instrument``, through the
``nemo_gym`` entry point) turns on two things:

* **connection-pool telemetry**: every ``aiohttp.TCPConnector(...)`` constructed afterwards,
  directly or inside ``aiohttp.ClientSession()``/``aiohttp.request()``, is a
  ``QueueTimedTCPConnector`` while the process exports metrics. It records how long each
  request waited for a pool slot and which limit was binding, counts connects per
  destination, and reports each connector configuration's sizing once.
* **sandbox resource telemetry**: a span processor that stamps sandbox identity on spans
  started inside ``sandbox_scope(handle)``; tracing of the bundled sandbox providers and of
  every provider NeMo Gym's ``create_provider`` builds (so ``AsyncSandbox`` and ``Sandbox``
  too), whether ``nemo_gym`` is imported before or after ``instrument()``; and the sandbox
  fleet metrics (``gym.sandbox.creations``, ``gym.sandbox.oom_kills``,
  ``gym.sandbox.allocation.mismatches``) on the meter provider.
* **pressure**, in NeMo Gym's names: the event-loop lag of each uvicorn server's loop (every
  NeMo Gym server) and of each loop that builds an aiohttp connector, garbage-collection
  pauses, requests in flight, and (with the ``pressure`` extra) process CPU, memory, threads
  and open file descriptors; none of them where NeMo Gym's own observer records them.

Usage::

    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    NemoGymInstrumentor().instrument(
        meter_provider=None,       # default: the global meter provider
        tracer_provider=None,      # default: the global tracer provider
        connection_pool=True,      # default: OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL
        sandbox_resources=True,    # default: OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES
        pressure=True,             # default: OTEL_PYTHON_NEMO_GYM_PRESSURE
    )

Connectors constructed before ``instrument()`` and subclasses of ``TCPConnector`` are left
alone. ``uninstrument()`` restores construction exactly, puts NeMo Gym's ``create_provider``
back, and gives the process back what ``instrument()`` changed in it (docs/process-effects.md);
connectors built while instrumented keep their telemetry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Collection
from typing import Any, Protocol

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)

from opentelemetry.instrumentation.nemo_gym._shared._exit_flush import (
    flush_at_exit,
    flush_at_sigterm,
    stop_flush_at_exit,
    stop_flush_at_sigterm,
)
from opentelemetry.instrumentation.nemo_gym._shared._exporting import (
    metrics_deliberately_off,
    metrics_export_status,
)
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    connection_pool_enabled as _connection_pool_enabled,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    fresh_request_context_enabled as _fresh_request_context_enabled,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    intended_concurrency as _intended_concurrency,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    intended_concurrency_per_host as _intended_concurrency_per_host,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    log_level as _log_level,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    loop_lag_interval_s as _loop_lag_interval_s,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    max_destinations as _max_destinations,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    max_server_names as _max_server_names,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    parse_bool as _parse_bool,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    pressure_enabled as _pressure_enabled,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    ray_propagation_enabled as _ray_propagation_enabled,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    rollout_span_enabled as _rollout_span_enabled,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    sandbox_resource_interval as _sandbox_resource_interval,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    sandbox_resources_enabled as _sandbox_resources_enabled,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    semconv_http_mode as _semconv_http_mode,
)
from opentelemetry.instrumentation.nemo_gym._shared._settings import (
    validate_all as _validate_all,
)
from opentelemetry.instrumentation.nemo_gym._shared._status import log_status as _log_status
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._identity import RUN_ID_VARIABLE

# Functions, not modules: pydoc lists a module-valued attribute that is not a direct
# submodule under "SUBMODULES", as if `...nemo_gym.sandbox_tracing` could be imported.
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._own_sampler import (
    own_sampler_patch as _own_sampler_patch,
)
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._providers import (
    provider_patch as _nemo_gym_provider_patch,
)
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._rollout_span import (
    rollout_patch as _rollout_patch,
)
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._sandbox_host import (
    register as _register_nemo_gym_sandbox_host,
)
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._server_client import (
    capacity_workers as _capacity_workers,
)
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._server_client import (
    label_patch as _server_label_patch,
)
from opentelemetry.instrumentation.nemo_gym.integrations.uvicorn._request_context import (
    fresh_context_patch as _fresh_context_patch,
)
from opentelemetry.instrumentation.nemo_gym.package import _instruments
from opentelemetry.instrumentation.nemo_gym.pressure._running import PressureMetrics
from opentelemetry.instrumentation.nemo_gym.pressure._uvicorn_server import (
    pressure_patch as _uvicorn_pressure_patch,
)
from opentelemetry.instrumentation.nemo_gym.ray import _takes_context
from opentelemetry.instrumentation.nemo_gym.ray._propagation import RayPropagation
from opentelemetry.instrumentation.nemo_gym.resource_detector import (
    begin_run,
    in_ray_system_process,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import SandboxSpanProcessor
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    disable as _disable_sandbox_tracing,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    enable as _enable_sandbox_tracing,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import (
    wrapping_for as _sandbox_wrapping_for,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._connector_patch import (
    TCPConnectorPatch,
    capacity_reporter,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    _INSTRUMENTED as _INSTRUMENTED_POOL_TELEMETRY,
)
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    timed_connector_mismatch,
)
from opentelemetry.instrumentation.nemo_gym.version import __version__

__all__ = ["NemoGymInstrumentor", "__version__"]

logger = logging.getLogger(__name__)
_PLAIN_CONNECTOR_NOTICE = OnceLog(logger)

# The sandbox core asks the application which server this process is and whether it records
# the sandbox lifecycle itself (sandbox/_host.py); NeMo Gym answers, for every use of the
# package, instrumented or not (importing any of its modules runs this first).
_register_nemo_gym_sandbox_host()


def _capability_flag(
    kwargs: dict[str, Any], name: str, from_environment: Callable[[], bool]
) -> bool:
    """``instrument(name=...)``: a bool, a boolean string, or ``None`` for the environment.

    Anything else is a mistake that must not silently turn telemetry on: it is logged with the
    value and the environment's setting is used.
    """
    value = kwargs.get(name)
    if value is None:
        return from_environment()
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        parsed = _parse_bool(value)
        if parsed is not None:
            return parsed
    default = from_environment()
    logger.warning(
        "nemo_gym: instrument(%s=%r) is not a boolean (True/False, or 'true'/'false'); "
        "using %s from the environment",
        name,
        value,
        default,
    )
    return default


class _Installed(Protocol):
    """What the instrumentor puts on and takes off: a ``Patch``, ``RayPropagation``, or one of
    the process-wide effects below (log lines, the run id, the SIGTERM handler, the pool patch)."""

    def install(self) -> None: ...

    def uninstall(self) -> None: ...


def _install(patches: list[_Installed], make: Callable[[], _Installed], what: str) -> None:
    """Make a patch, keep it in ``patches`` and install it; a failure is logged, never raised.

    Kept before it is installed: an installation that fails halfway is still taken off.
    """
    try:
        patch = make()
    except Exception:
        logger.exception("nemo_gym: %s failed; skipped", what)
        return
    patches.append(patch)
    try:
        patch.install()
    except Exception:
        logger.exception("nemo_gym: %s failed; skipped", what)


class _OwnLines:
    """This package's log lines at ``level`` and above printed to stderr, while installed.

    For processes whose logging nobody configures, NeMo Gym's servers among them: there the
    status line and the capacity report (INFO) would otherwise never be seen. The lines stop
    propagating, so a configured root logger does not print them twice. ``uninstall()`` takes
    the handler off and gives the package's logger back its level and propagation.
    """

    def __init__(self, level: int) -> None:
        self._level = level
        self._handler: logging.Handler | None = None
        self._before: tuple[int, bool] | None = None

    def install(self) -> None:
        package = logging.getLogger(__name__)
        if self._handler is not None:
            return
        self._before = (package.level, package.propagate)
        self._handler = logging.StreamHandler()  # sys.stderr, looked up at each line
        self._handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._handler.setLevel(self._level)
        package.addHandler(self._handler)
        package.setLevel(self._level)
        package.propagate = False

    def uninstall(self) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return
        package = logging.getLogger(__name__)
        package.removeHandler(handler)
        if self._before is not None:
            level, propagate = self._before
            package.setLevel(level)
            package.propagate = propagate


class _RunBegun:
    """NeMo Gym's command line begins a run (``begin_run``): the servers it spawns while
    instrumented share its id. ``uninstall()`` takes the variable out again where it still
    holds the id written here, so the environment is as ``instrument()`` found it."""

    def __init__(self) -> None:
        self._written: str | None = None

    def install(self) -> None:
        self._written = begin_run(os.environ, sys.argv)

    def uninstall(self) -> None:
        written, self._written = self._written, None
        if written is not None and os.environ.get(RUN_ID_VARIABLE) == written:
            del os.environ[RUN_ID_VARIABLE]


class _PoolPatch:
    """The ``TCPConnector`` construction patch and where directly built timed connectors
    record (``connection_pool._INSTRUMENTED``), installed and taken off together."""

    def __init__(
        self, patch: TCPConnectorPatch, current: Callable[[], PoolTelemetry | None] | None
    ) -> None:
        self._patch = patch
        self._current = current

    def install(self) -> None:
        self._patch.install()
        _INSTRUMENTED_POOL_TELEMETRY.bind(self._current)

    def uninstall(self) -> None:
        _INSTRUMENTED_POOL_TELEMETRY.unbind(self._current)
        self._patch.uninstall()


class _SigtermFlush:
    """The SIGTERM handler that exports the last counts (``flush_at_sigterm``); ``uninstall()``
    gives SIGTERM back the handler it had, where ours is still the one set."""

    def __init__(self) -> None:
        self._previous: object = None

    def install(self) -> None:
        self._previous = flush_at_sigterm()

    def uninstall(self) -> None:
        previous, self._previous = self._previous, None
        stop_flush_at_sigterm(previous)


def _start_pressure_in_running_loop(
    pressure: PressureMetrics, provider: metrics.MeterProvider
) -> None:
    """The pressure metrics for the loop building a connector (aiohttp builds connectors in a
    running loop; there is nothing to probe without one)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    pressure.start(provider, loop)


class NemoGymInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Instrument aiohttp connection pools and sandbox providers for OpenTelemetry.

    ``instrument()`` never raises: ``opentelemetry-instrument`` skips every later
    instrumentor after one that does, so a failure here is logged and the rest carries on.
    The state of each capability (its telemetry, its patches) belongs to this object from
    ``instrument()`` to ``uninstrument()``: every patch is made by ``instrument()``, kept here,
    and taken off by ``uninstrument()``. ``BaseInstrumentor`` makes one object per class, so a
    second object is an instance of a subclass; each keeps and removes only its own patches.
    """

    _sandbox_state: Any = None
    _pressure: PressureMetrics | None = None
    # Installed in this order, taken off in the reverse one (Patch, RayPropagation).
    _patches: tuple[_Installed, ...] = ()

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    # Spelled out, not inherited, so that help() shows the keywords.
    def instrument(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        connection_pool: bool | None = None,
        sandbox_resources: bool | None = None,
        pressure: bool | None = None,
        rollout_span: bool | None = None,
        ray_propagation: bool | None = None,
        fresh_request_context: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Turn the instrumentation on; a failure inside is logged, never raised.

        ``meter_provider`` / ``tracer_provider``: default the global providers, resolved at
        each connector construction. ``connection_pool`` / ``sandbox_resources``: default
        ``OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL`` / ``..._SANDBOX_RESOURCES`` (true).
        ``pressure``: default ``OTEL_PYTHON_NEMO_GYM_PRESSURE`` (true). ``rollout_span`` /
        ``ray_propagation``: default ``OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN`` /
        ``..._RAY_PROPAGATION`` (true). ``fresh_request_context``: default
        ``OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT`` (true). Other
        keywords (``skip_dep_check``, ...) go to ``BaseInstrumentor.instrument``. Logs one
        INFO line saying which capabilities are active and, for one that is not, why.
        """
        super().instrument(
            meter_provider=meter_provider,
            tracer_provider=tracer_provider,
            connection_pool=connection_pool,
            sandbox_resources=sandbox_resources,
            pressure=pressure,
            rollout_span=rollout_span,
            ray_propagation=ray_propagation,
            fresh_request_context=fresh_request_context,
            **kwargs,
        )

    def _instrument(self, **kwargs: Any) -> None:
        if in_ray_system_process():
            # Ray's dashboard, agents and monitors inherit the environment of whoever started
            # Ray, so they load the plugin too; their aiohttp pools are Ray's plumbing, not the
            # application's, and are left plain (docs/identity-and-ray.md says why).
            logger.debug("nemo_gym: a Ray system process; nothing instrumented")
            return
        try:
            _validate_all()  # every malformed variable warns now, once
            connection_pool = _capability_flag(kwargs, "connection_pool", _connection_pool_enabled)
            sandbox_resources = _capability_flag(
                kwargs, "sandbox_resources", _sandbox_resources_enabled
            )
            pressure = _capability_flag(kwargs, "pressure", _pressure_enabled)
            rollout_span = _capability_flag(kwargs, "rollout_span", _rollout_span_enabled)
            ray_propagation = _capability_flag(kwargs, "ray_propagation", _ray_propagation_enabled)
            fresh_request_context = _capability_flag(
                kwargs, "fresh_request_context", _fresh_request_context_enabled
            )
        except Exception:
            logger.exception("nemo_gym: reading the settings failed; instrumenting nothing")
            return
        patches: list[_Installed] = []
        self._patches = ()
        # NeMo Gym's command line begins a run: the servers it spawns from now on share it.
        _install(patches, _RunBegun, "beginning the run's id")
        try:
            level = _log_level()
        except Exception:
            logger.exception("nemo_gym: OTEL_PYTHON_NEMO_GYM_LOG_LEVEL could not be read")
            level = None
        if level is not None:
            _install(patches, lambda: _OwnLines(level), "OTEL_PYTHON_NEMO_GYM_LOG_LEVEL")
        if fresh_request_context:
            # Each request a uvicorn server handles starts from an empty OpenTelemetry context,
            # whatever the pressure setting: uvicorn may leak one request's context into the next.
            _install(patches, _fresh_context_patch, "uvicorn's fresh request context")
        if pressure:
            meter_provider = kwargs.get("meter_provider")
            _install(
                patches,
                lambda: self._instrument_pressure(meter_provider),
                "pressure instrumentation",
            )
        pressure_metrics = self._pressure if pressure else None
        if connection_pool:
            meter_provider = kwargs.get("meter_provider")
            _install(
                patches,
                lambda: self._instrument_connection_pool(meter_provider, pressure_metrics),
                "connection-pool instrumentation",
            )
            # NeMo Gym's ServerClient: its requests labelled by the server they target.
            _install(patches, _server_label_patch, "ServerClient labelling")
        if sandbox_resources:
            providers = (kwargs.get("tracer_provider"), kwargs.get("meter_provider"))
            _install(
                patches, lambda: self._instrument_sandbox(*providers), "sandbox instrumentation"
            )
            state = self._sandbox_state
            if state is not None:
                # NeMo Gym's own sandbox samplers, where loaded, own the sandboxes they sample.
                _install(
                    patches,
                    lambda: _own_sampler_patch(state),
                    "yielding to NeMo Gym's own sandbox samplers",
                )
        if rollout_span:
            # NeMo Gym's rollouts (a ServerClient POST /run): one span each, the root of the
            # rollout's trace. A non-recording span without a configured tracer provider.
            tracer_provider = kwargs.get("tracer_provider")
            _install(patches, lambda: _rollout_patch(tracer_provider), "rollout spans")
        if ray_propagation:
            # Ray tasks and actor methods started inside a span (a rollout's) join its trace,
            # where their workers take it off (_takes_context); Ray's modules are patched when
            # imported. Off, nothing of Ray's is patched, in a caller or a worker.
            _install(
                patches,
                lambda: RayPropagation(
                    _takes_context,
                    caller=True,
                    worker=_takes_context({"env_vars": os.environ}),
                ),
                "carrying the trace context into Ray tasks",
            )
        if (connection_pool or sandbox_resources or pressure) and not metrics_deliberately_off():
            # Where SIGTERM would end the process at once, the last counts leave first.
            _install(patches, _SigtermFlush, "exporting the last counts at SIGTERM")
        self._patches = tuple(patches)
        try:
            # One INFO line: which capabilities are on, and why not.
            _log_status(
                kwargs,
                pool_unfit=timed_connector_mismatch,
                own_span_processors=(SandboxSpanProcessor,),
            )
        except Exception:
            logger.exception("nemo_gym: describing the instrumentation's status failed")

    def _instrument_pressure(self, meter_provider: metrics.MeterProvider | None) -> _Installed:
        """This instrumentor's pressure metrics; their uvicorn hook, for ``_install`` to put on."""
        pressure = PressureMetrics(_loop_lag_interval_s(), __version__)
        self._pressure = pressure

        def exporting_provider() -> metrics.MeterProvider | None:
            # Resolved when a server starts: the global provider may be set after instrument().
            provider = meter_provider or metrics.get_meter_provider()
            if not metrics_export_status(provider)[0]:
                return None
            # Registered now, after the application's imports, as for a pool: a server that
            # never builds one (NeMo Gym's resources server) still sends its loop's last lag
            # before a kill (see _exit_flush).
            flush_at_exit(provider)
            return provider

        return _uvicorn_pressure_patch(pressure, exporting_provider)

    def _instrument_connection_pool(
        self, meter_provider: metrics.MeterProvider | None, pressure: PressureMetrics | None
    ) -> _Installed:
        """The pool's construction patch and its telemetry, for ``_install`` to put on."""
        max_server_names = _max_server_names()
        max_destinations = _max_destinations()
        semconv_mode = _semconv_http_mode()

        def telemetry_of(provider: metrics.MeterProvider) -> PoolTelemetry:
            return PoolTelemetry.of(
                provider,
                version=__version__,
                max_server_names=max_server_names,
                semconv_mode=semconv_mode,
                max_destinations=max_destinations,
            )

        def exporting_telemetry(provider: metrics.MeterProvider) -> PoolTelemetry | None:
            exporting, reason = metrics_export_status(provider)
            if exporting:
                # Registered now, after the application's imports: it runs before their
                # exit handlers, so the last counts leave before a kill (see _exit_flush).
                flush_at_exit(provider)
                if pressure is not None:
                    _start_pressure_in_running_loop(pressure, provider)
                return telemetry_of(provider)
            if not metrics_deliberately_off():
                # The first five minutes: installed, instrumented, and a pool that is not
                # timed must not go unnoticed. Said once, when it first matters.
                _PLAIN_CONNECTOR_NOTICE(
                    "plain",
                    logging.WARNING,
                    "nemo_gym: aiohttp.TCPConnector built without pool telemetry: %s",
                    reason,
                )
            return None

        # Where connectors constructed directly record: an explicit provider's telemetry, or
        # (None) the global provider's, which connection_pool resolves per construction and
        # never over the API's proxy (global_pool_telemetry).
        current: Callable[[], PoolTelemetry | None] | None = None
        if meter_provider is not None:
            # Made here, once per instrument(), never per connector or session.
            explicit = telemetry_of(meter_provider)

            def explicit_telemetry() -> PoolTelemetry | None:
                return explicit

            current = explicit_telemetry

            def choose() -> PoolTelemetry | None:
                return exporting_telemetry(meter_provider)

        else:
            # The global provider may be set after instrument(), so it is resolved per
            # construction; PoolTelemetry.of makes its instruments once per provider.
            def choose() -> PoolTelemetry | None:
                return exporting_telemetry(metrics.get_meter_provider())

        patch = TCPConnectorPatch(
            choose,
            capacity_reporter(
                _capacity_workers,  # read at each report: NeMo Gym may not be loaded yet
                _intended_concurrency(),
                _intended_concurrency_per_host(),
            ),
        )
        return _PoolPatch(patch, current)

    def _instrument_sandbox(
        self,
        tracer_provider: trace.TracerProvider | None,
        meter_provider: metrics.MeterProvider | None,
    ) -> _Installed:
        """Enable this instrumentor's sandbox state; NeMo Gym's ``create_provider`` hook with
        it, for ``_install`` to put on."""
        # None keeps the global provider, looked up at each use (it may be set later); the
        # fleet counters are made once per meter provider (SandboxFleetMetrics.of).
        state = _enable_sandbox_tracing(
            tracer_provider,
            meter_provider=meter_provider,
            interval_s=_sandbox_resource_interval(),
            instrumentation_version=__version__,
        )
        self._sandbox_state = state
        # Every provider NeMo Gym builds, whatever its origin, traced with this state.
        return _nemo_gym_provider_patch(_sandbox_wrapping_for(state))

    def _uninstrument(self, **kwargs: Any) -> None:
        patches, self._patches = self._patches, ()
        for patch in reversed(patches):
            try:
                patch.uninstall()
            except Exception:
                logger.exception("nemo_gym: taking a patch off failed (%r)", patch)
        try:
            pressure, self._pressure = self._pressure, None
            if pressure is not None:
                pressure.stop()
        except Exception:
            logger.exception("nemo_gym: stopping the pressure metrics failed")
        # Registered lazily (at the first timed connector or uvicorn server), for any provider.
        stop_flush_at_exit()
        try:
            state, self._sandbox_state = self._sandbox_state, None
            if state is not None:
                _disable_sandbox_tracing(state)
        except Exception:
            logger.exception("nemo_gym: disabling sandbox instrumentation failed")
