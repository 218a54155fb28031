"""The quickstart's sandbox half: what a sandbox asked for, what it got, what it used.

    python examples/quickstart_sandbox.py      (examples/quickstart.py runs it after the pool)

One sandbox of the embedded provider (``ProcessSandboxProvider``, ``otel_process`` in NeMo
Gym: no daemon) asks for 0.25 CPU and 32 MiB, runs a CPU loop and then a command that
allocates 128 MiB, and is closed. Its records (the ``sandbox.create`` span and the
``sandbox.resources`` spans: allocation, usage samples every 0.5 s, the final sample) go to
an embedded OpenTelemetry SDK with an in-memory exporter, and are printed: requested,
allocated, the samples over time, the OOM kill, and what to do about it.

The sandbox is isolated by bubblewrap where the provider can (its default); where bubblewrap is
missing or cannot make namespaces, this says so and runs it again unisolated, labelled as such.
Where no cgroup can be made (not root, or an unprivileged container), the limits are recorded
but not enforced: it says what is missing and shows the rest. Takes a few seconds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxExecResult,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import SandboxState, traced_provider

CPU = 0.25  # cores
MEMORY_MIB = 32
LOOP_S = 1.5
ALLOCATE_MIB = 128
# Short for the demo, so a few seconds show several samples; deployments sample every 10 s
# (OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL).
INTERVAL_S = 0.5
OOM_KILLS_METRIC = "gym.sandbox.oom_kills"
# The system's Python, which an isolated sandbox sees (a virtualenv's may live where it cannot).
PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
COMMANDS = (
    (
        f"CPU loop, {LOOP_S:g} s",
        f"{PYTHON} -c 'import time\nend = time.monotonic() + {LOOP_S}\n"
        "while time.monotonic() < end: pass'",
    ),
    (
        f"allocate {ALLOCATE_MIB} MiB",
        f"{PYTHON} -c \"data = b'x' * ({ALLOCATE_MIB} * 1024 * 1024)\"",
    ),
)
SAMPLE_COLUMNS = (
    ("cpu time s", "usage.cpu.time_s"),
    ("throttled s", "usage.cpu.throttled_s"),
    ("memory MiB", "usage.memory_mib"),
    ("peak MiB", "usage.memory_peak_mib"),
    ("pids", "usage.pids"),
    ("oom kills", "usage.oom_kills"),
)


def isolated_provider(**options: Any) -> ProcessSandboxProvider:
    """The provider as it comes: commands isolated by bubblewrap (its default)."""
    return ProcessSandboxProvider(**options)


def unisolated_provider(**options: Any) -> ProcessSandboxProvider:
    """The provider with isolation turned off, as a user must ask for it explicitly."""
    return ProcessSandboxProvider(isolation="none", **options)


@dataclass
class SandboxRun:
    """What one run of the sandbox did, and every record it left."""

    results: list[tuple[str, SandboxExecResult]] = field(default_factory=list)
    spans: tuple[ReadableSpan, ...] = ()
    oom_kills_metric: int = 0
    # Why the isolated sandbox could not be made (it then ran unisolated), or None.
    isolation_failure: str | None = None
    cgroups_missing: str | None = None  # why no cgroup was made, or None


def cgroups_missing(provider: ProcessSandboxProvider, cgroups: bool) -> str | None:
    """Why this provider's sandboxes get no cgroup, or None when they do."""
    if provider.cgroup_version is not None:
        return None
    if not cgroups:
        return "cgroups were turned off (ProcessSandboxProvider(cgroups=False))"
    if os.geteuid() != 0:
        return "this process is not root, and only root may make cgroups here"
    return (
        "the cgroup filesystem is read-only here (an unprivileged container: on the host, "
        "or with podman/docker run --privileged, it is writable)"
    )


