"""ProcessSandboxProvider's disk limit: enforced where the server may mount a tmpfs (root),
recorded as absent where it is not, never recorded without being enforced."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator

import pytest

from conftest import require_service
from isolation_support import bwrap_on_path, run_server_as
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

GIB = 1 << 30
NO_SPACE = "fallocate: fallocate failed: No space left on device\n"


@pytest.fixture
async def provider() -> AsyncIterator[ProcessSandboxProvider]:
    """An isolated provider in this (root) process, which may mount."""
    require_service(os.geteuid() == 0, "a disk limit needs a root server (run as root)")
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    made = ProcessSandboxProvider(cgroups=False)
    yield made
    await made.aclose()


async def test_process_isolation_disk_limit_bounds_dir_and_tmp(
    provider: ProcessSandboxProvider,
) -> None:
    """With disk_gib=1 the sandbox's directory and its /tmp share one 1 GiB file system: 1.1
    GiB fits in neither, 512 MiB in one leaves too little for 600 MiB in the other. Without a
    disk limit, 1.1 GiB fits (the control)."""
    limited = await provider.create(SandboxSpec(resources={"disk_gib": 1}))
    free = await provider.create(SandboxSpec())
    sizes = await provider.exec(limited, "stat -f -c '%b %S' . /tmp; stat -c %d . /tmp")
    too_big = await provider.exec(limited, "fallocate -l 1100M big; fallocate -l 1100M /tmp/big")
    shared = await provider.exec(limited, "fallocate -l 512M half && fallocate -l 600M /tmp/more")
    control = await provider.exec(free, "fallocate -l 1100M big && echo fits")
    allocation = await provider.resource_allocation(limited)
    unlimited = await provider.resource_allocation(free)

    blocks, block_size = map(int, (sizes.stdout or "").split()[:2])
    assert blocks * block_size == GIB
    lines = (sizes.stdout or "").splitlines()
    assert lines[0] == lines[1]  # the same size for both
    assert lines[2] == lines[3]  # on the same device
    assert (too_big.stderr, too_big.return_code) == (NO_SPACE * 2, 1)
    assert (shared.stderr, shared.return_code) == (NO_SPACE, 1)
    assert (control.stdout, control.return_code) == ("fits\n", 0)
    (component,) = allocation.components
    assert component.limits.disk_gib == 1
    (component,) = unlimited.components
    assert component.limits.disk_gib is None


async def test_process_isolation_disk_is_unmounted_at_close(
    provider: ProcessSandboxProvider,
) -> None:
    """Closing a sandbox with a disk limit unmounts its file system and removes its directory."""
    sandbox = await provider.create(SandboxSpec(resources={"disk_gib": 1}))
    disk = sandbox.raw.disk
    assert disk is not None
    assert os.path.ismount(disk)  # noqa: ASYNC240 - the sandbox's own mount point
    await provider.close(sandbox)
    assert not disk.exists()


async def test_process_isolation_unisolated_disk_is_not_recorded() -> None:
    """Without isolation a command can write anywhere: disk_gib is not enforced, and the
    allocation record has no disk limit."""
    provider = ProcessSandboxProvider(isolation="none", cgroups=False)
    try:
        sandbox = await provider.create(SandboxSpec(resources={"disk_gib": 1}))
        allocation = await provider.resource_allocation(sandbox)
    finally:
        await provider.aclose()
    (component,) = allocation.components
    assert component.limits.disk_gib is None
    assert sandbox.raw.disk is None


async def test_process_isolation_disk_gib_zero_is_refused() -> None:
    """disk_gib=0 (a tmpfs of size 0 has no limit at all) raises ValueError naming it."""
    provider = ProcessSandboxProvider(isolation="none", cgroups=False)
    with pytest.raises(ValueError, match=r"resources.disk_gib=0 must be at least 1"):
        await provider.create(SandboxSpec(resources={"disk_gib": 0}))
    await provider.aclose()


# A server that asks for disk_gib=1, prints its allocation's disk limit, then tries 1.1 GiB.
DISK_SERVER = r"""
import asyncio, json
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

async def main():
    provider = ProcessSandboxProvider()
    try:
        sandbox = await provider.create({"resources": {"disk_gib": 1}})
        allocation = await provider.resource_allocation(sandbox)
        result = await provider.exec(sandbox, "fallocate -l 1100M big && echo fits")
    finally:
        await provider.aclose()
    print(json.dumps([allocation.components[0].limits.disk_gib, result.stdout]))

asyncio.run(main())
"""


def test_process_isolation_disk_unenforced_by_ordinary_user_is_not_recorded() -> None:
    """A server that may not mount (not root) cannot bound disk use: the sandbox writes
    1.1 GiB, and its allocation record has no disk limit, with a warning saying why."""
    server = run_server_as("nobody", DISK_SERVER)
    assert server.returncode == 0, server.stderr
    assert json.loads(server.stdout) == [None, "fits\n"]
    assert "asked for disk_gib=1: not enforced" in server.stderr
