"""CPU per request of a saturated aiohttp pool: plain, ours, the contrib instrumentation, both.

A loopback aiohttp server runs in a child process; this process drives it through a client
whose pool is far smaller than its concurrency, so nearly every request queues for a slot.
Every round runs every mode once, in a rotating order, in this one process, so machine drift
hits all modes alike; medians over rounds are printed with the ratio to plain aiohttp.

Modes:

* ``plain``: ``aiohttp.TCPConnector`` with nothing installed.
* ``ours``: ``NemoGymInstrumentor`` installed with an SDK meter provider that has a reader,
  so ``TCPConnector(...)`` builds the queue-timed connector.
* ``ours_idle``: ``NemoGymInstrumentor`` installed with an SDK meter provider without a
  reader (nothing exported), so ``TCPConnector(...)`` stays plain.
* ``contrib``: opentelemetry-instrumentation-aiohttp-client with an SDK tracer provider (batch
  processor, discarding exporter) and an SDK meter provider with a reader.
* ``both``: ``ours`` and ``contrib`` together.
* ``record``: plain aiohttp plus one bare SDK ``Histogram.record`` (same name, unit,
  buckets and attributes as ours) after each response: what one record costs inside the
  request path, where the SDK's code and data are no longer in the CPU caches.

* ``hooks``: a ``TCPConnector`` subclass overriding the two methods ours overrides
  (``connect`` and ``_wait_for_available_connection``) with bare delegation: what the
  override mechanism costs before any telemetry.

In each round the CPU cost of one bare SDK ``Histogram.record`` with the same name, unit,
buckets and attributes is also measured in a tight loop: one record per queued wait is the
contract, so that record is the floor our added CPU per queued request is compared with.

Run from the repository root: ``python benchmarks/pool_overhead.py`` (``--help`` for flags).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from _common import (
    DiscardingSpanExporter,
    drive,
    median,
    require_at_least,
    run_and_report,
    server_process,
)
from _common import machine as machine_facts
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry import _instruments
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

MODES = ("plain", "ours", "ours_idle", "contrib", "both", "record", "hooks")

# Targets from the issue: added CPU per queued request at most 1.25 bare records; at most 6 %
# more CPU per request than plain while exporting; nothing while not exporting.
FLOOR_FACTOR_TARGET = 1.25
EXPORTING_OVERHEAD_TARGET = 0.06


@dataclass
class Providers:
    """The SDK providers every mode reuses across rounds (made once, like an application)."""

    ours_reader: InMemoryMetricReader = field(default_factory=InMemoryMetricReader)
    ours: MeterProvider = field(init=False)
    idle: MeterProvider = field(default_factory=MeterProvider)
    contrib_meter: MeterProvider = field(
        default_factory=lambda: MeterProvider(metric_readers=[InMemoryMetricReader()])
    )
    contrib_tracer: TracerProvider = field(default_factory=TracerProvider)

    bare: MeterProvider = field(
        default_factory=lambda: MeterProvider(metric_readers=[InMemoryMetricReader()])
    )

    def __post_init__(self) -> None:
        self.ours = MeterProvider(metric_readers=[self.ours_reader])
        self.contrib_tracer.add_span_processor(BatchSpanProcessor(DiscardingSpanExporter()))
        self.bare_record = _bare_recorder(self.bare)

    def queued_waits(self) -> int:
        """Cumulative number of queue-duration samples our connector has recorded."""
        data = self.ours_reader.get_metrics_data()
        count = 0
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name != _instruments.QUEUE_DURATION:
                        continue
                    for point in metric.data.data_points:
                        if isinstance(point, HistogramDataPoint):
                            count += point.count
        return count

    def shutdown(self) -> None:
        for provider in (self.ours, self.idle, self.contrib_meter, self.contrib_tracer, self.bare):
            provider.shutdown()


def _install(mode: str, providers: Providers) -> Callable[[], None]:
    """Install ``mode``'s instrumentation; return the function that removes it."""
    undo: list[Callable[[], None]] = []
    if mode == "plain":
        return lambda: None
    if mode in ("ours", "both"):
        NemoGymInstrumentor().instrument(meter_provider=providers.ours, sandbox_resources=False)
        undo.append(NemoGymInstrumentor().uninstrument)
    if mode == "ours_idle":
        NemoGymInstrumentor().instrument(meter_provider=providers.idle, sandbox_resources=False)
        undo.append(NemoGymInstrumentor().uninstrument)
    if mode in ("contrib", "both"):
        AioHttpClientInstrumentor().instrument(
            tracer_provider=providers.contrib_tracer, meter_provider=providers.contrib_meter
        )
        undo.append(AioHttpClientInstrumentor().uninstrument)

    def remove() -> None:
        for step in reversed(undo):
            step()

    return remove


@dataclass
class Sample:
    cpu_s: float
    wall_s: float
    queued: int


