"""The quickstart's sandbox half prints what its records say: requested, allocated, the samples,
the OOM kill, and what to do; and where the machine cannot isolate or limit, it says so.

examples/quickstart_sandbox.py runs here in-process, on the real process provider and the real
OpenTelemetry SDK; each printed line is checked against the records it came from.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import require_service
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX

ROOT = Path(__file__).resolve().parents[1]
LIMITS = PREFIX + "allocation.component.sandbox.limits."


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "quickstart_sandbox", ROOT / "examples" / "quickstart_sandbox.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("quickstart_sandbox", module)
    spec.loader.exec_module(module)
    return module


quickstart_sandbox = _load()


def _line(lines: list[str], start: str) -> str:
    found = [line for line in lines if line.strip().startswith(start)]
    assert len(found) == 1, (start, lines)
    return found[0]


def _cells(line: str) -> list[str]:
    return line.split()


def _check_common(run: object, lines: list[str]) -> None:
    """The requested, allocated and sample lines against the create span and the records."""
    create = quickstart_sandbox.the_create(run)
    assert create[PREFIX + "requested.cpu"] == 0.25
    assert create[PREFIX + "requested.memory_mib"] == 32
    assert _cells(_line(lines, "requested"))[:3] == ["requested", "0.25", "32"]
    allocation = quickstart_sandbox.allocation(run)
    allocated = _cells(_line(lines, "allocated"))
    source = allocation[PREFIX + "allocation.source"]
    assert allocated[3] == source
    if source.startswith("cgroup"):
        assert allocation[LIMITS + "cpu"] == 0.25
        assert allocation[LIMITS + "memory_mib"] == 32
        assert allocated[1:3] == ["0.25", "32"]
    else:
        assert LIMITS + "cpu" not in allocation
        assert allocated[1:3] == ["-", "-"]
    records = quickstart_sandbox.resource_records(run, "sample")
    finals = [r for r in records if r.attributes[PREFIX + "resource.final"]]
    assert len(finals) == 1
    sample_lines = [
        line for line in lines if re.match(r"^\s+(final|\d+\.\d)\s+[\d.]+\s", line) is not None
    ]
    assert len(sample_lines) == len(records)
    assert _cells(sample_lines[-1])[0] == "final"
    final = finals[0].attributes
    error = final.get(PREFIX + "resource.error")
    if error is None:
        assert _cells(sample_lines[-1])[-1] == final[PREFIX + "usage.source"]
        assert _cells(sample_lines[-1])[4] == quickstart_sandbox.number(
            final[PREFIX + "usage.memory_peak_mib"]
        )
    else:
        # A final the starved machine could not read in time (seen beside a CI run at load
        # 40): its row names the error, with no figures carried into it.
        assert _cells(sample_lines[-1])[-1] == f"error:{error}"
        assert set(_cells(sample_lines[-1])[1:-1]) == {"-"}
    assert "What to do:" in lines


async def test_quickstart_sandbox_oom_kill_matches_the_records() -> None:
    """With a cgroup, the allocation is OOM-killed at 32 MiB and the printed kill is the
    records' (exec result, final sample's usage.oom_kills, the fleet counter)."""
    require_service(
        ProcessSandboxProvider().cgroup_version is not None,
        "no writable cgroup hierarchy here (run as root): nothing can be OOM-killed",
    )
    run = await quickstart_sandbox.run_demo()
    lines = quickstart_sandbox.report(run)
    _check_common(run, lines)
    assert [(label, r.return_code, r.error_type) for label, r in run.results] == [
        ("CPU loop, 1.5 s", 0, None),
        ("allocate 128 MiB", 137, "oom_kill"),
    ]
    final = quickstart_sandbox.resource_records(run, "sample")[-1].attributes
    assert final[PREFIX + "usage.oom_kills"] == 1
    assert run.oom_kills_metric == 1
    assert "allocate 128 MiB     return code 137, error_type oom_kill" in [
        line.strip() for line in lines
    ]
    text = " ".join(line.strip() for line in lines)
    assert "OOM kill: the kernel killed 'allocate 128 MiB' at the 32 MiB limit" in text
    assert "usage.oom_kills 1 at a peak of" in text
    assert "gym.sandbox.oom_kills went up by 1." in text
    assert "limits     enforced by the sandbox's cgroup (cgroup.v" in "\n".join(lines)
    assert "NOT ENFORCED" not in text
    assert "NOT ISOLATED" not in text


async def test_quickstart_sandbox_without_cgroups_says_what_is_missing() -> None:
    """Without a cgroup, it says the limits are not enforced and why, and that nothing was
    OOM-killed; the allocation's record says no limits, its samples come from /proc."""
    run = await quickstart_sandbox.run_demo(cgroups=False)
    lines = quickstart_sandbox.report(run)
    _check_common(run, lines)
    assert quickstart_sandbox.allocation(run)[PREFIX + "allocation.source"] == "process"
    assert [(r.return_code, r.error_type) for _, r in run.results] == [(0, None), (0, None)]
    final = quickstart_sandbox.resource_records(run, "sample")[-1].attributes
    assert final[PREFIX + "usage.source"] == "proc"
    assert PREFIX + "usage.oom_kills" not in final
    text = " ".join(line.strip() for line in lines)
    assert (
        "NOT ENFORCED: no cgroup, because cgroups were turned off "
        "(ProcessSandboxProvider(cgroups=False))" in text
    )
    assert "No OOM kill: without a cgroup the 32 MiB limit is not enforced" in text
    assert "Enforce the limits: run where cgroups can be made" in text


