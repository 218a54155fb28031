"""Run a sandbox with 0.5 CPU and 64 MiB, and print what it asked for, got and used.

    python examples/sandbox.py

A local ``ProcessSandboxProvider`` (a cgroup per sandbox where this process may create one,
e.g. as root) wrapped by ``traced_provider`` runs a CPU-bound command and a memory-hungry one.
The resource records it emits (``sandbox.resources`` spans) are collected in memory and
printed as a table: requested shape, the allocation read back from the kernel, the periodic
samples and the final one. When no SDK tracer provider is configured globally, an embedded
one is installed; under ``opentelemetry-instrument`` an in-memory exporter is added beside
the configured ones. Takes a few seconds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import traced_provider

INTERVAL_S = "0.25"
# The commands run the system's Python, which an isolated sandbox sees; without one, this
# interpreter, which it sees only where it is told to (read-only): its virtualenv and the
# installation behind it (a root server's sandboxes must be able to reach them).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
PYTHON = SYSTEM_PYTHON or sys.executable
INTERPRETER = [] if SYSTEM_PYTHON else sorted({sys.prefix, sys.base_prefix})
CPU_BOUND = f"{PYTHON} -c 'import time\nend = time.time() + 1.0\nwhile time.time() < end: pass'"
MEMORY_HUNGRY = f"{PYTHON} -c \"b = b'x' * (200 * 1024 * 1024)\""


def collect_spans() -> InMemorySpanExporter:
    """An in-memory exporter on the global SDK provider, installing one if there is none."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def cell(attributes: Mapping[str, Any], key: str) -> str:
    value = attributes.get(PREFIX + key)
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


COLUMNS = (
    *("record", "cpu", "memory MiB"),
    *("cpu time s", "throttled s", "mem MiB", "peak MiB", "pids", "oom kills", "source"),
)
USAGE = {
    "cpu time s": "usage.cpu.time_s",
    "throttled s": "usage.cpu.throttled_s",
    "mem MiB": "usage.memory_mib",
    "peak MiB": "usage.memory_peak_mib",
    "pids": "usage.pids",
    "oom kills": "usage.oom_kills",
    "source": "usage.source",
}


def row(span: ReadableSpan) -> dict[str, str] | None:
    """The table row of one span: requested (create), allocated, sample or final."""
    a = dict(span.attributes or {})
    if span.name == "sandbox.create":
        return {
            "record": "requested",
            "cpu": cell(a, "requested.cpu"),
            "memory MiB": cell(a, "requested.memory_mib"),
            "source": "spec",
        }
    if span.name != "sandbox.resources":
        return None
    if a[PREFIX + "resource.kind"] == "allocation":
        limits = "allocation.component.sandbox.limits."
        return {
            "record": "allocated",
            "cpu": cell(a, limits + "cpu"),
            "memory MiB": cell(a, limits + "memory_mib"),
            "source": cell(a, "allocation.source"),
        }
    cells = {"record": "final" if a[PREFIX + "resource.final"] else "sample"}
    if PREFIX + "resource.error" in a:
        cells["cpu time s"] = "error: " + cell(a, "resource.error")
        return cells
    # A partial sample leaves out the figures that did not change since the previous one.
    unchanged = "=" if a.get(PREFIX + "resource.partial") else "-"
    cells.update(
        {column: cell(a, key) if PREFIX + key in a else unchanged for column, key in USAGE.items()}
    )
    return cells


def table(spans: tuple[ReadableSpan, ...]) -> list[str]:
    """One line per record: requested, allocated, each sample, and the final sample."""
    rows = [dict(zip(COLUMNS, COLUMNS, strict=True))]
    rows += [r for r in map(row, spans) if r is not None]
    widths = {c: max(len(r.get(c, "")) for r in rows) for c in COLUMNS}
    return ["  ".join(r.get(c, "").ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]


LEGEND = """\
How to read it: one row per resource record (a `sandbox.resources` span).
  requested  the shape asked for (SandboxSpec): cpu in cores, memory MiB
  allocated  what the infrastructure really set, read back (here: the cgroup's limits)
  sample     periodic usage while the sandbox runs (every {interval} s here)
  final      the last sample, taken at close
  cpu time s   CPU seconds used so far      throttled s  time held back by the cpu limit
  mem MiB      memory in use now            peak MiB     highest memory use so far
  pids         processes running            oom kills    processes killed for memory
  source       where the numbers come from: spec, cgroup.v1/v2, or process/proc without cgroups
  =            unchanged since the sample above (a partial sample leaves it out of its record)
The memory-hungry command asks for 200 MiB under a 64 MiB limit: oom kills 1 and return
code 137 show the limit at work (without cgroups nothing is enforced)."""


async def main() -> None:
    os.environ.setdefault("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", INTERVAL_S)
    exporter = collect_spans()
    inner = ProcessSandboxProvider(read_only_paths=INTERPRETER)
    if inner.cgroup_version is None:
        print("note: no writable cgroups here (try as root); limits are not enforced\n")
    provider = traced_provider(inner)
    try:
        sandbox = await provider.create(SandboxSpec(resources={"cpu": 0.5, "memory_mib": 64}))
        for label, command in (("cpu-bound", CPU_BOUND), ("memory-hungry", MEMORY_HUNGRY)):
            result = await provider.exec(sandbox, command, timeout_s=30)
            print(f"{label:<14} return code {result.return_code}, error {result.error_type}")
        await provider.close(sandbox)
    finally:
        await provider.aclose()
    print()
    for line in table(exporter.get_finished_spans()):
        print(line)
    print()
    print(LEGEND.format(interval=os.environ["OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"]))


if __name__ == "__main__":
    asyncio.run(main())
