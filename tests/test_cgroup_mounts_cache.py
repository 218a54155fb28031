"""The Docker provider reads this host's cgroup mounts once, not per container, yet finds a
container whose hierarchy was mounted after the first look (the real cgroups are read in
test_docker_cgroup_sampling.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from opentelemetry.instrumentation.nemo_gym.sandbox.providers import _docker_usage
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import Mount, Mounts
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroups import Cgroup
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import Attribute

EARLY = Mounts({}, Mount("/", Path("/sys/fs/cgroup")))
LATER = Mounts({}, Mount("/", Path("/mnt/cgroup")))


async def _no_inspect(container_id: str) -> dict[str, Any]:
    raise AssertionError("locate must not ask the engine")


async def _no_stats(container_id: str) -> dict[str, Attribute]:
    raise AssertionError("locate must not ask the engine")


def test_mounts_read_once_and_again_only_when_a_cgroup_is_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found containers reuse the first read; a miss re-reads the mounts, and searches
    again only when they changed."""
    host_mounts = [EARLY]
    reads: list[Mounts] = []
    searches: list[tuple[str, Mounts]] = []

    def read_mounts() -> Mounts:
        reads.append(host_mounts[0])
        return host_mounts[0]

    def container_cgroup(pid: object, container_id: str, mounts: Mounts) -> Cgroup | None:
        searches.append((container_id, mounts))
        shown = mounts.v2 is not None and container_id.startswith(
            "late" if mounts == LATER else "early"
        )
        return Cgroup(2, {"": Path("/x") / container_id}, "/" + container_id) if shown else None

    monkeypatch.setattr(_docker_usage, "read_mounts", read_mounts)
    monkeypatch.setattr(_docker_usage, "container_cgroup", container_cgroup)
    usage = _docker_usage.ContainerUsage(_no_inspect, _no_stats)
    running = {"State": {"Pid": 42, "Running": True}}

    def located(container_id: str) -> Cgroup | None:
        usage.locate(container_id, running)
        return usage._located[container_id].cgroup

    assert located("early-1") is not None
    assert located("early-2") is not None
    assert reads == [EARLY]
    assert located("late-1") is None  # a miss: read again, unchanged, no second search
    assert reads == [EARLY, EARLY]
    assert searches[-1] == ("late-1", EARLY)
    host_mounts[0] = LATER  # a hierarchy mounted since the first read
    assert located("late-2") is not None
    assert reads == [EARLY, EARLY, LATER]
    assert searches[-2:] == [("late-2", EARLY), ("late-2", LATER)]
    assert located("late-3") is not None
    assert reads == [EARLY, EARLY, LATER]
