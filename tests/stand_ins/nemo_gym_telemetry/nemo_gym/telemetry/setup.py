"""A stand-in for NeMo Gym 0.6+'s ``nemo_gym.telemetry.setup``: the resource its
``init_telemetry`` gives a server process, and nothing else.

NeMo Gym's telemetry is not in any release these machines can install (PyPI serves nemo-gym up
to 0.4.0; the repository main at 07d6b0d has none). This is written here from NeMo Gym's
source as read (NVIDIA-NeMo/Gym ``nemo_gym/telemetry/setup.py`` at 2be0e90 and branch
``ahmadki/lens-gym-callsites`` 2e50140, which ``SimpleServer.setup_telemetry`` calls with the
server's config name and its type) and nemo-lens's (NVIDIA-NeMo/Lens b85578f:
``NemoLensConfig.from_env``, ``handle.setup_telemetry``, ``providers.build_providers``):

* the service group is ``OTEL_SERVICE_NAME`` (NeMo Gym's orchestrator exports its
  ``telemetry.service_name``, ``nemo-gym``; nemo-lens falls back to ``nemo``), and
  ``service.name`` is ``<group>/<server>`` unless ``NEMO_GYM_OTEL_SERVICE_NAME_PER_SERVER`` is
  off;
* the run id is ``NEMO_GYM_OTEL_RUN_ID``, else ``NEMO_LENS_RUN_ID``, else ``SLURM_JOB_ID``,
  else 12 random hex digits of this process's own; ``service.instance.id`` is
  ``<run id>-rank0`` (every Gym process is rank 0 of a world of 1);
* the attributes are passed to ``Resource.create``, so they win over every detector.
"""

from __future__ import annotations

import os
import uuid

from opentelemetry.sdk.resources import Resource

_TRUTHY = ("1", "true", "yes", "on")
NEMO_GYM_VERSION = "0.6.0"
NEMO_LENS_VERSION = "0.1.0"


def _variable(name: str) -> str:
    return (
        os.environ.get(f"NEMO_GYM_OTEL_{name}", "").strip()
        or os.environ.get(f"NEMO_LENS_{name}", "").strip()
    )


def telemetry_resource(server_name: str | None, server_type: str | None) -> Resource:
    """The resource NeMo Gym's telemetry exports this server process with."""
    group = os.environ.get("OTEL_SERVICE_NAME", "").strip() or "nemo"
    per_server = os.environ.get("NEMO_GYM_OTEL_SERVICE_NAME_PER_SERVER", "").strip().lower()
    service = f"{group}/{server_name}" if server_name and per_server in ("", *_TRUTHY) else group
    run_id = _variable("RUN_ID") or os.environ.get("SLURM_JOB_ID", "") or uuid.uuid4().hex[:12]
    attributes: dict[str, str | int] = {
        "service.name": service,
        "service.version": NEMO_LENS_VERSION,
        "dl.rank": 0,
        "dl.world_size": 1,
        "nemo.run.id": run_id,
        "service.instance.id": f"{run_id}-rank0",
        "nemo.gym.version": NEMO_GYM_VERSION,
        "nemo.gym.service_group": group,
        "process.pid": os.getpid(),
    }
    if server_name:
        attributes["nemo.gym.server.name"] = server_name
    if server_type:
        attributes["nemo.gym.server.type"] = server_type
    return Resource.create(attributes)
