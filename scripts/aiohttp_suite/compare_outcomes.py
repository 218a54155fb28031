"""Run a test suite plain and instrumented; fail when a test's outcome differs between the two.

    python compare_outcomes.py --name NAME --python PYTHON --cwd FOLDER --results PREFIX \\
        [--contrib] [--reruns 2] -- PYTEST_OPTIONS... -- TEST_PATHS...

Runs ``PYTHON -P -m pytest PYTEST_OPTIONS TEST_PATHS`` in ``FOLDER`` twice: plain, then with
``-p _suite_instrumented`` (NemoGymInstrumentor on and exporting). The options must load
``_suite_outcomes``, which writes each test's outcome (``PREFIX-plain.json``,
``PREFIX-instrumented.json``). For every test whose outcome differs, the modules holding them
run again ``--reruns`` times in each mode, alternately (whole modules: an outcome may depend on
the tests before it in its module). A test is a **difference** when each mode gave it one
outcome every time and the two differ; otherwise (an outcome that changed between runs of the
same mode, or a first difference that did not come back) it is a **flake**, reported and not
failed. Exits 1 on any difference, on a run that pytest could not carry out (exit status other
than 0 or 1), or when the instrumented run did not go through the timed connector: no connect
or no queue wait recorded, or (without ``--contrib``; contrib's tests build no BaseConnector)
no queue wait in a test that built a timed ``aiohttp.BaseConnector``. Prints the outcome
counts and wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ABSENT = "absent"
PYTEST_USABLE_STATUSES = (0, 1)  # 1: some tests failed, which the comparison is about


@dataclass(frozen=True)
class Verdict:
    """What the runs of one test that differed at first say: ``difference`` or ``flake``."""

    nodeid: str
    kind: str
    plain: tuple[str, ...]
    instrumented: tuple[str, ...]


def differing(plain: Mapping[str, str], instrumented: Mapping[str, str]) -> list[str]:
    """Test ids whose outcome differs, a test missing from one run counted as ``absent``."""
    return sorted(
        nodeid
        for nodeid in plain.keys() | instrumented.keys()
        if plain.get(nodeid, ABSENT) != instrumented.get(nodeid, ABSENT)
    )


def judge(nodeid: str, plain: Sequence[str], instrumented: Sequence[str]) -> Verdict:
    """A difference when each mode's runs agree among themselves and the modes disagree."""
    steady = len(set(plain)) == 1 and len(set(instrumented)) == 1
    kind = "difference" if steady and plain[0] != instrumented[0] else "flake"
    return Verdict(nodeid, kind, tuple(plain), tuple(instrumented))


def timed_path_problems(tally: Mapping[str, Any], *, require_base_waits: bool) -> list[str]:
    """Why the instrumented run did not prove the timed connector ran, or an empty list."""
    problems = [f"harness: {failure}" for failure in tally.get("harness_failures", [])]
    if tally.get("connects", 0) <= 0:
        problems.append("no connect recorded by the instrumentation's meter")
    if tally.get("timed_tcp_connectors", 0) <= 0:
        problems.append("no aiohttp.TCPConnector was switched to QueueTimedTCPConnector")
    if require_base_waits:
        if tally.get("waits", 0) <= 0:
            problems.append("no queue wait recorded by the instrumentation's meter")
        base_tests = _base_tests(tally)
        if not base_tests:
            problems.append("no test built a timed aiohttp.BaseConnector")
        elif not any(counts["waits"] > 0 for counts in base_tests.values()):
            problems.append("no test that built a timed aiohttp.BaseConnector recorded a wait")
    return problems


def _base_tests(tally: Mapping[str, Any]) -> dict[str, Mapping[str, int]]:
    tests: Mapping[str, Mapping[str, int]] = tally.get("tests", {})
    return {
        nodeid: counts
        for nodeid, counts in tests.items()
        if counts.get("timed_base_connectors", 0) > 0
    }


def summary(outcomes: Mapping[str, str]) -> str:
    counts = Counter(outcomes.values())
    return ", ".join(f"{counts[name]} {name}" for name in sorted(counts)) or "no tests"


