"""Finding and reading a container's cgroup: the pure parsers, and the readers on files laid
out as cgroupfs lays them out (the real cgroups are read in test_docker_cgroup_sampling.py)."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import (
    Mount,
    Mounts,
    parse_mountinfo,
    parse_proc_cgroup,
    read_file,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroups import (
    Cgroup,
    cgroup_usage,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._container_cgroup import (
    cgroup_of_paths,
    container_cgroup,
)

CID = "d8557582430c4d8e8795f5ba1312629873c0a6f5c72616f122f3985edbd3c736"
HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:35 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_PROC = f"""\
9:name=systemd:/libpod_parent/libpod-{CID}
8:pids:/libpod_parent/libpod-{CID}
4:memory:/libpod_parent/libpod-{CID}
2:cpu,cpuacct:/libpod_parent/libpod-{CID}
3:cpuset:/libpod_parent/libpod-{CID}
0::/libpod_parent/libpod-{CID}
"""


def test_parse_mountinfo_hybrid_layout() -> None:
    """Co-mounted v1 controllers share one mount; named hierarchies are ignored; the
    unified hierarchy is the v2 mount."""
    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    cpu = Mount("/", Path("/sys/fs/cgroup/cpu,cpuacct"))
    assert mounts.v1 == {
        "cpu": cpu,
        "cpuacct": cpu,
        "memory": Mount("/", Path("/sys/fs/cgroup/memory")),
        "pids": Mount("/", Path("/sys/fs/cgroup/pids")),
    }
    assert mounts.v2 == Mount("/", Path("/sys/fs/cgroup/unified"))


def test_parse_mountinfo_escaped_point_and_namespaced_root() -> None:
    """Octal escapes in mount points are undone and a mount's root is kept."""
    mounts = parse_mountinfo(
        "41 31 0:38 /kubepods/pod1 /sys/fs/cgroup\\040x rw - cgroup2 cgroup2 rw\n"
    )
    assert mounts.v1 == {}
    assert mounts.v2 == Mount("/kubepods/pod1", Path("/sys/fs/cgroup x"))


def test_mount_directory_only_under_its_root() -> None:
    """A cgroup path maps below a mount only when the mount's root is a prefix of it."""
    mount = Mount("/kubepods/pod1", Path("/sys/fs/cgroup"))
    assert mount.directory("/kubepods/pod1/abc") == Path("/sys/fs/cgroup/abc")
    assert mount.directory("/kubepods/pod1") == Path("/sys/fs/cgroup")
    assert mount.directory("/kubepods/pod10/abc") is None
    assert mount.directory("/system.slice/x") is None
    assert Mount("/", Path("/c")).directory("/a/b") == Path("/c/a/b")
    # Outside this process's cgroup namespace: never a directory above the mount.
    assert Mount("/", Path("/c")).directory(f"/../../docker/{CID}") is None


def test_parse_proc_cgroup_hybrid() -> None:
    """v1 lines map each controller we read to its path; the 0:: line is the v2 path."""
    v1, v2 = parse_proc_cgroup(HYBRID_PROC)
    path = f"/libpod_parent/libpod-{CID}"
    assert v1 == {"pids": path, "memory": path, "cpu": path, "cpuacct": path}
    assert v2 == path
    assert parse_proc_cgroup(f"0::/system.slice/docker-{CID}.scope\n") == (
        {},
        f"/system.slice/docker-{CID}.scope",
    )


def test_cgroup_of_paths_prefers_v1_memory_on_hybrid() -> None:
    """On a hybrid machine the v1 hierarchies are used, one directory per controller."""
    cgroup = cgroup_of_paths(
        parse_mountinfo(HYBRID_MOUNTINFO), *parse_proc_cgroup(HYBRID_PROC), CID
    )
    assert cgroup is not None
    assert cgroup.version == 1
    assert cgroup.dirs["memory"] == Path(f"/sys/fs/cgroup/memory/libpod_parent/libpod-{CID}")
    assert cgroup.dirs["cpuacct"] == Path(f"/sys/fs/cgroup/cpu,cpuacct/libpod_parent/libpod-{CID}")
    assert set(cgroup.dirs) == {"cpu", "cpuacct", "memory", "pids"}


