"""What the SIGTERM handler and the exit flush keep: counts a process made since its last export.

Runs child processes that each record ``--counts`` increments on a counter of an SDK meter
provider exporting every 600 s (so only a last export can carry them) to a file, instrument
(every capability on), then end: by SIGTERM with the plugin's handler, by SIGTERM with SIGTERM's
default action put back (the process as it would be without the handler), or by returning from
main with a slow exit handler of the application's and a kill 1 s later, as NeMo Gym kills
its servers, with and without the exit flush. Prints, per way of ending, the counts that
reached the exporter, the exit status, and the milliseconds from the signal (or the return) to
the end. Used by docs/process-effects.md:

    .venv/bin/python scripts/sigterm_flush.py --counts 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter, MetricExportResult, PeriodicExportingMetricReader,
    )
    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    out, counts, way = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    class FileExporter(MetricExporter):
        def __init__(self):
            super().__init__()
        def export(self, data, timeout_millis=10_000, **_):
            total = sum(
                p.value for r in data.resource_metrics for s in r.scope_metrics
                for m in s.metrics if m.name == "app_total" for p in m.data.data_points
            )
            with open(out, "a") as f:
                f.write(json.dumps(total) + "\\n")
            return MetricExportResult.SUCCESS
        def force_flush(self, timeout_millis=10_000):
            return True
        def shutdown(self, timeout_millis=30_000, **_):
            pass

    reader = PeriodicExportingMetricReader(FileExporter(), export_interval_millis=600_000)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    NemoGymInstrumentor().instrument()
    if way == "sigterm-default":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    counter = metrics.get_meter("measure").create_counter("app_total")
    for _ in range(counts):
        counter.add(1)
    if way.startswith("exit"):
        import atexit, time
        atexit.register(time.sleep, 5)  # a slow exit handler of the application's (Ray's)
    if way in ("exit", "exit-killed"):
        from opentelemetry.instrumentation.nemo_gym._shared._exit_flush import flush_at_exit
        flush_at_exit(metrics.get_meter_provider())  # as the first timed connector does
    print("ready", flush=True)
    if not way.startswith("exit"):
        sys.stdin.readline()  # the signal's handler runs here
    """
)


def _once(way: str, counts: int, folder: Path, kill_after: float) -> tuple[int, int, float]:
    out = folder / f"{way}-{time.monotonic_ns()}.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), str(counts), way],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "ready\n"
    started = time.monotonic()
    if way.startswith("sigterm"):
        child.send_signal(signal.SIGTERM)
    elif way.startswith("exit-killed"):
        # NeMo Gym kills a server 1 s after its SIGINT: here that long after it starts to exit
        # (less than its 5 s exit handler takes).
        time.sleep(kill_after)
        child.kill()
    child.wait(timeout=120)
    ended_ms = (time.monotonic() - started) * 1000
    exported = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return (max(exported) if exported else 0), child.returncode, ended_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kill-after", type=float, default=1.0, help="seconds, below 5")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for way in ("sigterm-handler", "sigterm-default", "exit-killed", "exit-killed-noflush"):
            runs = [
                _once(way, args.counts, Path(folder), args.kill_after) for _ in range(args.rounds)
            ]
            exported = sorted({r[0] for r in runs})
            statuses = sorted({r[1] for r in runs})
            times = sorted(r[2] for r in runs)
            print(
                f"{way:19} exported {exported} of {args.counts}, exit status {statuses}, "
                f"ended after {times[len(times) // 2]:.0f} ms (median; {times[0]:.0f} to "
                f"{times[-1]:.0f})"
            )


if __name__ == "__main__":
    main()
