"""NeMo Gym's own sandbox API, with our process provider picked by its registry name.

    opentelemetry-instrument --traces_exporter console --metrics_exporter none \\
        python examples/nemo_gym_sandbox.py

This is NeMo Gym user code, unchanged: ``AsyncSandbox({"otel_process": {...}}, spec)`` finds
``ProcessSandboxProvider`` through NeMo Gym's ``nemo_gym.sandbox_providers`` entry points
(installed with this package), creates a sandbox asking for 0.5 CPU and 64 MiB, runs two
commands, and stops it. Under ``opentelemetry-instrument`` the ``nemo_gym`` instrumentor
traces whatever provider NeMo Gym builds: the console exporter prints the ``sandbox.create``,
``sandbox.exec`` and ``sandbox.close`` spans and the ``sandbox.resources`` records (requested,
allocated, samples). The example also counts the spans it saw and prints them last;
``--require-spans`` makes it exit 1 when there were none (CI uses it to prove the wiring).

Needs ``nemo-gym`` (``pip install --no-deps --ignore-requires-python nemo-gym==0.4.0``: its
``nemo_gym.sandbox`` package needs only the standard library).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys

from nemo_gym.sandbox import AsyncSandbox, SandboxSpec
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# What a NeMo Gym config names: `sandbox_provider: {otel_process: {cgroups: true}}`.
PROVIDER_CONFIG = {"otel_process": {"cgroups": True}}
SPEC = SandboxSpec(
    files={"solve.py": "print(sum(range(10**6)))\n"},
    resources={"cpu": 0.5, "memory_mib": 64},
)


async def run_sandbox() -> None:
    async with AsyncSandbox(PROVIDER_CONFIG, SPEC) as sandbox:
        await sandbox.start()
        for command in (f"{sys.executable} solve.py", "echo $HOME"):
            result = await sandbox.exec(command, timeout_s=30)
            print(f"$ {command}\n  exit {result.return_code}: {(result.stdout or '').strip()}")


def watch_spans() -> InMemorySpanExporter | None:
    """An in-memory exporter beside the configured ones, to count what was recorded; ``None``
    when no SDK tracer provider is configured (not run under opentelemetry-instrument)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return None
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--require-spans", action="store_true", help="exit 1 unless sandbox spans were recorded"
    )
    args = parser.parse_args()
    exporter = watch_spans()
    asyncio.run(run_sandbox())
    if exporter is None:
        print("no SDK tracer provider: run under opentelemetry-instrument to see the spans")
        return 1 if args.require_spans else 0
    names = collections.Counter(span.name for span in exporter.get_finished_spans())
    sandbox_spans = {name: n for name, n in sorted(names.items()) if name.startswith("sandbox.")}
    print("sandbox spans recorded:", sandbox_spans or "none")
    return 1 if args.require_spans and not sandbox_spans else 0


if __name__ == "__main__":
    sys.exit(main())
