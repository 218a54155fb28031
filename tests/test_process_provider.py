"""ProcessSandboxProvider with real processes and, where writable, real cgroups."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conftest import require_service
from isolation_support import cgroup_mounts, own_cgroup_paths
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import _cgroups
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxHandle,
    SandboxResourceAmounts,
    SandboxResources,
    SandboxSpec,
    SandboxStatus,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    EXEC_TIMEOUT_RETURN_CODE,
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    ResourceProvider,
)
from waiting import eventually

BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
USAGE = PREFIX + "usage."


def sandbox_cgroup_dirs(version: int, sandbox: SandboxHandle) -> dict[str, Path]:
    """Where the sandbox's cgroup must be, read independently of the code under test:
    ``nemo_gym/<sandbox id>`` beneath this process's own cgroup in each hierarchy (v2: beneath
    the cgroup whose ``nemo_gym_server`` child the provider moved this process into)."""
    mounts, own = cgroup_mounts(), own_cgroup_paths()
    controllers = ("cpu", "cpuacct", "memory", "pids") if version == 1 else ("",)
    dirs = {}
    for controller in controllers:
        if controller in mounts:
            base = own[controller].removesuffix("/nemo_gym_server").strip("/")
            dirs[controller] = mounts[controller] / base / "nemo_gym" / sandbox.sandbox_id
    return dirs


def require_cgroups(provider: ProcessSandboxProvider) -> int:
    version = provider.cgroup_version
    require_service(version is not None, "no writable cgroup hierarchy (run as root)")
    assert version is not None
    return version


def require_bwrap(isolation: str) -> None:
    """Skip (fail under CI) an isolated case on a machine without bubblewrap."""
    if isolation == "bwrap":
        require_service(shutil.which("bwrap") is not None, "bwrap not on PATH (bubblewrap)")


# Each behaviour holds whether commands run isolated by bubblewrap or as plain processes.
@pytest.fixture(params=["bwrap", "none"])
async def provider(request: pytest.FixtureRequest) -> AsyncIterator[ProcessSandboxProvider]:
    require_bwrap(request.param)
    made = ProcessSandboxProvider(isolation=request.param)
    yield made
    await made.aclose()


@pytest.fixture(params=["bwrap", "none"])
async def plain_provider(request: pytest.FixtureRequest) -> AsyncIterator[ProcessSandboxProvider]:
    require_bwrap(request.param)
    made = ProcessSandboxProvider(cgroups=False, isolation=request.param)
    yield made
    await made.aclose()


def pid_namespace(sandbox: SandboxHandle) -> int | None:
    """The inode of the sandbox's own PID namespace; ``None`` when its commands share ours."""
    jail = sandbox.raw.jail
    return None if jail is None else os.fstat(jail.pidns_fd).st_ino


def host_pid(namespace: int | None, pid: int) -> int | None:
    """The PID on this host of the live process that is ``pid`` in PID namespace
    ``namespace`` (``None`` for ours), from each process's ``NSpid`` line; ``None`` if none."""
    if namespace is None:
        return pid if alive(pid) else None
    with os.scandir("/proc") as entries:
        names = [e.name for e in entries if e.name.isdigit()]
    for name in names:
        try:
            if os.stat(f"/proc/{name}/ns/pid").st_ino != namespace:
                continue
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        nspids = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
        if nspids and int(nspids[-1]) == pid and alive(int(name)):
            return int(name)
    return None


async def sleeping_in_its_own_image(pid: int) -> None:
    """Wait until ``pid`` is ``sleep`` asleep: past its exec, whose new image has no resident
    pages yet (a sample read in between sees a memory of 0)."""
    await eventually(
        lambda: process_name_and_state(pid) == ("sleep", "S"),
        f"pid {pid} asleep in sleep's image",
        interval=0.01,
    )


def process_name_and_state(pid: int) -> tuple[str, str]:
    """``comm`` and state of ``pid`` from ``/proc/<pid>/stat``."""
    left, right = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    return left.split("(", 1)[1], right.split()[0]


