"""A process sandbox's state, and the helpers ``ProcessSandboxProvider`` runs it with.

The checks of the provider's options and of a spec, and those that keep paths and
environments inside a sandbox (raising ``ValueError`` naming the field), the sandbox
directory, running a command and collecting its result, and killing, reaping and reading the
output of its commands' processes. No provider logic: that is ``process``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym.sandbox._attributes import _resources_of
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import _cgroups
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._bwrap import Jail
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._proc_scan import proc_table
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    EXEC_TIMEOUT_RETURN_CODE,
    SandboxCreateError,
    SandboxExecResult,
    SandboxResources,
    SandboxSpec,
)

logger = logging.getLogger(__name__)

_MIN_CPU = 0.01  # the kernel refuses a CFS quota below 1 ms per period
# After a command's exit, what its pipes hold is read in at most this many reads of this size.
_DRAIN_READS = 64
_READ_SIZE = 1 << 16
_KILL_ROUNDS = 200
_KILL_PAUSE_S = 0.01

# --- sandboxes --------------------------------------------------------------------------------


@dataclass
class Sandbox:
    """A sandbox's state; it lives in ``SandboxHandle.raw`` and in the provider's table."""

    sandbox_id: str
    root: Path
    workdir: Path
    env: dict[str, str]
    cgroup: _cgroups.Cgroup | None
    isolation: str  # "bwrap" or "none"
    jail: Jail | None = None  # with bwrap: the holder whose namespaces commands join
    tmp: Path | None = None  # with bwrap: the directory each command sees as /tmp
    # With bwrap under a root server: the (uid, gid) commands run as, owner of all they write.
    owner: tuple[int, int] | None = None
    # With bwrap and disk_gib, where this process may mount: the tmpfs holding root and tmp.
    disk: Path | None = None
    sessions: set[int] = field(default_factory=set)  # one session (and group) per command
    closed: bool = False
    # /proc sampling without a cgroup: last CPU seconds per (pid, start time), and peak RSS.
    proc_cpu: dict[tuple[int, int], float] = field(default_factory=dict)
    proc_peak_mib: float = 0.0


ISOLATIONS = ("bwrap", "none")


def check_options(
    *,
    isolation: object,
    network: object,
    read_only_paths: object,
    cgroups: object,
    pids_limit: object,
    cgroup_parent: object,
    base_dir: object,
    max_output_bytes: object,
    sandbox_uid: object,
) -> tuple[str, ...]:
    """Check ``ProcessSandboxProvider``'s options (they may come from a NeMo Gym config, so
    types too), raising ``ValueError`` naming the option and the value; returns
    ``read_only_paths`` as a tuple."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation={isolation!r} must be 'bwrap' or 'none'")
    if not isinstance(network, bool):
        raise ValueError(f"network={network!r} must be true or false")  # noqa: TRY004
    if isinstance(read_only_paths, str) or not isinstance(read_only_paths, list | tuple):
        raise ValueError(  # noqa: TRY004
            f"read_only_paths={read_only_paths!r} must be a list of absolute paths"
        )
    for path in read_only_paths:
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
            raise ValueError(f"read_only_paths entry {path!r} must be an absolute path")
    if not isinstance(cgroups, bool):
        raise ValueError(f"cgroups={cgroups!r} must be true or false")  # noqa: TRY004
    if pids_limit is not None and (
        isinstance(pids_limit, bool) or not isinstance(pids_limit, int) or pids_limit < 1
    ):
        raise ValueError(f"pids_limit={pids_limit!r} must be a positive integer or None")
    if not isinstance(cgroup_parent, str):
        raise ValueError(f"cgroup_parent={cgroup_parent!r} must be a string")  # noqa: TRY004
    if base_dir is not None and not isinstance(base_dir, str | os.PathLike):
        raise ValueError(f"base_dir={base_dir!r} must be a path or None")
    if not cgroup_parent or "/" in cgroup_parent or cgroup_parent in (".", ".."):
        raise ValueError(f"cgroup_parent={cgroup_parent!r} must be one directory name")
    if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int):
        raise ValueError(f"max_output_bytes={max_output_bytes!r} must be an integer")  # noqa: TRY004
    if max_output_bytes < 0:
        raise ValueError(f"max_output_bytes={max_output_bytes!r} must not be negative")
    if isinstance(sandbox_uid, bool) or not isinstance(sandbox_uid, int) or sandbox_uid < 1:
        raise ValueError(f"sandbox_uid={sandbox_uid!r} must be a positive integer (never root's 0)")
    return tuple(read_only_paths)