async def run_sandbox(provider: ProcessSandboxProvider, run: SandboxRun) -> None:
    """Create the sandbox through a traced provider of its own embedded SDK, run the commands,
    close it; the records end up in ``run``. Raises ``SandboxCreateError`` from ``create``."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    state = SandboxState(
        tracer_provider, meter_provider=MeterProvider([reader]), interval_s=INTERVAL_S
    )
    traced = traced_provider(provider, state)
    try:
        sandbox = await traced.create(SandboxSpec(resources={"cpu": CPU, "memory_mib": MEMORY_MIB}))
        try:
            for label, command in COMMANDS:
                run.results.append((label, await traced.exec(sandbox, command, timeout_s=60)))
        finally:
            await traced.close(sandbox)
    finally:
        await traced.aclose()
        tracer_provider.shutdown()
    run.spans = exporter.get_finished_spans()
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == OOM_KILLS_METRIC:
                    run.oom_kills_metric += sum(
                        int(point.value)  # type: ignore[union-attr]
                        for point in metric.data.data_points
                    )


async def run_demo(
    *,
    cgroups: bool = True,
    isolated: Callable[..., ProcessSandboxProvider] = isolated_provider,
    unisolated: Callable[..., ProcessSandboxProvider] = unisolated_provider,
) -> SandboxRun:
    """The isolated sandbox, or (when it cannot be made) the same, unisolated.

    ``cgroups=False`` makes no cgroup, as on a machine that cannot; ``isolated`` and
    ``unisolated`` make the two providers (the defaults: as the provider comes, and with
    isolation turned off).
    """
    run = SandboxRun()
    provider = isolated(cgroups=cgroups)
    try:
        await run_sandbox(provider, run)
    except SandboxCreateError as error:
        run = SandboxRun(isolation_failure=str(error))
        provider = unisolated(cgroups=cgroups)
        await run_sandbox(provider, run)
    run.cgroups_missing = cgroups_missing(provider, cgroups)
    return run


# --- reading the records ------------------------------------------------------------------------


def attributes(span: ReadableSpan) -> Mapping[str, Any]:
    return span.attributes or {}


def the_create(run: SandboxRun) -> Mapping[str, Any]:
    return next(attributes(s) for s in run.spans if s.name == "sandbox.create")


def resource_records(run: SandboxRun, kind: str) -> list[ReadableSpan]:
    return [
        span
        for span in run.spans
        if span.name == "sandbox.resources"
        and attributes(span).get(PREFIX + "resource.kind") == kind
    ]


def allocation(run: SandboxRun) -> Mapping[str, Any]:
    return attributes(resource_records(run, "allocation")[0])


def samples(run: SandboxRun) -> list[tuple[float, bool, dict[str, Any]]]:
    """Each sample as (seconds since create, final, its usage figures): a sample leaves out a
    figure unchanged since the one before, which is carried forward here. A sample that could
    not be read (``resource.error``, such as a timeout on a starved machine) has no figures: its
    row names the error, and nothing is carried through it as if it had been read."""
    created = next(s for s in run.spans if s.name == "sandbox.create").start_time or 0
    rows: list[tuple[float, bool, dict[str, Any]]] = []
    figures: dict[str, Any] = {}
    for span in sorted(resource_records(run, "sample"), key=lambda s: s.start_time or 0):
        a = attributes(span)
        since = ((span.start_time or 0) - created) / 1e9
        final = bool(a.get(PREFIX + "resource.final"))
        error = a.get(PREFIX + "resource.error")
        if error is not None:
            rows.append((since, final, {"usage.source": f"error:{error}"}))
            continue
        figures = {**figures, **{k: a[PREFIX + k] for _, k in SAMPLE_COLUMNS if PREFIX + k in a}}
        figures["usage.source"] = a.get(PREFIX + "usage.source", figures.get("usage.source"))
        rows.append((since, final, dict(figures)))
    return rows


def isolation_of(run: SandboxRun) -> str:
    """The isolation level the records carry (``none`` from a provider that records none)."""
    levels = {attributes(s).get(PREFIX + "isolation") for s in run.spans} - {None}
    return ", ".join(sorted(str(level) for level in levels)) or "none"


def number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


# --- printing -----------------------------------------------------------------------------------

ISOLATION = {
    "bwrap": "bwrap: its own user, PID, mount, IPC and UTS namespaces, no network",
    "none": "none: commands run as this user, seeing its files and network",
}

SAMPLE_LEGEND = """\
cpu time s: CPU seconds used so far; throttled s: time held back by the cpu limit; memory MiB:
in use now; peak MiB: the most so far; pids: processes running; oom kills: processes the
kernel killed for memory; source: where the figures come from (the cgroup, or /proc without
one). A sample leaves out the figures unchanged since the one before: carried forward here."""


def labelled(label: str, text: str) -> list[str]:
    """``text`` wrapped under a label of the report's left column."""
    return textwrap.wrap(
        text,
        width=92,
        initial_indent=f"  {label:<10} ",
        subsequent_indent=" " * 13,
        break_on_hyphens=False,
        break_long_words=False,
    )


