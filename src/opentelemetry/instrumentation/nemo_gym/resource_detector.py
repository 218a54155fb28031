"""``NemoGymResourceDetector``: each process of a NeMo Gym deployment says what it is, in the
names NeMo Gym's own telemetry (0.6+) gives it.

Published in the ``opentelemetry_resource_detector`` entry-point group as ``nemo_gym``. Like
every detector outside the SDK's defaults it runs only when named::

    OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=nemo_gym opentelemetry-instrument ...

(``opentelemetry-instrument`` does not enable it by itself.) It names:

* a NeMo Gym server (``gym env start`` hands each server ``NEMO_GYM_CONFIG_PATH`` and
  ``NEMO_GYM_CONFIG_DICT``): ``service.name`` ``nemo-gym/<server>``, ``nemo.gym.service_group``
  ``nemo-gym``, ``nemo.gym.server.name`` (the server's top-level key, which is also what other
  servers' ``nemo.gym.http.destination.server.name`` calls it), ``nemo.gym.server.type``,
  ``nemo.gym.server.implementation``, ``nemo.gym.server.workers`` (its ``num_workers``) and
  ``nemo.gym.server.uvicorn_worker``;
* NeMo Gym's command line (``gym``, ``ng_run``, ...), which NeMo Gym calls its orchestrator:
  ``service.name`` ``nemo-gym/orchestrator``, ``nemo.gym.server.name`` and
  ``nemo.gym.server.type`` ``orchestrator``;
* a Ray process: ``service.name`` ``ray.<component>``, ``ray.component`` (``worker``,
  ``dashboard``, ``dashboard_agent``, ...), ``ray.node.id``, ``ray.worker.id`` and
  ``ray.session.name`` where Ray passed them;
* every process: ``nemo.run.id`` where it belongs to a run
  (``integrations.nemo_gym._identity.run_id``), a ``service.instance.id`` of its own (a
  UUID, the SDK's where it has one), ``process.pid`` and ``process.parent_pid``, so
  two workers of one server never share a series.

The command line is where a run begins: where ``NEMO_GYM_OTEL_RUN_ID`` is unset, the command
line's run id is minted there as NeMo Gym's orchestrator does, once per process, and
``detect()`` reports it. ``detect()`` only reads: it changes nothing in the process. The
instrumentor writes that id into ``NEMO_GYM_OTEL_RUN_ID`` when it starts (``begin_run``), so
every server the command line spawns afterwards (and NeMo Gym's own telemetry, where it is on)
reports the same run. NeMo Gym reads the variable for its own telemetry only.

``OTEL_SERVICE_NAME`` and a ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` still win: where
either is set, the detector names no service (whatever order an SDK runs detectors in). The
one exception is NeMo Gym's own: with its telemetry switched on (``NEMO_GYM_OTEL_ENABLED``),
``OTEL_SERVICE_NAME`` is its service group, and a server is ``<group>/<server>`` (which wins
over the SDK's ``otel`` detector only where that is listed first: ``otel,nemo_gym``).
Nothing from NeMo Gym's configuration reaches the resource or a log line except the keys
above and ``num_workers``: the configuration holds credentials. A problem is a warning naming
the variable, never an exception, unless ``raise_on_error`` is set.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import uuid
from collections.abc import Mapping, MutableMapping, Sequence

from opentelemetry.sdk.resources import Resource, ResourceDetector
from opentelemetry.util.types import AttributeValue

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym._identity import (
    ATTR_RUN_ID,
    RUN_ID_VARIABLE,
    is_nemo_gym_cli,
    nemo_gym_cli_attributes,
    nemo_gym_server_attributes,
    new_run_id,
    run_id,
    service_name_is_group,
)
from opentelemetry.instrumentation.nemo_gym.ray._identity import (
    is_ray_system_process,
    ray_process_attributes,
)

__all__ = ["NemoGymResourceDetector", "begin_run", "in_ray_system_process"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

_SERVICE_NAME = _names.ATTR_SERVICE_NAME
_SERVICE_INSTANCE_ID = _names.ATTR_SERVICE_INSTANCE_ID
_PROCESS_PID = "process.pid"
_PROCESS_PARENT_PID = "process.parent_pid"


class NemoGymResourceDetector(ResourceDetector):
    """Names the NeMo Gym server, uvicorn worker or Ray process this is (see the module)."""

    def detect(self) -> Resource:
        """Return this process's resource; reads the environment and ``/proc``, never raises.

        With ``raise_on_error=True`` (the SDK's switch) an unexpected failure propagates;
        otherwise it is logged once and an empty resource is returned.
        """
        try:
            attributes = process_attributes(os.environ, sys.argv, _parent_argv())
            if ATTR_RUN_ID not in attributes and is_nemo_gym_cli(sys.argv):
                # The run this command line begins (begin_run hands it to its children).
                attributes[ATTR_RUN_ID] = _run_begun_here(os.environ)
            return Resource(attributes)
        except Exception:
            if self.raise_on_error:
                raise
            _ONCE("detect", logging.WARNING, "nemo_gym: resource detection failed", exc_info=None)
            logger.debug("nemo_gym: resource detection failed", exc_info=True)
            return Resource.get_empty()

    def is_process_dependent(self) -> bool:
        """True: the instance id and pids change in a forked child, so SDKs re-detect there."""
        return True


def process_attributes(
    environ: Mapping[str, str],
    argv: Sequence[str],
    parent_argv: Sequence[str] = (),
) -> dict[str, AttributeValue]:
    """The attributes ``detect()`` puts on the resource, from explicit inputs (for tests)."""
    attributes: dict[str, AttributeValue] = {}
    ray = ray_process_attributes(argv, parent_argv)
    if ray:
        # A Ray process inherits the environment of whoever started Ray, which may be a
        # NeMo Gym server; it is not that server, so its variables are not read here.
        attributes.update(ray)
    else:
        attributes.update(nemo_gym_cli_attributes(environ, argv))
        attributes.update(nemo_gym_server_attributes(environ, _warn))
    if _service_name_configured(environ, named_from_group=bool(attributes) and not ray):
        # The user's choice wins, as the SDK's `otel` detector makes it do when it runs last;
        # SDKs that ran the listed detectors in no fixed order would otherwise pick either.
        attributes.pop(_SERVICE_NAME, None)
    run = run_id(environ)
    if run is not None:
        attributes[ATTR_RUN_ID] = run
    if not _in_resource_attributes(environ, _SERVICE_INSTANCE_ID):
        # Theirs wins too where `otel` runs before us (listed first: `otel,nemo_gym`).
        attributes[_SERVICE_INSTANCE_ID] = _instance_id()
    attributes[_PROCESS_PID] = os.getpid()
    attributes[_PROCESS_PARENT_PID] = os.getppid()
    return attributes


def _service_name_configured(environ: Mapping[str, str], *, named_from_group: bool) -> bool:
    """True where the user named the service. ``named_from_group``: our name was built from
    NeMo Gym's service group, which is ``OTEL_SERVICE_NAME`` where NeMo Gym's telemetry is on
    (then that variable names the group, not this service)."""
    if environ.get("OTEL_SERVICE_NAME", "").strip():
        return not (named_from_group and service_name_is_group(environ))
    return _in_resource_attributes(environ, _SERVICE_NAME)


def _in_resource_attributes(environ: Mapping[str, str], key: str) -> bool:
    """True where ``OTEL_RESOURCE_ATTRIBUTES`` sets ``key``."""
    pairs = environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(pair.split("=", 1)[0].strip() == key for pair in pairs if "=" in pair)


_run_lock = threading.Lock()
_run: tuple[int, str] | None = None


def _run_begun_here(environ: Mapping[str, str]) -> str:
    """The run id this process mints as NeMo Gym's command line: one per process (a forked
    child mints its own), written nowhere; ``begin_run`` hands it to the children."""
    global _run
    with _run_lock:
        pid = os.getpid()
        if _run is None or _run[0] != pid:
            _run = (pid, new_run_id(environ))
        return _run[1]


def begin_run(environ: MutableMapping[str, str], argv: Sequence[str]) -> str | None:
    """In NeMo Gym's command line, begin a run as its orchestrator does: where
    ``NEMO_GYM_OTEL_RUN_ID`` is unset, set it in ``environ`` to this process's run id (the one
    ``detect()`` reports), so every server, uvicorn worker and Ray worker started from here
    afterwards inherits it. Called by the instrumentor when it starts; returns the id set, or
    ``None`` where nothing was set (not the command line, or a run id already given)."""
    if not is_nemo_gym_cli(argv) or environ.get(RUN_ID_VARIABLE, "").strip():
        return None
    run = _run_begun_here(environ)
    environ[RUN_ID_VARIABLE] = run
    return run


def in_ray_system_process() -> bool:
    """True in Ray's dashboard, agents and monitors (which this plugin leaves plain)."""
    try:
        return is_ray_system_process(sys.argv, _parent_argv())
    except Exception:  # a guess that fails must not stop instrumentation elsewhere
        logger.debug("nemo_gym: could not tell whether this is a Ray process", exc_info=True)
        return False


