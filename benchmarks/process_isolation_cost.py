"""What bubblewrap isolation costs a process sandbox: a ``create``, an ``exec`` and a ``close``.

``ProcessSandboxProvider(isolation="bwrap")`` (the default: a holder ``bwrap`` per sandbox,
and a ``bwrap`` per command that joins its namespaces) against ``isolation="none"`` (plain
``sh -c`` processes), side by side in one run: each round runs both modes in a fresh seeded
random order, and each mode times ``--per-round`` sandboxes (create, then ``--execs`` runs of
the command, ``true`` by default, then close). Wall time per call (what a caller waits) and
the CPU it took, this process's and its children's (bwrap, the shell; ``RUSAGE_CHILDREN``
counts children once reaped, which every call here waits for). Prints medians with their
interquartile range and the ratio bwrap/none per round, pooled (median of the rounds'
ratios). Cgroups are used where writable (as root), as the provider does by default; a sandbox
holds no other work. Run from the repository root:

    .venv/bin/python benchmarks/process_isolation_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from _common import machine

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

MODES = ("none", "bwrap")
CALLS = ("create", "exec", "close")


@dataclass
class Timings:
    """Per mode and call: wall and CPU milliseconds of every call, and per round's median."""

    wall: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    round_wall: dict[tuple[str, str], list[float]] = field(default_factory=dict)


def cpu_seconds() -> float:
    """This process's CPU time plus that of its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


async def timed(call: Callable[[], Awaitable[Any]]) -> tuple[Any, float, float]:
    """``call``'s result, wall and CPU milliseconds."""
    cpu, wall = cpu_seconds(), time.perf_counter()
    result = await call()
    return result, (time.perf_counter() - wall) * 1000, (cpu_seconds() - cpu) * 1000


async def one_mode(
    provider: ProcessSandboxProvider, mode: str, args: argparse.Namespace, timings: Timings
) -> None:
    walls: dict[str, list[float]] = {call: [] for call in CALLS}
    for _ in range(args.per_round):
        handle, wall, cpu = await timed(lambda: provider.create(SandboxSpec()))
        walls["create"].append(wall)
        timings.cpu.setdefault((mode, "create"), []).append(cpu)
        for _ in range(args.execs):
            result, wall, cpu = await timed(lambda: provider.exec(handle, args.command))  # noqa: B023
            if result.return_code != 0:
                raise SystemExit(f"{mode}: {args.command!r} failed: {result.stderr}")
            walls["exec"].append(wall)
            timings.cpu.setdefault((mode, "exec"), []).append(cpu)
        _, wall, cpu = await timed(lambda: provider.close(handle))  # noqa: B023
        walls["close"].append(wall)
        timings.cpu.setdefault((mode, "close"), []).append(cpu)
    for call, values in walls.items():
        timings.wall.setdefault((mode, call), []).extend(values)
        timings.round_wall.setdefault((mode, call), []).append(statistics.median(values))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    # isolation="none" warns once per sandbox, as it should; not once per timed call here.
    logging.getLogger(ProcessSandboxProvider.__module__).setLevel(logging.ERROR)
    providers = {mode: ProcessSandboxProvider(isolation=mode) for mode in MODES}
    order = random.Random(args.seed)
    timings = Timings()
    try:
        for mode in MODES:  # warm-up: caches, the first bwrap exec
            await one_mode(
                providers[mode],
                mode,
                argparse.Namespace(**{**vars(args), "per_round": 1}),
                Timings(),
            )
        for _ in range(args.rounds):
            modes = list(MODES)
            order.shuffle(modes)
            for mode in modes:
                await one_mode(providers[mode], mode, args, timings)
    finally:
        for provider in providers.values():
            await provider.aclose()
    rows = []
    for call in CALLS:
        row: dict[str, Any] = {"call": call}
        for mode in MODES:
            wall = timings.wall[(mode, call)]
            q1, _, q3 = statistics.quantiles(wall, n=4)
            row[mode] = {
                "wall_ms_median": statistics.median(wall),
                "wall_ms_iqr": [q1, q3],
                "cpu_ms_median": statistics.median(timings.cpu[(mode, call)]),
                "calls": len(wall),
            }
        ratios = [
            b / n
            for b, n in zip(
                timings.round_wall[("bwrap", call)], timings.round_wall[("none", call)], strict=True
            )
        ]
        row["ratio_bwrap_to_none"] = statistics.median(ratios)
        row["added_wall_ms"] = row["bwrap"]["wall_ms_median"] - row["none"]["wall_ms_median"]
        rows.append(row)
    return {
        "machine": machine(),
        "bwrap": shutil.which("bwrap"),
        "cgroup_version": providers["bwrap"].cgroup_version,
        "command": args.command,
        "rounds": args.rounds,
        "per_round": args.per_round,
        "execs": args.execs,
        "rows": rows,
    }


def table(report: dict[str, Any]) -> str:
    def cell(figures: dict[str, Any]) -> str:
        q1, q3 = figures["wall_ms_iqr"]
        return (
            f"{figures['wall_ms_median']:.2f} [{q1:.2f}, {q3:.2f}] ({figures['cpu_ms_median']:.2f})"
        )

    header = ("call", *(f"{m}: wall ms median [IQR] (CPU ms)" for m in MODES), "bwrap / none")
    lines = ["| " + " | ".join((*header, "added ms")) + " |", "|---|---|---|---|---|"]
    for row in report["rows"]:
        name = f"`exec` (`{report['command']}`)" if row["call"] == "exec" else f"`{row['call']}`"
        lines.append(
            f"| {name} | {cell(row['none'])} | {cell(row['bwrap'])} | "
            f"{row['ratio_bwrap_to_none']:.2f}× | {row['added_wall_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of both modes")
    parser.add_argument("--per-round", type=int, default=5, help="sandboxes per mode and round")
    parser.add_argument("--execs", type=int, default=5, help="commands per sandbox")
    parser.add_argument("--command", default="true", help="the command each exec runs")
    parser.add_argument("--seed", type=int, default=1, help="seed of the modes' order")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    if shutil.which("bwrap") is None:
        print("bwrap not on PATH: apt-get install bubblewrap", file=sys.stderr)
        return 2
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{report['rounds']} rounds x {report['per_round']} sandboxes x {report['execs']} execs "
        f"per mode; cgroup v{report['cgroup_version']}; {report['machine']}"
    )
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
