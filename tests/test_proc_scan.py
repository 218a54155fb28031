"""The shared /proc scan of ProcessSandboxProvider without cgroups: one scan per tick for all
the samples asked for before it starts, and never a scan older than the sample."""

from __future__ import annotations

import asyncio
import os

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._proc_scan import (
    ProcScan,
    by_session,
    proc_table,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX

PIDS = PREFIX + "usage.pids"


def test_by_session_groups_rows() -> None:
    """Rows are grouped by their session id, in table order."""
    rows = [(1, 10, 0, 0.0, 0), (2, 20, 0, 0.0, 0), (3, 10, 0, 0.0, 0)]
    assert by_session(rows) == {10: [rows[0], rows[2]], 20: [rows[1]]}


def test_proc_table_lists_this_process() -> None:
    """The table holds this process with its own session id."""
    (me,) = [row for row in proc_table() if row[0] == os.getpid()]
    assert me[1] == os.getsid(0)


async def test_proc_scan_concurrent_callers_share_one_scan() -> None:
    """200 callers asking in the same moment are served by exactly one scan."""
    scan = ProcScan()
    tables = await asyncio.gather(*(scan.sessions() for _ in range(200)))
    assert scan.scans == 1
    assert all(table is tables[0] for table in tables)
    assert os.getsid(0) in tables[0]


async def test_proc_scan_later_caller_gets_a_newer_scan() -> None:
    """A caller that asks after a scan has started waits for the next one."""
    scan = ProcScan()
    first = await scan.sessions()
    second = await scan.sessions()
    assert scan.scans == 2
    assert second is not first


async def test_proc_scan_cancelled_caller_leaves_scan_to_others() -> None:
    """Cancelling one waiting caller neither cancels the scan nor the other callers."""
    scan = ProcScan()
    cancelled = asyncio.ensure_future(scan.sessions())
    kept = asyncio.ensure_future(scan.sessions())
    await asyncio.sleep(0)
    cancelled.cancel()
    assert os.getsid(0) in await kept
    assert cancelled.cancelled()
    assert scan.scans == 1


async def test_process_provider_proc_samples_of_a_tick_share_one_scan(
    process: ProcessSandboxProvider,
) -> None:
    """Samples of 200 sandboxes taken together cost one /proc scan, and each counts its own
    background process."""
    handles = [await process.create(SandboxSpec()) for _ in range(200)]
    for handle in handles:
        await process.exec(handle, "sleep 60 >/dev/null 2>&1 &")
    scans = process._proc_scan.scans
    samples = await asyncio.gather(*(process.resource_sample(h) for h in handles))
    assert process._proc_scan.scans == scans + 1
    assert [s[PIDS] for s in samples] == [1] * 200
    assert {s[PREFIX + "usage.source"] for s in samples} == {"proc"}


async def test_process_provider_proc_sample_right_after_exec_sees_it(
    process: ProcessSandboxProvider,
) -> None:
    """A sample taken right after an exec counts the process it started, though a scan was
    made just before the exec (a scan reused by age would miss it), every time."""
    watched = await process.create(SandboxSpec())
    other = await process.create(SandboxSpec())
    seen = []
    for _ in range(10):
        before = await process.resource_sample(watched)
        concurrent = asyncio.ensure_future(process.resource_sample(other))
        await process.exec(watched, "sleep 60 >/dev/null 2>&1 &")
        after = await process.resource_sample(watched)
        await concurrent
        seen.append((before[PIDS], after[PIDS]))
    assert seen == [(n, n + 1) for n in range(10)]
