"""Every Ray worker instrumented, on every node: ``runtime_env()`` for ``ray.init`` or a task.

``opentelemetry-instrument`` on a Ray driver configures the driver. Workers of a local cluster
that the driver starts happen to inherit its environment, but workers on a node started with
``ray start`` (or by an autoscaler) do not. A Ray ``runtime_env`` travels with the job or the
task to whichever node runs it, so::

    import ray
    from opentelemetry.instrumentation.nemo_gym.ray import runtime_env

    ray.init(address="auto", runtime_env=runtime_env())
    # or per task / actor: f.options(runtime_env=runtime_env({"pip": [...]})).remote()

gives every worker process of that job (or task) the driver's ``OTEL_*`` settings and Ray's
worker setup hook, set to ``setup_worker``, which configures the SDK from them as
``opentelemetry-instrument`` would (its distro, configurator and every installed
instrumentor, this plugin included), once per worker process, before the worker runs its
first task. The ``nemo_gym`` resource detector
is added to ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``, so each worker's resource names Ray's
node id and worker id. This module is the only one that imports ``ray``: in the worker's hook,
and for the name of Ray's setup-hook variable where Ray is installed (a fallback otherwise).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["SETUP_HOOK", "flush", "runtime_env", "setup_worker"]

logger = logging.getLogger(__name__)

SETUP_HOOK: Final = f"{__name__}.setup_worker"
"""The worker setup hook that ``runtime_env()`` installs (an importable name)."""

_DETECTORS: Final = "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"
_RESOURCE_ATTRIBUTES: Final = "OTEL_RESOURCE_ATTRIBUTES"
_OUR_DETECTOR: Final = "nemo_gym"
_SERVICE_NAME_VARIABLE: Final = "OTEL_SERVICE_NAME"
_PROCESS_IDENTITY: Final = frozenset({"service.name", "service.instance.id"})
_SETUP_HOOK_VARIABLE: Final = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
# opentelemetry-instrument's own settings live in OTEL_* too; PYTHONPATH is not copied: the
# driver's paths mean nothing on another node, and the hook does what its sitecustomize does.
_PREFIX: Final = "OTEL_"


def runtime_env(
    base: Mapping[str, Any] | None = None,
    *,
    env_vars: Mapping[str, str] | None = None,
    inherit_environment: bool = True,
) -> dict[str, Any]:
    """A Ray ``runtime_env`` whose workers export telemetry like this process would.

    ``base``: a runtime_env of your own to extend (``pip``, ``working_dir``, ``env_vars``...),
    not modified. ``env_vars``: variables to set on top, e.g. ``OTEL_SERVICE_NAME``.
    ``inherit_environment``: copy this process's ``OTEL_*`` variables (default), except what
    names this process (``OTEL_SERVICE_NAME``; ``service.name`` and ``service.instance.id`` in
    ``OTEL_RESOURCE_ATTRIBUTES``), so workers never share the driver's series. Precedence,
    lowest first: this process, ``base["env_vars"]``, ``env_vars``. Raises ``ValueError``
    naming the field and value for a ``base`` that already has a
    ``worker_process_setup_hook`` (Ray runs one; call ``setup_worker()`` from yours), and
    ``TypeError`` for an ``env_vars`` entry that is not a string (as Ray would).
    """
    merged: dict[str, Any] = dict(base or {})
    hook = merged.get("worker_process_setup_hook")
    if hook is not None:
        raise ValueError(
            f"runtime_env: base already has worker_process_setup_hook={hook!r}; Ray runs one "
            f"setup hook per worker and runtime_env() installs its own: call {SETUP_HOOK}() "
            "from yours instead"
        )
    variables: dict[str, str] = {}
    if inherit_environment:
        variables.update(_inherited(os.environ))
    for source, given in (("base['env_vars']", merged.get("env_vars")), ("env_vars", env_vars)):
        for key, value in (given or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"runtime_env: {source}[{key!r}] = {value!r}; Ray's env_vars maps "
                    "strings to strings"
                )
            variables[key] = value
    variables[_DETECTORS] = _with_our_detector(variables.get(_DETECTORS, ""))
    # Ray's `worker_process_setup_hook` field is honoured only in a job's runtime_env (ray.init)
    # and silently ignored in a task's or actor's (Ray 2.60). The variable Ray turns that field
    # into, and that every worker reads before its first task, works at both levels.
    variables[_setup_hook_variable()] = SETUP_HOOK
    merged["env_vars"] = variables
    return merged


def setup_worker() -> None:
    """Configure OpenTelemetry in this Ray worker as ``opentelemetry-instrument`` would.

    Ray calls it once per worker process, after the worker connects and before its first
    task. Does nothing where the SDK is already configured (a worker that inherited
    ``opentelemetry-instrument``'s environment). Never raises: telemetry that fails to start
    is logged, and the worker runs its tasks without it.
    """
    try:
        if _sdk_configured():
            logger.debug("nemo_gym: OpenTelemetry already configured in this Ray worker")
            return
        _name_ray_ids_if_missing()
        _initialize_like_opentelemetry_instrument()
    except Exception:
        logger.exception("nemo_gym: configuring OpenTelemetry in this Ray worker failed")


def _inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """This process's ``OTEL_*`` settings, minus what names this process rather than a worker.

    A worker is its own service instance: the driver's ``OTEL_SERVICE_NAME`` and the
    ``service.name``/``service.instance.id`` in its ``OTEL_RESOURCE_ATTRIBUTES`` would make
    every worker share the driver's series.
    """
    variables = {k: v for k, v in environ.items() if k.startswith(_PREFIX)}
    variables.pop(_SERVICE_NAME_VARIABLE, None)
    resource = variables.pop(_RESOURCE_ATTRIBUTES, "")
    kept = [
        pair
        for pair in resource.split(",")
        if pair.strip() and pair.split("=", 1)[0].strip() not in _PROCESS_IDENTITY
    ]
    if kept:
        variables[_RESOURCE_ATTRIBUTES] = ",".join(kept)
    return variables


def flush(timeout_millis: int = 5000) -> bool:
    """Export what this process has recorded now; call it at the end of a task that matters.

    Ray ends a job's workers without running their ``atexit`` handlers, so what a worker
    recorded after its last periodic export (``OTEL_METRIC_EXPORT_INTERVAL``, 60 s by default)
    is lost when its job ends. Exports the global meter provider's metrics and the global
    tracer provider's spans; returns within about ``timeout_millis`` (an export still running
    then goes on in the background), ``True`` only when every export ended in time and
    succeeded. Never raises.
    """
    results: list[bool] = []
    flushing = threading.Thread(
        target=lambda: results.append(_flush_providers(timeout_millis)),
        name="nemo-gym-ray-flush",
        daemon=True,  # an exporter that ignores its timeout does not hold the worker up
    )
    try:
        flushing.start()
    except RuntimeError:  # no thread can start (the interpreter is exiting)
        logger.warning("nemo_gym: flush() could not start its thread; nothing exported")
        return False
    flushing.join(max(0.0, timeout_millis / 1000))
    if not results:
        logger.debug("nemo_gym: flush() did not finish within %s ms", timeout_millis)
        return False
    return results[0]


def _flush_providers(timeout_millis: float) -> bool:
    """Export the global providers' data, in this thread; whether every export succeeded.

    Metrics go through ``export_metrics_now``, which keeps each exporter's answer (the SDK's
    ``force_flush`` returns ``True`` whatever it was).
    """
    from opentelemetry import metrics, trace  # imported only where a flush is asked for

    from opentelemetry.instrumentation.nemo_gym._exporting import export_metrics_now

    succeeded = True
    try:
        succeeded = export_metrics_now(metrics.get_meter_provider(), timeout_millis)
    except Exception:
        logger.exception("nemo_gym: flushing the meter provider failed")
        succeeded = False
    tracer_provider = trace.get_tracer_provider()
    force_flush = getattr(tracer_provider, "force_flush", None)
    if callable(force_flush):
        try:
            succeeded = bool(force_flush(timeout_millis)) and succeeded
        except Exception:
            logger.exception("nemo_gym: flushing %s failed", type(tracer_provider).__name__)
            succeeded = False
    return succeeded


def _setup_hook_variable() -> str:
    """Ray's name for the variable holding the setup hook (the same since Ray 2.7)."""
    try:
        from ray._private import ray_constants  # the driver has Ray; a worker reads the same
    except ImportError:
        return _SETUP_HOOK_VARIABLE
    name = getattr(ray_constants, "WORKER_PROCESS_SETUP_HOOK_ENV_VAR", _SETUP_HOOK_VARIABLE)
    return name if isinstance(name, str) and name else _SETUP_HOOK_VARIABLE


