"""Bubblewrap isolation for the process sandbox provider: the holder and the command lines.

A sandbox isolated by bubblewrap (``bwrap``) is first a *holder*: a ``bwrap`` started at
``create`` with new user, PID, mount, IPC and UTS namespaces (and a network namespace unless the
provider has ``network=True``), running ``sleep infinity`` under bwrap's own init, which is
PID 1 of the sandbox and reaps its orphans. Each command then runs in a ``bwrap`` of its own
that joins the holder's user and PID namespaces (``--userns``/``--pidns``) and builds its own
mount namespace from the same recipe. So all of a sandbox's processes share one process table
that shows nothing of the host's: a background process outlives its command, as in a
container, and killing the holder at close ends every one of them (the kernel kills all the
processes of a PID namespace whose init dies). IPC, UTS and network namespaces are made per
command: without ``network=True`` each command has a loopback of its own, and nothing else.

What a command sees (``mounts``): the system directories read-only, the few files of ``/etc``
that programs need to run (each listed with its reason), a fresh ``/proc`` of its own PID
namespace, a minimal ``/dev``, the sandbox directory (read-write, at its host path, so paths
mean the same inside and out), a private ``/tmp`` (a directory of the sandbox's own, kept
across its commands), and any ``read_only_paths`` the provider was given. Not the user's home,
not the server's working directory, not the rest of ``/etc``; the environment is only what the
provider passes (bubblewrap hands its own environment on, and the provider gives it only the
sandbox's). Capabilities are dropped, and ``--disable-userns`` stops a command from making
user namespaces of its own (the kernel interface most container escapes start from).

Never the host's root. The uid a command has inside maps to the uid bubblewrap runs as, and
the kernel lets that uid write whatever files it owns, capabilities or not: run by root, a
command could change the host's kernel settings through ``/proc/sys`` (``kernel.core_pattern``
is code execution as root on the host). So a root server starts every ``bwrap`` as an
unprivileged host uid (``Drop``, through ``setpriv``), which owns the sandbox's directories.
bwrap resolves what it binds as that uid, so every path it binds must be reachable by it
(``unreachable`` names one that is not: a virtualenv under ``/root``, say). And whatever uid
runs, the ``/proc`` files that change the host are bound read-only (``_PROC_READ_ONLY``):
bubblewrap's own cover of ``/proc/sys`` asks the kernel whether the directory is writable,
which a ``/proc/sys`` directory never says, and skips it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxCreateError

__all__ = [
    "SANDBOX_PATH",
    "Drop",
    "Jail",
    "command_argv",
    "drop_for",
    "find_bwrap",
    "mounts",
    "start_jail",
    "stop_jail",
    "unreachable",
]

# PATH inside an isolated sandbox: the host's may name directories it cannot see.
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The system directories, bound read-only; where the host has one as a symlink (merged /usr,
# as on Debian 12: /bin -> usr/bin), the sandbox gets the same symlink.
_SYSTEM_DIRECTORIES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The files of /etc a command needs, and why; bound read-only where the host has them.
_ETC_FOR_COMMANDS = (
    "/etc/ld.so.cache",  # the dynamic linker's index of shared libraries
    "/etc/ld.so.conf",  # ... and where it looks for them
    "/etc/ld.so.conf.d",
    "/etc/alternatives",  # Debian's command links (/usr/bin/awk -> /etc/alternatives/awk)
    "/etc/passwd",  # user and group names for the uid a command runs as (id, ls -l, getpwuid)
    "/etc/group",
    "/etc/nsswitch.conf",  # how the C library looks names up (users, hosts)
    "/etc/localtime",  # the host's time zone, so that dates read the same inside
)
# With the host's network, also what names and TLS need.
_ETC_FOR_NETWORK = (
    "/etc/resolv.conf",  # DNS servers
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/gai.conf",  # address ordering for getaddrinfo
    "/etc/ssl",  # CA certificates for TLS
    "/etc/ca-certificates",
)
# What in /proc changes the host rather than the sandbox, bound read-only (where the kernel has
# it) over the sandbox's fresh /proc.
_PROC_READ_ONLY = (
    "/proc/sys",  # kernel settings: core_pattern and modprobe run programs as root
    "/proc/sysrq-trigger",  # reboot, crash, kill every process
    "/proc/irq",  # interrupt affinity
    "/proc/bus",  # PCI configuration space
    "/proc/fs",  # file system settings (nfsd's exports)
    "/proc/mtrr",  # memory type ranges of the CPUs
    "/proc/acpi",  # wake-up devices
    "/proc/scsi",  # adding and removing SCSI devices
    "/proc/pressure",  # pressure triggers of the whole host
)
_HOSTNAME = "sandbox"
# ioctl(2) on a namespace file descriptor: the user namespace that owns this one (NS_GET_PARENT).
_NS_GET_PARENT = 0xB702
_START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Drop:
    """The unprivileged host uid and gid a root server runs bubblewrap as, and ``setpriv``."""

    setpriv: str
    uid: int
    gid: int

    def argv(self) -> list[str]:
        """The prefix that runs the rest of a command line as this uid, with no groups (and, a
        uid change from root clearing them, no capabilities)."""
        return [
            self.setpriv,
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--",
        ]


def drop_for(uid: int) -> Drop | None:
    """How this process runs bubblewrap: as ``uid`` (and the gid of the same number) when it is
    root, as itself otherwise (``None``). ``SandboxCreateError`` when root has no ``setpriv``."""
    if os.geteuid() != 0:
        return None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxCreateError(
            "a root server runs sandboxes as an unprivileged uid with setpriv, and there is "
            "no 'setpriv' on PATH; install util-linux"
        )
    return Drop(setpriv, uid, uid)


def unreachable(path: str, drop: Drop) -> str | None:
    """The first directory on the way to ``path`` that ``drop``'s uid may not pass (no search
    permission for it; ACLs aside), or ``None`` when it may reach ``path``."""
    directory = Path(os.path.realpath(path))
    for step in (*reversed(directory.parents), directory):
        try:
            info = step.stat()
        except OSError:
            return None  # missing: bwrap names it when it binds
        if step == directory and not stat.S_ISDIR(info.st_mode):
            break  # a file: reaching it is all a bind needs
        if info.st_uid == drop.uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == drop.gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            return str(step)
    return None


def find_bwrap() -> str:
    """The ``bwrap`` program on ``PATH``; ``SandboxCreateError`` in one line when missing."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxCreateError(
            "process sandbox isolation needs bubblewrap: no 'bwrap' on PATH; install it "
            "(apt-get install bubblewrap) or opt into unisolated processes with "
            'ProcessSandboxProvider(isolation="none")'
        )
    return found