def _warn(message: str) -> None:
    _ONCE(message, logging.WARNING, "nemo_gym resource detector: %s", message)


def _parent_argv() -> list[str]:
    """The parent's command line, read only where ours is ``python -c`` (a forkserver)."""
    if sys.argv[:1] != ["-c"]:
        return []
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            raw = cmdline.read()
    except OSError:
        return []
    parts = [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]
    # "python [-u -B ...] script.py ...": from the script on is what the parent's argv is.
    for index, part in enumerate(parts[1:], start=1):
        if not part.startswith("-"):
            return parts[index:]
    return []


_instance_lock = threading.Lock()
_instance: tuple[int, str] | None = None


def _instance_id() -> str:
    """One UUID per process: the SDK's own where it has one, else ours, new per fork."""
    global _instance
    try:
        from opentelemetry.sdk.resources import (  # recent SDKs only
            ServiceInstanceIdResourceDetector,
        )
    except ImportError:
        pass
    else:
        value = ServiceInstanceIdResourceDetector().detect().attributes.get(_SERVICE_INSTANCE_ID)
        if isinstance(value, str) and value:
            return value
    with _instance_lock:
        pid = os.getpid()
        if _instance is None or _instance[0] != pid:
            _instance = (pid, str(uuid.uuid4()))
        return _instance[1]
