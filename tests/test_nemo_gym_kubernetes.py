"""docs/nemo-gym-kubernetes.md, as written: a NeMo Gym deployment whose sandboxes are pods.

The test reads the page's three ``console`` blocks and runs them as ``bash -e`` scripts in a
fresh folder, with only the page's placeholders filled (``fill()``: the clone, the working
folder, the stub model's port, the head server's port): the first shell (the cluster and
OpenSandbox's controller and server, already running here, are found running; a collector and
Jaeger of the test's own; a Python 3.13 virtualenv with NeMo Gym main, the OpenSandbox SDK and
this plugin; NeMo Gym 0.4.0's simple_agent and openai_model; ``gym env start`` with the
example's ``sandbox_shell`` resources server), then, once the servers are ready, the second
shell (``gym eval run``: 5 tasks, 4 times each, 3 at a time), then Ctrl-C to the first shell's
process group, then the report in the second shell's state. NeMo Gym main comes from
``$NEMO_GYM_MAIN`` (.ci/run: the archive in ../shared), as the page lets a user choose.

What it checks is what an operator reads: each sandbox's allocation is its pod's (0.5 CPU,
64 MiB, ``kubernetes.pod``) and its samples the kubelet's, in Jaeger; the report's sandbox row
counts every create, every OOM kill (one per run of the task beyond the limit), CPU seconds and
the memory peak of the task within it; nothing is left in the cluster; every process started
has ended. The test runs on the host, as the page's shells do (pip reaches PyPI from there),
and enters the cluster's network namespace where the page does (its ``$in_cluster``): to pick
ports free in there, and to read Jaeger, which the page starts in there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_deployment import (
    CLONE,
    HEAD_PORT,
    MODEL_ENDPOINT,
    ROOT,
    STUB_PORT,
    UV_CACHE,
    _collector_lines,
    _environment,
    _exit_times,
    _session_and_folder_pids,
    _stub_model_pid,
    console_blocks,
    ctrl_c_reaches_the_shells,
    end_by_pid,
    fill,
    page_section,
    report_output_on_page,
    report_shape,
    run_second_shell,
    shells_of,
    start_first_shell,
    wait_for_servers,
)
from span_support import carried_forward
from waiting import eventually_blocking

pytestmark = [pytest.mark.kubernetes_deployment, pytest.mark.integration]

PAGE = ROOT / "docs" / "nemo-gym-kubernetes.md"
SECTION = "# A NeMo Gym deployment on Kubernetes sandboxes"
WORKING_FOLDER = "~/gym-k8s"
REPORT_COMMAND = "$ $in_cluster nemo-gym-otel report"
EXAMPLE = ROOT / "examples" / "nemo_gym_kubernetes" / "resources_servers" / "sandbox_shell"
TASKS = [json.loads(line) for line in (EXAMPLE / "data" / "example.jsonl").read_text().splitlines()]
REPEATS = 4  # the page's --num-repeats
ROLLOUTS = len(TASKS) * REPEATS
BEYOND_THE_LIMIT = [i for i, t in enumerate(TASKS) if "160 MiB" in json.dumps(t)]
RESOURCES = "sandbox_shell"
SERVICE = f"nemo-gym/{RESOURCES}"
NAMESPACE = "opensandbox"
P = "nemo.gym.sandbox."
SHARED_ARCHIVE = ROOT.parent / "shared" / "nemo-gym" / "nemo-gym-main-07d6b0d.tgz"
OPENSANDBOX_SETTINGS = (
    "NEMO_GYM_OPENSANDBOX_SOURCE",
    "NEMO_GYM_OPENSANDBOX_K8S_SOURCE",
    "NEMO_GYM_OPENSANDBOX_CACHE",
    "NEMO_GYM_KUBERNETES_CACHE",
)


@dataclass
class Walk:
    folder: Path
    run_id: str
    rollouts: list[dict[str, Any]]
    records: list[dict[str, Any]]  # the sandbox_shell server's sandbox.resources spans' tags
    report: str
    leftovers: list[str]
    server_exit_seconds: list[float]
    cluster_after: list[str]  # BatchSandboxes and pods in the namespace after Ctrl-C
    seconds: dict[str, float]


@dataclass(frozen=True)
class Cluster:
    """The single-node cluster of a clone's scripts/start-kubernetes.sh, as its ``--env``
    says: its network namespace and admin kubeconfig."""

    clone: Path
    netns: str
    kubeconfig: str

    @classmethod
    def of(cls, clone: Path) -> Cluster:
        """The clone's running cluster (its ``start-kubernetes.sh`` starts it if need be)."""
        said = subprocess.run(
            ["bash", str(clone / "scripts" / "start-kubernetes.sh"), "--env"],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        ).stdout
        exports = dict(re.findall(r"^export (\w+)=(.*)$", said, re.M))
        return cls(clone, exports["NEMO_GYM_KUBERNETES_NETNS"], exports["KUBECONFIG"])

    def run(self, *command: str) -> str:
        """``command``'s output, run in the cluster's network namespace (the page's
        ``$in_cluster``)."""
        return subprocess.run(
            ["nsenter", f"--net={self.netns}", *command],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout

    def free_ports(self, count: int) -> list[int]:
        """``count`` distinct loopback ports free in the cluster's network namespace."""
        ports: set[int] = set()
        while len(ports) < count:
            free_port = self.clone / "scripts" / "free_port.py"
            ports.add(int(self.run("python3", str(free_port), "0")))
        return sorted(ports)

    def objects(self) -> list[str]:
        """The BatchSandboxes and pods in OpenSandbox's namespace."""
        binaries = subprocess.run(
            ["bash", str(self.clone / "scripts" / "start-kubernetes.sh"), "--bin"],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout.strip()
        kubectl = [f"{binaries}/kubectl", "--kubeconfig", self.kubeconfig]
        return subprocess.run(
            [*kubectl, "--namespace", NAMESPACE, "get", "batchsandboxes,pods", "-o", "name"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.split()


def _resources_records(cluster: Cluster, jaeger_query: str, run_id: str) -> list[dict[str, Any]]:
    """The tags of every ``sandbox.resources`` span of this run's sandbox_shell server, in the
    order they were recorded."""
    tags = urllib.parse.quote(json.dumps({"nemo.run.id": run_id}), safe="")
    service = urllib.parse.quote(SERVICE, safe="")
    url = (
        f"{jaeger_query}/api/traces?service={service}&operation=sandbox.resources"
        f"&limit=10000&lookback=2h&tags={tags}"
    )
    found = json.loads(cluster.run("curl", "-sf", "--max-time", "60", url))["data"] or []
    spans = [
        span
        for trace in found
        for span in trace["spans"]
        if span["operationName"] == "sandbox.resources"
    ]
    spans.sort(key=lambda span: span["startTime"])
    return [{tag["key"]: tag["value"] for tag in span["tags"]} for span in spans]


def _settled_records(cluster: Cluster, jaeger_query: str, run_id: str) -> list[dict[str, Any]]:
    """The records once every sandbox's final sample is stored and the count held still for
    longer than the SDK's batch delay (5 s); bounded at 120 s."""
    previous = [-1]

    def settled() -> list[dict[str, Any]] | None:
        records = _resources_records(cluster, jaeger_query, run_id)
        finals = sum(1 for r in records if r.get(P + "resource.final") is True)
        still = finals >= ROLLOUTS and len(records) == previous[0]
        previous[0] = len(records)
        return records if still else None

    try:
        return eventually_blocking(settled, f"{ROLLOUTS} final samples held still", 120, 7)
    except AssertionError:
        return _resources_records(cluster, jaeger_query, run_id)


def _environment_of_a_fresh_shell(folder: Path, collector_state: Path) -> dict[str, str]:
    env = _environment(folder, collector_state, UV_CACHE)
    # A user's shell: no engine named, no kubeconfig yet (the page exports both it needs).
    for name in ("DOCKER_HOST", "KUBECONFIG"):
        env.pop(name, None)
    main = os.environ.get("NEMO_GYM_MAIN") or (
        str(SHARED_ARCHIVE) if SHARED_ARCHIVE.exists() else ""
    )
    if main:
        env["NEMO_GYM_MAIN"] = main
    # Where the user's OpenSandbox source and build caches are: the page's start-opensandbox.sh
    # line reads them (a clone without ../shared beside it needs the sources named).
    for name in OPENSANDBOX_SETTINGS:
        if name in os.environ:
            env[name] = os.environ[name]
    return env


@contextlib.contextmanager
def _collector_stopped_after(collector_state: Path) -> Iterator[None]:
    try:
        yield
    finally:
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "start-collector.sh"), "--stop"],
            env={**os.environ, "NEMO_GYM_COLLECTOR_DIR": str(collector_state)},
            timeout=60,
            check=False,
        )
        shutil.rmtree(collector_state, ignore_errors=True)


def run_walk(clone: Path = ROOT) -> Walk:
    """Run the page's shells with ``clone`` as the clone (its cluster started first, where it
    is not running: the ports the page's servers take are chosen free in its network)."""
    began = time.monotonic()
    cluster = Cluster.of(clone)
    seconds: dict[str, float] = {"cluster running": time.monotonic() - began}
    folder = Path(tempfile.mkdtemp(prefix="ngk-", dir="/tmp"))
    collector_state = Path(tempfile.mkdtemp(prefix="ngkc-", dir="/tmp"))
    work = folder / "gym-k8s"
    env = _environment_of_a_fresh_shell(folder, collector_state)
    stub_port, head_port = cluster.free_ports(2)
    placeholders = {
        CLONE: str(clone),
        WORKING_FOLDER: str(work),
        MODEL_ENDPOINT: f"127.0.0.1:{stub_port}",
        STUB_PORT: f"stub-model --port {stub_port}",
        HEAD_PORT: f"port:{head_port}",
    }
    first_shell, second_shell, report_shell = fill(
        shells_of(console_blocks(page_section(PAGE, SECTION))), placeholders
    )
    gym = None
    stub_pid = 0
    with ctrl_c_reaches_the_shells(), _collector_stopped_after(collector_state):
        try:
            start = began
            gym = start_first_shell(first_shell, folder, env)
            wait_for_servers(gym, folder)
            seconds["servers ready"] = time.monotonic() - start
            stub_pid = _stub_model_pid(gym.pid, folder, work / "stub-model.log")
            run_id = (work / "run-id").read_text().strip()
            run_second_shell(second_shell, folder, env)
            seconds["gym eval run ended"] = time.monotonic() - start
            jaeger_query = _collector_lines(collector_state, "jaeger.env")["JAEGER_QUERY"]
            records = _settled_records(cluster, jaeger_query, run_id)
            # Ctrl-C, as a terminal sends it: SIGINT to the first shell's process group.
            servers = [
                pid
                for pid in _session_and_folder_pids(gym.pid, folder, stub_pid)
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"python\0app.py\0"
            ]
            os.killpg(gym.pid, signal.SIGINT)
            exit_seconds = _exit_times(servers, bound_s=60)
            with contextlib.suppress(subprocess.TimeoutExpired):
                gym.wait(timeout=120)
            with contextlib.suppress(AssertionError):
                eventually_blocking(
                    lambda: not _session_and_folder_pids(gym.pid, folder, stub_pid),
                    "every process of the session gone",
                    60,
                    0.5,
                )
            leftovers = end_by_pid(gym.pid, folder, stub_pid)
            cluster_after = cluster.objects()
            time.sleep(3)  # the collector's batch processor forwards within a second
            report = subprocess.run(
                ["bash", "-e", "-c", report_shell],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            seconds["report"] = time.monotonic() - start
            assert report.returncode == 0, report.stderr[-4000:]
            return Walk(
                folder=folder,
                run_id=run_id,
                rollouts=[
                    json.loads(line) for line in (work / "rollouts.jsonl").read_text().splitlines()
                ],
                records=records,
                report=report.stdout,
                leftovers=leftovers,
                server_exit_seconds=exit_seconds,
                cluster_after=cluster_after,
                seconds=seconds,
            )
        finally:
            if gym is not None:
                end_by_pid(gym.pid, folder, stub_pid)
                if gym.poll() is None:
                    gym.kill()
                gym.wait(timeout=30)
            if stub_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stub_pid, signal.SIGKILL)
            if os.environ.get("NEMO_GYM_DEPLOYMENT_KEEP") != "1":
                shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def walk() -> Walk:
    done = run_walk()
    print(f"\n== docs/nemo-gym-kubernetes.md, timings: {done.seconds}\n{done.report}")
    return done


def _task_of(rollout: dict[str, Any]) -> int:
    asked = rollout["responses_create_params"]["input"][-1]["content"]
    (index,) = [
        i
        for i, task in enumerate(TASKS)
        if task["responses_create_params"]["input"][-1]["content"] == asked
    ]
    return index


def test_kubernetes_walk_every_rollout_ran_its_command(walk: Walk) -> None:
    """20 rollouts, each task 4 times; every task within the limit rewarded (its command's exit
    status as expected, its output downloaded)."""
    assert len(walk.rollouts) == ROLLOUTS
    by_task = [_task_of(r) for r in walk.rollouts]
    assert sorted(by_task) == sorted(list(range(len(TASKS))) * REPEATS)
    for rollout, task in zip(walk.rollouts, by_task, strict=True):
        if task not in BEYOND_THE_LIMIT:
            assert rollout["reward"] == 1.0, rollout["response"]["output"]


def test_kubernetes_walk_allocations_are_the_pods(walk: Walk) -> None:
    """Every sandbox's allocation record is its pod's requests and limits, exactly what the
    resources server asked NeMo Gym for (0.5 CPU, 64 MiB), from the pod (``kubernetes.pod``);
    one per sandbox."""
    allocations = [r for r in walk.records if r[P + "resource.kind"] == "allocation"]
    assert len(allocations) == ROLLOUTS, [
        r.get(P + "allocation.unknown_reason") for r in allocations
    ]
    component = P + "allocation.component.sandbox."
    for record in allocations:
        assert record[P + "allocation.source"] == "kubernetes.pod", record
        assert record[P + "allocation.host.kind"] == "k8s.pod", record
        assert record[P + "allocation.placement.namespace"] == NAMESPACE, record
        assert (record[component + "limits.cpu"], record[component + "limits.memory_mib"]) == (
            0.5,
            64,
        ), record
    assert len({r[P + "id"] for r in allocations}) == ROLLOUTS


def test_kubernetes_walk_samples_from_the_kubelet_and_a_final_each(walk: Walk) -> None:
    """Every sample is the kubelet's; each sandbox has one final sample, at close; no memory
    sample above the limit; OOM kills counted at most once a sandbox, and at most once a run of
    the task beyond the limit."""
    samples = [r for r in carried_forward(walk.records) if r[P + "resource.kind"] == "sample"]
    assert samples
    assert {r.get(P + "usage.source") for r in samples} == {"kubelet.summary"}
    finals = [r for r in samples if r[P + "resource.final"] is True]
    assert len(finals) == ROLLOUTS
    assert len({r[P + "id"] for r in finals}) == ROLLOUTS
    assert all(r.get(P + "usage.memory_mib", 0) <= 64 for r in samples)
    # The kernel's kill reaches the records once the kubelet reports the container's end (its
    # next status sync, about a second): a kill that close to the sandbox's close can miss the
    # final sample (CI saw 3 of 4 once). So: at least one, at most one a run of that task; the
    # report is checked against what the final samples say.
    killed = [r.get(P + "usage.oom_kills", 0) for r in finals]
    assert set(killed) <= {0, 1}, killed
    assert 1 <= sum(killed) <= REPEATS * len(BEYOND_THE_LIMIT), killed


def _sandbox_rows(report: str) -> dict[tuple[str, str], list[str]]:
    section = report.split("Sandboxes per provider and server", 1)[1]
    rows = {}
    for line in section.strip().splitlines()[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[(cells[0], cells[1])] = cells[2:7]
    return rows


def test_kubernetes_walk_report_counts_every_sandbox(walk: Walk) -> None:
    """The report's sandbox row: every create, no failure, the OOM kills the final samples
    counted, CPU seconds, and a memory peak of the task within the limit (40 MiB of tmpfs,
    charged to the container) below the limit."""
    rows = _sandbox_rows(walk.report)
    assert list(rows) == [("opensandbox", SERVICE)], walk.report
    created, failed, oom_kills, cpu, peak = rows[("opensandbox", SERVICE)]
    finals = [
        r
        for r in carried_forward(walk.records)
        if r[P + "resource.kind"] == "sample" and r[P + "resource.final"] is True
    ]
    counted = sum(r.get(P + "usage.oom_kills", 0) for r in finals)
    assert (int(created), int(failed), int(oom_kills)) == (ROLLOUTS, 0, counted), walk.report
    assert float(cpu) > 0, walk.report
    assert 40 <= float(peak) <= 64, walk.report


def test_kubernetes_walk_report_matches_the_page(walk: Walk) -> None:
    """The page's report, numbers aside, is what the run printed."""
    page = report_output_on_page(page_section(PAGE, SECTION), REPORT_COMMAND)
    assert walk.report.startswith(f"run {walk.run_id}: "), walk.report
    assert report_shape(walk.report) == report_shape(page), walk.report


def test_kubernetes_walk_leaves_nothing(walk: Walk) -> None:
    """After Ctrl-C: no BatchSandbox and no pod in the namespace (each rollout's verify closed
    its sandbox), and every process the shells started has ended by itself."""
    assert walk.cluster_after == []
    assert walk.leftovers == []
    assert all(seconds < 60 for seconds in walk.server_exit_seconds), walk.server_exit_seconds
