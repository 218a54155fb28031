"""A real NeMo Gym deployment run by the commands of its page, docs/nemo-gym-deployment.md, and
what reached the collector.

``run_deployment()`` reads the three ``console`` blocks of ``docs/nemo-gym-deployment.md`` ("A
NeMo Gym deployment: every server reports") and runs each, as written, as one ``bash -e``
script: the first shell (the collector, a Python 3.12 virtualenv with nemo-gym 0.4.0 and this
plugin from the clone, ``nemo-gym-otel server-venvs``, ``gym env start`` with three servers:
the ``example_single_tool_call`` resources server, its ``simple_agent``, and the
``openai_model`` model server), then, once the servers are ready, the second shell (``gym eval
run``, 300 rollouts), then SIGINT to the first shell's process group, as a terminal's Ctrl-C
does (NeMo Gym then also sends SIGINT to each server's shell and kills that 1 s later), then
the third block (``nemo-gym-otel report``) in the second shell's state. Only the page's
placeholders are filled (``fill()``): the clone's path, the working folder (a fresh one under
/tmp: Ray's socket paths must stay under 108 characters), the model endpoint's port (the page's
own ``nemo-gym-otel stub-model``, on a free port), the head server's port (a free one) and,
unless measuring, a 10 minute export interval, so that each process's final export at shutdown
is its only one. After the eval, an earlier run's rollout spans and counts (run
``EARLIER_RUN``, longer than any of this run's, started before it) are sent to the same
collector, so that the report and the tracing page's command must pick this run. The
environment gives the collector a state folder and free ports of the test's own, the server
virtualenvs' uv cache, and ``NEMO_GYM_FASTAPI_NUM_WORKERS=2`` to the first shell (each server
divides its pool limits by two and its capacity report must say ``workers=2``). The collector's
Prometheus exporter is read once everything has stopped.

Every process started is ended by PID: the first shell's session (gym env start, its servers
and Ray's daemons), anything whose command line names the run's folder (the stub model
last: like a terminal's background job, it outlives Ctrl-C), and the collector
(``start-collector.sh --stop`` on its state folder).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client.parser import text_string_to_metric_families

from waiting import eventually_blocking

ROOT = Path(__file__).resolve().parent.parent
TASKS = 5  # rows of example_single_tool_call's example.jsonl
REPEATS = 60
ROLLOUTS = TASKS * REPEATS  # 300 rollouts, two model calls each
# NeMo Gym's worker count, given to gym env start's servers. (0.4.0's openai_model and
# simple_agent define no module-level ASGI app, so num_workers > 1 cannot start them; the
# variable is what NeMo Gym sets for a multi-worker server and what its client divides by.)
SERVER_WORKERS = 2
AGENT = "example_single_tool_call_simple_agent"
RESOURCES = "example_single_tool_call"
MODEL = "policy_model"
SERVERS = (RESOURCES, AGENT, MODEL)
POOL_PREFIX = "gym_http_connection_pool_"
CONNECT_TOTAL = "gym_http_connection_pool_connect_total"
CONNECT_TOTAL_OTEL = "gym.http.connection_pool.connect_total"
# NEMO_GYM_DEPLOYMENT_KILL_AFTER=1: SIGKILL each server process that long after the SIGINT.
KILL_AFTER_S = (
    float(os.environ["NEMO_GYM_DEPLOYMENT_KILL_AFTER"])
    if os.environ.get("NEMO_GYM_DEPLOYMENT_KILL_AFTER")
    else None
)
UV_CACHE = Path.home() / ".cache" / "nemo-gym-otel" / "uv"
DEPLOYMENT_PAGE = ROOT / "docs" / "nemo-gym-deployment.md"
SECTION = "# A NeMo Gym deployment: every server reports"
# Its companion: how to find a slow rollout in Jaeger, run against this deployment's traces.
TRACING_PAGE = ROOT / "docs" / "tracing.md"
# The page's placeholders, which the test fills (and nothing else in its commands).
CLONE = "~/opentelemetry-instrumentation-nemo-gym"
WORKING_FOLDER = "~/gym-otel"
MODEL_ENDPOINT = "127.0.0.1:8000"  # the stub's address in --model-url and the curl check
STUB_PORT = "stub-model --port 8000"
HEAD_PORT = "port:11000"  # a free one here: 11000 may be anyone's
EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL=15000"


@dataclass
class Process:
    """One exporting process as the collector saw it (``job``/``instance`` = service)."""

    service: str
    instance: str
    resource: dict[str, str]
    connects: dict[str, float] = field(default_factory=dict)  # per destination label
    pool_series: set[str] = field(default_factory=set)  # gym_http_connection_pool_* names
    series: set[str] = field(default_factory=set)  # every sample name but target_info's


@dataclass
class Deployment:
    """What a run produced."""

    folder: Path
    served: int  # /v1/responses requests the stub answered
    rollouts: int  # lines in the rollouts file
    processes: list[Process]
    capacity_lines: dict[str, list[str]]  # server -> its capacity report lines
    server_logs: dict[str, str]
    gym_exit: int | None
    leftovers: list[str]  # processes still alive after gym env start returned
    server_exit_seconds: list[float]  # SIGINT to exit, per `python app.py` server process
    port_taken: PortTaken
    traces: list[dict[str, Any]]  # Jaeger's traces holding a rollout span (its JSON API)
    slowest_rollouts: list[str]  # what the tracing page's command printed against this run
    jaeger_services: list[str]
    run_id: str  # the run id the page's shells exported (NEMO_GYM_OTEL_RUN_ID)
    report: str  # what the page's `nemo-gym-otel report` printed after Ctrl-C
    earlier_traces: int  # the earlier run's rollout traces Jaeger held beside this run's


@dataclass
class PortTaken:
    """The first shell again, its head-server port held by a loopback listener, then Ctrl-C."""

    waiting_line: str  # what gym env start printed while its head server could not start
    gym_exit: int | None
    seconds_to_end: float | None  # SIGINT to the last process of the session gone; None: never
    leftovers: list[str]  # what was still alive after the bound (then SIGKILLed by PID)

    def of(self, service: str) -> list[Process]:
        return [p for p in self.processes if p.service == service]


# Ports the kernel never hands out on its own (below its ephemeral range) and Ray does not take
# (its workers' default range is 10002-19999): a port picked here for a process that binds it
# minutes later (after pip) stays free meanwhile, where a port-0 pick can be handed to any
# outgoing connection or free-port listener first (CI once lost the stub model's port so).
_UNCLAIMED_PORTS_START = 20000


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, from a random starting point."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = list(range(_UNCLAIMED_PORTS_START, max(low, _UNCLAIMED_PORTS_START + 1)))
    start = random.randrange(len(candidates))
    for port in candidates[start:] + candidates[:start]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free loopback port in {candidates[0]}-{candidates[-1]}")


def _session_and_folder_pids(session: int, folder: Path, spare: int = 0) -> list[int]:
    """Processes in ``session`` or whose command line names ``folder``: all ours (but
    ``spare``, the stub, which the test ends itself)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), spare):
            continue
        try:
            sid = os.getsid(int(entry.name))
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
        if sid == session or str(folder) in cmdline:
            pids.append(int(entry.name))
    return pids


