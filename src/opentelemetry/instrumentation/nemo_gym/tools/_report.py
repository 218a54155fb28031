"""``nemo-gym-otel report``: one run of a NeMo Gym deployment, as the collector holds it.

Reads the collector's Prometheus exporter (``$COLLECTOR_PROMETHEUS``, which
``scripts/start-collector.sh --env`` exports, or ``--url``) and prints, for one ``nemo.run.id``,
four plain-text tables with a bar per row:

* connections per server: each server's pool acquisitions per destination
  (``gym.http.connection_pool.connect_total``); a NeMo Gym server that made no requests has a
  row saying so;
* queue waits per destination (``gym.http.connection_pool.queue_duration_ms``, one sample per
  request that waited for a pool slot): how many, p50 and p99 estimated from the histogram's
  buckets as PromQL's ``histogram_quantile`` does, and the limit that was binding (the
  ``queue_constraint`` most waits name, with the callers' configured limit of that kind,
  ``gym.http.connection_pool.limit``);
* event-loop lag p99 per server (``gym.event_loop.lag_ms``, the pressure metrics);
* sandboxes per provider and server: created and failed (``gym.sandbox.creations`` by
  outcome), OOM kills (``gym.sandbox.oom_kills``), CPU seconds (``gym.sandbox.cpu.time``) and
  the highest memory any of them used (``gym.sandbox.memory.peak``, in MiB).

A process belongs to a run by its resource: ``target_info``'s ``nemo_run_id`` label, joined on
``job`` and ``instance`` (``service.name``, ``service.instance.id``). The run is ``--run-id``,
else ``$NEMO_GYM_OTEL_RUN_ID`` (the run this shell's NeMo Gym commands report as), else the
only run the collector holds. The Prometheus text carries no time, so among several runs none
is known to be the newest: the report then names them and asks for ``--run-id``.

Exit status: 0 with the report, 1 when the collector cannot be read, 2 on bad input (no URL,
an unknown run, several runs and none chosen).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.instrumentation.nemo_gym.tools._prometheus_text import (
    Sample,
    histogram_quantile,
    parse_samples,
)

# The names as the collector's Prometheus exporter writes ours: dots become underscores, the
# unit is appended (ms -> _milliseconds, s -> _seconds; {connection}-style units are not), and
# counters end in _total.
CONNECT_TOTAL = "gym_http_connection_pool_connect_total"
QUEUE_DURATION_BUCKET = "gym_http_connection_pool_queue_duration_ms_milliseconds_bucket"
POOL_LIMIT = "gym_http_connection_pool_limit"
LOOP_LAG_BUCKET = "gym_event_loop_lag_ms_milliseconds_bucket"
SANDBOX_CREATIONS = "gym_sandbox_creations_total"
SANDBOX_OOM_KILLS = "gym_sandbox_oom_kills_total"
SANDBOX_CPU_TIME = "gym_sandbox_cpu_time_seconds_total"
SANDBOX_MEMORY_PEAK = "gym_sandbox_memory_peak_bytes"
TARGET_INFO = "target_info"
# What the tables show: a process with none of these, and no NeMo Gym server name, has no row.
_TABLED = frozenset(
    {
        CONNECT_TOTAL,
        QUEUE_DURATION_BUCKET,
        LOOP_LAG_BUCKET,
        SANDBOX_CREATIONS,
        SANDBOX_OOM_KILLS,
        SANDBOX_CPU_TIME,
        SANDBOX_MEMORY_PEAK,
    }
)

# Labels: the resource's (job, instance, nemo_run_id, nemo_gym_server_name) and the points'.
RUN_LABEL = "nemo_run_id"
SERVER_NAME_LABEL = "nemo_gym_server_name"
DESTINATION_LABEL = "nemo_gym_http_destination_server_name"
CONSTRAINT_LABEL = "nemo_gym_http_connection_pool_queue_constraint"
LIMIT_KIND_LABEL = "nemo_gym_http_connection_pool_limit_kind"
PROVIDER_LABEL = "nemo_gym_sandbox_provider"
OUTCOME_LABEL = "nemo_gym_sandbox_outcome"

RUN_ID_VARIABLE = "NEMO_GYM_OTEL_RUN_ID"
URL_VARIABLE = "COLLECTOR_PROMETHEUS"
BAR_WIDTH = 24
_BAR = "█"
_MIB = 1024 * 1024

Process = tuple[str, str]  # (job, instance)


class ReportError(Exception):
    """Bad input: the message says what and what to do (exit status 2)."""


@dataclass(frozen=True)
class Run:
    """One run's processes, as ``target_info`` names them."""

    run_id: str
    processes: frozenset[Process]
    servers: frozenset[str]  # jobs of processes that are NeMo Gym servers or commands


