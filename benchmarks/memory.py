"""Resident memory of an exporting, instrumented aiohttp client over 100,000 requests.

``NemoGymInstrumentor`` is installed with an SDK meter provider whose periodic reader exports
every second to an exporter that discards, so collection and export run all along, as in a
real process. Requests go through a saturated pool (nearly all of them queue, so every one
records a queue-duration sample) and rotate over a few destination labels with
``set_server_name``. After a warm-up, the resident set size (``/proc/self/statm``) and the
number of objects the garbage collector tracks are taken at checkpoints; a leak shows as
growth that keeps pace with the request count.

Run from the repository root: ``python benchmarks/memory.py`` (``--help`` for flags).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import aiohttp
from _common import (
    DiscardingMetricExporter,
    drive,
    require_at_least,
    rss_bytes,
    run_and_report,
    server_process,
)
from _common import machine as machine_facts
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)

SERVER_NAMES = ("policy", "judge", "resources", "sandbox", "reward")


async def _requests(
    session: aiohttp.ClientSession, url: str, count: int, concurrency: int, batch: int
) -> None:
    """Send ``count`` requests in batches, each batch under the next destination label."""
    sent = 0
    index = 0
    while sent < count:
        size = min(batch, count - sent)
        token = set_server_name(SERVER_NAMES[index % len(SERVER_NAMES)])
        try:
            await drive(session, url, size, concurrency)
        finally:
            reset_server_name(token)
        sent += size
        index += 1


def _snapshot() -> tuple[int, int]:
    gc.collect()
    return rss_bytes(), len(gc.get_objects())


async def _benchmark(args: argparse.Namespace) -> dict[str, object]:
    reader = PeriodicExportingMetricReader(
        DiscardingMetricExporter(), export_interval_millis=args.export_interval_ms
    )
    provider = MeterProvider(metric_readers=[reader])
    instrumentor = NemoGymInstrumentor()
    if args.connector == "ours":
        instrumentor.instrument(meter_provider=provider, sandbox_resources=False, pressure=False)
    checkpoints: list[dict[str, float]] = []
    started = time.perf_counter()
    try:
        with server_process() as server:
            connector = aiohttp.TCPConnector(limit=args.limit)
            if isinstance(connector, QueueTimedTCPConnector) != (args.connector == "ours"):
                raise RuntimeError(f"expected the {args.connector} connector, got {connector!r}")
            async with aiohttp.ClientSession(connector=connector) as session:
                await _requests(session, server.url, args.warmup, args.concurrency, args.batch)
                done = 0
                rss, objects = _snapshot()
                checkpoints.append({"requests": 0, "rss_bytes": rss, "gc_objects": objects})
                step = max(1, args.requests // args.checkpoints)
                while done < args.requests:
                    size = min(step, args.requests - done)
                    await _requests(session, server.url, size, args.concurrency, args.batch)
                    done += size
                    rss, objects = _snapshot()
                    checkpoints.append({"requests": done, "rss_bytes": rss, "gc_objects": objects})
                    if not args.json:
                        print(
                            f"  {done:>7} requests: RSS {rss / 2**20:7.2f} MiB, "
                            f"{objects} gc objects",
                            flush=True,
                        )
    finally:
        if args.connector == "ours":
            instrumentor.uninstrument()
        provider.shutdown()
    first, last = checkpoints[0], checkpoints[-1]
    # The second half shows whether growth continues once allocator arenas have settled.
    middle = min(checkpoints, key=lambda c: abs(c["requests"] - args.requests / 2))
    half = last["requests"] - middle["requests"]
    return {
        "benchmark": "memory",
        "machine": machine_facts(),
        "command": " ".join(["python", *sys.argv]),
        "config": {
            "connector": args.connector,
            "warmup_requests": args.warmup,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "pool_limit": args.limit,
            "server_names": len(SERVER_NAMES),
            "export_interval_ms": args.export_interval_ms,
        },
        "elapsed_s": time.perf_counter() - started,
        "rss_before_bytes": first["rss_bytes"],
        "rss_after_bytes": last["rss_bytes"],
        "rss_growth_bytes_per_request": (last["rss_bytes"] - first["rss_bytes"]) / args.requests,
        "rss_growth_bytes_per_request_second_half": (
            (last["rss_bytes"] - middle["rss_bytes"]) / half if half else 0.0
        ),
        "gc_objects_before": first["gc_objects"],
        "gc_objects_after": last["gc_objects"],
        "checkpoints": checkpoints,
    }


def _print(result: dict[str, object]) -> None:
    config = result["config"]
    assert isinstance(config, dict)
    before = result["rss_before_bytes"]
    after = result["rss_after_bytes"]
    assert isinstance(before, int)
    assert isinstance(after, int)
    print(
        f"\n{config['requests']} requests after {config['warmup_requests']} warm-up, "
        f"connector {config['connector']}, concurrency {config['concurrency']}, pool limit "
        f"{config['pool_limit']}, {config['server_names']} destination labels, export every "
        f"{config['export_interval_ms']} ms; elapsed {result['elapsed_s']:.0f} s"
    )
    print(
        f"RSS before {before / 2**20:.2f} MiB, after {after / 2**20:.2f} MiB "
        f"({(after - before) / 2**10:+.0f} KiB)"
    )
    print(
        f"growth per request: {result['rss_growth_bytes_per_request']:+.3f} B overall, "
        f"{result['rss_growth_bytes_per_request_second_half']:+.3f} B over the second half"
    )
    print(f"gc-tracked objects: {result['gc_objects_before']} -> {result['gc_objects_after']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=100_000, help="measured requests")
    parser.add_argument("--warmup", type=int, default=10_000, help="requests before measuring")
    parser.add_argument("--checkpoints", type=int, default=10, help="RSS readings after warm-up")
    parser.add_argument("--concurrency", type=int, default=256, help="requests per wave")
    parser.add_argument("--limit", type=int, default=4, help="connector pool limit")
    parser.add_argument("--batch", type=int, default=500, help="requests per destination label")
    parser.add_argument("--export-interval-ms", type=int, default=1000, help="reader interval")
    parser.add_argument(
        "--connector",
        choices=("ours", "plain"),
        default="ours",
        help="ours (instrumented, exporting; default) or plain, for comparison",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args()
    require_at_least(
        parser,
        args,
        1,
        "requests",
        "checkpoints",
        "concurrency",
        "limit",
        "batch",
        "export_interval_ms",
    )
    require_at_least(parser, args, 0, "warmup")
    run_and_report(args, _benchmark, _print)


if __name__ == "__main__":
    main()
