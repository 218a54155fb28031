"""A server's cgroup limits bound the sandboxes it makes: sandbox cgroups nest beneath it.

The real half runs a server (a subprocess running ``ProcessSandboxProvider``) inside a cgroup
this test makes, with and without a 256 MiB memory limit, and has its sandbox allocate 400 MiB.
The other half checks the placement arithmetic on ``/proc/self/cgroup`` and ``mountinfo``
text, and the v2 preparation on directory trees laid out as cgroupfs lays them out (this
machine's cpu and memory controllers may be bound to v1).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import require_service
from isolation_support import bwrap_on_path, cgroup_mounts, own_cgroup_paths
from opentelemetry.instrumentation.nemo_gym import environment_variables as env
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import _cgroups
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import (
    parse_mountinfo,
    parse_proc_cgroup,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_placement import (
    SERVER_LEAF,
    PlacementError,
    UnavailableError,
    discover_layout,
    plan_layout,
    prepare_layout,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from waiting import eventually_blocking

MIB = 1 << 20
SERVER_LIMIT_MIB = 256
HOG_MIB = 400
USAGE = "nemo.gym.sandbox.usage."

# --- the real thing: a server in a bounded cgroup ------------------------------------------------

# A server: one isolated sandbox that asks for 1 GiB (so only the server's own bound can stop
# it), a command in it that fills a 400 MiB buffer, then the sandbox's sample, allocation and
# close, reported as JSON on stdout.
SERVER = f"""
import asyncio, json, os, sys
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

HOG = "dd if=/dev/zero of=/dev/null bs={HOG_MIB}M count=1 2>/dev/null && echo survived"


async def main():
    provider = ProcessSandboxProvider()
    sandbox = await provider.create(SandboxSpec(resources={{"memory_mib": 1024}}))
    cgroup = sandbox.raw.cgroup
    dirs = {{c: str(d) for c, d in cgroup.dirs.items()}}
    result = await provider.exec(sandbox, HOG, timeout_s=120)
    sample = await provider.resource_sample(sandbox)
    allocation = await provider.resource_allocation(sandbox)
    await provider.close(sandbox)
    after_close = sorted(d for d in dirs.values() if os.path.exists(d))
    await provider.aclose()
    print(json.dumps({{
        "version": provider.cgroup_version,
        "sandbox_id": sandbox.sandbox_id,
        "dirs": dirs,
        "designator": allocation.designator.id,
        "limit_mib": allocation.components[0].limits.memory_mib,
        "return_code": result.return_code,
        "error_type": result.error_type,
        "stdout": result.stdout,
        "sample": sample,
        "after_close": after_close,
    }}))


asyncio.run(main())
"""


def _remove_tree(top: Path) -> None:
    """Remove the cgroup ``top`` and every cgroup beneath it, deepest first, killing what is
    left in them: only processes of the server this test started can be there."""
    if not top.exists():
        return
    dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for directory in [*dirs, top]:
        for word in (directory / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(word), signal.SIGKILL)

        def removed(directory: Path = directory) -> bool:
            try:
                directory.rmdir()
            except FileNotFoundError:
                return True
            except OSError:
                return False  # busy until the killed processes are gone
            return True

        eventually_blocking(removed, f"cgroup {directory} removed", interval=0.01)


@pytest.fixture
def server_cgroup(request: pytest.FixtureRequest) -> Iterator[tuple[int, Path, str]]:
    """A cgroup of this test's (version, directory, cgroup path) for a server, memory-limited
    to ``request.param`` MiB (``None``: no limit), removed with all beneath it afterwards.

    v1: beneath this process's own memory cgroup. v2: at the hierarchy's root, the one place a
    test can give a cgroup's children controllers without moving itself (its own cgroup holds
    it: "no internal processes")."""
    limit_mib: int | None = request.param
    require_service(os.geteuid() == 0, "making cgroups needs root")
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    mounts, own = cgroup_mounts(), own_cgroup_paths()
    name = f"nemo_gym_test_server_{uuid.uuid4().hex[:8]}"
    if "memory" in mounts and "cpu" in mounts:
        version, path = 1, f"{own['memory'].rstrip('/')}/{name}"
        directory = mounts["memory"] / path.lstrip("/")
    else:
        require_service("" in mounts, "no cgroup hierarchy mounted")
        version, path, directory = 2, f"/{name}", mounts[""] / name
        available = (mounts[""] / "cgroup.controllers").read_text().split()
        wanted = [c for c in ("cpu", "memory", "pids") if c in available]
        (mounts[""] / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
    directory.mkdir()
    try:
        if limit_mib is not None:
            limit = str(limit_mib * MIB)
            # Swap capped too, else the excess could be swapped instead of refused.
            if version == 1:
                (directory / "memory.limit_in_bytes").write_text(limit)
                memsw = directory / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    memsw.write_text(limit)
            else:
                (directory / "memory.max").write_text(limit)
                swap = directory / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
        yield version, directory, path
    finally:
        _remove_tree(directory)


def _run_server_in(directory: Path, tmp_path: Path) -> dict[str, object]:
    """Run ``SERVER`` born inside cgroup ``directory`` (it joins before Python starts) and
    return its report."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    join = 'echo $$ > "$1" || exit 125; shift; exec "$@"'
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM"))}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        ["/bin/sh", "-c", join, "join", str(directory / "cgroup.procs"), sys.executable, script],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


