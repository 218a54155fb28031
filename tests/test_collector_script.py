"""``scripts/start-collector.sh``: idempotent start, the two lines it promises, ``--stop``.

Runs the script with a state folder of its own, so it starts a second collector beside the
shared one (the build is cached, so this costs a start, not a build) and stops only that one.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from collector_support import START_COLLECTOR, http_status, read_ports

pytestmark = [pytest.mark.integration, pytest.mark.collector]


def _script(state: Path, *args: str) -> list[str]:
    env = dict(os.environ, NEMO_GYM_COLLECTOR_DIR=str(state))
    done = subprocess.run(
        ["bash", str(START_COLLECTOR), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a first build on a fresh machine takes minutes
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_start_collector_is_idempotent_and_stops_by_pid(tmp_path: Path) -> None:
    """A second start reuses the running collector; --stop ends exactly the recorded PID."""
    state = tmp_path / "collector"
    first = _script(state)
    assert re.fullmatch(r"COLLECTOR_PROMETHEUS=http://127\.0\.0\.1:\d+/metrics", first[-2])
    assert re.fullmatch(r"OTEL_EXPORTER_OTLP_ENDPOINT=http://127\.0\.0\.1:\d+", first[-1])
    pid = int((state / "collector.pid").read_text())
    prometheus = first[-2].split("=", 1)[1]
    otlp = first[-1].split("=", 1)[1]
    assert http_status(prometheus) == 200
    assert http_status(otlp + "/v1/metrics") == 405
    assert read_ports(state)["COLLECTOR_PROMETHEUS"] == prometheus

    second = _script(state)
    assert second[-2:] == first[-2:]
    assert int((state / "collector.pid").read_text()) == pid

    _script(state, "--stop")
    assert not Path(f"/proc/{pid}").exists() or "zombie" in _status(pid)
    assert http_status(prometheus) == 0
    assert not (state / "collector.pid").exists()


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"