def _exit_times(pids: list[int], bound_s: float) -> list[float]:
    """Seconds until each of ``pids`` is gone (polled every 50 ms; ``bound_s`` at most)."""
    start = time.monotonic()
    times: dict[int, float] = {}
    while len(times) < len(pids) and time.monotonic() - start < bound_s:
        for pid in pids:
            if pid not in times and not Path(f"/proc/{pid}").exists():
                times[pid] = time.monotonic() - start
        time.sleep(0.05)
    return sorted(times.get(pid, bound_s) for pid in pids)


def _describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def end_by_pid(session: int, folder: Path, spare: int = 0) -> list[str]:
    """SIGKILL every process of ``session`` or naming ``folder`` (but ``spare``); returns what
    was still alive."""
    alive = _session_and_folder_pids(session, folder, spare)
    described = [f"{pid} {_describe(pid)}" for pid in alive]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return described


def page_section(page: Path, title: str) -> str:
    """A page's walk-through, from its ``title`` line up to the next heading."""
    text = "\n" + page.read_text(encoding="utf-8")
    return re.split(r"\n#{1,3} ", text.split(f"\n{title}\n", 1)[1], maxsplit=1)[0]


def deployment_section() -> str:
    """The deployment walk-through, from the page's title up to its next heading."""
    return page_section(DEPLOYMENT_PAGE, SECTION)


