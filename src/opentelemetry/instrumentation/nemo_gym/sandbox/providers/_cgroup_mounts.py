"""Where this machine's cgroup hierarchies are mounted, and which directory holds a cgroup.

The pure half parses ``/proc/self/mountinfo`` and ``/proc/<pid>/cgroup`` text; the I/O half
reads those two files. Shared by the process provider (which creates cgroups) and the Docker
provider (which reads the cgroup the engine made for a container). The ``mountinfo`` root
field matters when this process sees a cgroup namespace or a bind mount of a sub-tree: a
cgroup path is only reachable under a mount whose root is a prefix of it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

# The v1 controllers whose files the samples and limits read.
CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")
_READ_SIZE = 65536


@dataclass(frozen=True)
class Mount:
    """One mounted cgroup hierarchy: ``root`` is the hierarchy path shown at ``point``."""

    root: str
    point: Path

    def directory(self, cgroup_path: str) -> Path | None:
        """The directory of ``cgroup_path`` (as ``/proc/<pid>/cgroup`` names it) under this
        mount, or ``None`` when the mount does not show that part of the hierarchy.

        A process outside this process's cgroup namespace shows as ``/../..`` paths, which
        no mount here shows: those give ``None`` too, never a directory outside the mount.
        """
        if ".." in cgroup_path.split("/"):
            return None
        root = self.root.rstrip("/")
        if cgroup_path != root and not cgroup_path.startswith(root + "/"):
            return None
        relative = cgroup_path[len(root) :].strip("/")
        return self.point / relative if relative else self.point


@dataclass(frozen=True)
class Mounts:
    """The cgroup v1 hierarchy of each controller we read, and the v2 (unified) one."""

    v1: dict[str, Mount] = field(default_factory=dict)
    v2: Mount | None = None


def _unescape(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text


def parse_mountinfo(text: str) -> Mounts:
    """The cgroup mounts listed in ``mountinfo`` text; the first mount of each wins. Pure."""
    v1: dict[str, Mount] = {}
    v2: Mount | None = None
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        mount_fields, fs_fields = left.split(), right.split()
        if len(mount_fields) < 5 or len(fs_fields) < 3:
            continue
        mount = Mount(_unescape(mount_fields[3]), Path(_unescape(mount_fields[4])))
        if fs_fields[0] == "cgroup":
            for option in fs_fields[2].split(","):
                if option in CONTROLLERS:
                    v1.setdefault(option, mount)
        elif fs_fields[0] == "cgroup2" and v2 is None:
            v2 = mount
    return Mounts(v1, v2)


def parse_proc_cgroup(text: str) -> tuple[dict[str, str], str | None]:
    """``/proc/<pid>/cgroup`` text as (v1 controller → path, v2 path or ``None``). Pure.

    Lines are ``<id>:<controllers>:<path>``; the v2 line is ``0::<path>``. Named v1
    hierarchies (``name=systemd``) and controllers we do not read are left out.
    """
    v1: dict[str, str] = {}
    v2: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
            continue
        for controller in controllers.split(","):
            if controller in CONTROLLERS:
                v1[controller] = path
    return v1, v2


def read_file(path: Path | str) -> str | None:
    """A small kernel file's text, stripped; ``None`` when it cannot be read.

    Plain ``os.read`` calls rather than a file object: a sample reads several of these files,
    and the buffered text layer costs more than the read itself. A read shorter than asked
    is the end: kernel files (seq_file) fill a read until it is full or nothing is left, so
    a small file takes one read, not a second one that returns nothing.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = [os.read(fd, _READ_SIZE)]
        while len(chunks[-1]) == _READ_SIZE:
            chunks.append(os.read(fd, _READ_SIZE))
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace").strip()


def read_mounts() -> Mounts:
    """This process's view of the cgroup mounts (empty where ``/proc`` is unreadable)."""
    return parse_mountinfo(read_file("/proc/self/mountinfo") or "")


def read_proc_cgroup(pid: int) -> tuple[dict[str, str], str | None] | None:
    """The cgroups of process ``pid`` as this process sees them; ``None`` when it is gone or
    its ``/proc`` entry is unreadable."""
    text = read_file(f"/proc/{pid}/cgroup")
    return None if text is None else parse_proc_cgroup(text)


def procs_of(directory: Path) -> set[int]:
    """The PIDs in a cgroup directory's ``cgroup.procs`` (empty when unreadable)."""
    pids: set[int] = set()
    for word in (read_file(directory / "cgroup.procs") or "").split():
        with contextlib.suppress(ValueError):
            pids.add(int(word))
    return pids