def _peak_bytes(version: int, directory: Path) -> int:
    """The most memory cgroup ``directory`` and everything beneath it ever held (v1
    ``memory.max_usage_in_bytes``, v2 ``memory.peak``)."""
    name = "memory.max_usage_in_bytes" if version == 1 else "memory.peak"
    return int((directory / name).read_text())


@pytest.mark.parametrize("server_cgroup", [SERVER_LIMIT_MIB], indirect=True)
def test_process_cgroup_nesting_server_limit_bounds_its_sandbox(
    server_cgroup: tuple[int, Path, str], tmp_path: Path
) -> None:
    """A server held to 256 MiB makes a sandbox (asking for 1 GiB) whose command allocates
    400 MiB: the kernel kills it at the server's bound, the sample reads the nested cgroup,
    and close() and aclose() leave nothing beneath the server's cgroup."""
    version, directory, path = server_cgroup
    report = _run_server_in(directory, tmp_path)
    assert (report["return_code"], report["error_type"], report["stdout"]) == (
        137,
        "oom_kill",
        "",
    )
    assert report["limit_mib"] == 1024  # its own limit: the server's bound is what stopped it
    assert report["version"] == version
    sandbox_dir = directory / "nemo_gym" / str(report["sandbox_id"])
    dirs = report["dirs"]
    assert isinstance(dirs, dict)
    assert dirs["memory" if version == 1 else ""] == str(sandbox_dir)
    assert report["designator"] == f"{path}/nemo_gym/{report['sandbox_id']}"
    sample = report["sample"]
    assert isinstance(sample, dict)
    assert sample[USAGE + "source"] == f"cgroup.v{version}"
    assert sample[USAGE + "oom_kills"] == 1
    assert 0 < sample[USAGE + "memory_peak_mib"] <= SERVER_LIMIT_MIB
    # The server's cgroup reached its limit (the charge that failed; within the kernel's
    # charge batch of 64 pages): its bound, not the sandbox's own, did the killing.
    limit = SERVER_LIMIT_MIB * MIB
    assert limit - MIB < _peak_bytes(version, directory) <= limit
    assert report["after_close"] == []
    # aclose() removed the sandboxes' parent; on v2 the server's leaf is all that is left.
    assert sorted(p.name for p in directory.iterdir() if p.is_dir()) == (
        [] if version == 1 else [SERVER_LEAF]
    )


