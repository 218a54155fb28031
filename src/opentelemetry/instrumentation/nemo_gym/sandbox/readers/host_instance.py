"""The resource reader of NeMo Gym's ``apptainer`` and ``enroot`` providers: host processes.

Their sandboxes are processes on this host. An instance is found from one process of it, its
init (``enroot``: the provider's ``handle.raw.container_pid``; ``apptainer``: the ``pid`` that
``<binary> instance list --json`` gives for ``handle.raw.name``), and is every host process
in the init's mount namespace: commands the provider runs into it (``enroot exec <pid>``,
``apptainer exec instance://<name>``) join that namespace without descending from the init,
and no other process is in it.

* Where the init sits in a cgroup that holds nothing but the instance's processes (the one
  the runtime makes for ``--cpus``/``--memory``, or the batch system's per-job one), the
  allocation is that cgroup's limits (``<runtime>.cgroup``, designated by the cgroup) and
  samples are the cgroup's, with OOM kills (``usage.source`` ``cgroup.vN``), read with the
  process provider's cgroup code.
* Elsewhere the allocation is the init process with no limit (``<runtime>.proc``: nothing
  on this host enforces one on the instance alone), and a sample sums the instance's
  processes in the ``/proc`` process table (one scan per tick for all of a provider's
  instances, the process provider's ``ProcScan``) (``usage.source`` ``proc``: CPU time and memory
  of the processes alive at the sample, no OOM count).

The init and its cgroup are looked for at the allocation read (and at the first sample, if it
comes first); a sandbox is forgotten on ``release``.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    PREFIX,
    Attribute,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import (
    procs_of,
    read_file,
    read_mounts,
    read_proc_cgroup,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroups import (
    Cgroup,
    cgroup_limits,
    cgroup_sample,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._container_cgroup import (
    cgroup_of_paths,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._proc_scan import ProcScan
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import MIB, SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.readers._cli import output_of, provider_binary

__all__ = ["COMPONENT", "HostInstanceReader", "apptainer_reader", "enroot_reader"]

COMPONENT = "instance"


class InstanceGoneError(RuntimeError):
    """The instance's init process is not (or no longer) on this host."""


