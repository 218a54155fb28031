"""Helpers shared by the benchmarks: a server process, the request driver, machine facts.

Benchmarks are scripts, not tests: run them from the repository root, for example
``python benchmarks/pool_overhead.py``. Nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from opentelemetry.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from opentelemetry.instrumentation.nemo_gym.telemetry import _instruments

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


class PassThroughConnector(aiohttp.TCPConnector):
    """The two methods our connector overrides, overridden to do nothing but delegate.

    What the override mechanism alone costs on the request path: two extra coroutine frames
    per request, with no telemetry in them (benchmark mode ``hooks``).
    """

    async def connect(self, req: Any, *args: Any, **kwargs: Any) -> Any:
        return await super().connect(req, *args, **kwargs)

    async def _wait_for_available_connection(self, key: Any, traces: Any) -> None:
        await super()._wait_for_available_connection(key, traces)


def _queue_histogram(provider: MeterProvider, meter_name: str) -> Histogram:
    """A histogram with our queue-wait instrument's name, unit and buckets, on its own meter."""
    return provider.get_meter(meter_name).create_histogram(
        _instruments.QUEUE_DURATION,
        unit=_instruments.QUEUE_DURATION_UNIT,
        explicit_bucket_boundaries_advisory=_instruments.QUEUE_DURATION_BUCKETS,
    )


def bare_recorder(provider: MeterProvider) -> Callable[[], None]:
    """A function making one bare SDK record shaped like ours (name, unit, buckets, attributes)."""
    histogram = _queue_histogram(provider, "benchmark.floor")
    attributes = {
        _instruments.ATTR_QUEUE_CONSTRAINT: "total",
        _instruments.ATTR_QUEUE_OUTCOME: _instruments.OUTCOME_OK,
        _instruments.ATTR_SERVER_NAME: "external",
    }
    # Spread over the buckets, as queue waits are.
    values = itertools.cycle([0.003 * (1.37**i) for i in range(40)])
    record = histogram.record

    def record_once() -> None:
        record(next(values), attributes)

    return record_once


def queue_trace_config(provider: MeterProvider | None) -> aiohttp.TraceConfig:
    """A queue timer on aiohttp's public signals, ``on_connection_queued_start/end``.

    With ``provider``, each wait that ends with a slot makes one SDK record shaped like ours
    (benchmark mode ``trace_config``); without, the two handlers do nothing (mode
    ``trace_config_bare``: what the signals cost before any telemetry). The signals carry no
    fields (aiohttp's ``TraceConnectionQueuedStartParams`` is empty) and the handler gets the
    session, not the connection key, so the binding limit is not classified: the attributes
    are fixed. aiohttp sends no ``queued_end`` when the wait raises, so an abandoned wait is
    never recorded here.
    """
    trace_config = aiohttp.TraceConfig()
    if provider is None:

        async def ignore(*_: Any) -> None:
            return None

        trace_config.on_connection_queued_start.append(ignore)
        trace_config.on_connection_queued_end.append(ignore)
        trace_config.freeze()
        return trace_config
    histogram = _queue_histogram(provider, "benchmark.trace_config")
    attributes = {
        _instruments.ATTR_QUEUE_CONSTRAINT: "unknown",
        _instruments.ATTR_QUEUE_OUTCOME: _instruments.OUTCOME_OK,
        _instruments.ATTR_SERVER_NAME: "external",
    }
    record = histogram.record
    perf_counter = time.perf_counter

    async def queued_start(_session: Any, context: Any, _params: Any) -> None:
        context.queued_at = perf_counter()

    async def queued_end(_session: Any, context: Any, _params: Any) -> None:
        record((perf_counter() - context.queued_at) * 1000.0, attributes)

    trace_config.on_connection_queued_start.append(queued_start)
    trace_config.on_connection_queued_end.append(queued_end)
    trace_config.freeze()
    return trace_config


# The queue-wait histogram under NeMo Gym's connection-pool name and under the semantic-convention
# name that OTEL_SEMCONV_STABILITY_OPT_IN=http selects (http/dup emits both: the first present
# counts).
QUEUE_HISTOGRAM_NAMES = (_instruments.QUEUE_DURATION, "http.client.request.time_in_queue")

# Our naming modes: the value of OTEL_SEMCONV_STABILITY_OPT_IN each one runs with (None: unset).
NAMING_MODES: dict[str, str | None] = {"default": None, "http": "http", "http-dup": "http/dup"}


def queued_waits(data: MetricsData | None) -> int:
    """Cumulative number of queue-wait samples in ``data`` (one histogram name counted)."""
    counts: dict[str, int] = {}
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name not in QUEUE_HISTOGRAM_NAMES:
                    continue
                for point in metric.data.data_points:
                    if isinstance(point, HistogramDataPoint):
                        counts[metric.name] = counts.get(metric.name, 0) + point.count
    return next((counts[name] for name in QUEUE_HISTOGRAM_NAMES if name in counts), 0)


@contextlib.contextmanager
def semconv_opt_in(value: str | None) -> Iterator[None]:
    """Set (or unset, for ``None``) OTEL_SEMCONV_STABILITY_OPT_IN for the block, then restore.

    The instrumentation reads the variable when it is installed or builds a connector, so a
    mode installs inside this block. Contrib's reader of the variable caches its answer once
    per process; its cache is cleared on the way in and out so each mode gets its own value.
    """
    name = "OTEL_SEMCONV_STABILITY_OPT_IN"
    previous = os.environ.get(name)
    _forget_contrib_semconv_choice()
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
        _forget_contrib_semconv_choice()


def _forget_contrib_semconv_choice() -> None:
    try:
        from opentelemetry.instrumentation._semconv import (
            _OpenTelemetrySemanticConventionStability as stability,
        )
    except ImportError:
        return
    with stability._lock:
        stability._initialized = False


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (the interquartile range's ends)."""
    if len(values) < 2:
        only = values[0] if values else float("nan")
        return only, only
    first, _, third = statistics.quantiles(values, n=4, method="inclusive")
    return first, third


def pooled_ratio(
    numerators: Sequence[float], denominators: Sequence[float], resamples: int = 4000
) -> tuple[float, float, float]:
    """``sum(numerators) / sum(denominators)`` with a 95 % bootstrap interval over rounds.

    The two sequences are paired by round (the same minute of the same machine), so rounds
    are resampled as pairs. The generator is seeded: the same figures give the same interval.
    """
    pairs = list(zip(numerators, denominators, strict=True))
    ratio = sum(numerators) / sum(denominators)
    if len(pairs) < 2:
        return ratio, ratio, ratio
    generator = random.Random(0)
    estimates = []
    for _ in range(resamples):
        sample = generator.choices(pairs, k=len(pairs))
        estimates.append(sum(n for n, _ in sample) / sum(d for _, d in sample))
    estimates.sort()
    return ratio, estimates[int(0.025 * resamples)], estimates[int(0.975 * resamples) - 1]


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
    benchmark: Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]],
    print_result: Callable[[dict[str, Any]], None],
) -> None:
    """Run ``benchmark(args)``; print the machine and a table, or with ``--json`` one object."""
    if not args.json:
        print_machine()
    result: dict[str, Any] = asyncio.run(benchmark(args))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print_result(result)