class Runner:
    """Runs pytest in one mode and reads back the outcomes."""

    def __init__(self, python: str, cwd: Path, results: str, options: Sequence[str]) -> None:
        self.python = python
        self.cwd = cwd
        self.results = results
        self.options = list(options)
        self.broken: list[str] = []

    def run(
        self, label: str, instrumented: bool, paths: Sequence[str]
    ) -> tuple[dict[str, str], float]:
        outcomes_file = Path(f"{self.results}-{label}.json")
        outcomes_file.unlink(missing_ok=True)
        env = dict(os.environ, AIOHTTP_SUITE_OUTCOMES=str(outcomes_file))
        plugins: list[str] = []
        if instrumented:
            env["AIOHTTP_SUITE_TIMED"] = f"{self.results}-{label}-timed.json"
            plugins = ["-p", "_suite_instrumented"]
        command = [self.python, "-P", "-m", "pytest", *plugins, *self.options, *paths]
        log = Path(f"{self.results}-{label}.log")
        started = time.monotonic()
        with log.open("w") as output:
            status = subprocess.run(
                command, cwd=self.cwd, env=env, stdout=output, stderr=subprocess.STDOUT, check=False
            ).returncode
        seconds = time.monotonic() - started
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        print(f"  {label}: exit {status}, {seconds:.0f} s, {tail[0]} (log: {log})", flush=True)
        if status not in PYTEST_USABLE_STATUSES or not outcomes_file.exists():
            self.broken.append(f"{label}: pytest exited {status}; see {log}")
            return {}, seconds
        outcomes: dict[str, str] = json.loads(outcomes_file.read_text())["outcomes"]
        return outcomes, seconds


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--python", required=True)
    parser.add_argument("--cwd", required=True, type=Path)
    parser.add_argument("--results", required=True, help="path prefix of the result files")
    parser.add_argument("--contrib", action="store_true", help="no BaseConnector to require")
    parser.add_argument("--reruns", type=int, default=2)
    own, (options, paths) = _split(argv)
    args = parser.parse_args(own)
    if not paths:
        parser.error("no test paths after the second --")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.python, args.cwd, args.results, options)

    print(f"{args.name}: {len(paths)} test paths", flush=True)
    plain, plain_seconds = runner.run("plain", False, paths)
    instrumented, instrumented_seconds = runner.run("instrumented", True, paths)
    print(f"  plain:        {summary(plain)}")
    print(f"  instrumented: {summary(instrumented)}")

    failures = list(runner.broken)
    verdicts: list[Verdict] = []
    first = differing(plain, instrumented) if not runner.broken else []
    if first:
        modules = sorted({nodeid.split("::")[0] for nodeid in first})
        history = {
            nodeid: ([plain.get(nodeid, ABSENT)], [instrumented.get(nodeid, ABSENT)])
            for nodeid in first
        }
        print(
            f"  {len(first)} outcomes differ; {args.reruns} reruns of {len(modules)} modules "
            "in each mode",
            flush=True,
        )
        for attempt in range(1, args.reruns + 1):
            again_plain, _ = runner.run(f"rerun{attempt}-plain", False, modules)
            again_instrumented, _ = runner.run(f"rerun{attempt}-instrumented", True, modules)
            for nodeid, (plain_runs, instrumented_runs) in history.items():
                plain_runs.append(again_plain.get(nodeid, ABSENT))
                instrumented_runs.append(again_instrumented.get(nodeid, ABSENT))
        failures.extend(runner.broken)
        verdicts = [judge(nodeid, *runs) for nodeid, runs in history.items()]
    for verdict in verdicts:
        print(
            f"  {verdict.kind}: {verdict.nodeid}: plain {' '.join(verdict.plain)}; "
            f"instrumented {' '.join(verdict.instrumented)}"
        )
    failures += [f"outcome differs: {v.nodeid}" for v in verdicts if v.kind == "difference"]

    timed_file = Path(f"{args.results}-instrumented-timed.json")
    if timed_file.exists():
        tally = json.loads(timed_file.read_text())
        base_tests = _base_tests(tally)
        print(
            f"  timed path: {tally['connects']} connects and {tally['waits']} queue waits "
            f"recorded; {tally['timed_tcp_connectors']} TCPConnector and "
            f"{tally['timed_base_connectors']} BaseConnector pools timed; "
            f"{len(base_tests)} tests built a timed BaseConnector, "
            f"{sum(1 for c in base_tests.values() if c['waits'] > 0)} of them recorded waits"
        )
        print(f"  metrics recorded: {', '.join(tally.get('metrics', []))}")
        failures += timed_path_problems(tally, require_base_waits=not args.contrib)
    elif not runner.broken:
        failures.append(f"the instrumented run wrote no {timed_file}")
    print(f"  wall time: plain {plain_seconds:.0f} s, instrumented {instrumented_seconds:.0f} s")
    for failure in failures:
        print(f"  FAIL: {failure}")
    print(f"{args.name}: {'FAILED' if failures else 'same outcomes'}", flush=True)
    return 1 if failures else 0


def _split(argv: Sequence[str]) -> tuple[list[str], tuple[list[str], list[str]]]:
    """Own arguments, then the pytest options and the test paths (``-- OPTIONS -- PATHS``)."""
    items = list(argv)
    if "--" not in items:
        return items, ([], [])
    cut = items.index("--")
    own, rest = items[:cut], items[cut + 1 :]
    if "--" not in rest:
        return own, (rest, [])
    cut = rest.index("--")
    return own, (rest[:cut], rest[cut + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
