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
_OUTPUT_GRACE_S = 0.2
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
    base_dir: str | None, sandbox_id: str, workdir: Path | None, files: dict[str, str]
) -> tuple[Path, Path]:
    """Make the sandbox's directory, working directory and files: (root, workdir). Raises
    ``OSError`` after removing whatever it made."""
    root = make_temporary(base_dir, f"nemo-gym-{sandbox_id}-")
    try:
        work = root if workdir is None else root / workdir
        work.mkdir(parents=True, exist_ok=True)
        for target, content in files.items():
            path = work / target
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    except OSError:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root, work


def make_temporary(base_dir: str | None, prefix: str) -> Path:
    """A new private directory (mode 0700) in ``base_dir``, its path resolved."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base_dir)).resolve()


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


# Killed commands of cancelled execs, reaped beside the cancellation (the loop keeps only weak
# references to tasks).
_REAPING: set[asyncio.Task[int]] = set()


def reap_in_background(process: asyncio.subprocess.Process) -> None:
    """Wait for a killed command's exit in a task of its own, so a cancelled exec propagates at
    once and asyncio still closes the command's transport (instead of a ResourceWarning about
    a subprocess still running when the object is collected)."""
    task = asyncio.ensure_future(process.wait())
    _REAPING.add(task)
    task.add_done_callback(_REAPING.discard)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


async def drain(stream: asyncio.StreamReader | None, buffer: bytearray, limit: int) -> None:
    """Read ``stream`` to its end, keeping its first ``limit`` bytes (the rest is discarded
    but still read, so the command never blocks on a full pipe)."""
    if stream is None:
        return
    while chunk := await stream.read(1 << 16):
        if len(buffer) < limit:
            buffer += chunk[: limit - len(buffer)]


# --- commands ------------------------------------------------------------------------------


async def run_command(
    state: Sandbox,
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float | None,  # noqa: ASYNC109 - the exec's timeout_s, which kills the command
    max_output: int,
) -> SandboxExecResult:
    """Run ``argv`` for the sandbox (in its cgroup, in a new session) and collect its result:
    at ``timeout`` its process group is killed (``error_type="timeout"``); cancelled, it is
    killed and ``CancelledError`` propagates."""
    oom_before = _cgroups.oom_kills(state.cgroup)
    process = await asyncio.create_subprocess_exec(
        *_cgroups.joining(state.cgroup, argv),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        pass_fds=() if state.jail is None else state.jail.fds,
    )
    state.sessions.add(process.pid)
    out, err = bytearray(), bytearray()
    readers = [
        asyncio.ensure_future(drain(process.stdout, out, max_output)),
        asyncio.ensure_future(drain(process.stderr, err, max_output)),
    ]
    timed_out = False
    try:
        await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        timed_out = True
        kill_group(process.pid)
        await process.wait()
    except asyncio.CancelledError:
        kill_group(process.pid)
        reap_in_background(process)
        for reader in readers:
            reader.cancel()
        raise
    # Reaped: a command that left nothing running has ended its session, whose id is now free.
    forget_ended_sessions(state)
    # Background processes may hold the pipes open after the command ended: take what
    # arrived within a short grace and leave the rest.
    _, pending = await asyncio.wait(readers, timeout=_OUTPUT_GRACE_S)
    for reader in pending:
        reader.cancel()
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    if timed_out:
        return SandboxExecResult(stdout, stderr, EXEC_TIMEOUT_RETURN_CODE, "timeout")
    code = process.returncode if process.returncode is not None else EXEC_TIMEOUT_RETURN_CODE
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