@pytest.mark.parametrize("server_cgroup", [None], indirect=True)
def test_process_cgroup_nesting_unbounded_server_sandbox_allocates(
    server_cgroup: tuple[int, Path, str], tmp_path: Path
) -> None:
    """The control: the same server in a cgroup without a limit, the same sandbox and
    command: the 400 MiB are allocated and the command completes."""
    _, directory, path = server_cgroup
    report = _run_server_in(directory, tmp_path)
    assert report["designator"] == f"{path}/nemo_gym/{report['sandbox_id']}"
    assert (report["return_code"], report["error_type"], report["stdout"]) == (
        0,
        None,
        "survived\n",
    )
    sample = report["sample"]
    assert isinstance(sample, dict)
    assert sample[USAGE + "memory_peak_mib"] >= HOG_MIB
    assert sample.get(USAGE + "oom_kills", 0) == 0
    assert report["after_close"] == []


# --- an operator-named parent, for real -----------------------------------------------------------


@pytest.fixture
def named_parent() -> Iterator[tuple[str, list[Path]]]:
    """A cgroup ``/nemo_gym_test_named_<tag>`` in every v1 hierarchy the provider uses (or the
    v2 one), as an operator would prepare it, removed with all beneath it afterwards."""
    require_service(os.geteuid() == 0, "making cgroups needs root")
    mounts = cgroup_mounts()
    path = f"/nemo_gym_test_named_{uuid.uuid4().hex[:8]}"
    controllers = ("cpu", "cpuacct", "memory", "pids") if "memory" in mounts else ("",)
    made = sorted({mounts[c] / path.lstrip("/") for c in controllers if c in mounts})
    try:
        for directory in made:
            directory.mkdir()
        yield path, made
    finally:
        for directory in made:
            _remove_tree(directory)


async def test_process_cgroup_nesting_named_parent_holds_the_sandboxes(
    named_parent: tuple[str, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT naming a prepared cgroup, sandbox
    cgroups are made beneath it in every hierarchy, sampled there, and removed at close."""
    path, made = named_parent
    monkeypatch.setenv(env.OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT, path + "/")
    provider = ProcessSandboxProvider(isolation="none")
    try:
        sandbox = await provider.create(SandboxSpec(resources={"memory_mib": 64}))
        allocation = await provider.resource_allocation(sandbox)
        assert allocation.designator is not None
        assert allocation.designator.id == f"{path}/nemo_gym/{sandbox.sandbox_id}"
        cgroup = sandbox.raw.cgroup
        assert sorted(set(cgroup.dirs.values())) == [
            d / "nemo_gym" / sandbox.sandbox_id for d in made
        ]
        await provider.exec(sandbox, "sleep 30 >/dev/null 2>&1 &")
        sample = await provider.resource_sample(sandbox)
        assert sample[USAGE + "pids"] == 1
        await provider.close(sandbox)
        assert [d for d in made if (d / "nemo_gym" / sandbox.sandbox_id).exists()] == []
    finally:
        await provider.aclose()
    assert [d for d in made if (d / "nemo_gym").exists()] == []


async def test_process_cgroup_nesting_missing_named_parent_warns_and_nests_under_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A named cgroup that does not exist is one warning naming the variable and the value;
    the sandboxes' cgroups then go beneath the server's own cgroup."""
    require_service(os.geteuid() == 0, "making cgroups needs root")
    missing = f"/nemo_gym_test_missing_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING)
    layout = discover_layout(missing)
    require_service(layout is not None, "no writable cgroup hierarchy with cpu and memory")
    assert layout is not None
    own = own_cgroup_paths()
    assert layout.path == (own["memory"] if layout.version == 1 else own[""])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        f"OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT={missing} cannot hold sandbox cgroups: "
    )
    assert warnings[0].endswith("they go under this server's own cgroup instead")


# --- placement arithmetic, on text --------------------------------------------------------------

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# A Kubernetes container's view under cgroup v1: its memory and pids cgroups are its pod's
# container cgroup, its cpu one the root (no CPU limit).
POD_PROC = """\
12:pids:/kubepods/burstable/pod1/c0ffee
8:memory:/kubepods/burstable/pod1/c0ffee
4:cpu,cpuacct:/
0::/
"""
V2_MOUNTINFO = "41 23 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
SERVICE_PROC = "0::/system.slice/gym.service\n"


def test_plan_layout_v1_nests_under_each_hierarchys_own_cgroup() -> None:
    """On v1 each controller's base is the process's own cgroup in that hierarchy, and the
    layout's path (the designator's prefix) is the memory one."""
    layout = plan_layout(parse_mountinfo(HYBRID_MOUNTINFO), *parse_proc_cgroup(POD_PROC), None)
    assert layout == _cgroups.Layout(
        1,
        {
            "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
            "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct"),
            "memory": Path("/sys/fs/cgroup/memory/kubepods/burstable/pod1/c0ffee"),
            "pids": Path("/sys/fs/cgroup/pids/kubepods/burstable/pod1/c0ffee"),
        },
        "/kubepods/burstable/pod1/c0ffee",
    )