@dataclass
class Jail:
    """A sandbox's holder and the namespaces its commands join (file descriptors, open until
    ``stop_jail``: a PID could be reused, a namespace descriptor cannot)."""

    bwrap: str
    drop: Drop | None  # the uid every bwrap of the sandbox runs as, if not this process's
    holder: asyncio.subprocess.Process
    init_pidfd: int  # the sandbox's PID 1
    userns_fd: int  # where bwrap sets a command up (it owns the PID namespace)
    inner_userns_fd: int  # where the command runs: --disable-userns nests one more
    pidns_fd: int

    @property
    def fds(self) -> tuple[int, ...]:
        return (self.userns_fd, self.inner_userns_fd, self.pidns_fd)


def mounts(root: Path, tmp: Path, network: bool, read_only_paths: tuple[str, ...]) -> list[str]:
    """bwrap's mount arguments for a command of the sandbox whose directory is ``root``."""
    args = _system_directories()
    for path in _ETC_FOR_COMMANDS + (_ETC_FOR_NETWORK if network else ()):
        args += ["--ro-bind-try", path, path]
    args += ["--proc", "/proc", *_proc_read_only(), "--dev", "/dev"]
    # Later mounts cover earlier ones: the private /tmp first, then what may lie under /tmp on
    # the host (a virtualenv in read_only_paths, the sandbox directory), so that it shows.
    args += ["--bind", str(tmp), "/tmp"]  # noqa: S108
    for path in read_only_paths:
        args += ["--ro-bind", path, path]
    args += ["--bind", str(root), str(root)]
    return args


def _proc_read_only() -> list[str]:
    """The host-changing files of ``/proc``, bound read-only over the fresh ``/proc`` (from the
    host's: the files are the same, and the sandbox's namespaces choose what they show)."""
    args: list[str] = []
    for path in _PROC_READ_ONLY:
        args += ["--ro-bind-try", path, path]
    return args


def command_argv(
    jail: Jail,
    mount_args: list[str],
    network: bool,
    cwd: Path,
    command: str,
) -> list[str]:
    """The command line that runs ``command`` with ``sh -c`` inside the jail, in ``cwd``.

    No ``--new-session``: the provider starts it in a new session on the host side, which has
    no controlling terminal to inject input into, and keeps the command in the process group
    a timeout kills.

    No ``--die-with-parent`` either. To join the holder's PID namespace bwrap forks an
    intermediate process that exits at once, and the command's parent-death signal is set
    before that exit is certain: on a loaded machine the intermediate exits late and SIGKILLs
    a command that had already run (return code 137 with its whole output, about one exec in
    1,500 beside four CPU hogs). The command needs no signal of its own to end with the
    server: it lives in the holder's PID namespace, whose init dies with the holder, and the
    holder keeps ``--die-with-parent``."""
    return [
        *([] if jail.drop is None else jail.drop.argv()),
        jail.bwrap,
        "--userns",
        str(jail.userns_fd),
        "--userns2",
        str(jail.inner_userns_fd),
        "--pidns",
        str(jail.pidns_fd),
        "--unshare-ipc",
        "--unshare-uts",
        *([] if network else ["--unshare-net"]),
        "--hostname",
        _HOSTNAME,
        "--cap-drop",
        "ALL",
        *mount_args,
        "--chdir",
        str(cwd),
        "--",
        "/bin/sh",
        "-c",
        command,
    ]


