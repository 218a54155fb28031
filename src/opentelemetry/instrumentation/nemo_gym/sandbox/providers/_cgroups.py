"""Cgroup plumbing for the process sandbox provider (and cgroup reading for the Docker one).

Creates and configures one cgroup per sandbox where ``_cgroup_placement`` says they go,
reads back the limits the kernel enforces and the usage it accounts, and removes the cgroup.
Cgroup files are small in-memory kernel files, so they are read and written synchronously,
even from the event loop; only ``remove_cgroup`` is a coroutine, because it waits between
retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import PREFIX, Attribute
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import (
    procs_of,
    read_file,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    MIB,
    SandboxResourceAmounts,
)

logger = logging.getLogger(__name__)

CFS_PERIOD_US = 100_000
# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX pages in bytes (about 2**63).
_V1_UNLIMITED = 1 << 62
_RMDIR_ROUNDS = 200
_MKDIR_ROUNDS = 3
_RMDIR_PAUSE_S = 0.01

# The first process of every command. It writes its own pid into each of the sandbox's
# cgroup.procs files and only then execs the command, so the command and everything it ever
# starts are born inside the cgroups. Writing the pid from the parent after spawning leaves a
# window in which the child can fork (or allocate) outside them; this has none, and needs no
# preexec_fn (unsafe with threads). The command may be bwrap, whose sandboxed child is then
# born inside too. If joining fails the command does not run: exit 125.
# Arguments: $1 the number of cgroup.procs paths, those paths, then the command's argv.
JOIN_SCRIPT = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ >"$1" || exit 125; shift; n=$((n-1)); done; '
    'exec "$@"'
)


def joining(cgroup: Cgroup | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run so that it starts inside ``cgroup`` (as it is, without one)."""
    if cgroup is None:
        return list(argv)
    procs = [str(d / "cgroup.procs") for d in cgroup.unique_dirs()]
    return ["/bin/sh", "-c", JOIN_SCRIPT, "nemo-gym-sandbox", str(len(procs)), *procs, *argv]


def _read_int(path: Path | str | None) -> int | None:
    text = None if path is None else read_file(path)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def _read_keyed(path: Path | str | None) -> dict[str, int]:
    """``key value`` lines (cpu.stat, memory.events, memory.oom_control) as a dict."""
    values: dict[str, int] = {}
    for line in ((None if path is None else read_file(path)) or "").splitlines():
        name, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            values[name] = int(value)
    return values


def write_text(path: Path, value: str) -> None:
    path.write_text(value)


# --- cgroups --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where a provider makes its sandboxes' cgroups (``_cgroup_placement`` decides).

    ``bases`` maps each controller's hierarchy (v1), or ``""`` (v2), to the directory under
    which ``<parent>/<sandbox id>`` are made; ``path`` is that directory's cgroup path as
    ``/proc/self/cgroup`` spells it (the memory hierarchy's on v1), the prefix of every
    sandbox cgroup's designator.
    """

    version: int
    bases: dict[str, Path]
    path: str = "/"


@dataclass
class Cgroup:
    """One sandbox's cgroup: a directory per v1 controller, or one v2 directory."""

    version: int
    dirs: dict[str, Path]  # controller ("" for v2) -> directory
    # Its cgroup path as /proc/<pid>/cgroup spells it, e.g. "/system.slice/gym.service/
    # nemo_gym/process-1a2b"; on v1, the memory hierarchy's (others may differ above the base).
    path: str

    def file(self, controller: str, name: str) -> Path:
        return self.dirs["" if self.version == 2 else controller] / name

    @property
    def source(self) -> str:
        """The ``usage.source`` of its samples: ``cgroup.v1`` or ``cgroup.v2``."""
        return f"cgroup.v{self.version}"

    @functools.cached_property
    def usage_files(self) -> dict[str, str | None]:
        """The files a usage sample reads, by role, as path strings made once (a sample is
        taken every interval, and joining paths costs more than reading a kernel file);
        ``None`` where the controller is not there."""
        if self.version == 1:
            names = {
                "memory": ("memory", "memory.usage_in_bytes"),
                "peak": ("memory", "memory.max_usage_in_bytes"),
                "oom": ("memory", "memory.oom_control"),
                "cpu.stat": ("cpu", "cpu.stat"),
                "cpu.usage": ("cpuacct", "cpuacct.usage"),
                "pids": ("pids", "pids.current"),
            }
        else:
            names = {
                "memory": ("memory", "memory.current"),
                "peak": ("memory", "memory.peak"),
                "oom": ("memory", "memory.events"),
                "cpu.stat": ("cpu", "cpu.stat"),
                "cpu.usage": ("cpu", "cpu.stat"),
                "pids": ("pids", "pids.current"),
            }
        return {
            role: str(self.file(controller, name)) if self.has(controller) else None
            for role, (controller, name) in names.items()
        }

    def has(self, controller: str) -> bool:
        return self.version == 2 or controller in self.dirs

    def unique_dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))