def report(run: SandboxRun) -> list[str]:
    """The records, readably: what the sandbox asked for, got and used, and what to do."""
    create = the_create(run)
    given = allocation(run)
    limits = PREFIX + "allocation.component.sandbox.limits."
    source = str(given.get(PREFIX + "allocation.source"))
    enforced = source.startswith("cgroup")
    isolation = isolation_of(run)
    lines = [
        *textwrap.wrap(
            f"A sandbox asks for {CPU:g} CPU and {MEMORY_MIB} MiB, runs a CPU loop for "
            f"{LOOP_S:g} s, then a command that allocates {ALLOCATE_MIB} MiB, and is closed. "
            f"Its usage is sampled every {INTERVAL_S:g} s here (deployments: every 10 s, "
            "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL).",
            width=92,
        ),
        "",
    ]
    if run.isolation_failure is None:
        lines += labelled("isolation", ISOLATION.get(isolation, isolation))
    else:
        hint = (
            "install bubblewrap: sudo apt-get install bubblewrap"
            if shutil.which("bwrap") is None
            else "bwrap is installed but may not make namespaces here: an unprivileged "
            "container, or user namespaces turned off"
        )
        lines += labelled(
            "isolation",
            f"NONE, a fallback. The isolated sandbox failed: {run.isolation_failure} ({hint}). "
            "This run is NOT ISOLATED: its commands ran as this user, seeing its files and "
            'network (ProcessSandboxProvider(isolation="none")).',
        )
    if enforced:
        lines += labelled("limits", f"enforced by the sandbox's cgroup ({source})")
    else:
        lines += labelled(
            "limits",
            f"NOT ENFORCED: no cgroup, because {run.cgroups_missing or 'making it failed'}. "
            "The request is recorded, usage is read from /proc, and nothing is OOM-killed.",
        )
    lines += [
        "",
        f"  {'':<10} {'cpu cores':>9} {'memory MiB':>10}  from",
        f"  {'requested':<10} {number(create.get(PREFIX + 'requested.cpu')):>9} "
        f"{number(create.get(PREFIX + 'requested.memory_mib')):>10}  the spec (SandboxSpec)",
        f"  {'allocated':<10} {number(given.get(limits + 'cpu')):>9} "
        f"{number(given.get(limits + 'memory_mib')):>10}  {source}"
        + (" (read back from the kernel)" if enforced else " (no limits)"),
        "",
    ]
    for label, result in run.results:
        outcome = f"return code {result.return_code}"
        if result.error_type:
            outcome += f", error_type {result.error_type}"
        lines.append(f"  {label:<20} {outcome}")
    lines += ["", "  Usage samples (sandbox.resources records), seconds since create:", ""]
    header = f"  {'t s':>6}  " + "  ".join(f"{name:>11}" for name, _ in SAMPLE_COLUMNS)
    lines.append(header + "  source")
    for since, final, figures in samples(run):
        cells = "  ".join(f"{number(figures.get(key)):>11}" for _, key in SAMPLE_COLUMNS)
        when = "final" if final else f"{since:.1f}"
        lines.append(f"  {when:>6}  {cells}  {figures.get('usage.source', '-')}")
    lines += ["", *SAMPLE_LEGEND.splitlines(), "", *oom_story(run, enforced)]
    return lines


def oom_story(run: SandboxRun, enforced: bool) -> list[str]:
    """The OOM kill as the records tell it, and what to do about it."""
    label, result = run.results[-1]
    # The last sample read (a final that timed out tells nothing of the kill).
    read = [figures for _, _, figures in samples(run) if "usage.memory_peak_mib" in figures]
    final = read[-1] if read else {}
    kills = final.get("usage.oom_kills")
    peak = number(final.get("usage.memory_peak_mib"))
    throttled = final.get("usage.cpu.throttled_s")
    lines: list[str] = []
    if result.error_type == "oom_kill":
        lines.append(
            f"OOM kill: the kernel killed '{label}' at the {MEMORY_MIB} MiB limit (return code "
            f"{result.return_code}, error_type oom_kill): the final sample counts "
            f"usage.oom_kills {number(kills)} at a peak of {peak} MiB, and the fleet counter "
            f"{OOM_KILLS_METRIC} went up by {run.oom_kills_metric}."
        )
    elif enforced:
        lines.append(f"No OOM kill: '{label}' ended with return code {result.return_code}.")
    else:
        lines.append(
            f"No OOM kill: without a cgroup the {MEMORY_MIB} MiB limit is not enforced, so "
            f"'{label}' got its memory (return code {result.return_code}, peak {peak} MiB in "
            "the samples). As root on a machine (or in a --privileged container) the kernel "
            "kills it at the limit."
        )
    steps = []
    if run.isolation_failure is not None:
        steps.append(
            "Give sandboxes their isolation: install bubblewrap (sudo apt-get install "
            "bubblewrap) where namespaces can be made; isolation='none' is for trusted code only."
        )
    if not enforced:
        steps.append(
            "Enforce the limits: run where cgroups can be made (as root on the host, or in a "
            "container run with --privileged); here the records show what was asked and used."
        )
    steps.append(
        f"A command OOM-killed in a sandbox needed more than the memory it asked for: raise "
        f"the spec's memory_mib (SandboxSpec(resources={{'memory_mib': {ALLOCATE_MIB * 2}}})) or "
        "make it use less. The peak in the final sample is what it reached before the kill."
    )
    if isinstance(throttled, float) and throttled > 0:
        steps.append(
            f"The CPU loop spent {number(throttled)} s throttled at {CPU:g} cores: a sandbox "
            "that should finish sooner needs a larger cpu in its spec."
        )
    steps.append(
        f"In a backend, alert on {OOM_KILLS_METRIC} (NemoGymSandboxOOMKilled in "
        "examples/prometheus/rules.yml) and find the sandbox by nemo.gym.sandbox.id in its "
        "sandbox.resources spans."
    )
    lines = [*textwrap.wrap(lines[0], width=92), "", "What to do:"]
    for count, step in enumerate(steps, 1):
        lines += textwrap.wrap(
            step, width=92, initial_indent=f"  {count}. ", subsequent_indent="     "
        )
    return lines


def main() -> int:
    run = asyncio.run(run_demo())
    print("\n".join(report(run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
