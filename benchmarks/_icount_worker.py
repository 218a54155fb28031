"""One measurement of ``instruction_count.py``, run under valgrind's callgrind.

Not run by hand: ``instruction_count.py`` starts the loopback server natively and runs this
script under ``valgrind --tool=callgrind --dump-before=os_getppid``, so every ``os.getppid()``
here (the *marker*) writes the instructions executed since the previous marker to a numbered
file and starts counting afresh. The script sets up one mode, warms it up, then runs its
phases, each between two markers:

* ``requests`` modes (``plain``, ``ours``, ``hooks``, ``record``): each phase sends its
  number of requests in fan-out waves and then, for modes with a reader, collects once,
  inside the phase, so batched samples still buffered are paid for where they were made;
  ``ours`` then has one more phase of collections with no requests (the cost per collection).
* ``floor``: each phase makes its number of bare SDK ``Histogram.record`` calls shaped like
  ours, back to back in batches of 128 (how ``BatchedHistogram`` replays them), then collects.

A full ``gc.collect()`` runs before each phase, outside it, so every phase starts from the same
collector state. It prints one JSON object: per phase, the dump number holding it, the requests
or records made, the queue waits recorded and the garbage collections run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
from _common import PassThroughConnector, bare_recorder, drive, queued_waits
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
)

BATCH = 128


class Markers:
    """Counts the markers made so far: marker ``n`` ends callgrind's dump number ``n``."""

    def __init__(self) -> None:
        self.made = 0

    def __call__(self) -> int:
        os.getppid()  # callgrind dumps on entry to CPython's os_getppid (--dump-before)
        self.made += 1
        return self.made


def _collections() -> int:
    return sum(generation["collections"] for generation in gc.get_stats())


async def _requests_mode(args: argparse.Namespace, mark: Markers) -> dict[str, Any]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    after: Callable[[], None] | None = None
    collect: Callable[[], object] = lambda: None  # noqa: E731 - the plain modes collect nothing
    if args.mode == "ours":
        # The pool alone: the pressure metrics cost per second, not per request, and under
        # valgrind a second lasts fifty (benchmarks/loop_probe_cost.py measures them).
        NemoGymInstrumentor().instrument(
            meter_provider=provider, sandbox_resources=False, pressure=False
        )
        collect = reader.get_metrics_data
    elif args.mode == "record":
        after = bare_recorder(provider)
        collect = reader.get_metrics_data
    connector_class = PassThroughConnector if args.mode == "hooks" else aiohttp.TCPConnector
    connector = connector_class(limit=args.limit)
    if isinstance(connector, QueueTimedTCPConnector) != (args.mode == "ours"):
        raise RuntimeError(f"mode {args.mode}: got {type(connector).__name__}")
    phases = []
    async with aiohttp.ClientSession(connector=connector) as session:
        # Open the pool's connections and run every code path once before counting.
        await drive(session, args.url, args.warmup, args.concurrency, after)
        collect()
        for requests in args.phases:
            gc.collect()
            queued_before = queued_waits(reader.get_metrics_data())
            collections_before = _collections()
            mark()
            await drive(session, args.url, requests, args.concurrency, after)
            collect()
            dump = mark()
            phases.append(
                {
                    "dump": dump,
                    "requests": requests,
                    "queued": queued_waits(reader.get_metrics_data()) - queued_before,
                    "collections": _collections() - collections_before,
                }
            )
        collect_phase = None
        if args.mode == "ours":
            gc.collect()
            mark()
            for _ in range(args.collects):
                collect()
            collect_phase = {"dump": mark(), "collects": args.collects}
    NemoGymInstrumentor().uninstrument()
    provider.shutdown()
    return {"phases": phases, "collect_phase": collect_phase}


def _floor_mode(args: argparse.Namespace, mark: Markers) -> dict[str, Any]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    record_once = bare_recorder(provider)
    for _ in range(args.warmup):
        record_once()
    reader.get_metrics_data()
    phases = []
    for records in args.phases:
        gc.collect()
        collections_before = _collections()
        mark()
        for _ in range(records // BATCH):
            for _ in range(BATCH):
                record_once()
        reader.get_metrics_data()
        dump = mark()
        phases.append(
            {
                "dump": dump,
                "records": records // BATCH * BATCH,
                "collections": _collections() - collections_before,
            }
        )
    provider.shutdown()
    return {"phases": phases, "collect_phase": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--mode", required=True, choices=("plain", "ours", "hooks", "record", "floor")
    )
    parser.add_argument("--url", default="")
    parser.add_argument("--phases", type=lambda text: [int(n) for n in text.split(",")])
    parser.add_argument("--warmup", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--collects", type=int, default=20)
    args = parser.parse_args()
    mark = Markers()
    if args.mode == "floor":
        result = _floor_mode(args, mark)
    else:
        result = asyncio.run(_requests_mode(args, mark))
    result["gc_threshold"] = list(gc.get_threshold())
    result["gc_enabled"] = gc.isenabled()
    result["hash_seed"] = os.environ.get("PYTHONHASHSEED")
    result["semconv_opt_in"] = os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN")
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