def enable_v2_controllers(directory: Path, wanted: Sequence[str]) -> None:
    """Give ``directory``'s children the ``wanted`` controllers (v2 ``cgroup.subtree_control``);
    raises ``OSError`` (``EBUSY`` when it holds processes and is not the root)."""
    enabled = set((read_file(directory / "cgroup.subtree_control") or "").split())
    missing = [c for c in wanted if c not in enabled]
    if missing:
        write_text(directory / "cgroup.subtree_control", " ".join("+" + c for c in missing))


def _make_beneath_parent(directory: Path) -> None:
    """``mkdir`` of ``directory`` and, when missing, of its parent. The parent is shared with
    every provider of the same name in the same cgroup, and another one's ``aclose`` removes
    it once it is empty, possibly between the two calls: then it is made again."""
    for _ in range(_MKDIR_ROUNDS - 1):
        directory.parent.mkdir(exist_ok=True)
        try:
            directory.mkdir()
        except FileNotFoundError:
            continue
        return
    directory.parent.mkdir(exist_ok=True)
    directory.mkdir()


def make_cgroup(
    layout: Layout,
    parent: str,
    name: str,
    cpu: float | None,
    memory_mib: int | None,
    pids: int | None = None,
) -> Cgroup:
    """Create and configure a sandbox cgroup at ``<base>/<parent>/<name>`` in each of the
    layout's hierarchies; raises ``OSError`` after removing what it made. ``pids`` caps its
    processes and threads where the pids controller is there."""
    path = f"{layout.path.rstrip('/')}/{parent}/{name}"
    dirs = {c: base / parent / name for c, base in layout.bases.items()}
    cgroup = Cgroup(layout.version, dirs, path)
    created: list[Path] = []
    try:
        if layout.version == 2:
            base = layout.bases[""]
            available = (read_file(base / "cgroup.controllers") or "").split()
            wanted = [c for c in ("cpu", "memory", "pids") if c in available]
            enable_v2_controllers(base, wanted)
            (base / parent).mkdir(exist_ok=True)
            enable_v2_controllers(base / parent, wanted)
        for directory in cgroup.unique_dirs():
            _make_beneath_parent(directory)
            created.append(directory)
        if cpu is not None:
            quota = max(1000, round(cpu * CFS_PERIOD_US))
            if layout.version == 1:
                write_text(cgroup.file("cpu", "cpu.cfs_period_us"), str(CFS_PERIOD_US))
                write_text(cgroup.file("cpu", "cpu.cfs_quota_us"), str(quota))
            else:
                write_text(cgroup.file("cpu", "cpu.max"), f"{quota} {CFS_PERIOD_US}")
        if memory_mib is not None:
            limit = str(memory_mib * MIB)
            if layout.version == 1:
                write_text(cgroup.file("memory", "memory.limit_in_bytes"), limit)
                # memory+swap capped at the same figure: the limit bites instead of swapping.
                memsw = cgroup.file("memory", "memory.memsw.limit_in_bytes")
                if memsw.exists():
                    write_text(memsw, limit)
            else:
                write_text(cgroup.file("memory", "memory.max"), limit)
                swap = cgroup.file("memory", "memory.swap.max")
                if swap.exists():
                    write_text(swap, "0")
        if pids is not None and cgroup.has("pids"):
            write_text(cgroup.file("pids", "pids.max"), str(pids))
    except OSError:
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    return cgroup


def cgroup_pids(cgroup: Cgroup) -> set[int]:
    """The PIDs in any of the cgroup's directories."""
    pids: set[int] = set()
    for directory in cgroup.unique_dirs():
        pids |= procs_of(directory)
    return pids


