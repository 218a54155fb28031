"""Find the cgroup a container engine made for a container, when this host can read it.

Given the PID the engine reports for the container's first process (``State.Pid``), the
cgroup is the one ``/proc/<pid>/cgroup`` names, under this process's cgroup mounts. It is
accepted only when every check passes, so that a PID from another machine or another PID
namespace (a remote engine, an engine in a container of its own) can never point at an
unrelated cgroup:

* the PID is visible here and its cgroup path names the container (engines put the
  container ID in it: ``/docker/<id>``, ``/libpod_parent/libpod-<id>``,
  ``/system.slice/docker-<id>.scope``, ``.../libpod-<id>.scope/container``);
* the directory lists the PID in ``cgroup.procs``;
* its memory usage is readable (a rootless engine's cgroups may not be, to us).

Layouts: cgroup v1 (a hierarchy per controller; ``cpu``, ``cpuacct``, ``memory``, ``pids``
used where present), v2 (one directory), and hybrid (v1 controllers beside a v2 hierarchy
without them: v1 wins when it has ``memory``, as in ``_cgroup_placement.plan_layout``).
"""

from __future__ import annotations

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import (
    Mounts,
    procs_of,
    read_mounts,
    read_proc_cgroup,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroups import (
    Cgroup,
    memory_bytes,
)

__all__ = ["cgroup_of_paths", "container_cgroup"]


def cgroup_of_paths(
    mounts: Mounts, v1_paths: dict[str, str], v2_path: str | None, container_id: str | None
) -> Cgroup | None:
    """The container's cgroup directories from a process's cgroup paths, or ``None`` when
    they do not name ``container_id`` or no mount here shows them. Pure (no file access).
    ``container_id=None`` names no container: the process's own cgroup, whatever its path
    (the caller checks whose it is)."""
    if container_id == "":
        return None
    if container_id is None:
        container_id = "/"  # in every cgroup path
    if "memory" in v1_paths and "memory" in mounts.v1:
        dirs = {}
        for controller, path in v1_paths.items():
            mount = mounts.v1.get(controller)
            if mount is None:
                continue
            if container_id not in path:
                return None
            directory = mount.directory(path)
            if directory is None:
                return None
            dirs[controller] = directory
        return Cgroup(1, dirs, v1_paths["memory"])
    if v2_path is not None and mounts.v2 is not None and container_id in v2_path:
        directory = mounts.v2.directory(v2_path)
        return None if directory is None else Cgroup(2, {"": directory}, v2_path)
    return None


def container_cgroup(pid: object, container_id: str, mounts: Mounts | None = None) -> Cgroup | None:
    """The readable cgroup of the container whose first process is ``pid`` (the engine's
    ``State.Pid``), or ``None`` (see the module's checks). Reads a few small ``/proc`` and
    cgroup files; never raises for a missing or odd ``pid``."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    paths = read_proc_cgroup(pid)
    if paths is None:
        return None
    cgroup = cgroup_of_paths(mounts or read_mounts(), *paths, container_id)
    if cgroup is None:
        return None
    if pid not in procs_of(cgroup.dirs["memory" if cgroup.version == 1 else ""]):
        return None
    # The one figure without which cgroup_usage gives no sample at all.
    return cgroup if memory_bytes(cgroup) is not None else None