def test_plan_layout_named_parent_is_the_same_path_in_every_hierarchy() -> None:
    """A named parent replaces the process's own cgroup in every hierarchy."""
    layout = plan_layout(
        parse_mountinfo(HYBRID_MOUNTINFO), *parse_proc_cgroup(POD_PROC), "/gym/sandboxes"
    )
    assert layout.path == "/gym/sandboxes"
    assert layout.bases["memory"] == Path("/sys/fs/cgroup/memory/gym/sandboxes")
    assert layout.bases["cpu"] == Path("/sys/fs/cgroup/cpu,cpuacct/gym/sandboxes")


def test_plan_layout_v1_mount_of_a_subtree() -> None:
    """A hierarchy mounted from a sub-tree (a container's bind mount) shows the own cgroup
    relative to the mount's root; one that does not show it at all is refused, naming it."""
    mountinfo = (
        "1 0 0:1 /kubepods/pod1 /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "2 0 0:2 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    )
    mounts = parse_mountinfo(mountinfo)
    own = parse_proc_cgroup("3:memory:/kubepods/pod1/c1\n2:cpu:/\n")
    assert plan_layout(mounts, *own, None).bases == {
        "cpu": Path("/sys/fs/cgroup/cpu"),
        "memory": Path("/sys/fs/cgroup/memory/c1"),
    }
    elsewhere = parse_proc_cgroup("3:memory:/other/c1\n2:cpu:/\n")
    with pytest.raises(PlacementError, match=r"memory hierarchy .* does not show cgroup /other/c1"):
        plan_layout(mounts, *elsewhere, None)


def test_plan_layout_v2_own_named_and_server_leaf() -> None:
    """On v2 the base is the own cgroup, the named one, or, for a process already in a
    ``nemo_gym_server`` leaf, that leaf's parent (the base its first provider prepared)."""
    mounts = parse_mountinfo(V2_MOUNTINFO)
    own = parse_proc_cgroup(SERVICE_PROC)
    assert plan_layout(mounts, *own, None) == _cgroups.Layout(
        2, {"": Path("/sys/fs/cgroup/system.slice/gym.service")}, "/system.slice/gym.service"
    )
    in_leaf = parse_proc_cgroup(f"0::/system.slice/gym.service/{SERVER_LEAF}\n")
    assert plan_layout(mounts, *in_leaf, None) == plan_layout(mounts, *own, None)
    assert plan_layout(mounts, *in_leaf, "/gym").bases == {"": Path("/sys/fs/cgroup/gym")}
    assert plan_layout(mounts, *own, "/").bases == {"": Path("/sys/fs/cgroup")}


def test_plan_layout_refuses_what_it_cannot_place() -> None:
    """Nothing mounted is 'unavailable'; a v2 mount without the process's v2 line is an error."""
    with pytest.raises(UnavailableError):
        plan_layout(parse_mountinfo(""), {}, None, None)
    with pytest.raises(PlacementError, match="no cgroup v2 line"):
        plan_layout(parse_mountinfo(V2_MOUNTINFO), {}, None, None)


# --- v2 preparation, on directory trees laid out as cgroupfs ------------------------------------