async def start_jail(bwrap: str, network: bool, drop: Drop | None) -> Jail:
    """Start a sandbox's holder (as ``drop``'s uid, if given) and open its namespaces;
    ``SandboxCreateError`` with bwrap's own message when it cannot (no user namespaces for
    this user, say)."""
    info_read, info_write = os.pipe()
    argv = [
        *([] if drop is None else drop.argv()),
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        *([] if network else ["--unshare-net"]),
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        *_holder_mounts(),
        "--info-fd",
        str(info_write),
        "--",
        "/bin/sh",
        "-c",
        # The line says that bwrap's setup is over: its init has entered the nested user
        # namespace of --disable-userns by then (not yet when --info-fd is written).
        "echo ready && exec sleep infinity",
    ]
    try:
        holder = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": SANDBOX_PATH},
            start_new_session=True,
            pass_fds=(info_write,),
        )
    except OSError as exc:
        os.close(info_read)
        raise SandboxCreateError(f"bwrap could not be started: {exc}") from exc
    finally:
        os.close(info_write)
    try:
        async with asyncio.timeout(_START_TIMEOUT_S):
            info = await asyncio.to_thread(_read_info, info_read)
            await _wait_ready(holder)
        return _open_namespaces(bwrap, drop, holder, int(str(info["child-pid"])))
    except (Exception, asyncio.CancelledError) as exc:
        await _end_holder(holder)
        if isinstance(exc, asyncio.CancelledError):
            raise
        reason = await _first_error_line(holder)
        raise SandboxCreateError(f"bwrap could not start the sandbox: {reason}") from exc
    finally:
        os.close(info_read)


def _holder_mounts() -> list[str]:
    """The holder only sleeps: the system directories are all it needs."""
    return [*_system_directories(), "--proc", "/proc", *_proc_read_only(), "--dev", "/dev"]


def _system_directories() -> list[str]:
    args: list[str] = []
    for directory in _SYSTEM_DIRECTORIES:
        if os.path.islink(directory):
            args += ["--symlink", os.readlink(directory), directory]
        elif os.path.isdir(directory):
            args += ["--ro-bind", directory, directory]
    return args


def _read_info(fd: int) -> dict[str, object]:
    """bwrap's ``--info-fd`` JSON, read until it parses (bwrap may keep the pipe open)."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
        with contextlib.suppress(ValueError):
            parsed = json.loads(data)
            if isinstance(parsed, dict):
                return parsed
    raise SandboxCreateError("bwrap exited before the sandbox started")


async def _wait_ready(holder: asyncio.subprocess.Process) -> None:
    assert holder.stdout is not None
    if await holder.stdout.readline() != b"ready\n":
        raise SandboxCreateError("bwrap exited before the sandbox started")


def _open_namespaces(
    bwrap: str, drop: Drop | None, holder: asyncio.subprocess.Process, init_pid: int
) -> Jail:
    opened: list[int] = []
    try:
        opened.append(os.pidfd_open(init_pid))
        opened.append(os.open(f"/proc/{init_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
        # The init runs in the nested namespace --disable-userns made; bwrap sets a command
        # up in the one above it, which owns the PID namespace.
        opened.append(fcntl.ioctl(opened[1], _NS_GET_PARENT))
        opened.append(os.open(f"/proc/{init_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        for fd in opened:
            os.close(fd)
        raise
    pidfd, inner, outer, pidns = opened
    os.set_inheritable(outer, False)
    return Jail(bwrap, drop, holder, pidfd, outer, inner, pidns)


async def stop_jail(jail: Jail) -> None:
    """Kill the sandbox's init (every process of its PID namespace dies with it) and the
    holder, wait for the holder, and close the descriptors. Idempotent."""
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(jail.init_pidfd, signal.SIGKILL)
    await _end_holder(jail.holder)
    for fd in (jail.init_pidfd, *jail.fds):
        with contextlib.suppress(OSError):
            os.close(fd)


async def _end_holder(holder: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        holder.kill()
    await holder.wait()


async def _first_error_line(holder: asyncio.subprocess.Process) -> str:
    """bwrap's first line on stderr (it names what failed), or its exit status."""
    text = b""
    if holder.stderr is not None:
        with contextlib.suppress(Exception):
            text = await asyncio.wait_for(holder.stderr.read(4096), 1.0)
    line = text.decode("utf-8", errors="replace").strip().splitlines()
    return line[0] if line else f"bwrap exited with status {holder.returncode}"