def check_spec(
    spec: SandboxSpec,
) -> tuple[SandboxResources, Path | None, dict[str, str], dict[str, str]]:
    """A spec's resources, working directory (relative), environment and files, checked:
    ``ValueError`` naming the field and value for what the provider cannot honour as written,
    ``SandboxCreateError`` for a GPU request."""
    resources = _resources_of(spec)
    if resources.gpu or resources.gpu_type is not None:
        raise SandboxCreateError(
            f"process provider has no GPUs: gpu={resources.gpu!r}, gpu_type={resources.gpu_type!r}"
        )
    if resources.cpu is not None and resources.cpu < _MIN_CPU:
        raise ValueError(f"resources.cpu={resources.cpu!r} must be at least {_MIN_CPU} cores")
    if resources.memory_mib is not None and resources.memory_mib < 1:
        raise ValueError(f"resources.memory_mib={resources.memory_mib!r} must be at least 1")
    if resources.disk_gib is not None and resources.disk_gib < 1:
        raise ValueError(f"resources.disk_gib={resources.disk_gib!r} must be at least 1")
    options = getattr(spec, "provider_options", None) or {}
    if options:
        # Keys only: option values may hold credentials.
        keys = ", ".join(sorted(repr(k) for k in options))
        raise ValueError(
            f"provider_options keys {keys}: the process provider takes none (allowed: none)"
        )
    workdir = getattr(spec, "workdir", None)
    relative_workdir = None if workdir is None else relative_path("workdir", workdir)
    env = check_env("env", getattr(spec, "env", None))
    files = getattr(spec, "files", None) or {}
    if not isinstance(files, dict):
        raise ValueError(f"files={files!r} must map relative paths to text")  # noqa: TRY004
    for target, content in files.items():
        relative_path("files key", target)
        if not isinstance(content, str):
            kind = type(content).__name__
            raise ValueError(f"files[{target!r}] must be text, not {kind}")  # noqa: TRY004
    return resources, relative_workdir, env, files


# Bad spec input raises ValueError throughout (wrong types included, hence the TRY004
# exemptions): callers handle one exception type for "the spec is wrong".
def check_env(name: str, env: object) -> dict[str, str]:
    """``env`` (any mapping of strings: a dict, ``os.environ``) as a dict. Errors name the
    offending key, never a value: environments hold secrets, and error text gets logged."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        kind = type(env).__name__
        raise ValueError(f"{name} must be a mapping of strings, not {kind}")  # noqa: TRY004
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ValueError(f"{name} key {key!r} must be a non-empty string without '=' or NUL")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"{name}[{key!r}] must be a string without NUL (value not shown)")
    return dict(env)


def relative_path(name: str, value: object) -> Path:
    """A path that stays inside the sandbox whatever the filesystem holds: relative, no ``..``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}={value!r} must be a non-empty relative path")
    path = Path(value)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"{name}={value!r} must be relative and stay inside the sandbox's fresh directory"
        )
    return path


def make_directory(
    base_dir: str | None,
    sandbox_id: str,
    workdir: Path | None,
    files: dict[str, str],
    owner: tuple[int, int] | None,
) -> tuple[Path, Path]:
    """Make the sandbox's directory, working directory and files, all ``owner``'s (when not
    ``None``): (root, workdir). Raises ``OSError`` after removing whatever it made."""
    root = make_temporary(base_dir, f"nemo-gym-{sandbox_id}-", owner)
    try:
        work = root if workdir is None else root / workdir
        make_directories(root, work, owner)
        for target, content in files.items():
            path = work / target
            make_directories(root, path.parent, owner)
            path.write_text(content)
            give(path, owner)
    except OSError:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root, work


def make_temporary(base_dir: str | None, prefix: str, owner: tuple[int, int] | None) -> Path:
    """A new private directory (mode 0700) in ``base_dir``, ``owner``'s, its path resolved."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base_dir)).resolve()
    try:
        give(path, owner)
    except OSError:
        path.rmdir()
        raise
    return path


def make_directories(root: Path, directory: Path, owner: tuple[int, int] | None) -> None:
    """Make ``directory`` and its missing parents below ``root``, ``owner``'s: a command that
    does not run as this process's uid must be able to write in them."""
    missing: list[Path] = []
    while directory != root and not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for made in reversed(missing):
        made.mkdir(exist_ok=True)
        give(made, owner)


def give(path: Path, owner: tuple[int, int] | None) -> None:
    """Make ``path`` (never what a symlink there points to) ``owner``'s; nothing for ``None``."""
    if owner is not None:
        os.chown(path, *owner, follow_symlinks=False)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def forget_ended_sessions(state: Sandbox) -> None:
    """Drop the sessions of ``state`` that no process is in any more.

    A command's session id is its first process's PID. Once the last process of the session
    is gone the kernel may give that number to any new process, and a later kill or sample by
    the number would reach a stranger (another sandbox's command, or any process on the host).
    While one process of the session lives, the number stays taken.
    """
    for session in list(state.sessions):
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            state.sessions.discard(session)
        except PermissionError:
            pass  # a process of the group lives (under another user): the number is taken


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


# --- commands ------------------------------------------------------------------------------


