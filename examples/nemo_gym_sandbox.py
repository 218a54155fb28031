"""NeMo Gym's own sandbox API, with our process provider picked by its registry name.

    opentelemetry-instrument --traces_exporter console --metrics_exporter console \\
        --logs_exporter none python examples/nemo_gym_sandbox.py

This is NeMo Gym user code, unchanged: ``AsyncSandbox({"otel_process": {...}}, spec)`` finds
``ProcessSandboxProvider`` through NeMo Gym's ``nemo_gym.sandbox_providers`` entry points
(installed with this package), creates a sandbox asking for 0.5 CPU and 64 MiB, runs two
commands, and stops it. Under ``opentelemetry-instrument`` the ``nemo_gym`` instrumentor
traces whatever provider NeMo Gym builds: the console exporter prints the ``sandbox.create``,
``sandbox.upload``, ``sandbox.exec`` and ``sandbox.close`` spans and the ``sandbox.resources``
records (the allocation, compared with the request, and the final usage sample); the console
metrics exporter prints ``gym.sandbox.creations`` (and ``gym.sandbox.allocation.mismatches``
or ``gym.sandbox.oom_kills`` when there are any) at exit.

The example then prints a summary of what it saw: the spans by name, and for the sandbox the
requested shape, the allocated limits, the mismatches (``none`` when the limits honour the
request) and the final sample. Where cgroups are writable (as root) the process provider
enforces the request; ``--without-cgroups`` turns them off, so the allocation has no limits
and the summary, the record and a warning report the mismatch (``no_limit``).
``--require-spans`` makes it exit 1 when no sandbox span was recorded (CI uses it to prove the
wiring).

Needs ``nemo-gym`` (``pip install --no-deps --ignore-requires-python nemo-gym==0.4.0``: its
``nemo_gym.sandbox`` package needs only the standard library).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import sys
from typing import Any

from nemo_gym.sandbox import AsyncSandbox, SandboxSpec
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# What a NeMo Gym config names: `sandbox_provider: {otel_process: {cgroups: true, ...}}`. The
# sandbox runs the system's Python, which it sees; without one, this interpreter, which its
# isolation hides unless it is named, read-only (where a root server's sandboxes reach it).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
PYTHON = SYSTEM_PYTHON or sys.executable
INTERPRETER = [] if SYSTEM_PYTHON else sorted({sys.prefix, sys.base_prefix})
PROVIDER_CONFIG: dict[str, dict[str, Any]] = {
    "otel_process": {"cgroups": True, "read_only_paths": INTERPRETER}
}
SPEC = SandboxSpec(
    files={"solve.py": "print(sum(range(10**6)))\n"},
    resources={"cpu": 0.5, "memory_mib": 64},
)
PREFIX = "nemo.gym.sandbox."
MISMATCH = PREFIX + "allocation.mismatch."


async def run_sandbox(config: dict[str, dict[str, Any]]) -> None:
    async with AsyncSandbox(config, SPEC) as sandbox:
        await sandbox.start()
        for command in (f"{PYTHON} solve.py", "echo $HOME"):
            result = await sandbox.exec(command, timeout_s=30)
            print(f"$ {command}\n  exit {result.return_code}: {(result.stdout or '').strip()}")
    # The records run in tasks beside the sandbox's calls, and asyncio.run() cancels whatever
    # is still running when this returns: let them end (each is bounded by its own timeout).
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=10)


def watch_spans() -> InMemorySpanExporter | None:
    """An in-memory exporter beside the configured ones, to count what was recorded; ``None``
    when no SDK tracer provider is configured (not run under opentelemetry-instrument)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return None
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def summarize(exporter: InMemorySpanExporter) -> dict[str, int]:
    """Print the sandbox spans by name and what the records say; return the span counts."""
    spans = exporter.get_finished_spans()
    names = collections.Counter(span.name for span in spans)
    sandbox_spans = {name: n for name, n in sorted(names.items()) if name.startswith("sandbox.")}
    print("sandbox spans recorded:", sandbox_spans or "none")
    creates = [dict(s.attributes or {}) for s in spans if s.name == "sandbox.create"]
    records = [dict(s.attributes or {}) for s in spans if s.name == "sandbox.resources"]
    for create in creates:
        requested = {
            key.removeprefix(PREFIX + "requested."): value
            for key, value in create.items()
            if key.startswith(PREFIX + "requested.") and not key.endswith("unspecified")
        }
        print(f"sandbox {create.get(PREFIX + 'id')}: requested {requested}")
    for record in records:
        if record.get(PREFIX + "resource.kind") == "allocation":
            limits = {
                key.rsplit(".", 1)[1]: value
                for key, value in record.items()
                if ".limits." in key and not key.endswith("unspecified")
            }
            print(f"  allocated ({record.get(PREFIX + 'allocation.source')}): limits {limits}")
            mismatched = record.get(MISMATCH + "resources") or ()
            for resource in mismatched:
                print(
                    f"  mismatch: {resource} {record.get(MISMATCH + resource + '.kind')} "
                    f"(requested {record.get(MISMATCH + resource + '.requested')}, "
                    f"allocated {record.get(MISMATCH + resource + '.allocated', 'no limit')})"
                )
            if not mismatched:
                print("  mismatch: none (the limits honour the request)")
        elif record.get(PREFIX + "resource.final"):
            usage = {
                key.removeprefix(PREFIX + "usage."): value
                for key, value in record.items()
                if key.startswith(PREFIX + "usage.")
            }
            print(f"  final sample: {usage}")
    return sandbox_spans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--require-spans", action="store_true", help="exit 1 unless sandbox spans were recorded"
    )
    parser.add_argument(
        "--without-cgroups",
        action="store_true",
        help="run the sandbox without cgroups: nothing enforces the request (a mismatch)",
    )
    args = parser.parse_args()
    without_cgroups = {"otel_process": {"cgroups": False, "read_only_paths": INTERPRETER}}
    config = without_cgroups if args.without_cgroups else PROVIDER_CONFIG
    exporter = watch_spans()
    asyncio.run(run_sandbox(config))
    if exporter is None:
        print("no SDK tracer provider: run under opentelemetry-instrument to see the spans")
        return 1 if args.require_spans else 0
    sandbox_spans = summarize(exporter)
    return 1 if args.require_spans and not sandbox_spans else 0


if __name__ == "__main__":
    sys.exit(main())
