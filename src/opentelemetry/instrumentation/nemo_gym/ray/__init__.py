"""Every Ray worker instrumented, on every node: ``runtime_env()`` for ``ray.init`` or a task.

``opentelemetry-instrument`` on a Ray driver configures the driver. Workers of a local cluster
that the driver starts happen to inherit its environment, but workers on a node started with
``ray start`` (or by an autoscaler) do not. A Ray ``runtime_env`` travels with the job or the
task to whichever node runs it, so::

    import ray
    from opentelemetry.instrumentation.nemo_gym.ray import runtime_env

    ray.init(address="auto", runtime_env=runtime_env())
    # or per task / actor: f.options(runtime_env=runtime_env({"pip": [...]})).remote()

gives every worker process of that job (or task) the driver's ``OTEL_*`` settings, except
credentials, its run (``NEMO_GYM_OTEL_RUN_ID``, the resource's ``nemo.run.id``), and Ray's
worker setup hook, set to ``setup_worker``, which configures the SDK
from them as ``opentelemetry-instrument`` would (its distro, configurator and every
installed instrumentor, this plugin included), once per worker process, before the worker
runs its first task. A task or actor method started inside a span, in a process where
``NemoGymInstrumentor`` is instrumented, runs in that span's trace when its worker runs
``setup_worker`` (the task's or actor's ``runtime_env``, else the job's, is one of these).
The ``nemo_gym`` resource detector is added to ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``, so
each worker's resource names Ray's node id and worker id. This package is the only one that
imports ``ray``: in the worker's hook, for the name of Ray's setup-hook variable where Ray is
installed (a fallback otherwise), and where Ray submits a task (``_propagation``, which
patches Ray's modules once the application imports them).

Ray writes a runtime_env in plain text into ``runtime_env_agent.log`` and shows it on its
dashboard, so credentials stay out of it by default: the OTLP headers (where API keys and
bearer tokens go), any variable named like a password, token, key or secret, and any value
holding a URL with user-info (``https://user:pass@host``). Workers read those from their
node's environment instead (what ``ray start`` ran with): a variable a runtime_env does not
set keeps the node's value. ``inherit_credentials=True`` copies them anyway.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog, shown_value
from opentelemetry.instrumentation.nemo_gym._shared._settings import parse_bool
from opentelemetry.instrumentation.nemo_gym.environment_variables import (
    OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION,
)
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._identity import RUN_ID_VARIABLE

__all__ = ["SETUP_HOOK", "flush", "runtime_env", "setup_worker"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

SETUP_HOOK: Final = f"{__name__}.setup_worker"
"""The worker setup hook that ``runtime_env()`` installs (an importable name)."""

_DETECTORS: Final = "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"
_RESOURCE_ATTRIBUTES: Final = "OTEL_RESOURCE_ATTRIBUTES"
_OUR_DETECTOR: Final = "nemo_gym"
_SERVICE_NAME_VARIABLE: Final = "OTEL_SERVICE_NAME"
_PROCESS_IDENTITY: Final = frozenset({_names.ATTR_SERVICE_NAME, _names.ATTR_SERVICE_INSTANCE_ID})
_SETUP_HOOK_VARIABLE: Final = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
# opentelemetry-instrument's own settings live in OTEL_* too; PYTHONPATH is not copied: the
# driver's paths mean nothing on another node, and the hook does what its sitecustomize does.
_PREFIX: Final = "OTEL_"
_HOOK_FIELD: Final = "worker_process_setup_hook"
# Words of a variable's name (split at "_") that mark its value as a credential. HEADERS: the
# OTLP exporters' headers carry API keys and bearer tokens (OTEL_EXPORTER_OTLP_HEADERS and
# OTEL_EXPORTER_OTLP_<SIGNAL>_HEADERS). SECRET counts anywhere in the name, even mid-word.
_CREDENTIAL_WORDS: Final = frozenset(
    {
        "HEADERS",
        "PASSWORD",
        "PASSWD",
        "TOKEN",
        "KEY",
        "APIKEY",
        "CREDENTIAL",
        "CREDENTIALS",
        "AUTH",
        "AUTHORIZATION",
    }
)
# The OTLP exporters' TLS files are named by path (the SDK opens them): a path grants
# nothing, the key stays in its file on the node, and workers need the same paths to export
# where every node mounts them alike. So these are copied, unless the value is the key or
# certificate itself pasted in.
_TLS_FILE_VARIABLE: Final = re.compile(
    r"OTEL_EXPORTER_OTLP_(?:(?:TRACES|METRICS|LOGS)_)?(?:CERTIFICATE|CLIENT_KEY|CLIENT_CERTIFICATE)"
)
_URL_USER_INFO: Final = re.compile(r"://[^/?#\s]*@")


def runtime_env(
    base: Mapping[str, Any] | None = None,
    *,
    env_vars: Mapping[str, str] | None = None,
    inherit_environment: bool = True,
    inherit_credentials: bool = False,
) -> dict[str, Any]:
    """A Ray ``runtime_env`` whose workers export telemetry like this process would.

    ``base``: a runtime_env of your own to extend (``pip``, ``working_dir``, ``env_vars``...),
    not modified. ``env_vars``: variables to set on top, e.g. ``OTEL_SERVICE_NAME``.
    ``inherit_environment``: copy this process's ``OTEL_*`` variables (default), except what
    names this process (``OTEL_SERVICE_NAME``; ``service.name`` and ``service.instance.id`` in
    ``OTEL_RESOURCE_ATTRIBUTES``), so workers never share the driver's series, and except
    credentials: the OTLP headers, any variable whose name has ``PASSWORD``, ``TOKEN``,
    ``KEY``, ``SECRET``, ``CREDENTIAL`` or ``AUTH`` in it, and any value with a URL's
    user-info (``https://user:pass@host``). Those are logged by name (never value), once, and
    workers read them from their node's environment (export them where ``ray start`` runs).
    The OTLP TLS file variables (``OTEL_EXPORTER_OTLP_CERTIFICATE``, ``..._CLIENT_KEY``,
    ``..._CLIENT_CERTIFICATE``) are paths and are copied; pasted PEM content is not.

    ``inherit_credentials=True`` copies the credentials too. The risk: Ray writes the
    runtime_env in plain text into ``runtime_env_agent.log`` on every node that runs the job
    and shows it on its dashboard, so anyone who can read those logs or open the dashboard
    reads the credentials. What you pass in ``base["env_vars"]`` or ``env_vars`` is yours and
    is copied as given, with that same exposure.

    Precedence, lowest first: this process, ``base["env_vars"]``, ``env_vars``. Raises
    ``ValueError`` naming the field and the value for a setup hook of your own, whether given
    as ``base["worker_process_setup_hook"]`` or as Ray's variable behind that field in
    either ``env_vars`` (Ray runs one; call ``setup_worker()`` from yours); ours is accepted.
    Raises ``TypeError`` for a ``base`` or ``env_vars`` that is not a mapping, and for an
    ``env_vars`` entry that is not a string (as Ray would), naming the key, never the value.
    """
    if base is not None and not isinstance(base, Mapping):
        raise TypeError(
            f"runtime_env: base must be a runtime_env mapping, not {type(base).__name__}"
        )
    merged: dict[str, Any] = dict(base or {})
    hook = merged.get(_HOOK_FIELD)
    if hook is not None and not _is_our_hook(hook):
        raise ValueError(_hook_conflict("base", _HOOK_FIELD, hook, "Ray's setup-hook field"))
    variables: dict[str, str] = {}
    if inherit_environment:
        variables.update(_inherited(os.environ, credentials=inherit_credentials))
    hook_variable = _setup_hook_variable()
    for source, given in (("base['env_vars']", merged.get("env_vars")), ("env_vars", env_vars)):
        for key, value in _checked_env_vars(source, given).items():
            if key == hook_variable and value != SETUP_HOOK:
                raise ValueError(
                    _hook_conflict(source, key, value, f"the variable Ray turns {_HOOK_FIELD} into")
                )
            variables[key] = value
    variables[_DETECTORS] = _with_our_detector(variables.get(_DETECTORS, ""))
    # Ray's `worker_process_setup_hook` field is honoured only in a job's runtime_env (ray.init)
    # and silently ignored in a task's or actor's (Ray 2.60). The variable Ray turns that field
    # into, and that every worker reads before its first task, works at both levels.
    variables[hook_variable] = SETUP_HOOK
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
        else:
            _name_ray_ids_if_missing()
            _initialize_like_opentelemetry_instrument()
    except Exception:
        logger.exception("nemo_gym: configuring OpenTelemetry in this Ray worker failed")
    try:
        # A caller that sees this hook in the runtime_env sends its trace context along with
        # the task; the instrumentor, run above or at the worker's start, takes it off again.
        # Where none did (nemo_gym disabled here, a failed start), the task must still get
        # exactly its own arguments. Callers send it only where Ray's hook variable names
        # ours (not where a hook of the user's calls this one).
        from opentelemetry.instrumentation.nemo_gym.ray._propagation import (
            take_carrier_off_here,
        )

        sent_here = _takes_context({"env_vars": os.environ})
        if sent_here and take_carrier_off_here() is not None:
            logger.debug("nemo_gym: no instrumentor takes the trace context off; setup_worker does")
    except Exception:
        logger.exception("nemo_gym: joining Ray tasks to their caller's trace failed")


def _inherited(environ: Mapping[str, str], *, credentials: bool) -> dict[str, str]:
    """This process's ``OTEL_*`` settings and run id, minus what names this process rather
    than a worker, and minus credentials unless ``credentials`` is true.

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
    # The run is the job's, not the driver's own: its workers belong to it too.
    run = environ.get(RUN_ID_VARIABLE, "").strip()
    if run:
        variables[RUN_ID_VARIABLE] = run
    if credentials:
        return variables
    withheld = sorted(name for name, value in variables.items() if _is_credential(name, value))
    if withheld:
        _ONCE(
            tuple(withheld),
            logging.INFO,
            "nemo_gym: runtime_env() left %s out of the Ray runtime_env (Ray logs it and shows "
            "it on its dashboard in plain text); Ray workers read them from their node's "
            "environment, or pass inherit_credentials=True",
            ", ".join(withheld),
        )
    return {name: value for name, value in variables.items() if name not in withheld}


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

    from opentelemetry.instrumentation.nemo_gym._shared._exporting import export_metrics_now

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


def _runs_setup_worker(runtime_env: object) -> bool:
    """Whether a Ray ``runtime_env`` (a mapping, or ``None``) has its workers run
    ``setup_worker``: Ray's setup-hook variable in its ``env_vars`` names ours."""
    if not isinstance(runtime_env, Mapping):
        return False
    variables = runtime_env.get("env_vars")
    if not isinstance(variables, Mapping):
        return False
    return variables.get(_setup_hook_variable()) == SETUP_HOOK


def _takes_context(runtime_env: object) -> bool:
    """Whether the workers of a Ray ``runtime_env`` take a caller's trace context off: they run
    ``setup_worker`` and their ``OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION`` (``runtime_env()``
    copies the caller's) does not turn propagation off. Callers send the context only to those,
    and only those workers patch Ray to take it off, so with the switch off nothing of Ray's
    is patched on either side."""
    if not _runs_setup_worker(runtime_env) or not isinstance(runtime_env, Mapping):
        return False
    variables = runtime_env.get("env_vars")
    raw = variables.get(OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION) if variables else None
    return not isinstance(raw, str) or parse_bool(raw) is not False


def _with_our_detector(configured: str) -> str:
    names = [name.strip() for name in configured.split(",") if name.strip()]
    if _OUR_DETECTOR in names or "*" in names:
        return ",".join(names)
    return ",".join([*names, _OUR_DETECTOR])


def _is_credential(name: str, value: str) -> bool:
    """Whether ``name=value`` holds a secret that must not travel in a runtime_env."""
    if _URL_USER_INFO.search(value):
        return True  # an endpoint with user:password@ in it, whatever the variable's name
    if _TLS_FILE_VARIABLE.fullmatch(name):
        return "-----BEGIN" in value or "\n" in value  # a path is copied, key material is not
    upper = name.upper()
    return "SECRET" in upper or any(word in _CREDENTIAL_WORDS for word in upper.split("_"))


def _checked_env_vars(source: str, given: object) -> Mapping[str, str]:
    """``given`` as Ray's ``env_vars`` (strings to strings), else ``TypeError`` naming
    ``source`` and the key; a value is never shown, as it may be a credential."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(
            f"runtime_env: {source} must be a mapping of strings to strings, "
            f"not {type(given).__name__}"
        )
    for key, value in given.items():
        if not isinstance(key, str):
            raise TypeError(
                f"runtime_env: {source} has a key of type {type(key).__name__}; Ray's "
                "env_vars maps strings to strings"
            )
        if not isinstance(value, str):
            raise TypeError(
                f"runtime_env: {source}[{shown_value(key)}] is of type {type(value).__name__} "
                "(value not shown); Ray's env_vars maps strings to strings"
            )
    return given


def _is_our_hook(hook: object) -> bool:
    return hook == SETUP_HOOK or hook is setup_worker


def _hook_conflict(source: str, name: str, hook: object, what: str) -> str:
    """The error for a setup hook of the caller's own, the same for the field and the variable."""
    return (
        f"runtime_env: {source} has {name}={shown_value(hook)} ({what}), a worker setup hook of "
        f"your own; Ray runs one per worker and runtime_env() installs its own: call "
        f"{SETUP_HOOK}() from yours instead"
    )


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