def mount_namespace(pid: int) -> str | None:
    """``/proc/<pid>/ns/mnt``'s target (``mnt:[<inode>]``); ``None`` when unreadable."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def instance_pids(namespace: str, candidates: list[int]) -> set[int]:
    """The ``candidates`` in mount namespace ``namespace``."""
    return {pid for pid in candidates if mount_namespace(pid) == namespace}


def own_cgroup(pid: int, namespace: str) -> Cgroup | None:
    """The cgroup of ``pid`` when it holds only processes of ``namespace`` (so its limits and
    accounting are the instance's alone); else ``None``."""
    paths = read_proc_cgroup(pid)
    if paths is None:
        return None
    cgroup = cgroup_of_paths(read_mounts(), *paths, None)
    if cgroup is None or cgroup.path.strip("/") == "":
        return None
    members = procs_of(cgroup.dirs["memory" if cgroup.version == 1 else ""])
    if pid not in members or instance_pids(namespace, sorted(members)) != members:
        return None
    return cgroup


class HostInstanceReader:
    """Allocation and usage of one provider's host-process instances (see the module).

    ``find_init`` gives the host PID of a sandbox's init, or ``None`` when it has none.
    Reads only; ``/proc`` and cgroup files are small kernel files read on the event loop.
    """

    periodic = True

    def __init__(
        self, runtime: str, find_init: Callable[[SandboxHandle], Awaitable[int | None]]
    ) -> None:
        self._runtime = runtime
        self._find_init = find_init
        self._known: dict[str, tuple[int, str, Cgroup | None]] = {}
        # Samples without a cgroup share one /proc scan per tick, as the process provider's.
        self._proc_scan = ProcScan()
        self._boot_id = read_file("/proc/sys/kernel/random/boot_id") or None
        hostname = socket.gethostname()
        self._host = ResourceDesignator("host", hostname) if hostname else None

    async def _instance(self, handle: SandboxHandle, fresh: bool) -> tuple[int, str, Cgroup | None]:
        """The sandbox's init PID, mount namespace and own cgroup (``fresh``: look again)."""
        key = str(handle.sandbox_id)
        known = self._known.get(key)
        if known is not None and not fresh:
            return known
        pid = known[0] if known is not None else await self._find_init(handle)
        namespace = None if pid is None else mount_namespace(pid)
        if pid is None or namespace is None:
            raise InstanceGoneError(f"{self._runtime} instance {key}: no init process here")
        found = (pid, namespace, own_cgroup(pid, namespace))
        self._known[key] = found
        return found

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        """The limits of the instance's own cgroup; without one, its init and no limit."""
        pid, _, cgroup = await self._instance(handle, fresh=True)
        if cgroup is None:
            return ResourceAllocation(
                source=f"{self._runtime}.proc",
                components=(ComponentAllocation(COMPONENT),),
                designator=ResourceDesignator("process", str(pid), self._boot_id),
                host=self._host,
            )
        return ResourceAllocation(
            source=f"{self._runtime}.cgroup",
            components=(ComponentAllocation(COMPONENT, limits=cgroup_limits(cgroup)),),
            designator=ResourceDesignator("cgroup", cgroup.path, self._boot_id),
            host=self._host,
        )

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        """The instance's cgroup sample, else the sum over its processes in ``/proc``."""
        _, namespace, cgroup = await self._instance(handle, fresh=False)
        if cgroup is not None:
            return cgroup_sample(cgroup)
        sessions = await self._proc_scan.sessions()
        rows = [row for session in sessions.values() for row in session]
        members = instance_pids(namespace, [row[0] for row in rows])
        if not members:
            name = handle.sandbox_id
            raise InstanceGoneError(f"{self._runtime} instance {name}: no process left")
        mine = [row for row in rows if row[0] in members]
        usage = PREFIX + "usage."
        return {
            usage + "source": "proc",
            usage + "cpu.time_s": round(sum(row[3] for row in mine), 6),
            usage + "memory_mib": sum(row[4] for row in mine) / MIB,
            usage + "pids": len(mine),
        }

    def release(self, handle: SandboxHandle) -> None:
        """Forget the sandbox (called after its final sample)."""
        self._known.pop(str(handle.sandbox_id), None)


async def _enroot_init(handle: SandboxHandle) -> int | None:
    pid = getattr(getattr(handle, "raw", None), "container_pid", None)
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def enroot_reader(provider: object) -> HostInstanceReader:
    """The reader of NeMo Gym's ``EnrootProvider``: the init is ``handle.raw.container_pid``."""
    return HostInstanceReader("enroot", _enroot_init)


def apptainer_reader(provider: object) -> HostInstanceReader:
    """The reader of NeMo Gym's ``ApptainerProvider``: the init is the instance's ``pid`` in
    ``<binary> instance list --json``."""
    binary = provider_binary(provider, "apptainer")

    async def find_init(handle: SandboxHandle) -> int | None:
        name = getattr(getattr(handle, "raw", None), "name", None) or str(handle.sandbox_id)
        if binary is None:
            return None
        _, listing = await output_of(binary, "instance", "list", "--json")
        return _pid_of(listing, name)

    return HostInstanceReader("apptainer", find_init)


def _pid_of(listing: bytes, name: str) -> int | None:
    """The ``pid`` of instance ``name`` in ``apptainer instance list --json`` output."""
    try:
        answer: Any = json.loads(listing or b"{}")
    except json.JSONDecodeError:
        return None
    for entry in answer.get("instances") or () if isinstance(answer, dict) else ():
        if isinstance(entry, dict) and entry.get("instance") == name:
            pid = entry.get("pid")
            if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
                return pid
    return None
