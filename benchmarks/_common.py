"""Helpers shared by the benchmarks: a server process, the request driver, machine facts.

Benchmarks are scripts, not tests: run them from the repository root, for example
``python benchmarks/pool_overhead.py``. Nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_SERVER_SCRIPT = Path(__file__).with_name("_server.py")


@dataclass(frozen=True)
class ServerProcess:
    """A running ``_server.py``; ``url`` is its base URL."""

    url: str
    process: subprocess.Popen[str]


@contextlib.contextmanager
def server_process(host: str = "127.0.0.1", delay_s: float = 0.0) -> Iterator[ServerProcess]:
    """Run the loopback aiohttp server in a child process for the duration of the block."""
    process = subprocess.Popen(
        [sys.executable, str(_SERVER_SCRIPT), "--host", host, "--delay", str(delay_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line.startswith("PORT "):
            raise RuntimeError(f"benchmark server did not start (said {line!r})")
        yield ServerProcess(url=f"http://{host}:{int(line.split()[1])}", process=process)
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


async def _one(session: aiohttp.ClientSession, url: str, after: Callable[[], None] | None) -> None:
    async with session.get(url) as response:
        await response.read()
        response.raise_for_status()
    if after is not None:
        after()


async def drive(
    session: aiohttp.ClientSession,
    url: str,
    requests: int,
    concurrency: int,
    after: Callable[[], None] | None = None,
) -> None:
    """Send ``requests`` GETs to ``url`` in waves of ``concurrency`` tasks, one request each.

    This is a rollout server's fan-out: every wave starts all its requests at once, so with
    a pool of ``limit`` slots all but ``limit`` of each wave queue for a slot, which is the
    path the queue timer instruments. (A few long-lived worker tasks would not do: since
    aiohttp 3.14 a task that just released a connection takes it straight back from the
    pool in its next ``connect()``, ahead of the queued waiters, so few requests would queue.)
    """
    sent = 0
    while sent < requests:
        wave = min(concurrency, requests - sent)
        await asyncio.gather(*(_one(session, url, after) for _ in range(wave)))
        sent += wave


class DiscardingMetricExporter(MetricExporter):
    """A metric exporter that accepts everything and keeps nothing (an exporting process)."""

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        return None


class DiscardingSpanExporter(SpanExporter):
    """A span exporter that accepts everything and keeps nothing (an exporting process)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def machine() -> dict[str, str]:
    """What the figures were measured on, printed with every result."""
    return {
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "aiohttp": _version("aiohttp"),
        "opentelemetry-sdk": _version("opentelemetry-sdk"),
        "opentelemetry-instrumentation-aiohttp-client": _version(
            "opentelemetry-instrumentation-aiohttp-client"
        ),
    }


def print_machine() -> None:
    facts = machine()
    print("machine: " + "; ".join(f"{key} {value}" for key, value in facts.items()))


def require_at_least(
    parser: argparse.ArgumentParser, args: argparse.Namespace, minimum: float, *names: str
) -> None:
    """Stop with a usage error naming the first of ``names`` whose value is below ``minimum``."""
    for name in names:
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be at least {minimum}")


def run_and_report(
    args: argparse.Namespace,
    benchmark: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
    print_result: Callable[[dict[str, Any]], None],
) -> None:
    """Run ``benchmark(args)``; print the machine and a table, or with ``--json`` one object."""
    if not args.json:
        print_machine()
    result = asyncio.run(benchmark(args))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print_result(result)