def console_blocks(body: str) -> list[list[str]]:
    """The ``console`` blocks of ``body``, each as the commands a user types into a shell:
    every ``$ `` command with its continuation lines, exactly as written."""
    blocks: list[list[str]] = []
    commands: list[str] = []
    in_console = continued = False
    for line in body.splitlines():
        if line.startswith("```"):
            if in_console:
                blocks.append(commands)
                commands = []
            in_console = line.strip() == "```console"
            continue
        if in_console and continued:
            commands[-1] += "\n" + line
        elif in_console and line.startswith("$ "):
            commands.append(line[2:])
        continued = in_console and line.endswith("\\")
    return blocks


def deployment_commands() -> list[list[str]]:
    """The page's ``console`` blocks (``console_blocks``)."""
    return console_blocks(deployment_section())


def shells_of(blocks: list[list[str]]) -> list[str]:
    """A walk's three shells as scripts: the first shell; the second; and the report, typed
    into the second shell after Ctrl-C, so run after that shell's commands but its last (the
    eval): its folder, virtualenv and exports."""
    first, second, report = blocks
    # The second shell's state, its commands' own output aside: the report's is what is read.
    state = ["{", *second[:-1], "} >/dev/null"]
    return ["\n".join(first), "\n".join(second), "\n".join([*state, *report])]


def deployment_shells() -> list[str]:
    """The page's three shells as scripts (``shells_of``)."""
    return shells_of(deployment_commands())


def report_output_on_page(body: str | None = None, command: str = "$ nemo-gym-otel report") -> str:
    """The ``text`` block that follows the report ``command`` in ``body`` (the deployment
    page's walk by default): what it printed."""
    after = (deployment_section() if body is None else body).split(command, 1)[1]
    return re.search(r"```text\n(.*?)```", after, re.S).group(1)  # type: ignore[union-attr]