def runs(samples: Iterable[Sample]) -> dict[str, Run]:
    """Every run the collector holds, by ``nemo_run_id``."""
    processes: dict[str, set[Process]] = defaultdict(set)
    servers: dict[str, set[str]] = defaultdict(set)
    for sample in samples:
        run_id = sample.labels.get(RUN_LABEL)
        if sample.name != TARGET_INFO or not run_id:
            continue
        process = (sample.labels.get("job", ""), sample.labels.get("instance", ""))
        processes[run_id].add(process)
        if sample.labels.get(SERVER_NAME_LABEL):
            servers[run_id].add(process[0])
    return {
        run_id: Run(run_id, frozenset(members), frozenset(servers[run_id]))
        for run_id, members in processes.items()
    }


def choose_run(found: Mapping[str, Run], wanted: str | None, environ: Mapping[str, str]) -> Run:
    """The run to report: ``wanted``, else ``$NEMO_GYM_OTEL_RUN_ID``, else the only one."""
    if not found:
        raise ReportError(
            "the collector holds no process with a nemo_run_id (target_info): did the NeMo Gym "
            "commands run with OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=nemo_gym and export to this "
            "collector? (it drops series 5 minutes after their last update)"
        )
    named = sorted(found)
    source = "--run-id"
    if wanted is None and environ.get(RUN_ID_VARIABLE):
        wanted, source = environ[RUN_ID_VARIABLE], f"${RUN_ID_VARIABLE}"
    if wanted is not None:
        if wanted not in found:
            raise ReportError(
                f"{source} {wanted!r}: no such run in the collector; it holds {named}"
            )
        return found[wanted]
    if len(found) > 1:
        described = "; ".join(f"{run_id} ({_jobs(found[run_id])})" for run_id in named)
        raise ReportError(
            f"the collector holds {len(found)} runs and the Prometheus text does not say which is "
            f"newest; pick one with --run-id (or export {RUN_ID_VARIABLE}): {described}"
        )
    return found[named[0]]


def _jobs(run: Run) -> str:
    return ", ".join(sorted({job for job, _ in run.processes}))


def render(samples: Sequence[Sample], run: Run, other_runs: Sequence[str] = ()) -> str:
    """The report of ``run`` from ``samples``: a heading and the four tables."""
    mine = [s for s in samples if _process(s) in run.processes]
    # Counted: the processes the tables have a row for (NeMo Gym's servers and commands, and
    # any other that recorded what they show). Ray's dashboard and its agents export under the
    # run's id too, with nothing to show: they are named apart, not counted.
    tabled = {p for p in run.processes if p[0] in run.servers}
    tabled |= {_process(s) for s in mine if s.name in _TABLED}
    services = len({job for job, _ in tabled})
    heading = (
        f"run {run.run_id}: {_plural(len(tabled), 'process', 'processes')}, "
        f"{_plural(services, 'service', 'services')}"
    )
    untabled = run.processes - tabled
    if untabled:
        jobs = ", ".join(sorted({job or "(no service name)" for job, _ in untabled}))
        others = _plural(len(untabled), "process", "processes")
        heading += f" (and {others} with nothing to report: {jobs})"
    lines = [heading]
    if other_runs:
        lines.append(f"(the collector also holds runs {', '.join(other_runs)}: --run-id picks one)")
    for section in (_connections, _queue_waits, _loop_lag, _sandboxes):
        lines += ["", *section(mine, run)]
    return "\n".join(lines) + "\n"


def _process(sample: Sample) -> Process:
    return (sample.labels.get("job", ""), sample.labels.get("instance", ""))


