"""What sandbox telemetry costs a burst of sandboxes: all started at once, then one command each.

A NeMo Gym run starts its sandboxes in bursts (every rollout of a batch asks for one at once).
This script does what such a run does, with NeMo Gym's own ``docker`` provider (the ``docker``
CLI, here on Podman through ``DOCKER_HOST``): ``--sandboxes`` ``AsyncSandbox.start()`` calls
under one ``asyncio.gather``, then one ``exec("echo hi")`` in each, also at once; then it
waits for every allocation record and stops the sandboxes (not timed). Each run is a fresh
process, without the plugin (``off``: not imported) or with it instrumented (``on``:
``NemoGymInstrumentor`` with an SDK tracer provider that exports, the default sampling
interval unless ``--interval``). Runs alternate: each round runs both modes in a fresh
seeded random order, for each burst size. Prints per mode and size the median wall time of
the start and of the exec round, and their ratio on/off (median of the rounds' ratios); the
CPU of the processes the run started (the ``docker`` CLI processes, the application's and
ours: ``RUSAGE_CHILDREN``) and its own; the allocation records and how many carry
``resource.error``.

``--count-calls`` adds one run per mode and size with the engine's socket behind a counting
proxy (in the run's process, on a thread of its own): every request the engine receives, by
kind (``inspect``, ``info``, ``exec.start``, ...), the application's and ours; on less off is
what the plugin asked. It is not timed.

``--check RATIO`` exits 1 when a median ratio (start or exec, any size) is above ``RATIO``, or
when an allocation record of an ``on`` run is missing or carries an error: the quick CI form
is ``--sandboxes 20 --rounds 3 --check 1.10``. Run from the repository root, in the NeMo Gym
main virtualenv (``scripts/nemo-gym-main-env.sh``), with the engine of
``scripts/start-podman.sh``:

    DOCKER_HOST=unix:///run/nemo-gym-podman/podman.sock \\
      .venv-nemo-gym-main/bin/python benchmarks/sandbox_burst.py --sandboxes 20 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODES = ("off", "on")
IMAGE = "localhost/nemo-gym-busybox:latest"
# The longest a run waits for its allocation records after the exec round.
RECORDS_BOUND_S = 120.0
# Requests as the engine's socket receives them (HTTP/1.1 request lines).
_REQUEST = re.compile(rb"^(GET|POST|PUT|DELETE|HEAD) (\S+) HTTP/1\.[01]\r?$", re.MULTILINE)
_VERSIONED = re.compile(r"^/v[0-9.]+")


# --- the counting proxy (--count-calls) ------------------------------------------------------


def request_kind(method: str, path: str) -> str:
    """A request's kind: its path without the API version, query and ids."""
    path = _VERSIONED.sub("", path.split("?", 1)[0])
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["libpod"]:
        parts = parts[1:]
        prefix = "libpod."
    else:
        prefix = ""
    if not parts:
        return prefix + method
    if parts[0] in ("containers", "exec", "images") and len(parts) >= 2:
        if parts[1] in ("json", "create"):
            name = {"json": "list", "create": "create"}[parts[1]]
            return f"{prefix}{parts[0]}.{name}"
        action = (
            parts[2]
            if len(parts) > 2
            else {"GET": "inspect", "DELETE": "remove"}.get(method, method)
        )
        if action == "json":
            action = "inspect"
        return f"{prefix}{parts[0]}.{action}"
    return prefix + "/".join(parts)


class CountingProxy:
    """A unix-socket proxy in front of the engine that counts the requests it forwards."""

    def __init__(self, upstream: str, path: str) -> None:
        self.upstream = upstream
        self.path = path
        self.counts: Counter[str] = Counter()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="counting proxy", daemon=True)

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the counting proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(asyncio.start_unix_server(self._serve, self.path))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer, count=True),
            self._pump(up_reader, writer, count=False),
            return_exceptions=True,
        )
        for end in (writer, up_writer):
            end.close()

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, count: bool
    ) -> None:
        """Forward until ``source`` ends, then half-close ``sink`` (an exec's client closes
        its side and still reads the command's output)."""
        while chunk := await source.read(65536):
            if count:
                for match in _REQUEST.finditer(chunk):
                    method, path = match.group(1).decode(), match.group(2).decode()
                    self.counts[request_kind(method, path)] += 1
            sink.write(chunk)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()