def connection_rows(report: str) -> list[tuple[str, str, int | None]]:
    """The report's connections table as (server, destination, connects) rows."""
    section = report.split("Connections per server", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in section.splitlines()[2:]:  # after the heading's rest and the column names
        cells = re.split(r"\s{2,}", line.strip())
        if cells[1:2] == ["(no requests)"]:
            rows.append((cells[0], cells[1], None))
        else:
            rows.append((cells[0], cells[1], int(cells[2])))
    return rows


def report_shape(report: str) -> list[str]:
    """The report's lines with the run id, numbers and bars masked and spaces collapsed; the
    line naming other runs in the collector left out (the page's collector held one run), and
    the heading's processes with nothing to report (Ray's dashboard and agent, where they
    export under the run: the page says so beside its table)."""
    shape = []
    for line in report.splitlines():
        if line.startswith("(the collector also holds"):
            continue
        line = re.sub(r"^run \S+:", "run RUN:", line)
        line = re.sub(r" \(and \d+ process(es)? with nothing to report: [^)]*\)$", "", line)
        line = re.sub(r"\d+(\.\d+)?", "N", re.sub("█+", "BAR", line))
        shape.append(" ".join(line.split()))
    return shape


def tracing_page_commands() -> list[str]:
    """The tracing page's ``console`` commands: each block is one command, a ``$ `` line and
    the lines that continue it (a pipe into a quoted Python program), exactly as written."""
    commands = []
    for block in re.findall(
        r"```console\n(.*?)```", TRACING_PAGE.read_text(encoding="utf-8"), re.S
    ):
        assert block.startswith("$ "), block
        assert "\n$ " not in block, block
        commands.append(block[2:])
    return commands


def fill(shells: list[str], values: dict[str, str]) -> list[str]:
    """The shells with each page placeholder replaced by its value here; a placeholder the
    page no longer has fails, so the test cannot go on running its own idea of the commands."""
    for placeholder in values:
        assert any(placeholder in shell for shell in shells), f"the page lacks {placeholder!r}"
    filled = []
    for shell in shells:
        for placeholder, value in values.items():
            shell = shell.replace(placeholder, value)
        filled.append(shell)
    return filled


def _environment(folder: Path, collector_state: Path, uv_cache: Path) -> dict[str, str]:
    """The user's shell before the page's first command: nothing of OpenTelemetry, Ray or uv
    set, no virtualenv active; the collector's state folder and free ports of the test's own."""
    # The build cache stays (benchmarks/deployment_time.py --cold points it at an empty folder).
    caches = ("NEMO_GYM_COLLECTOR_CACHE",)
    env = {
        k: v
        for k, v in os.environ.items()
        if k in caches
        or not k.startswith(("OTEL_", "RAY_", "UV_", "PYTEST_", "VIRTUAL_ENV", "NEMO_GYM_"))
    }
    env.pop("PYTHONPATH", None)
    env.update(
        # The collector the page starts: in a state folder of the test's own (the user's
        # default, /tmp/nemo-gym-collector-<uid>, is left alone), on free ports.
        NEMO_GYM_COLLECTOR_DIR=str(collector_state),
        NEMO_GYM_COLLECTOR_PORTS="0,0,0",
        NEMO_GYM_JAEGER_PORT="0",
        # The page's +uv_cache_dir reads it: reruns reuse the server virtualenvs' packages.
        UV_CACHE_DIR=str(uv_cache),
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def _collector_lines(state: Path, name: str = "ports.env") -> dict[str, str]:
    """The collector's (or, ``jaeger.env``, Jaeger's) settings as its state folder records
    them (``KEY=VALUE`` lines)."""
    ports = state / name
    if not ports.exists():
        return {}
    return dict(line.split("=", 1) for line in ports.read_text().splitlines() if "=" in line)


def _has_pool_series(url: str) -> bool:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return False
    return CONNECT_TOTAL in text


@dataclass
class Timeline:
    """Seconds from the page's first command to each milestone (``measure=True``)."""

    servers_ready: float | None = None
    first_metrics: float | None = None  # first gym_http_connection_pool_connect_total scraped
    eval_done: float | None = None  # the second shell (gym eval run) ended
    report_done: float | None = None  # the page's `nemo-gym-otel report` printed its table


def _watch_first_metrics(
    state: Path, start: float, timeline: Timeline, stop: threading.Event
) -> None:
    while not stop.wait(1.0) and timeline.first_metrics is None:
        url = _collector_lines(state).get("COLLECTOR_PROMETHEUS")
        if url and _has_pool_series(url):
            timeline.first_metrics = time.monotonic() - start


def _scrape(url: str) -> dict[tuple[str, str], Process]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    processes: dict[tuple[str, str], Process] = {}

    def process(labels: dict[str, str]) -> Process:
        key = (labels.get("job", ""), labels.get("instance", ""))
        if key not in processes:
            processes[key] = Process(key[0], key[1], {})
        return processes[key]

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "target_info":
                process(sample.labels).resource.update(sample.labels)
                continue
            process(sample.labels).series.add(sample.name)
            if sample.name.startswith(POOL_PREFIX) and not sample.name.endswith("_created"):
                process(sample.labels).pool_series.add(sample.name)
                if sample.name == CONNECT_TOTAL:
                    destination = sample.labels.get("nemo_gym_http_destination_server_name", "")
                    process(sample.labels).connects[destination] = sample.value
    return processes


ROLLOUT_SPAN = "rollout"  # the plugin's span of each rollout (_rollout_span.SPAN_NAME)


def _jaeger(query: str, path: str) -> Any:
    return json.loads(urllib.request.urlopen(f"{query}{path}", timeout=60).read())


def rollout_traces(query: str, run_id: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every trace of run ``run_id`` (the ``nemo.run.id`` of the process that made it) Jaeger
    holds with a rollout span (from whichever service made it: the CLI's name is the
    resource's), and every service Jaeger knows."""
    services: list[str] = _jaeger(query, "/api/services")["data"] or []
    traces: dict[str, dict[str, Any]] = {}
    for service in services:
        named = urllib.parse.quote(service, safe="")  # service names hold a slash (nemo-gym/...)
        operations = _jaeger(query, f"/api/services/{named}/operations")["data"] or []
        if ROLLOUT_SPAN not in [o["name"] if isinstance(o, dict) else o for o in operations]:
            continue
        tags = urllib.parse.quote(json.dumps({"nemo.run.id": run_id}), safe="")
        search = (
            f"/api/traces?service={named}&operation={ROLLOUT_SPAN}&limit={10 * ROLLOUTS}"
            f"&tags={tags}"
        )
        for found in _jaeger(query, f"{search}&lookback=2h")["data"] or []:
            traces[found["traceID"]] = found
    return list(traces.values()), services


def _settled_rollout_traces(query: str, run_id: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The rollout traces once ROLLOUTS of them are stored and their span count held still
    for longer than the SDK's batch delay (5 s), so each process's last batch is in; bounded
    at 180 s (then whatever is stored, for the test to report)."""
    previous = [-1]

    def settled() -> tuple[list[dict[str, Any]], list[str]] | None:
        traces, services = rollout_traces(query, run_id)
        spans = sum(len(t["spans"]) for t in traces)
        still = len(traces) >= ROLLOUTS and spans == previous[0]
        previous[0] = spans
        return (traces, services) if still else None

    try:
        return eventually_blocking(settled, f"{ROLLOUTS} rollout traces held still", 180, 7)
    except AssertionError:
        return rollout_traces(query, run_id)


# An earlier run in the same collector and Jaeger: its rollouts (longer than any of this run's)
# and a count, which the report and the tracing page's command must leave out.
EARLIER_RUN = "run-earlier"
EARLIER_ROLLOUTS = 3
EARLIER_CONNECTS = 7


def send_earlier_run(otlp_endpoint: str) -> None:
    """Send, over OTLP/HTTP as the CLI would, an earlier run's rollout spans (100 s each, ended
    20 s ago) and one connect count, from a process of run ``EARLIER_RUN``."""
    resource = Resource(
        {
            "service.name": "nemo-gym/orchestrator",
            "service.instance.id": "earlier-orchestrator",
            "nemo.run.id": EARLIER_RUN,
            "nemo.gym.server.name": "orchestrator",
            "nemo.gym.server.type": "orchestrator",
        }
    )
    tracer_provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=f"{otlp_endpoint}/v1/traces")
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tracer_provider.get_tracer("earlier-run")
    now = time.time_ns()
    for task in range(EARLIER_ROLLOUTS):
        span = tracer.start_span(
            ROLLOUT_SPAN,
            start_time=now - 120 * 10**9,
            attributes={
                "nemo.gym.rollout.task_index": task,
                "nemo.gym.rollout.rollout_index": 0,
                "nemo.gym.rollout.agent": AGENT,
            },
        )
        span.end(end_time=now - 20 * 10**9)
    tracer_provider.shutdown()
    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=f"{otlp_endpoint}/v1/metrics"), export_interval_millis=600_000
    )
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    connects = meter_provider.get_meter("earlier-run").create_counter(CONNECT_TOTAL_OTEL)
    connects.add(EARLIER_CONNECTS, {"nemo.gym.http.destination.server.name": AGENT})
    meter_provider.shutdown()  # its one export


# Ray gives up on a cluster that has gone after 60 s; a process of ours holding a server open
# would keep it alive for good.
PORT_TAKEN_BOUND_S = 150


def _head_port_taken(
    shells: list[str], placeholders: dict[str, str], folder: Path, env: dict[str, str], spare: int
) -> PortTaken:
    """Run the page's first shell again in the same folder, with its head-server port held by
    a listener that never answers; once gym env start says it is waiting for its head server,
    press Ctrl-C and time how long its processes take to end (at most PORT_TAKEN_BOUND_S)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = {**placeholders, HEAD_PORT: f"port:{listener.getsockname()[1]}"}
        first_shell = fill(shells, taken)[0]
        log_path = folder / "port-taken.log"
        with log_path.open("w") as log:
            gym = subprocess.Popen(
                ["bash", "-e", "-x", "-c", first_shell],
                cwd=folder,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        waiting = "Head server is not up yet"
        try:

            def stuck() -> bool:
                if gym.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-4000:]
                    raise AssertionError(f"the first shell exited {gym.returncode}:\n{tail}")
                return waiting in log_path.read_text(errors="replace")

            eventually_blocking(stuck, "gym env start waiting for its head server", 900, 0.5)
            line = next(line for line in log_path.read_text().splitlines() if waiting in line)
            os.killpg(gym.pid, signal.SIGINT)
            start = time.monotonic()
            seconds: float | None = None
            while time.monotonic() - start < PORT_TAKEN_BOUND_S:
                gym.poll()  # reaps the shell once it has ended: its zombie would count as alive
                if not _session_and_folder_pids(gym.pid, folder, spare):
                    seconds = time.monotonic() - start
                    break
                time.sleep(0.5)
            try:
                gym_exit: int | None = gym.wait(timeout=10)
            except subprocess.TimeoutExpired:
                gym_exit = None
            return PortTaken(line, gym_exit, seconds, end_by_pid(gym.pid, folder, spare))
        finally:
            end_by_pid(gym.pid, folder, spare)
            if gym.poll() is None:
                gym.kill()
            gym.wait(timeout=30)


@contextlib.contextmanager
def ctrl_c_reaches_the_shells() -> Iterator[None]:
    """SIGINT with its default action in every shell started meanwhile, as in a terminal's
    foreground command, whatever the test process inherited.

    A test process started as a background job of a non-interactive shell (``pytest ... &``,
    ``(nohup pytest ... &)``) has SIGINT ignored, and an ignored signal stays ignored through
    fork and exec: bash cannot reset a signal ignored at its start, and Python then installs no
    KeyboardInterrupt handler. The test's Ctrl-C (SIGINT to the first shell's process group)
    would reach nobody: ``gym env start`` waiting for a head server it cannot start, its
    servers' shells and ``tee`` run on. (With the servers up it looks fine: uvicorn sets its own
    handler, the servers end, and gym env start stops because they did.) A handler of this
    process's own, unlike an ignored signal, is reset to the default action at exec.
    """
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main thread only
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _shell(script: str, folder: Path) -> tuple[list[str], dict[str, Any]]:
    """A walk's shell script as ``bash`` runs it: -e stops at the first failing command, as a
    user would, -x shows which it was; in ``folder``, in a session of its own."""
    return ["bash", "-e", "-x", "-c", script], {"cwd": folder, "start_new_session": True}


def start_first_shell(script: str, folder: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start a walk's first shell (it runs until Ctrl-C), its output in
    ``folder/first-shell.log``."""
    log_path = folder / "first-shell.log"
    command, options = _shell(script, folder)
    with log_path.open("w") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, **options)


def wait_for_servers(gym: subprocess.Popen[bytes], folder: Path) -> None:
    """Until the first shell's ``gym env start`` says its servers are ready; fails with the
    log's tail if the shell ends first."""
    log_path = folder / "first-shell.log"

    def ready() -> bool:
        if gym.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise AssertionError(f"the first shell exited {gym.returncode}:\n{tail}")
        return "servers ready!" in log_path.read_text(errors="replace")

    # A bound, not a timing: a cold pip cache and collector build take minutes.
    eventually_blocking(ready, "the first shell's servers", 1800, 0.5)


def run_second_shell(script: str, folder: Path, env: dict[str, str]) -> Path:
    """Run a walk's second shell to its end (status 0, else its log's tail fails the test);
    its log, ``folder/second-shell.log``."""
    log_path = folder / "second-shell.log"
    command, options = _shell(script, folder)
    with log_path.open("w") as log:
        done = subprocess.run(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=False,
            **options,
        )
    assert done.returncode == 0, log_path.read_text(errors="replace")[-4000:]
    return log_path


def run_deployment(
    *,
    clone: Path = ROOT,
    uv_cache: Path = UV_CACHE,
    measure: bool = False,
    timeline: Timeline | None = None,
) -> Deployment:
    """Run the page's two shells, as written, and collect what arrived; see the
    module. ``measure``: keep the page's export interval and record ``timeline``."""
    with ctrl_c_reaches_the_shells():
        return _run_deployment(clone, uv_cache, measure, timeline)


def _run_deployment(
    clone: Path, uv_cache: Path, measure: bool, timeline: Timeline | None
) -> Deployment:
    folder = Path(tempfile.mkdtemp(prefix="ngd-", dir="/tmp"))
    # The collector's state outside the deployment's folder: end_by_pid() ends whatever names
    # that folder, and the collector must outlive the deployment.
    collector_state = Path(tempfile.mkdtemp(prefix="ngc-", dir="/tmp"))
    work = folder / "gym-otel"
    env = _environment(folder, collector_state, uv_cache)
    timeline = timeline if timeline is not None else Timeline()
    stop_watching = threading.Event()
    gym = None
    stub_pid = 0  # the page's stub model, found once the first shell has started it
    leftovers: list[str] = []
    try:
        stub_port = free_port()
        placeholders = {
            CLONE: str(clone),
            WORKING_FOLDER: str(work),
            MODEL_ENDPOINT: f"127.0.0.1:{stub_port}",
            STUB_PORT: f"stub-model --port {stub_port}",
            HEAD_PORT: f"port:{free_port()}",
        }
        if not measure:
            # Ten minutes: each process's final export at shutdown is its only one.
            placeholders[EXPORT_INTERVAL] = "OTEL_METRIC_EXPORT_INTERVAL=600000"
        shells = deployment_shells()
        first_shell, second_shell, report_shell = fill(shells, placeholders)

        start = time.monotonic()
        if measure:
            threading.Thread(
                target=_watch_first_metrics,
                args=(collector_state, start, timeline, stop_watching),
                daemon=True,
            ).start()
        gym = start_first_shell(
            first_shell, folder, {**env, "NEMO_GYM_FASTAPI_NUM_WORKERS": str(SERVER_WORKERS)}
        )
        wait_for_servers(gym, folder)
        timeline.servers_ready = time.monotonic() - start
        stub_pid = _stub_model_pid(gym.pid, folder, work / "stub-model.log")
        run_id = (work / "run-id").read_text().strip()
        eval_log = run_second_shell(second_shell, folder, env)
        timeline.eval_done = time.monotonic() - start
        stats = json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{stub_port}/stats", timeout=10).read()
        )
        # Before Ctrl-C: every process's spans leave within the SDK's batch delay.
        jaeger_query = _collector_lines(collector_state, "jaeger.env").get("JAEGER_QUERY")
        assert jaeger_query, "the deployment page's start-collector.sh line started no Jaeger"
        # Now, so that its counts are within the collector's 5 minutes when the report runs.
        send_earlier_run(_collector_lines(collector_state)["OTEL_EXPORTER_OTLP_ENDPOINT"])
        traces, jaeger_services = _settled_rollout_traces(jaeger_query, run_id)

        def earlier_run_stored() -> bool:
            return len(rollout_traces(jaeger_query, EARLIER_RUN)[0]) >= EARLIER_ROLLOUTS

        eventually_blocking(earlier_run_stored, "the earlier run's rollouts in Jaeger", 60, 0.5)
        earlier_traces = len(rollout_traces(jaeger_query, EARLIER_RUN)[0])
        if os.environ.get("NEMO_GYM_DEPLOYMENT_TRACES"):
            Path(os.environ["NEMO_GYM_DEPLOYMENT_TRACES"]).write_text(json.dumps(traces))
        (find_slow,) = tracing_page_commands()
        slowest = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", find_slow],
            cwd=folder,
            # The second shell's: Jaeger's address and this run's id.
            env={**env, "JAEGER_QUERY": jaeger_query, "NEMO_GYM_OTEL_RUN_ID": run_id},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert slowest.returncode == 0, slowest.stderr[-4000:]
        # Ctrl-C, as a terminal sends it: SIGINT to the whole foreground process group, so to
        # the shell, gym env start and each server. NeMo Gym then also sends SIGINT to each
        # server's shell, kills that shell 1 s later, and shuts down its Ray cluster.
        servers = {
            pid: _describe(pid)
            for pid in _session_and_folder_pids(gym.pid, folder, stub_pid)
            if _describe(pid).strip() == "python app.py"
        }
        os.killpg(gym.pid, signal.SIGINT)
        if KILL_AFTER_S is not None:
            # What NeMo Gym means to do (its kill lands on each server's shell instead):
            # SIGKILL the servers themselves KILL_AFTER_S after the SIGINT.
            time.sleep(KILL_AFTER_S)
            for pid in servers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        exit_seconds = _exit_times(list(servers), bound_s=60)
        try:
            gym_exit: int | None = gym.wait(timeout=120)
        except subprocess.TimeoutExpired:
            gym_exit = None
        # A bound, not a timing: every process of the session is gone well within it; those
        # left are ended and reported.
        with contextlib.suppress(AssertionError):
            eventually_blocking(
                lambda: not _session_and_folder_pids(gym.pid, folder, stub_pid),
                "every process of the session gone",
                60,
                0.5,
            )
        leftovers = end_by_pid(gym.pid, folder, stub_pid)
        # The collector's batch processor forwards within a second; give it a few.
        time.sleep(3)
        scraped = _scrape(_collector_lines(collector_state)["COLLECTOR_PROMETHEUS"])
        # This run's and its Ray processes', not the earlier run's the test sent.
        processes = {
            key: process
            for key, process in scraped.items()
            if process.resource.get("nemo_run_id") != EARLIER_RUN
        }
        report = subprocess.run(
            ["bash", "-e", "-c", report_shell],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        timeline.report_done = time.monotonic() - start
        assert report.returncode == 0, report.stderr[-4000:]
        port_taken = _head_port_taken(shells, placeholders, folder, env, stub_pid)
        server_logs = {
            server: (work / "logs" / f"{server}.log").read_text(errors="replace")
            for server in SERVERS
        }
        capacity_lines = {
            server: [line for line in text.splitlines() if "aggregate_total=" in line]
            for server, text in server_logs.items()
        }
        capacity_lines["gym eval run"] = [
            line
            for line in eval_log.read_text(errors="replace").splitlines()
            if "aggregate_total=" in line
        ]
        return Deployment(
            folder=folder,
            served=int(stats["responses"]),
            rollouts=len((work / "rollouts.jsonl").read_text().splitlines()),
            processes=list(processes.values()),
            capacity_lines=capacity_lines,
            server_logs=server_logs,
            gym_exit=gym_exit,
            leftovers=leftovers,
            server_exit_seconds=exit_seconds,
            port_taken=port_taken,
            traces=traces,
            slowest_rollouts=slowest.stdout.splitlines(),
            jaeger_services=jaeger_services,
            run_id=run_id,
            report=report.stdout,
            earlier_traces=earlier_traces,
        )
    finally:
        stop_watching.set()
        if gym is not None:
            # After a failure midway: end what is left (reported by the test that failed).
            end_by_pid(gym.pid, folder, stub_pid)
            if gym.poll() is None:
                gym.kill()
            gym.wait(timeout=30)
        if stub_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stub_pid, signal.SIGKILL)
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "start-collector.sh"), "--stop"],
            env={**os.environ, "NEMO_GYM_COLLECTOR_DIR": str(collector_state)},
            timeout=60,
            check=False,
        )
        shutil.rmtree(collector_state, ignore_errors=True)
        if os.environ.get("NEMO_GYM_DEPLOYMENT_KEEP") != "1":
            shutil.rmtree(folder, ignore_errors=True)


def _stub_model_pid(session: int, folder: Path, log: Path) -> int:
    """The PID of the page's ``nemo-gym-otel stub-model``, a background job of the first
    shell (so of its session); its ``log`` says why when there is none."""

    def command_line(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    stubs = [
        pid
        for pid in _session_and_folder_pids(session, folder)
        if "nemo-gym-otel stub-model" in command_line(pid)
    ]
    if len(stubs) != 1:
        told = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        raise AssertionError(f"stub models {[_describe(pid) for pid in stubs]}; {log}:\n{told}")
    return stubs[0]


def table(deployment: Deployment) -> str:
    """The per-process table of what arrived: process, resource attributes, connects."""
    keys = (
        "nemo_gym_server_name",
        "nemo_gym_server_type",
        "nemo_gym_server_uvicorn_worker",
        "nemo_gym_server_workers",
        "ray_component",
    )
    rows = []
    for p in sorted(deployment.processes, key=lambda p: (p.service, p.instance)):
        attributes = " ".join(f"{k}={p.resource[k]}" for k in keys if k in p.resource)
        connects = ", ".join(f"{d}: {int(v)}" for d, v in sorted(p.connects.items())) or "-"
        rows.append(f"| {p.service} | {p.instance[:8]} | {attributes} | {connects} |")
    head = "| service.name | instance | resource attributes | connects per destination |"
    return "\n".join([head, "|---|---|---|---|", *rows])


def connects_to(processes: list[Process], destination: str) -> float:
    return sum(p.connects.get(destination, 0.0) for p in processes)


def by_service(deployment: Deployment) -> dict[str, list[Process]]:
    grouped: dict[str, list[Process]] = defaultdict(list)
    for p in deployment.processes:
        grouped[p.service].append(p)
    return grouped