def _connections(samples: Sequence[Sample], run: Run) -> list[str]:
    connects: dict[tuple[str, str], float] = defaultdict(float)
    for sample in samples:
        if sample.name == CONNECT_TOTAL:
            key = (sample.labels.get("job", ""), sample.labels.get(DESTINATION_LABEL, ""))
            connects[key] += sample.value
    processes = _process_counts(run)
    rows: list[list[str]] = []
    values: list[float] = []
    callers = {job for job, _ in connects}
    for job in sorted(callers | run.servers):
        destinations = sorted(
            (key for key in connects if key[0] == job), key=lambda key: (-connects[key], key[1])
        )
        if not destinations:
            rows.append([_server(job, processes), "(no requests)", ""])
            values.append(0.0)
        for key in destinations:
            rows.append([_server(job, processes), key[1], _count(connects[key])])
            values.append(connects[key])
    heading = "Connections per server (pool acquisitions per destination)"
    return [heading, *_table(["server", "destination", "connects"], rows, values, numeric={2})]


def _queue_waits(samples: Sequence[Sample], run: Run) -> list[str]:
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    constraints: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    callers: dict[str, set[Process]] = defaultdict(set)
    for sample in samples:
        if sample.name != QUEUE_DURATION_BUCKET:
            continue
        destination = sample.labels.get(DESTINATION_LABEL, "")
        upper = float(sample.labels.get("le", "nan"))
        buckets[destination][upper] += sample.value
        if math.isinf(upper):
            constraint = sample.labels.get(CONSTRAINT_LABEL, "unknown")
            constraints[destination][constraint] += sample.value
            if sample.value:
                callers[destination].add(_process(sample))
    limits = {
        (_process(s), s.labels.get(LIMIT_KIND_LABEL, "")): s.value
        for s in samples
        if s.name == POOL_LIMIT
    }
    rows: list[list[str]] = []
    values: list[float] = []
    for destination in sorted(buckets, key=lambda d: (-buckets[d].get(math.inf, 0.0), d)):
        cumulative = list(buckets[destination].items())
        waits = buckets[destination].get(math.inf, 0.0)
        if not waits:
            continue
        p50 = histogram_quantile(0.5, cumulative)
        p99 = histogram_quantile(0.99, cumulative)
        binding = max(constraints[destination].items(), key=lambda item: (item[1], item[0]))[0]
        configured = sorted(
            {limits[(p, binding)] for p in callers[destination] if (p, binding) in limits}
        )
        limit = binding
        if configured:
            shown = _count(configured[0])
            if len(configured) > 1:
                shown += f"-{_count(configured[-1])}"
            limit = f"{binding} {shown}"
        rows.append([destination, _count(waits), _ms(p50), _ms(p99), limit])
        values.append(p99 or 0.0)
    heading = "Queue waits per destination (requests that waited for a pool slot)"
    if not rows:
        return [heading, "  (none: no request waited for a pool slot)"]
    columns = ["destination", "waits", "p50 ms", "p99 ms", "binding limit"]
    return [heading, *_table(columns, rows, values, numeric={1, 2, 3})]


def _loop_lag(samples: Sequence[Sample], run: Run) -> list[str]:
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for sample in samples:
        if sample.name == LOOP_LAG_BUCKET:
            upper = float(sample.labels.get("le", "nan"))
            buckets[sample.labels.get("job", "")][upper] += sample.value
    processes = _process_counts(run)
    rows: list[list[str]] = []
    values: list[float] = []
    for job in sorted(buckets):
        p99 = histogram_quantile(0.99, list(buckets[job].items()))
        if p99 is None:
            continue
        rows.append([_server(job, processes), _count(buckets[job][math.inf]), _ms(p99)])
        values.append(p99)
    heading = "Event-loop lag per server (how late the loop ran a timed callback)"
    if not rows:
        return [heading, "  (none: no process of this run measured its event loop)"]
    return [heading, *_table(["server", "samples", "p99 ms"], rows, values, numeric={1, 2})]


