"""Where the process provider makes its sandboxes' cgroups: inside the server's own cgroup.

A cgroup's limits hold for everything beneath it. A sandbox cgroup made under the server's own
cgroup (``/proc/self/cgroup``) therefore counts against whatever bounds the server: the memory
limit Kubernetes, Slurm or systemd set on it holds for the server and its sandboxes together.
One made at the root of the hierarchy escapes it (a server held to 256 MiB made a sandbox that
allocated 400 MiB).

The *base*, the cgroup under which ``<cgroup_parent>/<sandbox id>`` are made, is the cgroup
that ``OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT`` names when it is set (the operator answers
for its bounds), else the server's own cgroup: on v1 in each controller's hierarchy (the paths
may differ: the memory cgroup of a Kubernetes container, ``/`` for cpu), on v2 the one path.

cgroup v2 has one more rule: a cgroup other than the root that holds processes cannot give its
children any controller ("no internal processes"). The server's own cgroup holds the server,
so to nest there this process, and only it, first moves into a leaf child,
``<base>/nemo_gym_server``, which is still beneath every limit on the base; then the base's
children get ``cpu``, ``memory`` and ``pids``. That is what systemd does for a delegated unit
(``DelegateSubgroup=``). It happens only when this process is alone in the base: a process
somebody else placed (a shell, a container's init, another server) is never moved. When the
base holds others, sandboxes get no cgroup of their own: their processes stay in the server's
cgroup, bounded by its limits but without limits of their own, and a warning says so. A later
provider in the same process (or a child process) finds itself in ``nemo_gym_server`` and
uses the base its first provider prepared.

``plan_layout`` is pure (mount and ``/proc/<pid>/cgroup`` facts in, directories out);
``prepare_layout`` checks and readies those directories; ``discover_layout`` reads this
process's facts, tries the named base, then the own one, and logs why it settles.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym.environment_variables import (
    OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import (
    Mounts,
    procs_of,
    read_file,
    read_mounts,
    read_proc_cgroup,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroups import (
    Layout,
    enable_v2_controllers,
    write_text,
)

__all__ = ["SERVER_LEAF", "PlacementError", "discover_layout", "plan_layout", "prepare_layout"]

logger = logging.getLogger(__name__)

# The leaf a server moves itself into on v2 so that its own cgroup can have sandbox children.
SERVER_LEAF = "nemo_gym_server"
# Without these the sandbox cgroups would enforce nothing that was asked.
_REQUIRED = ("cpu", "memory")
_V2_CONTROLLERS = ("cpu", "memory", "pids")


class PlacementError(Exception):
    """Sandbox cgroups cannot go where they should; the message says where and why."""


class UnavailableError(PlacementError):
    """This process has no cgroups to make at all (none mounted, or none writable to it): the
    usual case without root, not worth a warning."""


def plan_layout(
    mounts: Mounts, own_v1: dict[str, str], own_v2: str | None, named: str | None
) -> Layout:
    """Where sandbox cgroups go: under cgroup ``named`` (a path as ``/proc/<pid>/cgroup``
    spells it) or, when it is ``None``, under the process's own cgroups ``own_v1``/``own_v2``.

    v1 when the cpu and memory hierarchies are mounted (a hybrid machine binds them to v1 and
    leaves its v2 hierarchy without them), else v2. A v1 hierarchy other than cpu's and
    memory's that does not show the path is left out (its controller stays the server's). On
    v2 a process in ``<base>/nemo_gym_server`` has ``<base>`` as its own base. Pure; raises
    ``PlacementError`` (``UnavailableError`` when nothing is mounted).
    """
    if "cpu" in mounts.v1 and "memory" in mounts.v1:
        bases: dict[str, Path] = {}
        for controller, mount in sorted(mounts.v1.items()):
            path = named if named is not None else own_v1.get(controller)
            directory = None if path is None else mount.directory(path)
            if directory is not None:
                bases[controller] = directory
            elif controller in _REQUIRED:
                raise PlacementError(
                    f"the {controller} hierarchy mounted at {mount.point} (root {mount.root}) "
                    f"does not show cgroup {path}"
                )
        path = named if named is not None else own_v1["memory"]
        return Layout(1, bases, path)
    if mounts.v2 is None:
        raise UnavailableError("no cgroup hierarchy with the cpu and memory controllers")
    path = named if named is not None else own_v2
    if path is None:
        raise PlacementError("/proc/self/cgroup has no cgroup v2 line")
    if named is None and path.rstrip("/").endswith("/" + SERVER_LEAF):
        path = path.rstrip("/").rpartition("/")[0] or "/"
    directory = mounts.v2.directory(path)
    if directory is None:
        raise PlacementError(
            f"the cgroup v2 hierarchy mounted at {mounts.v2.point} (root {mounts.v2.root}) "
            f"does not show cgroup {path}"
        )
    return Layout(2, {"": directory}, path)


def prepare_layout(layout: Layout, pid: int) -> Layout:
    """Check that ``layout``'s bases are cgroups this process may write, and make a v2 base
    able to have controllers in its children (moving process ``pid`` into ``nemo_gym_server``
    when it is alone there; see the module). Returns the layout, without the v1 hierarchies
    beyond cpu and memory whose base is missing or not writable (those controllers stay the
    server's); raises ``PlacementError`` saying why not. Writes to cgroupfs; never moves
    another process."""
    bases = dict(layout.bases)
    for controller, directory in layout.bases.items():
        required = controller in _REQUIRED or layout.version == 2
        if not (directory / "cgroup.procs").is_file():
            if required:
                raise PlacementError(f"{directory} is not a cgroup (or does not exist)")
            del bases[controller]
        elif not os.access(directory, os.W_OK):
            if required:
                raise UnavailableError(f"{directory} is not writable by this process")
            del bases[controller]
    if layout.version == 1:
        return Layout(1, bases, layout.path)
    base = bases[""]
    available = (read_file(base / "cgroup.controllers") or "").split()
    missing = [c for c in _REQUIRED if c not in available]
    if missing:
        raise PlacementError(
            f"{base} offers no {' or '.join(missing)} controller to its children "
            f"(cgroup.controllers: {' '.join(available) or 'none'})"
        )
    wanted = [c for c in _V2_CONTROLLERS if c in available]
    enabled = (read_file(base / "cgroup.subtree_control") or "").split()
    if all(c in enabled for c in wanted):
        return layout
    # The hierarchy's root, the one cgroup exempt from "no internal processes", is the one
    # without a cgroup.type file (a cgroup namespace's root is not the real root: it has one).
    if (base / "cgroup.type").exists():
        procs = procs_of(base)
        others = sorted(procs - {pid})
        if others:
            shown = " ".join(map(str, others[:5])) + (" ..." if len(others) > 5 else "")
            raise PlacementError(
                f"cgroup v2 {layout.path} holds processes other than this server ({shown}), "
                "and a v2 cgroup with processes cannot give controllers to sandbox cgroups "
                "beneath it; run the server in a cgroup of its own (systemd-run --scope -p "
                "Delegate=yes, or a container of its own) or name a prepared cgroup in "
                f"{OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT}"
            )
        if pid in procs:
            _move_into_leaf(base, pid)
    try:
        enable_v2_controllers(base, wanted)
    except OSError as exc:
        raise PlacementError(f"cannot enable {' '.join(wanted)} in {base}: {exc}") from exc
    return layout


def _move_into_leaf(base: Path, pid: int) -> None:
    leaf = base / SERVER_LEAF
    try:
        leaf.mkdir(exist_ok=True)
        write_text(leaf / "cgroup.procs", str(pid))
    except OSError as exc:
        raise PlacementError(f"cannot move this server into {leaf}: {exc}") from exc
    logger.info(
        "moved this server (pid %d) into its cgroup's child %s, so that sandbox cgroups can "
        "nest beneath its cgroup (cgroup v2: a cgroup with processes has no controllers for "
        "its children); it stays beneath every limit set on %s",
        pid,
        leaf,
        base,
    )


def discover_layout(named: str | None) -> Layout | None:
    """Where this process's sandbox cgroups go, prepared; ``None`` when they cannot be made.

    ``named`` (the value of ``OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT``) first: when it
    does not do, one warning naming the variable and the value, and the server's own cgroup
    is tried. Without cgroups the reason is logged (a warning when cgroups are there but the
    sandboxes cannot nest under the server; debug when this process has none to write).
    """
    pid = os.getpid()
    own = read_proc_cgroup(pid)
    if own is None:
        logger.debug("sandbox cgroups off: /proc/%d/cgroup is unreadable", pid)
        return None
    mounts = read_mounts()
    if named is not None:
        try:
            return prepare_layout(plan_layout(mounts, *own, named), pid)
        except PlacementError as exc:
            logger.warning(
                "%s=%s cannot hold sandbox cgroups: %s; they go under this server's own "
                "cgroup instead",
                OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT,
                named,
                exc,
            )
    try:
        return prepare_layout(plan_layout(mounts, *own, None), pid)
    except UnavailableError as exc:
        logger.debug("sandbox cgroups off: %s", exc)
    except PlacementError as exc:
        logger.warning(
            "sandboxes get no cgroup of their own (their processes stay in this server's "
            "cgroup, bounded by its limits; the CPU, memory and pids they ask for are not "
            "enforced): %s",
            exc,
        )
    return None