class _Output:
    """One output stream of a command: a pipe of our own, read as data arrives, whose first
    ``limit`` bytes are kept.

    Our own pipe, read here, rather than asyncio's: asyncio hands data on a loop turn after
    reading it, and ``finish`` must know that what it read last came last. Once finished, the
    pipe is still read (so that a background process the command left never blocks on a full
    pipe, nor dies of a closed one) and what comes is thrown away, until the last writer has
    gone (at the sandbox's close, at the latest).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, limit: int) -> None:
        self._loop = loop
        self._fd = fd
        self._limit = limit
        self._keeping = True
        self.kept = bytearray()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._read, 1)

    def finish(self) -> None:
        """Take what the pipe holds now, without waiting for more (once the command has
        exited, all it wrote is there), then keep nothing more. Bounded: a background process
        that writes without pause stops this after ``_DRAIN_READS`` reads."""
        self._read(_DRAIN_READS)
        self._keeping = False

    def _read(self, reads: int) -> None:
        for _ in range(reads):
            if self._fd < 0:
                return
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return  # empty for now
            except OSError:
                data = b""
            if not data:  # every writer has gone
                self._loop.remove_reader(self._fd)
                os.close(self._fd)
                self._fd = -1
                return
            if self._keeping and len(self.kept) < self._limit:
                self.kept += data[: self._limit - len(self.kept)]


class _Exit(asyncio.SubprocessProtocol):
    """Says when the command's process has exited (not its pipes: a background process it
    started may hold those for as long as it lives), and closes its transport then."""

    def __init__(self, exited: asyncio.Future[None]) -> None:
        self._exited = exited
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def process_exited(self) -> None:
        if not self._exited.done():
            self._exited.set_result(None)
        if self._transport is not None:
            self._transport.close()


async def run_command(
    state: Sandbox,
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float | None,  # noqa: ASYNC109 - the exec's timeout_s, which kills the command
    max_output: int,
    pass_fds: tuple[int, ...] = (),
) -> SandboxExecResult:
    """Run ``argv`` for the sandbox (in its cgroup, in a new session) and collect its result
    once it exits (background processes it started are not waited for): at ``timeout`` its
    process group is killed (``error_type="timeout"``); cancelled, it is killed and
    ``CancelledError`` propagates."""
    oom_before = _cgroups.oom_kills(state.cgroup)
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
    try:
        transport, _ = await loop.subprocess_exec(
            lambda: _Exit(exited),
            *_cgroups.joining(state.cgroup, argv),
            stdin=subprocess.DEVNULL,
            stdout=out_write,
            stderr=err_write,
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except BaseException:
        for fd in (out_read, err_read):
            os.close(fd)
        raise
    finally:
        for fd in (out_write, err_write):
            os.close(fd)  # the command has its own copies: EOF comes when its side closes
    outputs = (_Output(loop, out_read, max_output), _Output(loop, err_read, max_output))
    pid = transport.get_pid()
    state.sessions.add(pid)
    try:
        # asyncio.wait, not wait_for: a timeout or a cancellation leaves ``exited`` as it is.
        done, _ = await asyncio.wait({exited}, timeout=timeout)
        timed_out = not done
        if timed_out:
            kill_group(pid)
            await asyncio.wait({exited})
    except asyncio.CancelledError:
        kill_group(pid)  # asyncio reaps it, and _Exit closes the transport then
        for output in outputs:
            output.finish()
        raise
    # Reaped: a command that left nothing running has ended its session, whose id is now free.
    forget_ended_sessions(state)
    for output in outputs:
        output.finish()
    stdout, stderr = (output.kept.decode("utf-8", errors="replace") for output in outputs)
    if timed_out:
        return SandboxExecResult(stdout, stderr, EXEC_TIMEOUT_RETURN_CODE, "timeout")
    returned = transport.get_returncode()
    code = returned if returned is not None else EXEC_TIMEOUT_RETURN_CODE
    if code < 0:
        code = 128 - code
    error_type = None
    oom_after = _cgroups.oom_kills(state.cgroup)
    if code == 128 + signal.SIGKILL and oom_after is not None and oom_after > (oom_before or 0):
        error_type = "oom_kill"
    return SandboxExecResult(stdout, stderr, code, error_type)


async def kill_all(state: Sandbox) -> None:
    """Kill every process of the sandbox: its commands' groups, its cgroup's members (or,
    without one, every process in its commands' sessions), until none is left (bounded)."""
    forget_ended_sessions(state)  # never a group whose number may belong to a stranger now
    for session in state.sessions:
        kill_group(session)
    cgroup = state.cgroup
    if cgroup is not None and cgroup.version == 2 and cgroup.file("", "cgroup.kill").exists():
        with contextlib.suppress(OSError):
            _cgroups.write_text(cgroup.file("", "cgroup.kill"), "1")
    # Processes can fork while being killed: repeat until none is left (bounded).
    for _ in range(_KILL_ROUNDS):
        if cgroup is not None:
            pids = _cgroups.cgroup_pids(cgroup)
        else:
            pids = {p[0] for p in proc_table() if p[1] in state.sessions}
        if not pids:
            return
        for pid in pids:
            kill(pid)
        await asyncio.sleep(_KILL_PAUSE_S)
    logger.warning("sandbox %s: processes survived SIGKILL at close", state.sandbox_id)