def _sandboxes(samples: Sequence[Sample], run: Run) -> list[str]:
    """One row per provider and server (the process's ``job``): a server that creates sandboxes
    of two providers has two rows, two servers with the same provider one each."""
    columns: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for sample in samples:
        provider = sample.labels.get(PROVIDER_LABEL)
        if provider is None:
            continue
        row = columns[(provider, sample.labels.get("job", ""))]
        if sample.name == SANDBOX_CREATIONS:
            outcome = sample.labels.get(OUTCOME_LABEL, "")
            row["failed" if outcome == "failed" else "created"] += sample.value
        elif sample.name == SANDBOX_OOM_KILLS:
            row["oom"] += sample.value
        elif sample.name == SANDBOX_CPU_TIME:
            row["cpu"] += sample.value
        elif sample.name == SANDBOX_MEMORY_PEAK:
            # A high-water mark per process: the run's is the highest of them.
            row["memory"] = max(row["memory"], sample.value)
            row["sampled"] = 1.0
    heading = "Sandboxes per provider and server"
    if not columns:
        return [heading, "  (none: no process of this run created a sandbox)"]
    processes = _process_counts(run)
    ordered = sorted(columns.items())
    rows = [
        [
            provider,
            _server(job, processes),
            _count(row["created"]),
            _count(row["failed"]),
            _count(row["oom"]),
            f"{row['cpu']:.1f}",
            f"{row['memory'] / _MIB:.1f}" if row["sampled"] else "-",
        ]
        for (provider, job), row in ordered
    ]
    values = [row["cpu"] for _, row in ordered]
    names = ["provider", "server", "created", "failed", "OOM kills", "CPU s", "peak MiB"]
    return [heading, *_table(names, rows, values, numeric={2, 3, 4, 5, 6})]


def _process_counts(run: Run) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for job, _ in run.processes:
        counts[job] += 1
    return counts


def _server(job: str, processes: Mapping[str, int]) -> str:
    """The job, with how many processes report as it where more than one does."""
    count = processes.get(job, 1)
    return f"{job} ({count} processes)" if count > 1 else job


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _count(value: float) -> str:
    return str(round(value))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(
    names: list[str], rows: list[list[str]], values: list[float], numeric: set[int]
) -> list[str]:
    """Aligned columns (numbers to the right) and a bar per row, scaled to the largest value."""
    widths = [max(len(cell) for cell in column) for column in zip(names, *rows, strict=False)]
    largest = max(values, default=0.0)

    def line(cells: list[str], bar: str) -> str:
        padded = [
            cell.rjust(width) if index in numeric else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return ("  " + "  ".join(padded) + "  " + bar).rstrip()

    lines = [line(names, "")]
    for cells, value in zip(rows, values, strict=True):
        length = round(BAR_WIDTH * value / largest) if largest > 0 else 0
        lines.append(line(cells, _BAR * max(length, 1 if value > 0 else 0)))
    return lines


def fetch(url: str) -> str:
    """The text the Prometheus endpoint ``url`` serves (10 s timeout)."""
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - the user's URL
        body: bytes = response.read()
    return body.decode("utf-8", errors="replace")


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the ``report`` subcommand on ``nemo-gym-otel``'s subparsers."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "report",
        help="print one run's connections, queue waits, loop lag and sandboxes from a collector",
        description=(
            "Read the collector's Prometheus exporter and print one run's connections per "
            "server, queue waits per destination, event-loop lag per server and sandboxes per "
            "provider. Exit status 0 with the report, 1 when the collector cannot be read, "
            "2 on bad input."
        ),
    )
    parser.add_argument(
        "--url",
        default=None,
        help=f"the collector's Prometheus endpoint (default ${URL_VARIABLE})",
    )
    parser.add_argument(
        "--run-id",
        default=None,
        help=f"the nemo.run.id to report (default ${RUN_ID_VARIABLE}, else the only run)",
    )
    return parser


def run(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    """Print the report; 0 done, 1 the collector unreadable, 2 bad input (reason on stderr)."""
    url = args.url or environ.get(URL_VARIABLE)
    if not url:
        print(
            f"nemo-gym-otel report: error: no collector: set ${URL_VARIABLE} "
            '(eval "$(bash scripts/start-collector.sh --env)") or pass --url',
            file=sys.stderr,
        )
        return 2
    try:
        text = fetch(url)
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", None) or error
        print(f"nemo-gym-otel report: error: cannot read {url}: {reason}", file=sys.stderr)
        return 1
    try:
        samples = parse_samples(text)
    except ValueError as error:
        print(
            f"nemo-gym-otel report: error: {url} is not Prometheus text: {error}",
            file=sys.stderr,
        )
        return 1
    found = runs(samples)
    try:
        chosen = choose_run(found, args.run_id, environ)
    except ReportError as error:
        print(f"nemo-gym-otel report: error: {error} ({url})", file=sys.stderr)
        return 2
    others = sorted(run_id for run_id in found if run_id != chosen.run_id)
    sys.stdout.write(render(samples, chosen, others))
    return 0
