"""A real NeMo Gym deployment under the README's commands, and what reached the collector.

``run_deployment()`` does what the README's "With NeMo Gym" section tells a user to do, with
the real programs: ``nemo-gym-otel server-venvs``, then ``opentelemetry-instrument ... -- gym
env start`` (three servers: the ``example_single_tool_call`` resources server, its
``simple_agent``, and the ``openai_model`` model server pointed at the OpenAI-compatible stub
in ``deployment/openai_stub.py``; ``NEMO_GYM_FASTAPI_NUM_WORKERS=2``, so each server divides
its pool limits by two and its capacity report must say ``workers=2``), then
``opentelemetry-instrument ... -- gym eval run --no-serve`` for ``ROLLOUTS`` rollouts, then
SIGINT to ``gym env start``'s process group, as a terminal's Ctrl-C does (NeMo Gym then also
sends SIGINT to each server's shell and kills that 1 s later). Every
process exports over OTLP to its own collector (``scripts/start-collector.sh``) with a 10
minute export interval, so each process's final export at shutdown is the only one; the
collector's Prometheus exporter is read once everything has stopped.

Everything runs in a short folder of its own under /tmp (Ray's socket paths must stay under
108 characters), Ray included (``RAY_TMPDIR``), on 127.0.0.1. Every process started is ended by
PID: the session of ``gym env start`` (its servers and Ray's daemons) and anything whose
command line names the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
STUB = Path(__file__).resolve().parent / "deployment" / "openai_stub.py"
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
# NEMO_GYM_DEPLOYMENT_KILL_AFTER=1: SIGKILL each server process that long after the SIGINT.
KILL_AFTER_S = (
    float(os.environ["NEMO_GYM_DEPLOYMENT_KILL_AFTER"])
    if os.environ.get("NEMO_GYM_DEPLOYMENT_KILL_AFTER")
    else None
)
UV_CACHE = Path.home() / ".cache" / "nemo-gym-otel" / "uv"


@dataclass
class Process:
    """One exporting process as the collector saw it (``job``/``instance`` = service)."""

    service: str
    instance: str
    resource: dict[str, str]
    connects: dict[str, float] = field(default_factory=dict)  # per destination label
    pool_series: set[str] = field(default_factory=set)  # gym_http_connection_pool_* names


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

    def of(self, service: str) -> list[Process]:
        return [p for p in self.processes if p.service == service]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for(what: str, done: Callable[[], bool], bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {bound_s:.0f} s")


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


def _environment(venv: Path, folder: Path, collector_otlp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RAY_", "UV_"))}
    env.pop("PYTHONPATH", None)
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        # The README's environment: uv from PyPI, no interpreter downloads.
        UV_PYTHON_DOWNLOADS="never",
        UV_CACHE_DIR=str(UV_CACHE),
        # Ray on this machine only, its files in our folder.
        RAY_TMPDIR=str(folder / "ray"),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        # The README's OpenTelemetry settings.
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="nemo_gym",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector_otlp,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_PYTHON_NEMO_GYM_LOG_LEVEL="info",
        # Ten minutes: the final export at shutdown is each process's only one.
        OTEL_METRIC_EXPORT_INTERVAL="600000",
        PYTHONUNBUFFERED="1",
    )
    return env


INSTRUMENT = (
    "opentelemetry-instrument",
    "--metrics_exporter",
    "otlp",
    "--traces_exporter",
    "none",
    "--logs_exporter",
    "none",
    "--",
)


def _gym_arguments(stub_port: int, head_port: int, folder: Path) -> list[str]:
    return [
        "--config",
        "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
        "--config",
        "responses_api_models/openai_model/configs/openai_model.yaml",
        "--model-url",
        f"http://127.0.0.1:{stub_port}/v1",
        "--model-api-key",
        "not-a-real-key",
        "--model",
        "stub-model",
        f"+head_server={{host:127.0.0.1,port:{head_port}}}",
        f"+nemo_gym_log_dir={folder / 'logs'}",
        # NeMo Gym points uv at its own cache (./cache/uv) unless told; reruns reuse this one.
        f"+uv_cache_dir={UV_CACHE}",
    ]


@contextmanager
def _collector() -> Iterator[dict[str, str]]:
    # A collector of our own, its state outside the deployment's folder: end_by_pid() ends
    # whatever names that folder, and the collector must outlive the deployment.
    state = Path(tempfile.mkdtemp(prefix="ngc-", dir="/tmp"))
    # Free ports: the standard ones are left to the user's (or CI's shared) collector.
    env = dict(os.environ, NEMO_GYM_COLLECTOR_DIR=str(state), NEMO_GYM_COLLECTOR_PORTS="0,0,0")
    start = ROOT / "scripts" / "start-collector.sh"
    out = subprocess.run(
        ["bash", str(start)], env=env, capture_output=True, text=True, timeout=900, check=True
    )
    ports = dict(line.split("=", 1) for line in out.stdout.splitlines()[-2:])
    try:
        yield ports
    finally:
        subprocess.run(["bash", str(start), "--stop"], env=env, timeout=60, check=False)
        shutil.rmtree(state, ignore_errors=True)


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
            elif sample.name.startswith(POOL_PREFIX) and not sample.name.endswith("_created"):
                process(sample.labels).pool_series.add(sample.name)
                if sample.name == CONNECT_TOTAL:
                    destination = sample.labels.get("nemo_gym_http_destination_server_name", "")
                    process(sample.labels).connects[destination] = sample.value
    return processes


def run_deployment(venv: Path) -> Deployment:
    """Run the README's NeMo Gym commands for real and collect what arrived; see the module."""
    folder = Path(tempfile.mkdtemp(prefix="ngd-", dir="/tmp"))
    (folder / "logs").mkdir()
    stub = None
    gym = None
    leftovers: list[str] = []
    try:
        with _collector() as collector:
            env = _environment(venv, folder, collector["OTEL_EXPORTER_OTLP_ENDPOINT"])
            port_file = folder / "stub.port"
            stub = subprocess.Popen(
                [str(venv / "bin" / "python"), str(STUB), str(port_file)],
                env=env,
                start_new_session=True,
            )
            _wait_for("the stub's port", port_file.exists, 60)
            stub_port = int(port_file.read_text())
            args = _gym_arguments(stub_port, free_port(), folder)
            head_server = [a for a in args if a.startswith("+head_server=")]

            # Step 1 of the README: every server virtualenv gets OpenTelemetry.
            subprocess.run(
                ["nemo-gym-otel", "server-venvs", *args],
                cwd=folder,
                env=env,
                check=True,
                timeout=900,
            )
            # Step 2: the servers, instrumented.
            with (folder / "gym-env-start.log").open("w") as gym_log:
                gym = subprocess.Popen(
                    [*INSTRUMENT, "gym", "env", "start", *args, "+skip_venv_if_present=true"],
                    cwd=folder,
                    env={**env, "NEMO_GYM_FASTAPI_NUM_WORKERS": str(SERVER_WORKERS)},
                    stdout=gym_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

            def ready() -> bool:
                if gym.poll() is not None:
                    raise AssertionError(f"gym env start exited {gym.returncode}")
                return "servers ready!" in (folder / "gym-env-start.log").read_text()

            _wait_for("gym env start's servers", ready, 600)
            # Step 3: the rollouts, from an instrumented CLI.
            data = next(
                venv.glob(
                    "lib/python*/site-packages/resources_servers/"
                    "example_single_tool_call/data/example.jsonl"
                )
            )
            output = folder / "rollouts.jsonl"
            with (folder / "gym-eval-run.log").open("w") as eval_log:
                subprocess.run(
                    [
                        *INSTRUMENT,
                        "gym",
                        "eval",
                        "run",
                        "--no-serve",
                        "--agent",
                        AGENT,
                        "--input",
                        str(data),
                        "--output",
                        str(output),
                        "--num-repeats",
                        str(REPEATS),
                        *head_server,
                    ],
                    cwd=folder,
                    env=env,
                    stdout=eval_log,
                    stderr=subprocess.STDOUT,
                    check=True,
                    timeout=600,
                )
            stats = json.loads(
                urllib.request.urlopen(f"http://127.0.0.1:{stub_port}/stats", timeout=10).read()
            )
            # Step 4: Ctrl-C, as a terminal sends it: SIGINT to the whole foreground process
            # group, so to gym env start and to each server. NeMo Gym then also sends SIGINT to
            # each server's shell, kills that shell 1 s later, and shuts down its Ray cluster.
            servers = {
                pid: _describe(pid)
                for pid in _session_and_folder_pids(gym.pid, folder, stub.pid)
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
            # A bound, not a timing: every process of the session is gone well within it.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _session_and_folder_pids(
                gym.pid, folder, stub.pid
            ):
                time.sleep(0.5)
            leftovers = end_by_pid(gym.pid, folder, stub.pid)
            # The collector's batch processor forwards within a second; give it a few.
            time.sleep(3)
            processes = _scrape(collector["COLLECTOR_PROMETHEUS"])
        server_logs = {
            server: (folder / "logs" / f"{server}.log").read_text(errors="replace")
            for server in SERVERS
        }
        capacity_lines = {
            server: [line for line in text.splitlines() if "aggregate_total=" in line]
            for server, text in server_logs.items()
        }
        capacity_lines["gym eval run"] = [
            line
            for line in (folder / "gym-eval-run.log").read_text(errors="replace").splitlines()
            if "aggregate_total=" in line
        ]
        return Deployment(
            folder=folder,
            served=int(stats["responses"]),
            rollouts=len(output.read_text().splitlines()),
            processes=list(processes.values()),
            capacity_lines=capacity_lines,
            server_logs=server_logs,
            gym_exit=gym_exit,
            leftovers=leftovers,
            server_exit_seconds=exit_seconds,
        )
    finally:
        if gym is not None:
            # After a failure midway: end what is left (reported by the test that failed).
            end_by_pid(gym.pid, folder, stub.pid if stub is not None else 0)
            if gym.poll() is None:
                gym.kill()
            gym.wait(timeout=30)
        if stub is not None:
            stub.kill()
            stub.wait()
        if os.environ.get("NEMO_GYM_DEPLOYMENT_KEEP") != "1":
            shutil.rmtree(folder, ignore_errors=True)


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