async def test_quickstart_sandbox_failed_isolated_create_falls_back_labelled(
    tmp_path: Path,
) -> None:
    """When the isolated sandbox cannot be made, the failure is shown, the same sandbox runs
    unisolated, and the report says NOT ISOLATED."""
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")

    def failing(**options: object) -> ProcessSandboxProvider:
        return ProcessSandboxProvider(base_dir=not_a_directory, **options)  # type: ignore[arg-type]

    run = await quickstart_sandbox.run_demo(cgroups=False, isolated=failing)
    assert run.isolation_failure is not None
    assert run.isolation_failure.startswith("process sandbox directory failed")
    lines = quickstart_sandbox.report(run)
    _check_common(run, lines)
    text = " ".join(line.strip() for line in lines)
    assert f"NONE, a fallback. The isolated sandbox failed: {run.isolation_failure}" in text
    assert "This run is NOT ISOLATED" in text
    assert "Give sandboxes their isolation: install bubblewrap" in text


def test_quickstart_sandbox_sample_that_failed_shows_its_error() -> None:
    """A sample that could not be read shows its error and no figures, and the samples after it
    carry forward only what was read."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    sample = {PREFIX + "resource.kind": "sample", PREFIX + "usage.source": "proc"}
    with tracer.start_as_current_span("sandbox.create"):
        pass
    for attributes in (
        {**sample, PREFIX + "usage.memory_peak_mib": 5.0, PREFIX + "resource.final": False},
        {PREFIX + "resource.kind": "sample", PREFIX + "resource.error": "TimeoutError"},
        {**sample, PREFIX + "usage.memory_mib": 3.0, PREFIX + "resource.final": True},
    ):
        with tracer.start_as_current_span("sandbox.resources", attributes=attributes):
            pass
    run = quickstart_sandbox.SandboxRun(spans=tuple(exporter.get_finished_spans()))
    rows = [(final, figures) for _, final, figures in quickstart_sandbox.samples(run)]
    assert rows == [
        (False, {"usage.memory_peak_mib": 5.0, "usage.source": "proc"}),
        (False, {"usage.source": "error:TimeoutError"}),
        (True, {"usage.memory_peak_mib": 5.0, "usage.memory_mib": 3.0, "usage.source": "proc"}),
    ]
