"""The reader of NeMo Gym's ``apptainer`` and ``enroot`` instances, on real host processes.

Neither runtime installs here, so the instance is built the way they build one: an init in a
mount namespace of its own (``unshare --mount``), and an "exec'd" command that joins that
namespace without descending from the init (``nsenter --mount``, as ``enroot exec <pid>``
does), beside an unrelated process. Once without a cgroup (the ``/proc`` path), once in a
cgroup of the instance's own with 0.5 CPU and 64 MiB, where an exec'd command is OOM-killed.
Needs root (namespaces, cgroups): skipped otherwise, failing under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from conftest import require_service
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import _cgroups
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_placement import (
    discover_layout,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroups import (
    Cgroup,
    joining,
    remove_cgroup,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.host_instance import (
    COMPONENT,
    HostInstanceReader,
    _pid_of,
    enroot_reader,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX

USAGE = PREFIX + "usage."


class Processes:
    """Processes started by a test, each ready (it printed a line) before it is used; all
    killed by PID at the end."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *argv: str) -> int:
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        self.started.append(process)
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"  # past unshare/nsenter: in place
        return process.pid

    def stop(self) -> None:
        for process in self.started:
            process.kill()
            process.wait(timeout=30)
            if process.stdout is not None:
                process.stdout.close()


@pytest.fixture
def processes() -> Iterator[Processes]:
    require_service(
        os.geteuid() == 0 and bool(shutil.which("unshare")) and bool(shutil.which("nsenter")),
        "namespaces and cgroups need root, unshare and nsenter",
    )
    started = Processes()
    try:
        yield started
    finally:
        started.stop()


# A process that says it runs, then stays: one with ``exec`` keeps the PID it was started with.
STAY = "echo ready; exec sleep 600"


def _handle(init_pid: int) -> SandboxHandle:
    """A handle as NeMo Gym's enroot provider makes one: the init's host PID on ``raw``."""
    return SandboxHandle(
        sandbox_id=f"enroot-{uuid.uuid4().hex[:8]}",
        provider_name="enroot",
        raw=SimpleNamespace(container_pid=init_pid),
    )


async def test_host_instance_reader_sums_the_namespace_from_proc(processes: Processes) -> None:
    """Without a cgroup of its own, the instance is its init and the command exec'd into its
    namespace, not the unrelated process: allocation the init with no limit, usage from /proc."""
    init = processes.start("unshare", "--mount", "sh", "-c", STAY)
    processes.start("nsenter", f"--target={init}", "--mount", "sh", "-c", STAY)
    processes.start("sh", "-c", STAY)  # on the host, outside the instance
    reader = enroot_reader(object())
    handle = _handle(init)
    allocation = await reader.resource_allocation(handle)
    assert allocation.source == "enroot.proc"
    assert allocation.designator is not None
    assert (allocation.designator.kind, allocation.designator.id) == ("process", str(init))
    assert [c.name for c in allocation.components] == [COMPONENT]
    assert allocation.components[0].limits.cpu is None
    assert allocation.components[0].limits.memory_mib is None
    sample = await reader.resource_sample(handle)
    assert sample[USAGE + "source"] == "proc"
    assert sample[USAGE + "pids"] == 2
    assert isinstance(sample[USAGE + "memory_mib"], float)
    assert sample[USAGE + "memory_mib"] > 0
    assert set(sample) == {USAGE + k for k in ("source", "pids", "memory_mib", "cpu.time_s")}


@pytest.fixture
async def instance_cgroup(processes: Processes) -> Iterator[Cgroup]:  # type: ignore[misc]
    layout = discover_layout(None)
    require_service(layout is not None, "no writable cgroup hierarchy with cpu and memory")
    assert layout is not None
    cgroup = _cgroups.make_cgroup(
        layout, "nemo_gym_test", f"instance-{uuid.uuid4().hex[:8]}", 0.5, 64
    )
    try:
        yield cgroup
    finally:
        processes.stop()
        processes.started.clear()
        await remove_cgroup(cgroup)
        for base in set(layout.bases.values()):
            with contextlib.suppress(OSError):
                (base / "nemo_gym_test").rmdir()


def _in_cgroup(cgroup: Cgroup, *argv: str) -> list[str]:
    """``argv`` started inside ``cgroup`` (it joins before it runs, as the provider's do)."""
    return joining(cgroup, argv)


async def test_host_instance_reader_reads_the_instance_cgroup(
    processes: Processes, instance_cgroup: Cgroup
) -> None:
    """In a cgroup holding only the instance, the allocation is its limits (0.5 CPU, 64 MiB)
    designated by the cgroup, and samples are the cgroup's, with an exec'd OOM kill."""
    cgroup = instance_cgroup
    init = processes.start(*_in_cgroup(cgroup, "unshare", "--mount", "sh", "-c", STAY))
    reader = HostInstanceReader("apptainer", _init_of)
    handle = _handle(init)
    allocation = await reader.resource_allocation(handle)
    assert allocation.source == "apptainer.cgroup"
    assert allocation.designator is not None
    assert (allocation.designator.kind, allocation.designator.id) == ("cgroup", cgroup.path)
    limits = allocation.components[0].limits
    assert (limits.cpu, limits.memory_mib) == (0.5, 64)

    oom = await asyncio.to_thread(
        subprocess.run,
        _in_cgroup(
            cgroup,
            "nsenter",
            f"--target={init}",
            "--mount",
            "sh",
            "-c",
            "echo 1000 >/proc/self/oom_score_adj; head -c 300000000 /dev/zero | tail",
        ),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert oom.returncode == 137
    sample = await reader.resource_sample(handle)
    assert sample[USAGE + "source"] == f"cgroup.v{cgroup.version}"
    assert sample[USAGE + "pids"] == 1
    assert sample[USAGE + "oom_kills"] == 1
    assert sample[USAGE + "memory_peak_mib"] == 64.0


async def _init_of(handle: SandboxHandle) -> int | None:
    return int(handle.raw.container_pid)


def test_apptainer_instance_pid_read_from_instance_list() -> None:
    """``apptainer instance list --json`` gives the named instance's PID; another name, a
    bad PID or unreadable output gives none."""
    listing = (
        b'{"instances": [{"instance": "other", "pid": 7}, {"instance": "box", "pid": 4242},'
        b' {"instance": "odd", "pid": true}]}'
    )
    assert _pid_of(listing, "box") == 4242
    assert _pid_of(listing, "missing") is None
    assert _pid_of(listing, "odd") is None
    assert _pid_of(b"not json", "box") is None
    assert _pid_of(b"", "box") is None