def test_cgroup_of_paths_v2_only() -> None:
    """On a v2 machine the one unified directory is used."""
    mounts = Mounts({}, Mount("/", Path("/sys/fs/cgroup")))
    path = f"/system.slice/docker-{CID}.scope"
    cgroup = cgroup_of_paths(mounts, {}, path, CID)
    assert cgroup == Cgroup(2, {"": Path(f"/sys/fs/cgroup/system.slice/docker-{CID}.scope")}, path)


def test_cgroup_of_paths_refuses_other_container_or_unmounted() -> None:
    """A path that does not name the container (a PID of another machine or namespace), or
    that no mount here shows, gives no cgroup."""
    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    paths = parse_proc_cgroup(HYBRID_PROC)
    assert cgroup_of_paths(mounts, *paths, "f" * 64) is None
    assert cgroup_of_paths(mounts, *paths, "") is None
    assert cgroup_of_paths(Mounts(), *paths, CID) is None
    namespaced = Mounts({}, Mount("/other", Path("/sys/fs/cgroup")))
    assert cgroup_of_paths(namespaced, {}, f"/docker/{CID}", CID) is None


def test_container_cgroup_odd_pid_is_none() -> None:
    """A missing, zero, negative or non-integer State.Pid gives no cgroup and no error."""
    for pid in (None, 0, -1, True, "123", 2**22 + 12345):
        assert container_cgroup(pid, CID) is None


def _v1_files(root: Path, oom_control: str | None) -> Cgroup:
    dirs = {c: root / c / "ctr" for c in ("cpu", "cpuacct", "memory", "pids")}
    for directory in dirs.values():
        directory.mkdir(parents=True)
    (dirs["cpuacct"] / "cpuacct.usage").write_text("2500000000\n")
    (dirs["cpu"] / "cpu.stat").write_text(
        "nr_periods 40\nnr_throttled 10\nthrottled_time 300000000\n"
    )
    (dirs["memory"] / "memory.usage_in_bytes").write_text(str(5 << 20))
    (dirs["memory"] / "memory.max_usage_in_bytes").write_text(str(64 << 20))
    if oom_control is not None:
        (dirs["memory"] / "memory.oom_control").write_text(oom_control)
    (dirs["pids"] / "pids.current").write_text("2\n")
    return Cgroup(1, dirs, "/ctr")


def test_cgroup_usage_v1_with_oom_kill_count(tmp_path: Path) -> None:
    """v1 files give every figure, oom_kill from memory.oom_control (Linux 4.13+)."""
    cgroup = _v1_files(tmp_path, "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cgroup_usage(cgroup) == {
        "cpu.time_s": 2.5,
        "cpu.throttled_s": 0.3,
        "cpu.throttled_periods": 10,
        "memory_mib": 5.0,
        "memory_peak_mib": 64.0,
        "oom_kills": 2,
        "pids": 2,
    }


def test_cgroup_usage_v1_old_kernel_has_no_oom_count(tmp_path: Path) -> None:
    """A v1 memory.oom_control without oom_kill (kernels before 4.13) leaves the count out
    rather than reporting 0."""
    cgroup = _v1_files(tmp_path, "oom_kill_disable 0\nunder_oom 0\n")
    usage = cgroup_usage(cgroup)
    assert usage is not None
    assert "oom_kills" not in usage
    assert usage["pids"] == 2


def test_cgroup_usage_gone_is_none(tmp_path: Path) -> None:
    """A cgroup whose memory usage cannot be read (removed) gives None, not an empty sample."""
    cgroup = _v1_files(tmp_path, None)
    (cgroup.dirs["memory"] / "memory.usage_in_bytes").unlink()
    assert cgroup_usage(cgroup) is None
    assert cgroup_usage(Cgroup(2, {"": tmp_path / "nothing"}, "/nothing")) is None


def test_read_file_missing_and_long(tmp_path: Path) -> None:
    """read_file gives None for a missing file and the whole text of one longer than a read."""
    assert read_file(tmp_path / "missing") is None
    (tmp_path / "long").write_text("x" * 200_000 + "\n")
    assert read_file(tmp_path / "long") == "x" * 200_000
