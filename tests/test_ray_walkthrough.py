"""docs/identity-and-ray.md's Ray walk-through, run as written: it prints ``200`` and the
collector shows the worker's one connect.

The page's ``console`` block runs in one ``bash`` from a folder holding the page's
its ray_task.py, in the environment of a user's shell where the collector's ``eval`` line ran
(a collector of the test's own, from ``scripts/start-collector.sh --env``), with this
virtualenv's ``ray`` and ``python`` first on ``PATH``. Only the head node's port is changed (to
a free one, in the block and in ray_task.py, where the page has it); Ray's temporary folder
is the test's own (``RAY_TMPDIR``, whose value no command shows), and ``RAY_AUTH_MODE=disabled``
is set, as the page tells a user on a machine of their own. Every Ray process the walk-through
started is ended by PID (by that ``RAY_TMPDIR`` in its environment), never by ``ray stop``, and
checked gone.

Marked ``ray_cluster``: it runs in .ci/run's Ray section, in ``.venv-ray``
(``scripts/ray-env.sh``), about 20 s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from collector_support import START_COLLECTOR, free_port
from conftest import processes_with
from nemo_gym_deployment import fill
from ray_walkthrough import HEAD_PORT, ray_task_source, walkthrough_commands
from waiting import eventually_blocking

pytestmark = [pytest.mark.integration, pytest.mark.ray_cluster]

CONNECTS = "gym_http_connection_pool_connect_total"
BOUND_S = 60.0


def end_ray_processes(ray_tmpdir: str) -> None:
    """SIGTERM to every process with the test's ``RAY_TMPDIR``, SIGKILL to any left after 15 s;
    fails when one outlives that."""
    for pid in processes_with("RAY_TMPDIR", ray_tmpdir):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(AssertionError):  # those left get SIGKILL
        eventually_blocking(
            lambda: not processes_with("RAY_TMPDIR", ray_tmpdir),
            "Ray's processes ending at SIGTERM",
            timeout=15,
            interval=0.2,
        )
    for pid in processes_with("RAY_TMPDIR", ray_tmpdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    eventually_blocking(
        lambda: not processes_with("RAY_TMPDIR", ray_tmpdir),
        "Ray's processes ending at SIGKILL",
        timeout=10,
        interval=0.2,
    )


@pytest.fixture
def shell_environment(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A user's shell after the collector's ``eval`` line: nothing of OpenTelemetry or Ray set
    but what that line exports, this virtualenv's commands first on ``PATH``. The collector is
    stopped after."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OTEL_", "RAY_", "PYTEST_", "VIRTUAL_ENV", "NEMO_GYM_"))
        and key not in ("PYTHONPATH", "COLLECTOR_PROMETHEUS")
    }
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    collector = dict(
        env,
        NEMO_GYM_COLLECTOR_DIR=str(tmp_path / "collector"),
        NEMO_GYM_COLLECTOR_PORTS="0,0,0",
    )
    try:
        started = subprocess.run(
            ["bash", str(START_COLLECTOR), "--env"],
            env=collector,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert started.returncode == 0, started.stderr[-4000:]
        for line in started.stdout.splitlines():
            assert line.startswith("export "), line
            key, value = line.removeprefix("export ").split("=", 1)
            env[key] = value
        assert env.get("COLLECTOR_PROMETHEUS"), started.stdout
        yield env
    finally:
        subprocess.run(
            ["bash", str(START_COLLECTOR), "--stop"], env=collector, timeout=60, check=False
        )


def worker_connects(prometheus_url: str) -> list[float]:
    """The collector's ``connect_total`` values from ``ray.worker`` processes to ``external``."""
    with urllib.request.urlopen(prometheus_url, timeout=5) as response:
        exposition = response.read().decode()
    return [
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == CONNECTS
        and sample.labels.get("job") == "ray.worker"
        and sample.labels.get("nemo_gym_http_destination_server_name") == "external"
    ]


def test_ray_walkthrough_prints_200_and_the_collector_shows_the_connect(
    shell_environment: dict[str, str], tmp_path: Path
) -> None:
    """The page's commands and its ray_task.py print ``200``; the worker's one connect reaches
    the collector as the page shows it."""
    port = str(free_port())
    commands = fill(walkthrough_commands(), {HEAD_PORT: port})
    (ray_task,) = fill([ray_task_source()], {HEAD_PORT: port})
    (tmp_path / "ray_task.py").write_text(ray_task, encoding="utf-8")
    # Short: Ray's unix socket paths under it must stay below 108 characters.
    ray_tmpdir = tempfile.mkdtemp(prefix="rw-", dir="/tmp")
    env = dict(
        shell_environment,
        RAY_TMPDIR=ray_tmpdir,
        RAY_AUTH_MODE="disabled",  # as the page says, for `ray start` and the driver alike
        RAY_USAGE_STATS_ENABLED="0",  # no report to the internet
    )
    # Files, not pipes: the daemons `ray start` leaves behind keep their output open.
    stdout_path, stderr_path = tmp_path / "stdout", tmp_path / "stderr"
    try:
        with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
            shell = subprocess.Popen(
                ["bash", "-e", "-c", "\n".join(commands)],
                cwd=tmp_path,
                env=env,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
            try:
                returncode = shell.wait(timeout=BOUND_S)
            finally:
                if shell.poll() is None:
                    shell.kill()
                    shell.wait()
        output = stdout_path.read_text() + stderr_path.read_text()
        assert returncode == 0, output[-6000:]
        assert stdout_path.read_text().splitlines()[-1] == "200", output[-6000:]

        eventually_blocking(
            lambda: worker_connects(env["COLLECTOR_PROMETHEUS"]) == [1.0],
            "the worker's one connect at the collector",
            interval=0.5,
        )
    finally:
        end_ray_processes(ray_tmpdir)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