def _fake_v2_cgroup(
    directory: Path, procs: list[int], *, root: bool = False, controllers: str = "cpu memory pids"
) -> Path:
    """A directory with the files of a v2 cgroup (the root has no cgroup.type)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in procs))
    (directory / "cgroup.controllers").write_text(controllers + "\n")
    (directory / "cgroup.subtree_control").write_text("")
    if not root:
        (directory / "cgroup.type").write_text("domain\n")
    return directory


def test_prepare_layout_v2_alone_moves_itself_into_a_leaf(tmp_path: Path) -> None:
    """A server alone in its v2 cgroup moves itself (only itself) into ``nemo_gym_server``,
    then its cgroup's children get cpu, memory and pids."""
    base = _fake_v2_cgroup(tmp_path / "gym.service", [4242])
    layout = _cgroups.Layout(2, {"": base}, "/gym.service")
    assert prepare_layout(layout, 4242) == layout
    assert (base / SERVER_LEAF / "cgroup.procs").read_text() == "4242"
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"


def test_prepare_layout_v2_shared_cgroup_moves_nobody(tmp_path: Path) -> None:
    """A v2 cgroup holding other processes is refused, naming them and the variable: nothing
    is moved and no controller is enabled."""
    base = _fake_v2_cgroup(tmp_path / "session-1.scope", [17, 4242, 99])
    layout = _cgroups.Layout(2, {"": base}, "/session-1.scope")
    with pytest.raises(PlacementError) as raised:
        prepare_layout(layout, 4242)
    message = str(raised.value)
    assert "holds processes other than this server (17 99)" in message
    assert env.OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT in message
    assert not (base / SERVER_LEAF).exists()
    assert (base / "cgroup.subtree_control").read_text() == ""


def test_prepare_layout_v2_root_and_prepared_cgroups_are_used_as_they_are(
    tmp_path: Path,
) -> None:
    """The hierarchy's root (exempt from the rule) gets the controllers with its processes in
    place; a cgroup whose children already have them is left untouched."""
    root = _fake_v2_cgroup(tmp_path / "root", [1, 4242], root=True)
    prepare_layout(_cgroups.Layout(2, {"": root}, "/"), 4242)
    assert not (root / SERVER_LEAF).exists()
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    prepared = _fake_v2_cgroup(tmp_path / "prepared", [])
    (prepared / "cgroup.subtree_control").write_text("cpu memory pids\n")
    prepare_layout(_cgroups.Layout(2, {"": prepared}, "/prepared"), 4242)
    assert (prepared / "cgroup.subtree_control").read_text() == "cpu memory pids\n"


def test_prepare_layout_refuses_a_base_without_controllers_or_files(tmp_path: Path) -> None:
    """A v2 base whose parent gives it no memory controller, and a v1 base that is no
    cgroup, are refused naming the directory; a missing optional v1 hierarchy is left out."""
    base = _fake_v2_cgroup(tmp_path / "v2", [4242], controllers="cpu pids")
    with pytest.raises(PlacementError, match=r"offers no memory controller .*cpu pids"):
        prepare_layout(_cgroups.Layout(2, {"": base}, "/v2"), 4242)
    memory = tmp_path / "memory"
    memory.mkdir()
    (memory / "cgroup.procs").write_text("")
    cpu = tmp_path / "cpu"
    layout = _cgroups.Layout(1, {"cpu": cpu, "memory": memory, "pids": tmp_path / "pids"}, "/")
    with pytest.raises(PlacementError, match=f"{cpu} is not a cgroup"):
        prepare_layout(layout, 4242)
    cpu.mkdir()
    (cpu / "cgroup.procs").write_text("")
    assert prepare_layout(layout, 4242).bases == {"cpu": cpu, "memory": memory}


def test_make_cgroup_nested_path_and_directories(tmp_path: Path) -> None:
    """A sandbox cgroup is ``<base>/<parent>/<id>``, designated by the base's path."""
    base = _fake_v2_cgroup(tmp_path / "gym.service", [])
    made = _cgroups.make_cgroup(
        _cgroups.Layout(2, {"": base}, "/gym.service"), "nemo_gym", "sbx", None, 64
    )
    assert made.path == "/gym.service/nemo_gym/sbx"
    assert made.unique_dirs() == [base / "nemo_gym" / "sbx"]
    assert (base / "nemo_gym" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