# --- one run (a process of its own) ----------------------------------------------------------


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _instrument(interval: float | None) -> Any:
    """Instrument as a user does, with an SDK tracer provider that exports (in memory)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    if interval is not None:
        os.environ["OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"] = str(interval)
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    NemoGymInstrumentor().instrument(
        tracer_provider=tracer_provider, meter_provider=MeterProvider()
    )
    return exporter


def _allocation_records(exporter: Any) -> list[dict[str, Any]]:
    return [
        dict(span.attributes or {})
        for span in exporter.get_finished_spans()
        if (span.attributes or {}).get("nemo.gym.sandbox.resource.kind") == "allocation"
    ]


async def _burst(args: argparse.Namespace) -> dict[str, Any]:
    exporter = _instrument(args.interval) if args.mode == "on" else None
    from nemo_gym.sandbox import AsyncSandbox, SandboxResources, SandboxSpec

    spec = SandboxSpec(image=args.image, resources=SandboxResources(cpu=0.5, memory_mib=64))
    # The readiness probe tried again until its deadline (NeMo Gym's default is one try):
    # Podman's service sometimes loses an exec's output under a burst, plugin or not.
    # The shell named (NeMo Gym's default asks the container for bash at each create, one
    # more exec whose answer Podman can lose the same way).
    config: dict[str, Any] = {
        "docker": {"probe": {"deadline_s": 120}, "exec": {"exec_shell": "sh"}}
    }
    if args.provider == "opensandbox":
        # As NeMo Gym's shipped opensandbox.yaml has it, on scripts/start-opensandbox.sh's
        # server (its Docker runtime on the same engine).
        config = {
            "opensandbox": {
                "connection": {
                    "domain": os.environ["OPENSANDBOX_DOMAIN"],
                    "api_key": args.api_key,
                    "protocol": "http",
                    "use_server_proxy": True,
                },
                "create": {"timeout_s": 300},
            }
        }
        spec = SandboxSpec(
            image=args.image,
            resources=SandboxResources(cpu=0.5, memory_mib=64),
            ready_timeout_s=300,
        )
    sandboxes = [AsyncSandbox(config, spec) for _ in range(args.sandboxes)]
    cpu_children, cpu_own = _children_cpu_s(), _own_cpu_s()
    result: dict[str, Any] = {"mode": args.mode, "sandboxes": args.sandboxes}
    try:
        burst_started = started = time.perf_counter()
        # Every start ends before a failure is raised, so the finally below stops them all
        # (a start still running when the run ends would leave its container behind).
        starts = await asyncio.gather(*(s.start() for s in sandboxes), return_exceptions=True)
        result["start_s"] = time.perf_counter() - started
        failed = [e for e in starts if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        started = time.perf_counter()
        answers = await asyncio.gather(*(s.exec("echo hi") for s in sandboxes))
        result["exec_s"] = time.perf_counter() - started
        # Podman's service sometimes loses an exec's output (rc 0, nothing printed) or its
        # start under a burst, with or without the plugin: counted, not failed.
        result["exec_output_lost"] = sum(a.stdout.strip() != "hi" for a in answers)
        result["exec_failed"] = sum(a.return_code != 0 for a in answers)
        if exporter is not None:
            # Every allocation record while the sandboxes live (the close would end a read).
            deadline = time.monotonic() + RECORDS_BOUND_S
            while len(_allocation_records(exporter)) < args.sandboxes:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            result["records_s"] = time.perf_counter() - burst_started
        result["cpu_children_s"] = _children_cpu_s() - cpu_children
        result["cpu_own_s"] = _own_cpu_s() - cpu_own
    finally:
        await asyncio.gather(*(s.stop() for s in sandboxes), return_exceptions=True)
    if exporter is not None:
        records = _allocation_records(exporter)
        result["allocations"] = len(records)
        result["allocation_errors"] = dict(
            Counter(
                str(r["nemo.gym.sandbox.resource.error"])
                for r in records
                if "nemo.gym.sandbox.resource.error" in r
            )
        )
    return result


def child(args: argparse.Namespace) -> None:
    """One run; prints its result as one JSON line."""
    if not args.count_calls:
        print(json.dumps(asyncio.run(_burst(args))), flush=True)
        return
    upstream = os.environ.get("DOCKER_HOST", "")
    if not upstream.startswith("unix://"):
        raise SystemExit("--count-calls needs DOCKER_HOST=unix:///path/to/engine.sock")
    with tempfile.TemporaryDirectory(prefix="burst-proxy-") as folder:
        path = str(Path(folder) / "engine.sock")
        with CountingProxy(upstream.removeprefix("unix://"), path) as proxy:
            os.environ["DOCKER_HOST"] = f"unix://{path}"
            result = asyncio.run(_burst(args))
            result["engine_calls"] = dict(sorted(proxy.counts.items()))
    print(json.dumps(result), flush=True)


# --- the driver ------------------------------------------------------------------------------


def run_one(
    args: argparse.Namespace, mode: str, size: int, count_calls: bool
) -> dict[str, Any] | None:
    """One run's result; ``None`` when the application failed (said on standard error: a
    lost round, not a lost benchmark)."""
    command = [
        args.python, __file__, "--child", "--mode", mode, "--sandboxes", str(size),
        "--image", args.image, "--provider", args.provider,
    ]  # fmt: skip
    if args.interval is not None:
        command += ["--interval", str(args.interval)]
    if count_calls:
        command.append("--count-calls")
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        print(
            f"run {mode}/{size} failed ({done.returncode}): {done.stderr[-600:]}", file=sys.stderr
        )
        return None
    line = done.stdout.strip().splitlines()[-1]
    print(f"run {mode}/{size}: {line}", file=sys.stderr, flush=True)
    return dict(json.loads(line))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@contextlib.contextmanager
def _load_note() -> Iterator[dict[str, Any]]:
    note: dict[str, Any] = {"load_before": os.getloadavg()}
    yield note
    note["load_after"] = os.getloadavg()


def drive(args: argparse.Namespace) -> int:
    order = random.Random(args.seed)
    # Per size, the rounds in which both modes ran: {mode: result}.
    rounds: dict[int, list[dict[str, dict[str, Any]]]] = {}
    lost = 0
    with _load_note() as load:
        for size in args.sandboxes:
            run_one(args, "off", size, False)  # warm-up: image, engine caches
            for _ in range(args.rounds):
                modes = list(MODES)
                order.shuffle(modes)
                results = {mode: run_one(args, mode, size, False) for mode in modes}
                if all(results.values()):
                    rounds.setdefault(size, []).append(results)  # type: ignore[arg-type]
                else:
                    lost += 1
        calls: dict[tuple[str, int], dict[str, Any]] = {}
        if args.count_calls:
            for size in args.sandboxes:
                for mode in MODES:
                    counted = run_one(args, mode, size, True)
                    if counted is not None:
                        calls[(mode, size)] = counted
    failed = False
    report: dict[str, Any] = {
        "provider": args.provider,
        "load": load,
        "rounds": args.rounds,
        "rounds_lost": lost,
        "interval": args.interval,
    }
    if lost and args.check is not None:
        failed = True
    for size in args.sandboxes:
        if not rounds.get(size):
            continue
        off = [r["off"] for r in rounds[size]]
        on = [r["on"] for r in rounds[size]]
        row: dict[str, Any] = {"sandboxes": size}
        for what in ("start_s", "exec_s", "cpu_children_s", "cpu_own_s"):
            row[what] = {
                "off": [round(r[what], 3) for r in off],
                "on": [round(r[what], 3) for r in on],
                "median_off": round(_median([r[what] for r in off]), 3),
                "median_on": round(_median([r[what] for r in on]), 3),
            }
        for what in ("start_s", "exec_s"):
            ratios = [b[what] / a[what] for a, b in zip(off, on, strict=True)]
            row[what]["ratio"] = round(_median(ratios), 3)
            if args.check is not None and row[what]["ratio"] > args.check:
                failed = True
        for what in ("exec_output_lost", "exec_failed"):
            row[what] = {"off": [r[what] for r in off], "on": [r[what] for r in on]}
        row["allocations"] = [r["allocations"] for r in on]
        row["allocation_errors"] = [r["allocation_errors"] for r in on]
        if any(r["allocations"] != size or r["allocation_errors"] for r in on):
            failed = failed or args.check is not None
        if ("off", size) in calls and ("on", size) in calls:
            counts = {m: calls[(m, size)]["engine_calls"] for m in MODES}
            ours = {
                kind: counts["on"].get(kind, 0) - counts["off"].get(kind, 0)
                for kind in sorted(set(counts["on"]) | set(counts["off"]))
            }
            row["engine_calls"] = counts
            row["engine_calls_added_per_sandbox"] = {
                k: round(v / size, 3) for k, v in ours.items() if v
            }
        report.setdefault("rows", []).append(row)
    print(json.dumps(report, indent=2))
    for row in report.get("rows", []):
        print(
            f"{row['sandboxes']:>3} sandboxes: start {row['start_s']['median_off']:.2f} s -> "
            f"{row['start_s']['median_on']:.2f} s ({row['start_s']['ratio']:.2f}x), "
            f"exec {row['exec_s']['median_off']:.2f} s -> {row['exec_s']['median_on']:.2f} s "
            f"({row['exec_s']['ratio']:.2f}x); allocations {row['allocations']}, "
            f"errors {row['allocation_errors']}"
        )
    if failed:
        print(
            f"FAIL: a ratio above {args.check}, an allocation record missing or failed, or "
            "a round lost"
        )
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, nargs="+", default=[20])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval", type=float, default=None, help="sampling interval (s)")
    parser.add_argument("--image", default=IMAGE)
    parser.add_argument(
        "--provider",
        choices=("docker", "opensandbox"),
        default="docker",
        help="NeMo Gym's provider: docker (its CLI), or opensandbox (the server of "
        "scripts/start-opensandbox.sh: OPENSANDBOX_DOMAIN, OPENSANDBOX_API_KEY_FILE)",
    )
    parser.add_argument("--python", default=sys.executable, help="the runs' interpreter")
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument("--count-calls", action="store_true")
    parser.add_argument("--check", type=float, default=None, metavar="RATIO")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.sandboxes = args.sandboxes[0]
        if args.provider == "opensandbox":
            # Read here, never passed on a command line.
            args.api_key = Path(os.environ["OPENSANDBOX_API_KEY_FILE"]).read_text().strip()
        child(args)
        return
    if args.rounds < 1 or min(args.sandboxes) < 1:
        parser.error("--rounds and --sandboxes must be at least 1")
    sys.exit(drive(args))


if __name__ == "__main__":
    main()