class _PassThroughConnector(aiohttp.TCPConnector):
    """The two methods our connector overrides, overridden to do nothing but delegate.

    What the override mechanism alone costs on the request path: two extra coroutine frames
    per request, with no telemetry in them.
    """

    async def connect(self, req: Any, *args: Any, **kwargs: Any) -> Any:
        return await super().connect(req, *args, **kwargs)

    async def _wait_for_available_connection(self, key: Any, traces: Any) -> None:
        await super()._wait_for_available_connection(key, traces)


async def _run_mode(
    mode: str, providers: Providers, url: str, requests: int, concurrency: int, limit: int
) -> Sample:
    remove = _install(mode, providers)
    try:
        connector_class = _PassThroughConnector if mode == "hooks" else aiohttp.TCPConnector
        connector = connector_class(limit=limit)
        timed = isinstance(connector, QueueTimedTCPConnector)
        if timed != (mode in ("ours", "both")):
            raise RuntimeError(f"mode {mode}: got {type(connector).__name__}")
        async with aiohttp.ClientSession(connector=connector) as session:
            # Open the pool's connections outside the timed window: every mode then measures
            # steady-state reuse, not TCP handshakes.
            await drive(session, url, limit * 4, concurrency)
            gc.collect()
            queued_before = providers.queued_waits()
            after = providers.bare_record if mode == "record" else None
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            await drive(session, url, requests, concurrency, after)
            cpu = time.process_time() - cpu_start
            wall = time.perf_counter() - wall_start
            queued = providers.queued_waits() - queued_before
    finally:
        remove()
    return Sample(cpu, wall, queued)


def _bare_recorder(provider: MeterProvider) -> Callable[[], None]:
    """A function making one bare SDK record shaped like ours (name, unit, buckets, attributes)."""
    histogram = provider.get_meter("benchmark.floor").create_histogram(
        _instruments.QUEUE_DURATION,
        unit=_instruments.QUEUE_DURATION_UNIT,
        explicit_bucket_boundaries_advisory=_instruments.QUEUE_DURATION_BUCKETS,
    )
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


def _floor_us(records: int) -> float:
    """CPU microseconds of one bare SDK ``Histogram.record`` in a tight loop."""
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    record_once = _bare_recorder(provider)
    gc.collect()
    start = time.process_time()
    for _ in range(records):
        record_once()
    elapsed = time.process_time() - start
    provider.shutdown()
    return elapsed / records * 1e6


async def _benchmark(args: argparse.Namespace) -> dict[str, object]:
    providers = Providers()
    samples: dict[str, list[Sample]] = {mode: [] for mode in args.modes}
    floors: list[float] = []
    started = time.perf_counter()
    with server_process() as server:
        for round_index in range(args.warmup + args.rounds):
            # Rotate the order so no mode always runs first (warm caches) or last.
            shift = round_index % len(args.modes)
            order = args.modes[shift:] + args.modes[:shift]
            for mode in order:
                sample = await _run_mode(
                    mode, providers, server.url, args.requests, args.concurrency, args.limit
                )
                if round_index >= args.warmup:
                    samples[mode].append(sample)
            floor = _floor_us(args.floor_records)
            if round_index >= args.warmup:
                floors.append(floor)
            if not args.json:
                print(f"  round {round_index + 1}/{args.warmup + args.rounds} done", flush=True)
    providers.shutdown()
    return _summarise(args, samples, floors, time.perf_counter() - started)


def _summarise(
    args: argparse.Namespace,
    samples: dict[str, list[Sample]],
    floors: list[float],
    elapsed_s: float,
) -> dict[str, object]:
    plain = samples.get("plain")
    floor = median(floors)
    modes: dict[str, dict[str, float]] = {}
    for mode, runs in samples.items():
        cpu_us = [s.cpu_s / args.requests * 1e6 for s in runs]
        throughput = [args.requests / s.wall_s for s in runs]
        entry = {
            "cpu_us_per_request": median(cpu_us),
            "requests_per_s": median(throughput),
            "queued_fraction": median([s.queued / args.requests for s in runs]),
        }
        if plain is not None:
            # Ratios are taken round by round (same minute, same machine state), then the median.
            entry["cpu_ratio_to_plain"] = median(
                [s.cpu_s / p.cpu_s for s, p in zip(runs, plain, strict=True)]
            )
            entry["throughput_ratio_to_plain"] = median(
                [p.wall_s / s.wall_s for s, p in zip(runs, plain, strict=True)]
            )
            # What ours adds is measured against the same stack without it: plain for
            # ``ours``, the contrib instrumentation alone for ``both``.
            # ``record`` makes one bare record per request, queued or not.
            reference = samples["contrib"] if mode == "both" and "contrib" in samples else plain
            pairs = [
                (s, r, args.requests if mode == "record" else s.queued)
                for s, r in zip(runs, reference, strict=True)
            ]
            if any(n for _, _, n in pairs):
                added = median([(s.cpu_s - r.cpu_s) / n * 1e6 for s, r, n in pairs if n])
                entry["added_cpu_us_per_queued_request"] = added
                entry["added_per_queued_vs_floor"] = added / floor
        modes[mode] = entry
    in_request = modes.get("record", {}).get("added_cpu_us_per_queued_request")
    targets: dict[str, dict[str, object]] = {}
    ours = modes.get("ours", {})
    if "added_per_queued_vs_floor" in ours:
        value = ours["added_per_queued_vs_floor"]
        targets["ours added CPU per queued request <= 1.25 x floor"] = {
            "value": value,
            "met": value <= FLOOR_FACTOR_TARGET,
        }
        if in_request:
            value = ours["added_cpu_us_per_queued_request"] / in_request
            targets[
                "(for context) ours added per queued request vs a bare record in the request path"
            ] = {
                "value": value,
                "met": None,
            }
    if "cpu_ratio_to_plain" in ours:
        value = ours["cpu_ratio_to_plain"] - 1
        targets["ours CPU per request <= plain + 6%"] = {
            "value": value,
            "met": value <= EXPORTING_OVERHEAD_TARGET,
        }
    idle = modes.get("ours_idle", {})
    if "cpu_ratio_to_plain" in idle:
        targets["ours_idle CPU per request == plain (connector is plain)"] = {
            "value": idle["cpu_ratio_to_plain"] - 1,
            "met": None,  # equal within noise; the connector type is asserted every round
        }
    return {
        "benchmark": "pool_overhead",
        "machine": machine_facts(),
        "command": " ".join(["python", *sys.argv]),
        "config": {
            "rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "requests_per_round": args.requests,
            "concurrency": args.concurrency,
            "pool_limit": args.limit,
            "floor_records_per_round": args.floor_records,
        },
        "elapsed_s": elapsed_s,
        "floor_us_per_record": floor,
        "record_in_request_path_us": in_request,
        "modes": modes,
        "targets": targets,
    }


