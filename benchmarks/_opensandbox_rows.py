"""The OpenSandbox rows of ``sampler_cost.py`` (``--opensandbox``): NeMo Gym main's
``opensandbox`` provider's sandboxes, read by ``readers.opensandbox.OpenSandboxReader``.

* ``opensandbox co-located (cgroup vN)``: the container found by its ``opensandbox.io/id``
  label, sampled from its cgroup (the engine column is the engine's, as for the docker rows);
* ``opensandbox API (opensandbox.metrics)``: one ``get_metrics()`` call per sample through the
  provider's SDK object (as a remote sandbox is read); the engine column is then the
  OpenSandbox server's process tree (execd's own CPU inside each container is not counted).

Needs NeMo Gym main with the OpenSandbox SDK (``scripts/nemo-gym-main-env.sh``) and the server
of ``scripts/start-opensandbox.sh``: ``OPENSANDBOX_DOMAIN`` and ``OPENSANDBOX_API_KEY_FILE``
as it prints them, and its state folder (``NEMO_GYM_OPENSANDBOX_DIR``, default
``.opensandbox``) for the server's PID.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import OpenSandboxReader


class ApiCalls(OpenSandboxReader):
    """Every sample one metrics call, as a remote sandbox's reader makes one per sample (the
    reader's answer-from-the-previous-call bookkeeping left out: its cost is the call's)."""

    async def resource_sample(self, handle: Any) -> Any:
        return await self._ask_metrics(handle)

    def resource_sample_nowait(self, handle: Any) -> None:
        return None


def provider() -> Any:
    """NeMo Gym main's provider, configured as its shipped opensandbox.yaml is."""
    from nemo_gym.sandbox.providers.opensandbox.provider import OpenSandboxProvider

    key = Path(os.environ["OPENSANDBOX_API_KEY_FILE"]).read_text().strip()
    return OpenSandboxProvider(
        connection={
            "domain": os.environ["OPENSANDBOX_DOMAIN"],
            "api_key": key,
            "protocol": "http",
            "use_server_proxy": True,
        }
    )


def spec(image: str) -> Any:
    from nemo_gym.sandbox import SandboxResources, SandboxSpec

    return SandboxSpec(
        image=image, resources=SandboxResources(cpu=0.5, memory_mib=64), ready_timeout_s=120
    )


def server_pid() -> int | None:
    """The server's PID from its state folder: ``NEMO_GYM_OPENSANDBOX_DIR``, else the folder of
    the API key file it printed (``.opensandbox``, or ``.opensandbox-kubernetes`` for
    ``--kubernetes``)."""
    explicit = os.environ.get("NEMO_GYM_OPENSANDBOX_DIR")
    state = Path(explicit) if explicit else Path(os.environ["OPENSANDBOX_API_KEY_FILE"]).parent
    try:
        return int((state / "server.pid").read_text().strip())
    except (OSError, ValueError):
        return None
