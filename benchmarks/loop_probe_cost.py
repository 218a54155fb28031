"""What the pressure metrics cost: the event-loop lag probe, and the in-flight count per request.

Three measurements, each side by side in one run, modes alternating round by round:

* **idle loop**: CPU (``time.process_time``) per wall second of an asyncio loop that has
  nothing to do (one ``asyncio.sleep``), without the probe and with it at 100 ms (the default
  ``OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS``) and at 10 ms (the smallest allowed), each tick
  recorded into a real SDK histogram (``InMemoryMetricReader``, collected at the end of each
  window). The difference is the probe's share of one core;
* **busy loop**: callbacks per CPU second of a loop kept busy by a chain of ``call_soon``
  callbacks (the scheduling work every request does), without and with the probe at 100 ms;
  their ratio shows the probe puts nothing on the path of the loop's own work;
* **per collection**: CPU nanoseconds per ``gc.collect(0)`` of a small heap, without and with
  the GC pause callback (a deque append and three integer additions; the SDK record happens
  at the metrics' collection);
* **per request**: nanoseconds per call of a minimal ASGI app (it answers one
  ``http.response.start`` and one ``http.response.body``), called directly, without and with
  the ``InFlightApp`` wrapper (an integer added and taken per request, no OpenTelemetry call).

Run from the repository root: ``python benchmarks/loop_probe_cost.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import machine as machine_facts
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from opentelemetry.instrumentation.nemo_gym.pressure._loop_lag import LoopLagProbe
from opentelemetry.instrumentation.nemo_gym.pressure._pressure import (
    LOOP_LAG,
    LOOP_LAG_BUCKETS_MS,
    InFlightApp,
    _GcPauses,
    _InFlight,
)


def _recorder(provider: MeterProvider) -> Callable[[float], None]:
    histogram = provider.get_meter("bench").create_histogram(
        LOOP_LAG, unit="ms", explicit_bucket_boundaries_advisory=list(LOOP_LAG_BUCKETS_MS)
    )
    return histogram.record


async def idle_share(interval_s: float | None, window_s: float) -> float:
    """CPU seconds per wall second of an idle loop, with the probe every ``interval_s``."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    probe = None
    if interval_s is not None:
        probe = LoopLagProbe(asyncio.get_running_loop(), interval_s, _recorder(provider))
    wall, cpu = time.perf_counter(), time.process_time()
    if probe is not None:
        probe.start()
    await asyncio.sleep(window_s)
    if probe is not None:
        probe.stop()
    reader.get_metrics_data()
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    provider.shutdown()
    return share


async def busy_rate(interval_s: float | None, window_s: float) -> float:
    """``call_soon`` callbacks run per CPU second, with the probe every ``interval_s``."""
    loop = asyncio.get_running_loop()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    probe = None
    if interval_s is not None:
        probe = LoopLagProbe(loop, interval_s, _recorder(provider))
        probe.start()
    done = loop.create_future()
    count = 0
    deadline = time.perf_counter() + window_s

    def step() -> None:
        nonlocal count
        count += 1
        if count % 1024 == 0 and time.perf_counter() >= deadline:
            done.set_result(None)
        else:
            loop.call_soon(step)

    cpu = time.process_time()
    loop.call_soon(step)
    await done
    used = time.process_time() - cpu
    if probe is not None:
        probe.stop()
    provider.shutdown()
    return count / used


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def per_call_ns(app: Any, calls: int) -> float:
    """CPU nanoseconds per call of ``app`` with an HTTP scope."""
    scope = {"type": "http", "path": "/"}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(_message: Any) -> None:
        return None

    cpu = time.process_time_ns()
    for _ in range(calls):
        await app(scope, receive, send)
    return (time.process_time_ns() - cpu) / calls


def gc_ns(with_callback: bool, collections: int) -> float:
    """CPU nanoseconds per young-generation collection, with the GC pause callback or not."""
    pauses = _GcPauses(MeterProvider().get_meter("bench").create_histogram("pause"))
    if with_callback:
        gc.callbacks.append(pauses)
    try:
        cpu = time.process_time_ns()
        for _ in range(collections):
            gc.collect(0)
        return (time.process_time_ns() - cpu) / collections
    finally:
        if with_callback:
            gc.callbacks.remove(pauses)


async def main(arguments: argparse.Namespace) -> None:
    idle: dict[str, list[float]] = {"no probe": [], "probe 100 ms": [], "probe 10 ms": []}
    intervals = {"no probe": None, "probe 100 ms": 0.1, "probe 10 ms": 0.01}
    busy: dict[str, list[float]] = {"no probe": [], "probe 100 ms": []}
    calls: dict[str, list[float]] = {"plain app": [], "InFlightApp": []}
    collections: dict[str, list[float]] = {"no callback": [], "GC pause callback": []}
    wrapped = InFlightApp(_app, _InFlight())
    for _ in range(arguments.rounds):
        for mode, interval in intervals.items():
            idle[mode].append(await idle_share(interval, arguments.window))
        for mode in busy:
            busy[mode].append(await busy_rate(intervals[mode], arguments.window))
        calls["plain app"].append(await per_call_ns(_app, arguments.calls))
        calls["InFlightApp"].append(await per_call_ns(wrapped, arguments.calls))
        collections["no callback"].append(gc_ns(False, arguments.calls // 10))
        collections["GC pause callback"].append(gc_ns(True, arguments.calls // 10))

    print(", ".join(f"{key}: {value}" for key, value in machine_facts().items()))
    print(f"{arguments.rounds} rounds; windows of {arguments.window} s; {arguments.calls} calls")
    print("\n| idle loop | CPU share of one core, median [min, max] | added by the probe |")
    print("|---|---|---|")
    base = statistics.median(idle["no probe"])
    for mode, values in idle.items():
        added = "–" if mode == "no probe" else f"{(statistics.median(values) - base) * 100:.3f}%"
        print(
            f"| {mode} | {statistics.median(values) * 100:.3f}% "
            f"[{min(values) * 100:.3f}%, {max(values) * 100:.3f}%] | {added} |"
        )
    print("\n| busy loop | callbacks per CPU second, median | vs no probe |")
    print("|---|---|---|")
    plain_rate = statistics.median(busy["no probe"])
    for mode, values in busy.items():
        rate = statistics.median(values)
        print(f"| {mode} | {rate:,.0f} | {rate / plain_rate:.3f} |")
    print("\n| ASGI call | CPU ns per request, median | added |")
    print("|---|---|---|")
    plain_ns = statistics.median(calls["plain app"])
    for mode, values in calls.items():
        added = "–" if mode == "plain app" else f"{statistics.median(values) - plain_ns:+.0f} ns"
        print(f"| {mode} | {statistics.median(values):.0f} | {added} |")

    print("\n| young collection | CPU ns per collection, median | added |")
    print("|---|---|---|")
    plain_gc = statistics.median(collections["no callback"])
    for mode, values in collections.items():
        added = "–" if mode == "no callback" else f"{statistics.median(values) - plain_gc:+.0f} ns"
        print(f"| {mode} | {statistics.median(values):.0f} | {added} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode (default 5)")
    parser.add_argument("--window", type=float, default=4.0, help="seconds per window (4)")
    parser.add_argument("--calls", type=int, default=200_000, help="ASGI calls per round")
    asyncio.run(main(parser.parse_args()))