def _print_table(result: dict[str, object]) -> None:
    config = result["config"]
    assert isinstance(config, dict)
    modes = result["modes"]
    assert isinstance(modes, dict)
    print(
        f"\n{config['rounds']} rounds (+{config['warmup_rounds']} warm-up) x "
        f"{config['requests_per_round']} requests, concurrency {config['concurrency']}, "
        f"pool limit {config['pool_limit']}; medians; elapsed {result['elapsed_s']:.0f} s"
    )
    floor = result["floor_us_per_record"]
    print(f"floor: one bare SDK Histogram.record, same attributes, tight loop: {floor:.2f} us CPU")
    in_request = result.get("record_in_request_path_us")
    if isinstance(in_request, float):
        print(f"the same record once per request, in the request path: {in_request:.2f} us CPU")
    header = (
        f"{'mode':<10} {'CPU us/req':>10} {'vs plain':>9} {'req/s':>8} {'vs plain':>9} "
        f"{'queued':>7} {'added us/queued':>16} {'x floor':>8}"
    )
    print(header)
    print("-" * len(header))
    for mode, entry in modes.items():
        ratio = entry.get("cpu_ratio_to_plain")
        tput_ratio = entry.get("throughput_ratio_to_plain")
        added = entry.get("added_cpu_us_per_queued_request")
        vs_floor = entry.get("added_per_queued_vs_floor")
        print(
            f"{mode:<10} {entry['cpu_us_per_request']:>10.1f} "
            f"{_fmt(ratio, '{:>8.3f}x')} {entry['requests_per_s']:>8.0f} "
            f"{_fmt(tput_ratio, '{:>8.3f}x')} {entry['queued_fraction']:>7.1%} "
            f"{_fmt(added, '{:>16.2f}')} {_fmt(vs_floor, '{:>7.2f}x')}"
        )
    print(
        "added us/queued: CPU over the reference per queued request (reference: plain; for "
        "both: contrib; for record: per request)"
    )
    targets = result["targets"]
    assert isinstance(targets, dict)
    print("\ntargets:")
    for name, verdict in targets.items():
        met = verdict["met"]
        status = "for context" if met is None else ("met" if met else "MISSED")
        value = verdict["value"]
        shown = f"{value:+.1%}" if "plain" in name else f"{value:.2f}x"
        print(f"  {name}: {shown} -> {status}")


def _fmt(value: object, pattern: str) -> str:
    if not isinstance(value, float):
        width = len(pattern.format(0.0))
        return f"{'-':>{width}}"
    return pattern.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=13, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    parser.add_argument("--requests", type=int, default=3000, help="requests per mode and round")
    parser.add_argument("--concurrency", type=int, default=256, help="requests per wave")
    parser.add_argument("--limit", type=int, default=4, help="connector pool limit")
    parser.add_argument(
        "--floor-records", type=int, default=50_000, help="bare records timed per round"
    )
    parser.add_argument(
        "--modes",
        type=lambda text: [m for m in text.split(",") if m],
        default=list(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (plain is needed for ratios)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args()
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {unknown}; choose from {','.join(MODES)}")
    require_at_least(parser, args, 1, "rounds", "requests", "concurrency", "limit", "floor_records")
    run_and_report(args, _benchmark, _print_table)


if __name__ == "__main__":
    main()
