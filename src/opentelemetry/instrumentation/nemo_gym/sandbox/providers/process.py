"""A local sandbox provider: a private directory, isolated by bubblewrap, a cgroup where possible.

``ProcessSandboxProvider`` needs no daemon. Each sandbox is a fresh temporary directory in
which commands run with ``sh -c`` semantics, in their own session (so a timeout can kill the
whole process group), with a minimal environment rather than the caller's. By default every
command runs isolated by bubblewrap (``_bwrap``: new user, PID, mount, IPC and UTS namespaces,
no network unless the provider has ``network=True``, the system directories read-only, the
sandbox directory the only writable place); without ``bwrap`` on PATH, ``create`` refuses,
unless the provider was made with ``isolation="none"``, which runs commands as plain processes
of this user and says so (a warning per sandbox, ``nemo.gym.sandbox.isolation`` on its spans
and records).

Where the machine lets this process create cgroups (v1 hierarchies or a v2 hierarchy with the
``cpu`` and ``memory`` controllers, writable), each sandbox gets one, at
``<base>/<cgroup_parent>/<sandbox id>``, enforcing the requested cpu (CFS quota), memory (a
hard limit, swap included, so the kernel OOM-kills inside the sandbox instead of swapping) and
the provider's ``pids_limit``. The base is the server's own cgroup, so that the server's limits
bound its sandboxes too, or the cgroup ``OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT`` names
(``_cgroup_placement``; on cgroup v2 the server may move itself into a leaf child of its
cgroup first). Elsewhere the sandbox still works; its allocation then says
``source = "process"`` with no limits. A requested ``disk_gib`` is a size-limited tmpfs
where this process may mount one (``_disk``).

It is also a ``ResourceProvider``: the allocation is read back from what the kernel enforces,
and samples come from the cgroup (or, without one, from ``/proc``).

The cgroup and ``/proc`` plumbing lives in ``_cgroups``; file copies (``_transfers``, which
opens paths in the sandbox following no symlink) go to a thread, and subprocess I/O uses
asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.instrumentation.nemo_gym._shared import _settings
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import (
    _bwrap,
    _cgroup_placement,
    _cgroups,
    _disk,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import read_file
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._proc_scan import ProcScan
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._process_sandbox import (
    Sandbox,
    check_env,
    check_options,
    check_spec,
    forget_ended_sessions,
    kill_all,
    make_directory,
    make_temporary,
    run_command,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._transfers import (
    download,
    open_working_directory,
    upload,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    EXEC_TIMEOUT_RETURN_CODE,
    MIB,
    ContainerResourceAmounts,
    SandboxCreateError,
    SandboxExecResult,
    SandboxHandle,
    SandboxResourceAmounts,
    SandboxSpec,
    SandboxStatus,
    _positive_seconds,
    _spec_from,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    Attribute,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
)

__all__ = ["EXEC_TIMEOUT_RETURN_CODE", "ISOLATION", "ProcessSandboxProvider"]

logger = logging.getLogger(__name__)

_COMPONENT = "sandbox"
# The isolation level of a sandbox, on every span and record of it: "bwrap" or "none".
ISOLATION = PREFIX + "isolation"


class ProcessSandboxProvider:
    """Local sandboxes: a temporary directory each, commands run with ``sh -c``, no daemon.

    ``isolation`` is ``"bwrap"`` (the default: each sandbox's commands run isolated by
    bubblewrap, and ``create`` raises ``SandboxCreateError`` when ``bwrap`` is not on PATH) or
    ``"none"`` (commands run as plain processes of this user, on this machine's filesystem,
    network and process table: for trusted code only; each sandbox logs a warning).
    ``network=True`` gives isolated commands the host's network (``SandboxSpec`` has no network
    field; in a NeMo Gym config, ``{"otel_process": {"network": true}}``); without it they have
    a loopback of their own and nothing else. ``read_only_paths`` are absolute host paths
    isolated commands also see, read-only, at the same place (an interpreter or a virtualenv
    outside ``/usr``). ``cgroups=False`` never uses cgroups; otherwise they are used where
    writable, beneath the server's own cgroup (or the one
    ``OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT`` names), decided when the provider is made;
    on cgroup v2 that may move this process, only when it is alone in its cgroup, into the
    cgroup's child ``nemo_gym_server`` (docs/sandboxes.md, "Where sandbox cgroups go").
    ``pids_limit`` caps the processes and threads of a sandbox with a cgroup (``None`` for no
    cap). ``cgroup_parent`` names the directory beneath that cgroup that holds the sandboxes'
    cgroups; ``base_dir`` is where the sandbox directories are made (default: the
    system temporary directory); ``max_output_bytes`` caps what ``exec`` keeps of each stream.
    Isolated commands never run as the host's root: a server running as root runs bubblewrap,
    and so every command, as ``sandbox_uid`` (and the gid of that number; default 65534,
    ``nobody``), which owns the sandbox's files and must be able to reach ``base_dir`` and
    ``read_only_paths`` (``create`` names the first it cannot); any other server runs them as
    its own uid. ``disk_gib`` is enforced for isolated sandboxes of a root server (a tmpfs of
    that size holds the sandbox's directory and its ``/tmp``; see ``_disk``); elsewhere it is
    not, and the allocation record has no disk limit.

    Not enforced here: ``image`` and ``entrypoint`` (container concepts, ignored) and
    ``ttl_s``. A GPU request raises
    ``SandboxCreateError``. Options arrive as keyword arguments, from code or from a NeMo Gym
    config (``{"otel_process": {...}}``); a bad value raises ``ValueError`` naming the option
    and the value.
    """

    name = "process"

    def __init__(
        self,
        *,
        isolation: str = "bwrap",
        network: bool = False,
        read_only_paths: Sequence[str] = (),
        cgroups: bool = True,
        pids_limit: int | None = 1024,
        cgroup_parent: str = "nemo_gym",
        base_dir: str | os.PathLike[str] | None = None,
        max_output_bytes: int = 8 * MIB,
        sandbox_uid: int = 65534,
    ) -> None:
        # Options may come from a NeMo Gym config ({"otel_process": {...}}): check their types.
        self._read_only_paths = check_options(
            isolation=isolation,
            network=network,
            read_only_paths=read_only_paths,
            cgroups=cgroups,
            pids_limit=pids_limit,
            cgroup_parent=cgroup_parent,
            base_dir=base_dir,
            max_output_bytes=max_output_bytes,
            sandbox_uid=sandbox_uid,
        )
        self._isolation = isolation
        self._sandbox_uid = sandbox_uid
        self._network = network
        self._pids_limit = pids_limit
        self._layout = (
            _cgroup_placement.discover_layout(_settings.sandbox_cgroup_parent())
            if cgroups
            else None
        )
        self._cgroup_parent = cgroup_parent
        self._base_dir = None if base_dir is None else os.fspath(base_dir)
        self._max_output = max_output_bytes
        self._sandboxes: dict[str, Sandbox] = {}
        # Samples without a cgroup share one /proc scan per tick (see _proc_scan).
        self._proc_scan = ProcScan()
        boot_id = read_file("/proc/sys/kernel/random/boot_id")
        self._boot_id = boot_id or None
        hostname = socket.gethostname()
        self._host = ResourceDesignator("host", hostname) if hostname else None

    @property
    def isolation(self) -> str:
        """How this provider isolates its sandboxes' commands: ``"bwrap"`` or ``"none"``."""
        return self._isolation

    @property
    def cgroup_version(self) -> int | None:
        """1 or 2 when new sandboxes get a cgroup, ``None`` when they cannot."""
        return None if self._layout is None else self._layout.version

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Make the sandbox directory, its files and (where possible) its cgroup.

        Raises ``ValueError`` for a spec this provider cannot honour as written (naming the
        field and value) and ``SandboxCreateError`` for a GPU request or a filesystem failure.
        ``spec`` may also be nemo_gym's ``SandboxSpec`` or a plain mapping of its fields.
        """
        spec = _spec_from(spec)
        resources, relative_workdir, env, files = check_spec(spec)
        # Before anything is made: without bwrap there is nothing to undo.
        bwrap = _bwrap.find_bwrap() if self._isolation == "bwrap" else None
        drop = None if bwrap is None else _bwrap.drop_for(self._sandbox_uid)
        owner = None if drop is None else (drop.uid, drop.gid)
        if drop is not None:
            await asyncio.to_thread(self._check_reach, drop)
        sandbox_id = f"process-{uuid.uuid4().hex[:16]}"
        disk = None
        if bwrap is not None and resources.disk_gib is not None:
            disk = await self._make_disk(sandbox_id, resources.disk_gib, owner)
        # With a disk limit, the sandbox's directory and its /tmp are made on its disk.
        base_dir = self._base_dir if disk is None else str(disk)
        try:
            root, work = await asyncio.to_thread(
                make_directory, base_dir, sandbox_id, relative_workdir, files, owner
            )
        except OSError as exc:
            if disk is not None:
                await self._remove_disk(disk)
            raise SandboxCreateError(f"process sandbox directory failed: {exc}") from exc

        cgroup = None
        if self._layout is not None:
            try:
                cgroup = _cgroups.make_cgroup(
                    self._layout,
                    self._cgroup_parent,
                    sandbox_id,
                    resources.cpu,
                    resources.memory_mib,
                    self._pids_limit,
                )
            except OSError as exc:
                # Still a working sandbox; its allocation says it has no cgroup or limits.
                logger.warning(
                    "sandbox %s runs without a cgroup (limits not enforced): %s", sandbox_id, exc
                )
        base_env = {
            "PATH": _bwrap.SANDBOX_PATH if bwrap else os.environ.get("PATH", os.defpath),
            "HOME": str(work),
            "LANG": "C.UTF-8",
        }
        state = Sandbox(
            sandbox_id,
            root,
            work,
            {**base_env, **env},
            cgroup,
            self._isolation,
            owner=owner,
            disk=disk,
        )
        if bwrap is None:
            logger.warning(
                "sandbox %s is not isolated (isolation='none'): its commands run as this "
                "process's user, with its filesystem, network and processes in reach",
                sandbox_id,
            )
        else:
            try:
                state.tmp = await asyncio.to_thread(
                    make_temporary, base_dir, f"nemo-gym-{sandbox_id}-tmp-", owner
                )
                state.jail = await _bwrap.start_jail(bwrap, self._network, drop)
            except (Exception, asyncio.CancelledError) as exc:
                await self._discard(state)
                if isinstance(exc, OSError):
                    raise SandboxCreateError(f"process sandbox directory failed: {exc}") from exc
                raise
        self._sandboxes[sandbox_id] = state
        return SandboxHandle(sandbox_id=sandbox_id, provider_name=self.name, raw=state)

    async def _make_disk(
        self, sandbox_id: str, size_gib: int, owner: tuple[int, int] | None
    ) -> Path | None:
        """A tmpfs of ``size_gib`` GiB for the sandbox (see ``_disk``), or ``None`` with a
        warning where this process cannot mount one: its disk use is then not bounded."""
        if not _disk.can_mount():
            logger.warning(
                "sandbox %s asked for disk_gib=%s: not enforced (a size-limited file system "
                "needs a root server); its allocation record has no disk limit",
                sandbox_id,
                size_gib,
            )
            return None
        try:
            disk = await asyncio.to_thread(
                make_temporary, self._base_dir, f"nemo-gym-{sandbox_id}-disk-", None
            )
        except OSError as exc:
            raise SandboxCreateError(f"process sandbox directory failed: {exc}") from exc
        try:
            await _disk.mount(disk, size_gib, owner)
        except (Exception, asyncio.CancelledError) as exc:
            await asyncio.to_thread(disk.rmdir)
            if isinstance(exc, OSError):
                raise SandboxCreateError(f"process sandbox disk failed: {exc}") from exc
            raise
        return disk

    async def _remove_disk(self, disk: Path) -> None:
        await _disk.unmount(disk)
        await asyncio.to_thread(shutil.rmtree, disk, True)

    def _check_reach(self, drop: _bwrap.Drop) -> None:
        """``SandboxCreateError`` naming the first path bwrap would bind that ``drop``'s uid
        cannot reach (bwrap resolves them as that uid)."""
        base_dir = self._base_dir or tempfile.gettempdir()
        # A base_dir that is no directory fails as the sandbox's directory is made.
        places = [("base_dir", base_dir)] if os.path.isdir(base_dir) else []
        places += [("read_only_paths entry", path) for path in self._read_only_paths]
        for name, path in places:
            blocked = _bwrap.unreachable(path, drop)
            if blocked is not None:
                raise SandboxCreateError(
                    f"{name} {path!r} is out of reach of sandbox_uid {drop.uid}, which may not "
                    f"pass {blocked!r}: a root server runs its sandboxes as that uid (make the "
                    "directories on the way searchable by it, or use another path)"
                )

    def sandbox_attributes(self, handle: SandboxHandle) -> dict[str, Attribute]:
        """Attributes of the sandbox for its whole life, which tracing adds to its identity
        (every span and record of it): ``nemo.gym.sandbox.isolation``. Never blocks."""
        raw = getattr(handle, "raw", None)
        isolation = raw.isolation if isinstance(raw, Sandbox) else self._isolation
        return {ISOLATION: isolation}

    def _open(self, handle: SandboxHandle) -> Sandbox:
        state = self._sandboxes.get(getattr(handle, "sandbox_id", ""))
        if state is None:
            raise RuntimeError(
                f"process sandbox {getattr(handle, 'sandbox_id', None)!r} is not open"
            )
        return state

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        """Run ``command`` with ``sh -c`` in the sandbox, in its cgroup, in a new session.

        ``cwd`` is relative to the sandbox's working directory (or absolute inside the
        sandbox), a directory reached through no symlink (``ValueError`` otherwise, naming
        it); ``env`` is added to the sandbox's environment. At ``timeout_s`` the whole
        process group is killed and the result has ``error_type="timeout"`` and
        ``return_code=EXEC_TIMEOUT_RETURN_CODE``. A command killed by a signal returns
        128 + the signal number; when the kernel OOM-killed it, ``error_type="oom_kill"``.
        Background processes it leaves keep running until the sandbox closes. Cancelling the
        call kills the command's process group. ``user`` is not supported (``ValueError``).
        Isolated, the command runs inside bubblewrap, joined to the sandbox's namespaces.
        """
        state = self._open(handle)
        if not isinstance(command, str) or "\0" in command:
            raise ValueError("command must be a string without NUL characters")
        if user is not None:
            raise ValueError(f"user={user!r}: the process provider runs commands as its own user")
        timeout = _positive_seconds("timeout_s", timeout_s)
        command_env = {**state.env, **check_env("env", env)}
        directory, opened = state.workdir, None
        if cwd is not None:
            # Opened following no symlink, so that a command cannot point it out of the sandbox.
            directory, opened = open_working_directory(state, "cwd", cwd)
        try:
            if state.jail is None:
                # Through the descriptor, not by name: the directory checked, even if a command
                # has swapped a symlink in for it since.
                on_host = directory if opened is None else Path(f"/proc/self/fd/{opened}")
                argv, cwd_on_host = ["/bin/sh", "-c", command], on_host
            else:
                # bwrap changes to the directory inside the command's own mount namespace, where
                # a symlink swapped in since the check leads only to what the command sees anyway.
                assert state.tmp is not None  # made with the jail
                mounts = _bwrap.mounts(state.root, state.tmp, self._network, self._read_only_paths)
                argv = _bwrap.command_argv(state.jail, mounts, self._network, directory, command)
                cwd_on_host = state.root
            return await run_command(
                state,
                argv,
                cwd=cwd_on_host,
                env=command_env,
                timeout=timeout,
                max_output=self._max_output,
                pass_fds=() if state.jail is None else state.jail.fds,
            )
        finally:
            if opened is not None:
                os.close(opened)

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        """Copy local ``source_path`` to ``target_path`` inside the sandbox (parents made).

        Every component of ``target_path`` is opened following no symlink: a path outside the
        sandbox, or through a symlink in it, raises ``ValueError`` (``_transfers``)."""
        state = self._open(handle)
        await asyncio.to_thread(upload, state, Path(source_path), "target_path", target_path)

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path
    ) -> None:
        """Copy ``source_path`` from inside the sandbox to local ``target_path``.

        Every component of ``source_path`` is opened following no symlink: a path outside the
        sandbox, or through a symlink in it, raises ``ValueError`` (``_transfers``)."""
        state = self._open(handle)
        await asyncio.to_thread(download, state, "source_path", source_path, Path(target_path))

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        """``RUNNING`` while open, ``STOPPED`` once closed, ``UNKNOWN`` for a foreign handle,
        ``ERROR`` if the sandbox's directory has vanished or its bubblewrap holder has ended."""
        state = self._sandboxes.get(getattr(handle, "sandbox_id", ""))
        if state is None:
            raw = getattr(handle, "raw", None)
            return (
                SandboxStatus.STOPPED
                if isinstance(raw, Sandbox) and raw.closed
                else (SandboxStatus.UNKNOWN)
            )
        if state.jail is not None and state.jail.holder.returncode is not None:
            return SandboxStatus.ERROR  # its namespaces are gone: no command can run
        return SandboxStatus.RUNNING if state.root.is_dir() else SandboxStatus.ERROR

    async def close(self, handle: SandboxHandle) -> None:
        """Kill every process the sandbox started, remove its cgroup and directory; idempotent.

        With a cgroup, everything in it is killed, including processes that left the
        command's session; without one, every process in the sessions of its commands.
        """
        state = self._sandboxes.pop(getattr(handle, "sandbox_id", ""), None)
        if state is None:
            return
        state.closed = True
        await self._discard(state)

    async def _discard(self, state: Sandbox) -> None:
        """End every process of the sandbox, then remove its cgroup and directories."""
        if state.jail is not None:
            await _bwrap.stop_jail(state.jail)
        await kill_all(state)
        if state.cgroup is not None:
            await _cgroups.remove_cgroup(state.cgroup)
        for directory in (state.root, state.tmp):
            if directory is not None:
                await asyncio.to_thread(shutil.rmtree, directory, True)
        if state.disk is not None:
            await self._remove_disk(state.disk)

    async def aclose(self) -> None:
        """Close every sandbox still open and drop the (empty) cgroup parents."""
        for sandbox_id in list(self._sandboxes):
            await self.close(SandboxHandle(sandbox_id, self.name, None))
        if self._layout is not None:
            for base in set(self._layout.bases.values()):
                with contextlib.suppress(OSError):
                    (base / self._cgroup_parent).rmdir()

    # --- ResourceProvider ---------------------------------------------------------------------

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        """The limits the kernel enforces on the sandbox, read back from its cgroup.

        Without a cgroup: ``source="process"``, designator the provider's own process (which
        parents every command), and no limits.
        """
        state = self._open(handle)
        disk_gib = None if state.disk is None else _disk.limit_gib(state.disk)
        if state.cgroup is None:
            return ResourceAllocation(
                source="process",
                components=(
                    ComponentAllocation(
                        _COMPONENT, limits=SandboxResourceAmounts(disk_gib=disk_gib)
                    ),
                ),
                designator=ResourceDesignator("process", str(os.getpid()), self._boot_id),
                host=self._host,
            )
        enforced = _cgroups.cgroup_limits(state.cgroup)
        pids = _cgroups.pids_limit(state.cgroup)
        limits = (
            SandboxResourceAmounts(enforced.cpu, enforced.memory_mib, disk_gib)
            if pids is None
            else ContainerResourceAmounts(enforced.cpu, enforced.memory_mib, disk_gib, pids=pids)
        )
        return ResourceAllocation(
            source=f"cgroup.v{state.cgroup.version}",
            components=(ComponentAllocation(_COMPONENT, limits=limits),),
            designator=ResourceDesignator("cgroup", state.cgroup.path, self._boot_id),
            host=self._host,
        )

    def resource_sample_nowait(self, handle: SandboxHandle) -> dict[str, Attribute] | None:
        """The sandbox's cgroup sample, read synchronously (small kernel files); ``None``
        without a cgroup (the ``/proc`` sample waits for the shared scan: ``resource_sample``).
        ``ResourceSampler`` takes it first, sparing the bounded wait. Raises as
        ``resource_sample`` for a sandbox that is not open."""
        state = self._open(handle)
        return None if state.cgroup is None else _cgroups.cgroup_sample(state.cgroup)

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        """Usage now: CPU time and throttling, memory and its peak, OOM kills, process count.

        From the cgroup (``usage.source = "cgroup.v1"``/``"cgroup.v2"``), or from ``/proc``
        over the processes in the sandbox's sessions (``"proc"``: CPU time counts processes
        seen alive at some sample, peak memory is the largest sampled figure). ``/proc``
        samples of a provider share one scan of the process table per tick, which starts
        after the sample is asked for, so a process started before the call is counted.
        """
        sample = self.resource_sample_nowait(handle)
        if sample is not None:
            return sample
        state = self._open(handle)
        forget_ended_sessions(state)  # a reused session id would count a stranger's processes
        sessions = await self._proc_scan.sessions()
        pids = memory = 0
        for session in state.sessions:
            for pid, _, start, cpu_s, rss in sessions.get(session, ()):
                pids += 1
                memory += rss
                state.proc_cpu[(pid, start)] = cpu_s
        memory_mib = round(memory / MIB, 3)
        state.proc_peak_mib = max(state.proc_peak_mib, memory_mib)
        usage = PREFIX + "usage."
        return {
            usage + "source": "proc",
            usage + "cpu.time_s": round(sum(state.proc_cpu.values()), 6),
            usage + "memory_mib": memory_mib,
            usage + "memory_peak_mib": state.proc_peak_mib,
            usage + "pids": pids,
        }