def _with_our_detector(configured: str) -> str:
    names = [name.strip() for name in configured.split(",") if name.strip()]
    if _OUR_DETECTOR in names or "*" in names:
        return ",".join(names)
    return ",".join([*names, _OUR_DETECTOR])


def _sdk_configured() -> bool:
    from opentelemetry import metrics, trace  # imported only in the hook
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(metrics.get_meter_provider(), MeterProvider) or isinstance(
        trace.get_tracer_provider(), TracerProvider
    )


def _name_ray_ids_if_missing() -> None:
    """Ray releases that do not pass ``--node-id`` to workers: the ids from Ray's context."""
    if any(argument.startswith("--node-id") for argument in sys.argv):
        return  # the nemo_gym resource detector reads them from the command line
    import ray  # the one module allowed to, only in a worker

    context = ray.get_runtime_context()
    pairs = [f"ray.node.id={context.get_node_id()}", f"ray.worker.id={context.get_worker_id()}"]
    existing = os.environ.get(_RESOURCE_ATTRIBUTES, "")
    os.environ[_RESOURCE_ATTRIBUTES] = ",".join([*([existing] if existing else []), *pairs])


def _initialize_like_opentelemetry_instrument() -> None:
    from opentelemetry.instrumentation.auto_instrumentation import (
        initialize,
    )
    from opentelemetry.util._importlib_metadata import entry_points

    if not list(entry_points(group="opentelemetry_configurator")):
        logger.warning(
            "nemo_gym: no OpenTelemetry configurator is installed in this Ray worker's "
            "environment, so nothing is exported; install opentelemetry-distro there"
        )
    initialize()
