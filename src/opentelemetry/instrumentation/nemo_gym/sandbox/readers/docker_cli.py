"""The resource reader of NeMo Gym's built-in ``docker`` provider, which drives a CLI.

NeMo Gym's ``DockerProvider`` runs ``docker run``, ``docker exec`` and ``docker rm`` through
the binary it found (``provider._binary``), naming each container ``nemo-gym-<hex>``
(``handle.raw.name``, also the sandbox id). This reader asks the engine that binary talks to
(Docker, Podman through ``DOCKER_HOST``, or Podman itself where ``podman-docker`` installs it
as ``docker``), through the process's one ``Engine`` for it (``_engine``): over the engine's
socket where ``DOCKER_HOST`` names one, else through the same binary. It records what
``otel_docker`` records, from the same code:

* the allocation: the container's inspect answer (``HostConfig``, the same JSON on Docker and
  Podman) through ``allocation_from_inspect``, designated by the engine's container ID and
  scoped by the daemon as ``otel_docker`` scopes it. The inspects of sandboxes created
  together are one batch (one request each over the socket, one ``inspect`` process for all
  through the CLI), and the daemon's facts are read once per engine for the process;
* usage: the container's cgroup where this host can read it, found from the inspect's
  ``State.Pid`` (``ContainerUsage``): no engine call per sample; else
  ``<binary> stats --no-stream``, whose text gives memory and pids but no CPU time
  (``usage.source`` ``docker.cli.stats``).

Each engine read is bounded (``_engine.READ_TIMEOUT_S`` per request or CLI process, which is
then killed); a record gives up waiting for it at its own timeout.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    Attribute,
    ResourceAllocation,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._attributes import within_total
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_resources import (
    allocation_from_inspect,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_usage import ContainerUsage
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import MIB, SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.readers._cli import output_of, provider_binary
from opentelemetry.instrumentation.nemo_gym.sandbox.readers._engine import (
    DockerCliError,
    Engine,
    engine_of,
)

__all__ = ["CLI_STATS_SOURCE", "DockerCliError", "DockerCliReader"]

CLI_STATS_SOURCE = "docker.cli.stats"

# "444KiB", "1.2MB", "64MiB": the CLI's human sizes (Docker's binary units, Podman's decimal).
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B)\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def _bytes_of(text: object) -> int | None:
    """Bytes from a CLI size such as ``444KiB``; ``None`` for anything else."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None:
        return None
    try:
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    except (KeyError, ValueError):
        return None


def sample_from_cli_stats(stats: Mapping[str, Any]) -> dict[str, Attribute]:
    """Usage attributes from one ``stats --format '{{json .}}'`` line: memory (the first half
    of ``MemUsage``) and pids; absent or unreadable fields are omitted, never 0. Memory above
    ``MemUsage``'s second half (the limit, else the host's memory) is impossible and dropped
    (``within_total``: logged once)."""
    sample: dict[str, Attribute] = {}
    used, _, limit = str(stats.get("MemUsage", "")).partition("/")
    memory = _bytes_of(used)
    if memory is not None:
        memory = within_total("usage.memory_mib", memory, _bytes_of(limit), "memory limit")
    if memory is not None:
        sample["usage.memory_mib"] = memory / MIB
    pids = stats.get("PIDs", stats.get("PIDS"))
    if isinstance(pids, str) and pids.strip().isdigit():
        sample["usage.pids"] = int(pids)
    elif isinstance(pids, int) and not isinstance(pids, bool) and pids >= 0:
        sample["usage.pids"] = pids
    return sample


def _container_name(handle: SandboxHandle) -> str:
    """The container's name as NeMo Gym's provider gave it (also the sandbox id)."""
    name = getattr(getattr(handle, "raw", None), "name", None)
    return name if isinstance(name, str) and name else str(handle.sandbox_id)


class DockerCliReader:
    """Allocation and usage of one NeMo Gym ``DockerProvider``'s containers (see the module).

    Runs on the event loop; never blocks it. Reads only: it never changes a container.
    """

    periodic = True
    # Samples from containers' cgroups where readable; False keeps every sample on the CLI's
    # stats (the tests compare the two paths on one container).
    _cgroup_sampling = True

    def __init__(self, provider: object) -> None:
        self._binary = provider_binary(provider, "docker")
        # Shared by every reader on the same engine: its facts, its batches of reads.
        self.engine: Engine = engine_of(self._binary)
        self._usage = ContainerUsage(
            self._inspect,
            self._stats,
            stats_source=CLI_STATS_SOURCE,
            cgroups=self._cgroup_sampling,
        )

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        """The allocation the engine shows in the container's inspect, placed by the daemon."""
        name = _container_name(handle)
        inspect, daemon = await asyncio.gather(self._inspect(name), self.engine.daemon())
        if (inspect.get("State") or {}).get("Running"):
            # The first sample then needs no inspect of its own to find the cgroup.
            self._usage.locate(name, inspect)
        return allocation_from_inspect(inspect, daemon)

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        """One usage sample, as ``otel_docker``'s (``ContainerUsage``)."""
        return await self._usage.sample(_container_name(handle))

    def resource_sample_nowait(self, handle: SandboxHandle) -> dict[str, Attribute] | None:
        """The sample ``resource_sample`` would give, when the container's cgroup gives it
        without running the CLI (see ``DockerSandboxProvider.resource_sample_nowait``)."""
        return self._usage.sample_nowait(_container_name(handle))

    def release(self, handle: SandboxHandle) -> None:
        """Forget the container (called after its final sample)."""
        self._usage.forget(_container_name(handle))

    async def _run(self, *args: str) -> str:
        """The standard output of ``<binary> *args``; ``DockerCliError`` when it fails. A
        cancelled read kills the command."""
        if self._binary is None:
            raise DockerCliError("no docker binary")
        returncode, stdout = await output_of(self._binary, *args)
        if returncode != 0:
            raise DockerCliError(f"docker {args[0]} exited with code {returncode}")
        return stdout.decode("utf-8", "replace")

    async def _inspect(self, name: str) -> dict[str, Any]:
        """The container's inspect answer, read in one batch with the others asked for at
        the same time on this engine (``_engine``)."""
        return await self.engine.inspect(name)

    async def _stats(self, name: str) -> dict[str, Attribute]:
        line = await self._run("stats", "--no-stream", "--format", "{{json .}}", name)
        try:
            stats = json.loads(line.strip().splitlines()[0]) if line.strip() else {}
        except json.JSONDecodeError as exc:
            raise DockerCliError("docker stats printed no JSON") from exc
        return sample_from_cli_stats(stats) if isinstance(stats, dict) else {}