def exists(path: Path) -> bool:
    return path.exists()


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        # Gone before the open, or between the open and the read (ESRCH).
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def dead(namespace: int | None, pid: int) -> None:
    """Wait until no live process is ``pid`` in PID namespace ``namespace``."""
    await eventually(lambda: host_pid(namespace, pid) is None, f"pid {pid} gone", interval=0.02)


# --- plain behaviour (with or without cgroups) ----------------------------------------------


async def test_process_provider_is_a_resource_provider(provider: ProcessSandboxProvider) -> None:
    """The bundled provider implements the ResourceProvider capability and is named process."""
    assert isinstance(provider, ResourceProvider)
    assert provider.name == "process"


async def test_process_provider_exec_output_code_cwd_env(
    provider: ProcessSandboxProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exec returns stdout, stderr and the exit code, honours cwd and env, hides ours."""
    monkeypatch.setenv("CALLER_SECRET", "do-not-leak")
    sandbox = await provider.create(
        SandboxSpec(workdir="work", env={"GREETING": "hi"}, files={"data/a.txt": "alpha"})
    )
    result = await provider.exec(
        sandbox,
        'cat a.txt; echo " $GREETING $EXTRA ${CALLER_SECRET:-none}"; echo oops >&2; exit 3',
        cwd="data",
        env={"EXTRA": "there"},
    )
    assert result.stdout == "alpha hi there none\n"
    assert result.stderr == "oops\n"
    assert result.return_code == 3
    assert result.error_type is None
    assert (await provider.exec(sandbox, "pwd")).stdout.strip().endswith("/work")  # type: ignore[union-attr]


async def test_process_provider_timeout_kills_the_process_group(
    provider: ProcessSandboxProvider,
) -> None:
    """At the timeout the whole group dies and the result says so with the sentinel code
    (a 30 s command that ran to its end would return 0, with no error type)."""
    sandbox = await provider.create(SandboxSpec())
    result = await provider.exec(
        sandbox, "sleep 30 & echo $! > bg.pid; echo $$ > fg.pid; exec sleep 30", timeout_s=0.3
    )
    assert result.error_type == "timeout"
    assert result.return_code == EXEC_TIMEOUT_RETURN_CODE
    for name in ("bg.pid", "fg.pid"):
        pid = int((await provider.exec(sandbox, f"cat {name}")).stdout or "0")
        await dead(pid_namespace(sandbox), pid)


async def test_process_provider_signal_death_is_shell_style(
    provider: ProcessSandboxProvider,
) -> None:
    """A command killed by a signal returns 128 plus the signal number."""
    sandbox = await provider.create(SandboxSpec())
    result = await provider.exec(sandbox, "kill -TERM $$")
    assert result.return_code == 128 + 15


async def test_process_provider_cancelled_exec_kills_command(
    provider: ProcessSandboxProvider,
) -> None:
    """Cancelling exec propagates CancelledError and kills the command's group."""
    sandbox = await provider.create(SandboxSpec())
    task = asyncio.ensure_future(provider.exec(sandbox, "echo $$ > me.pid; exec sleep 30"))
    root = Path(sandbox.raw.workdir)
    await eventually(
        lambda: (root / "me.pid").exists() and (root / "me.pid").read_text().strip(),
        "the command wrote its pid",
        interval=0.01,
    )
    pid = int((root / "me.pid").read_text())
    assert host_pid(pid_namespace(sandbox), pid) is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await dead(pid_namespace(sandbox), pid)


async def test_process_provider_upload_download_round_trip(
    provider: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """A file uploaded into the sandbox is seen by commands and downloads back unchanged."""
    sandbox = await provider.create(SandboxSpec())
    source = tmp_path / "in.bin"
    source.write_bytes(b"\x00payload\xff")
    await provider.upload_file(sandbox, source, "nested/in.bin")
    result = await provider.exec(sandbox, "wc -c < nested/in.bin; cp nested/in.bin out.bin")
    assert result.stdout == "9\n"
    target = tmp_path / "out.bin"
    await provider.download_file(sandbox, "out.bin", target)
    assert target.read_bytes() == b"\x00payload\xff"


async def test_process_provider_refuses_paths_outside_the_sandbox(
    provider: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """Paths that escape the sandbox, by .., absolute or through a symlink, raise ValueError."""
    sandbox = await provider.create(SandboxSpec())
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    await provider.exec(sandbox, f"ln -s {outside} link")
    for path in ("../x", str(outside), "link"):
        with pytest.raises(ValueError, match="outside sandbox"):
            await provider.download_file(sandbox, path, tmp_path / "copy")
    with pytest.raises(ValueError, match="target_path"):
        await provider.upload_file(sandbox, outside, "/etc/evil")
    with pytest.raises(ValueError, match="cwd"):
        await provider.exec(sandbox, "true", cwd="/")


async def test_process_provider_exec_cwd_must_be_a_directory(
    provider: ProcessSandboxProvider,
) -> None:
    """A cwd that is missing, or a file, raises ValueError naming it and the reason."""
    sandbox = await provider.create(SandboxSpec(files={"file.txt": "x"}))
    with pytest.raises(ValueError, match=r"cwd='missing' is not a directory .*No such file"):
        await provider.exec(sandbox, "true", cwd="missing")
    with pytest.raises(ValueError, match=r"cwd='file\.txt' is not a directory .*Not a directory"):
        await provider.exec(sandbox, "true", cwd="file.txt")


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (SandboxSpec(workdir="/workspace"), ValueError, "workdir='/workspace'"),
        (SandboxSpec(workdir="a/../../b"), ValueError, "workdir"),
        (SandboxSpec(env={"A=B": "x"}), ValueError, "'A=B'"),
        (SandboxSpec(files={"../x": "y"}), ValueError, "files key"),
        (SandboxSpec(provider_options={"cpus": 2}), ValueError, "provider_options"),
        (SandboxSpec(resources={"cpu": 0.001}), ValueError, "cpu=0.001"),
        (SandboxSpec(resources={"memory_mib": 0}), ValueError, "memory_mib=0"),
        (SandboxSpec(resources={"gpu": 1}), SandboxCreateError, "gpu=1"),
        (SandboxSpec(resources={"gpu_type": "a100"}), SandboxCreateError, "gpu_type='a100'"),
    ],
)
async def test_process_provider_create_validates_spec(
    plain_provider: ProcessSandboxProvider,
    spec: SandboxSpec,
    error: type[Exception],
    match: str,
) -> None:
    """A spec the provider cannot honour raises a clear error naming the field and value."""
    with pytest.raises(error, match=match):
        await plain_provider.create(spec)


async def test_process_provider_exec_validates_arguments(
    plain_provider: ProcessSandboxProvider,
) -> None:
    """Unsupported user, bad timeouts and bad env raise ValueError naming them."""
    sandbox = await plain_provider.create(SandboxSpec())
    with pytest.raises(ValueError, match="user='nobody'"):
        await plain_provider.exec(sandbox, "true", user="nobody")
    for timeout in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            await plain_provider.exec(sandbox, "true", timeout_s=timeout)
    with pytest.raises(ValueError, match="env"):
        await plain_provider.exec(sandbox, "true", env={"": "x"})


def test_process_provider_constructor_validates() -> None:
    """A cgroup parent that is not one directory name raises ValueError naming it."""
    with pytest.raises(ValueError, match="cgroup_parent='a/b'"):
        ProcessSandboxProvider(cgroup_parent="a/b")


async def test_process_provider_status_and_close(plain_provider: ProcessSandboxProvider) -> None:
    """Status follows the lifecycle; close kills background processes, removes the directory
    and is idempotent; a closed sandbox refuses commands."""
    sandbox = await plain_provider.create(SandboxSpec())
    assert await plain_provider.status(sandbox) is SandboxStatus.RUNNING
    result = await plain_provider.exec(sandbox, "sleep 30 >/dev/null 2>&1 & echo $!")
    background = int(result.stdout or "0")
    namespace = pid_namespace(sandbox)
    assert host_pid(namespace, background) is not None
    root = Path(sandbox.raw.root)
    await plain_provider.close(sandbox)
    await plain_provider.close(sandbox)
    await dead(namespace, background)
    assert not exists(root)
    assert await plain_provider.status(sandbox) is SandboxStatus.STOPPED
    foreign = SandboxHandle("other", "process", None)
    assert await plain_provider.status(foreign) is SandboxStatus.UNKNOWN
    with pytest.raises(RuntimeError, match="not open"):
        await plain_provider.exec(sandbox, "true")


async def test_process_provider_without_cgroups_says_so(
    plain_provider: ProcessSandboxProvider,
) -> None:
    """Without cgroups the allocation has source process and no limits; samples use /proc."""
    sandbox = await plain_provider.create(SandboxSpec(resources={"cpu": 0.5, "memory_mib": 64}))
    allocation = await plain_provider.resource_allocation(sandbox)
    assert allocation.source == "process"
    assert allocation.designator is not None
    assert allocation.designator.kind == "process"
    assert allocation.designator.scope == BOOT_ID
    assert allocation.host is not None
    assert allocation.host.kind == "host"
    (component,) = allocation.components
    assert component.limits.cpu is None
    assert component.limits.memory_mib is None
    started = await plain_provider.exec(sandbox, "sleep 30 >/dev/null 2>&1 & echo $!")
    pid = host_pid(pid_namespace(sandbox), int((started.stdout or "").strip()))
    assert pid is not None
    await sleeping_in_its_own_image(pid)
    sample = await plain_provider.resource_sample(sandbox)
    assert sample[USAGE + "source"] == "proc"
    assert sample[USAGE + "pids"] == 1
    assert isinstance(sample[USAGE + "memory_mib"], float)
    assert sample[USAGE + "memory_mib"] > 0


# --- with real cgroups ----------------------------------------------------------------------


async def test_process_provider_allocation_equals_enforced_limits(
    provider: ProcessSandboxProvider,
) -> None:
    """The allocation reports exactly the cpu and memory limits the kernel files hold."""
    version = require_cgroups(provider)
    sandbox = await provider.create(SandboxSpec(resources={"cpu": 0.5, "memory_mib": 64}))
    allocation = await provider.resource_allocation(sandbox)
    assert allocation.source == f"cgroup.v{version}"
    assert allocation.designator is not None
    assert allocation.designator.kind == "cgroup"
    dirs = sandbox_cgroup_dirs(version, sandbox)
    memory_dir = dirs["memory" if version == 1 else ""]
    mount = cgroup_mounts()["memory" if version == 1 else ""]
    assert allocation.designator.id == "/" + str(memory_dir.relative_to(mount))
    if version == 1:
        quota = int((dirs["cpu"] / "cpu.cfs_quota_us").read_text())
        period = int((dirs["cpu"] / "cpu.cfs_period_us").read_text())
        memory = int((memory_dir / "memory.limit_in_bytes").read_text())
        memsw = memory_dir / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            assert int(memsw.read_text()) == memory
    else:
        quota_text, period_text = (memory_dir / "cpu.max").read_text().split()
        quota, period = int(quota_text), int(period_text)
        memory = int((memory_dir / "memory.max").read_text())
    (component,) = allocation.components
    assert component.limits.cpu == quota / period == 0.5
    assert component.limits.memory_mib == memory // (1 << 20) == 64
    assert component.requests.cpu is None


async def test_process_provider_commands_run_inside_the_cgroup(
    provider: ProcessSandboxProvider,
) -> None:
    """A command (and its children) are members of the sandbox's cgroup from the start, in
    every hierarchy beneath this process's own cgroup there."""
    version = require_cgroups(provider)
    sandbox = await provider.create(SandboxSpec(resources={"memory_mib": 128}))
    allocation = await provider.resource_allocation(sandbox)
    assert allocation.designator is not None
    result = await provider.exec(sandbox, "sh -c 'cat /proc/self/cgroup'")
    # hierarchy-id:controllers:path; v1 lists each hierarchy, v2 has the one "0::" line.
    lines = [ln.split(":", 2) for ln in (result.stdout or "").splitlines()]
    joined = {c: path for _, controllers, path in lines for c in controllers.split(",")}
    mounts = cgroup_mounts()
    dirs = sandbox_cgroup_dirs(version, sandbox)
    for controller, directory in dirs.items():
        assert joined[controller] == "/" + str(directory.relative_to(mounts[controller]))
    assert joined["memory" if version == 1 else ""] == allocation.designator.id


async def test_process_provider_close_kills_escaped_processes(
    provider: ProcessSandboxProvider,
) -> None:
    """close() kills processes that left the command's session, and removes the cgroup."""
    version = require_cgroups(provider)
    sandbox = await provider.create(SandboxSpec())
    dirs = sandbox_cgroup_dirs(version, sandbox)
    assert all(d.is_dir() for d in dirs.values())
    escape = "setsid sh -c 'echo $$ > escaped.pid; exec sleep 30' >/dev/null 2>&1 &"
    result = await provider.exec(
        sandbox,
        escape + " for i in $(seq 100); do [ -s escaped.pid ] && break; sleep 0.02; done;"
        " cat escaped.pid",
    )
    escaped = int(result.stdout or "0")
    namespace = pid_namespace(sandbox)
    assert host_pid(namespace, escaped) is not None
    await provider.close(sandbox)
    await dead(namespace, escaped)
    assert not any(d.exists() for d in dirs.values())


# Two CPU-bound processes left running in the sandbox's background, their PIDs in burners.pid.
BURN = "sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $! >> burners.pid; "
BURNERS = BURN + BURN


async def wait_throttled(
    provider: ProcessSandboxProvider, sandbox: SandboxHandle
) -> dict[str, object]:
    """Poll the sandbox's real cgroup until the kernel has throttled it, bounded generously:
    on a loaded machine the burners may get less than their quota for a long while."""

    async def throttled() -> dict[str, object]:
        sample = dict(await provider.resource_sample(sandbox))
        return sample if sample.get(USAGE + "cpu.throttled_s", 0) > 0 else {}  # type: ignore[operator]

    return await eventually(
        throttled, "the kernel throttled the sandbox", timeout=150, interval=0.1
    )


async def test_process_provider_cpu_limit_throttles(provider: ProcessSandboxProvider) -> None:
    """CPU-bound commands under 0.5 CPU are throttled and never get more than half a core."""
    require_cgroups(provider)
    sandbox = await provider.create(SandboxSpec(resources={"cpu": 0.5}))
    started = time.monotonic()
    await provider.exec(sandbox, BURNERS)
    sample = await wait_throttled(provider, sandbox)
    wall = time.monotonic() - started
    await provider.close(sandbox)
    assert sample[USAGE + "cpu.throttled_periods"] > 0  # type: ignore[operator]
    # The quota is 50 ms per 100 ms period: at most half of the wall time, plus a period. (An
    # upper bound on CPU time, which a loaded machine only makes easier to meet; the kernel's
    # nr_periods is no base for it, as it counts only periods its bandwidth timer ran.)
    assert sample[USAGE + "cpu.time_s"] <= wall * 0.5 + 0.15  # type: ignore[operator]


async def test_process_provider_memory_limit_oom_kills(provider: ProcessSandboxProvider) -> None:
    """A command exceeding the memory limit is killed by the kernel and the result says so."""
    require_cgroups(provider)
    sandbox = await provider.create(SandboxSpec(resources=SandboxResources(memory_mib=48)))
    # dd's 200 MiB block is one buffer, filled from /dev/zero: far past the 48 MiB limit.
    hog = "dd if=/dev/zero of=/dev/null bs=200M count=1 2>/dev/null && echo survived"
    result = await provider.exec(sandbox, hog, timeout_s=20)
    assert result.return_code == 137
    assert result.error_type == "oom_kill"
    assert "survived" not in (result.stdout or "")
    sample = await provider.resource_sample(sandbox)
    assert sample[USAGE + "oom_kills"] >= 1  # type: ignore[operator]
    assert 40 <= sample[USAGE + "memory_peak_mib"] <= 48  # type: ignore[operator]


async def test_process_provider_sample_counts_pids(provider: ProcessSandboxProvider) -> None:
    """Background processes in the sandbox show in usage.pids until close."""
    require_cgroups(provider)
    sandbox = await provider.create(SandboxSpec())
    await provider.exec(sandbox, "sleep 30 >/dev/null 2>&1 & sleep 30 >/dev/null 2>&1 &")
    sample = await provider.resource_sample(sandbox)
    assert sample[USAGE + "pids"] == 2
    assert str(sample[USAGE + "source"]).startswith("cgroup.v")


def test_process_provider_environment_has_no_caller_variables() -> None:
    """The sandbox's base environment holds PATH, HOME and LANG only (checked on a sandbox)."""

    async def run() -> str:
        made = ProcessSandboxProvider(cgroups=False)
        try:
            sandbox = await made.create(SandboxSpec())
            return (await made.exec(sandbox, "env | cut -d= -f1 | sort")).stdout or ""
        finally:
            await made.aclose()

    names = set(asyncio.run(run()).split()) - {"PWD", "SHLVL", "_", "OLDPWD"}
    assert names == {"PATH", "HOME", "LANG"}
    assert os.environ.get("PATH")


def test_cgroup_v2_files_written_and_read_back(tmp_path: Path) -> None:
    """On a v2 layout (a directory in cgroupfs's file format, since this host's cpu and
    memory controllers may be bound to v1) the limits written are the ones read back, and
    samples parse the v2 files; "max" reads as unlimited."""
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    layout = _cgroups.Layout(2, {"": tmp_path})
    made = _cgroups.make_cgroup(layout, "nemo_gym", "sbx", 0.5, 64)
    directory = tmp_path / "nemo_gym" / "sbx"
    assert made.path == "/nemo_gym/sbx"
    assert made.unique_dirs() == [directory]
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (tmp_path / "nemo_gym" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (directory / "cpu.max").read_text() == "50000 100000"
    assert (directory / "memory.max").read_text() == str(64 << 20)
    assert _cgroups.cgroup_limits(made) == SandboxResourceAmounts(cpu=0.5, memory_mib=64)
    (directory / "cpu.stat").write_text(
        "usage_usec 1500000\nnr_periods 30\nnr_throttled 12\nthrottled_usec 250000\n"
    )
    (directory / "memory.current").write_text(str(10 << 20))
    (directory / "memory.peak").write_text(str(64 << 20))
    (directory / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    (directory / "pids.current").write_text("3\n")
    assert _cgroups.cgroup_sample(made) == {
        USAGE + "source": "cgroup.v2",
        USAGE + "cpu.time_s": 1.5,
        USAGE + "cpu.throttled_s": 0.25,
        USAGE + "cpu.throttled_periods": 12,
        USAGE + "memory_mib": 10.0,
        USAGE + "memory_peak_mib": 64.0,
        USAGE + "oom_kills": 1,
        USAGE + "pids": 3,
    }
    (directory / "cpu.max").write_text("max 100000\n")
    (directory / "memory.max").write_text("max\n")
    assert _cgroups.cgroup_limits(made) == SandboxResourceAmounts()


async def test_process_provider_forgets_a_session_once_it_has_ended(
    plain_provider: ProcessSandboxProvider,
) -> None:
    """A command that left nothing running gives its session id back at once (the kernel may
    reuse the number for a stranger, whom a close or a sample must never reach); one that left
    a background process keeps it until that process is gone."""
    sandbox = await plain_provider.create(SandboxSpec())
    state = plain_provider._sandboxes[sandbox.sandbox_id]
    await plain_provider.exec(sandbox, "true")
    assert state.sessions == set()
    result = await plain_provider.exec(sandbox, "sleep 60 >/dev/null 2>&1 & echo $!")
    assert len(state.sessions) == 1
    (session,) = state.sessions
    background = int(result.stdout)
    os.kill(host_pid(pid_namespace(sandbox), background) or 0, signal.SIGKILL)

    def session_ended() -> bool:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return True
        return False

    await eventually(session_ended, "the background process killed and reaped", interval=0.01)
    sample = await plain_provider.resource_sample(sandbox)
    assert state.sessions == set()
    assert sample[PREFIX + "usage.pids"] == 0
    await plain_provider.close(sandbox)