def cgroup_limits(cgroup: Cgroup) -> SandboxResourceAmounts:
    """The cpu and memory limits the kernel enforces on ``cgroup``, read back from it."""
    cpu: float | None = None
    memory_mib: int | None = None
    if cgroup.version == 1:
        quota = _read_int(cgroup.file("cpu", "cpu.cfs_quota_us"))
        period = _read_int(cgroup.file("cpu", "cpu.cfs_period_us"))
        if quota is not None and quota > 0 and period:
            cpu = quota / period
        limit = _read_int(cgroup.file("memory", "memory.limit_in_bytes"))
        if limit is not None and limit < _V1_UNLIMITED:
            memory_mib = limit // MIB
    else:
        # cpu.max is "<quota> <period>" or "max <period>"; memory.max is "<bytes>" or "max".
        quota_text, _, period_text = (read_file(cgroup.file("cpu", "cpu.max")) or "max").partition(
            " "
        )
        if quota_text.isdigit() and period_text.isdigit() and int(period_text) > 0:
            cpu = int(quota_text) / int(period_text)
        limit_text = read_file(cgroup.file("memory", "memory.max")) or "max"
        if limit_text.isdigit():
            memory_mib = int(limit_text) // MIB
    return SandboxResourceAmounts(cpu=cpu, memory_mib=memory_mib)


def pids_limit(cgroup: Cgroup) -> int | None:
    """The most processes the kernel lets ``cgroup`` hold, read back; ``None`` for none."""
    return _read_int(cgroup.file("pids", "pids.max")) if cgroup.has("pids") else None


def oom_kills(cgroup: Cgroup | None) -> int | None:
    if cgroup is None:
        return None
    return _read_keyed(cgroup.usage_files["oom"]).get("oom_kill")


def memory_bytes(cgroup: Cgroup) -> int | None:
    """The cgroup's memory usage in bytes; ``None`` when it cannot be read (see
    ``cgroup_usage``)."""
    return _read_int(cgroup.usage_files["memory"])


def cgroup_usage(cgroup: Cgroup) -> dict[str, float | int] | None:
    """What the kernel accounts for ``cgroup``, by quantity (``cpu.time_s``,
    ``cpu.throttled_s``, ``cpu.throttled_periods``, ``memory_mib``, ``memory_peak_mib``,
    ``oom_kills``, ``pids``); a figure the kernel does not offer is left out. ``None`` when
    the memory usage cannot be read: the cgroup is gone (its processes ended and it was
    removed) or this process may not read it.

    OOM kills: v2 ``memory.events`` ``oom_kill`` counts kills in the cgroup and its
    descendants; v1 ``memory.oom_control`` ``oom_kill`` (Linux 4.13+) counts kills charged to
    this memory cgroup; older v1 kernels offer no count, and the figure is left out.
    """
    files = cgroup.usage_files
    memory = _read_int(files["memory"])
    if memory is None:
        return None
    cpu_stat = _read_keyed(files["cpu.stat"])
    if cgroup.version == 1:
        cpu_ns = _read_int(files["cpu.usage"])
        cpu_s = None if cpu_ns is None else cpu_ns / 1e9
        throttled = cpu_stat.get("throttled_time")
        throttled_s = None if throttled is None else throttled / 1e9
    else:
        usage_us = cpu_stat.get("usage_usec")
        cpu_s = None if usage_us is None else usage_us / 1e6
        throttled = cpu_stat.get("throttled_usec")
        throttled_s = None if throttled is None else throttled / 1e6
    peak = _read_int(files["peak"])
    values: dict[str, float | int | None] = {
        "cpu.time_s": None if cpu_s is None else round(cpu_s, 6),
        "cpu.throttled_s": None if throttled_s is None else round(throttled_s, 6),
        "cpu.throttled_periods": cpu_stat.get("nr_throttled"),
        "memory_mib": round(memory / MIB, 3),
        "memory_peak_mib": None if peak is None else round(peak / MIB, 3),
        "oom_kills": _read_keyed(files["oom"]).get("oom_kill"),
        "pids": (
            _read_int(files["pids"]) if files["pids"] is not None else len(cgroup_pids(cgroup))
        ),
    }
    return {k: v for k, v in values.items() if v is not None}


def cgroup_sample(cgroup: Cgroup) -> dict[str, Attribute]:
    """``cgroup_usage`` as sample attributes under ``PREFIX``, with ``usage.source``."""
    usage = PREFIX + "usage."
    sample: dict[str, Attribute] = {usage + "source": cgroup.source}
    sample.update({usage + k: v for k, v in (cgroup_usage(cgroup) or {}).items()})
    return sample


async def remove_cgroup(cgroup: Cgroup) -> None:
    # A killed process leaves its cgroup a moment after it dies: retry a busy rmdir briefly.
    for directory in cgroup.unique_dirs():
        for _ in range(_RMDIR_ROUNDS):
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    logger.warning("cannot remove cgroup %s: %s", directory, exc)
                    break
                await asyncio.sleep(_RMDIR_PAUSE_S)
        else:
            logger.warning("cgroup %s stayed busy; left in place", directory)
