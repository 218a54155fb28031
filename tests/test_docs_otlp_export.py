"""The two commands of "Exporting over OTLP to a collector" (docs/nemo-gym-deployment.md), run
as written in one shell: the first starts a collector and exports its endpoint, the second
exports a process's metrics to it, under an ``instance`` of its own.

The page's ``app.py`` is the one thing replaced: by ``tests/apps/fleet_worker.py``, whose
traffic is exact. The collector runs from a state folder of the test's own on free ports
(``NEMO_GYM_COLLECTOR_DIR``, ``NEMO_GYM_COLLECTOR_PORTS``) and is stopped by the script's
``--stop``. Marked ``collector``: it runs in the collector section of ``.ci/run``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from collector_support import FLEET_WORKER, START_COLLECTOR, read_ports
from waiting import eventually_blocking

pytestmark = [pytest.mark.integration, pytest.mark.collector]

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "nemo-gym-deployment.md"
SECTION = "## Exporting over OTLP to a collector"
APP = "python app.py"
POLICY, RESOURCES = 3, 2


def export_section_blocks() -> list[str]:
    """The plain code blocks of the page's OTLP section, in order."""
    text = PAGE.read_text(encoding="utf-8")
    section = re.split(r"\n#{1,3} ", text.split(f"\n{SECTION}\n", 1)[1], maxsplit=1)[0]
    return re.findall(r"^```\n(.*?)^```", section, re.MULTILINE | re.DOTALL)


def _connects(prometheus: str) -> dict[tuple[str, str], float]:
    """``gym_http_connection_pool_connect_total`` by ``instance`` and destination label."""
    with urllib.request.urlopen(prometheus, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.labels["instance"], sample.labels["nemo_gym_http_destination_server_name"]): (
            sample.value
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gym_http_connection_pool_connect_total"
    }


def test_docs_otlp_export_commands_reach_the_collector(tmp_path: Path) -> None:
    """The page's two commands, run as written, put the process's exact connects in the
    collector under ``instance`` ``$HOSTNAME-<pid of the shell>``."""
    blocks = export_section_blocks()
    assert len(blocks) == 2, blocks
    start, export = blocks
    assert APP in export, export
    script = start + export.replace(
        APP, f"python {FLEET_WORKER} --policy={POLICY} --resources={RESOURCES}"
    )
    state = tmp_path / "collector"
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        NEMO_GYM_COLLECTOR_DIR=str(state),
        NEMO_GYM_COLLECTOR_PORTS="0,0,0",
    )
    try:
        done = subprocess.run(
            ["bash", "-e", "-c", script + 'echo "shell=$$"\n'],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,  # a first build of the collector takes minutes
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        shell = done.stdout.split("shell=")[-1].strip()
        instance = f"{socket.gethostname()}-{shell}"
        prometheus = read_ports(state)["COLLECTOR_PROMETHEUS"]
        expected = {(instance, "policy"): POLICY, (instance, "resources"): RESOURCES}
        # The process exported at its exit; the collector's batch processor passes it on
        # within its timeout (200 ms). Bounded, not a synchronisation: the counts are exact.
        eventually_blocking(
            lambda: _connects(prometheus) == expected,
            f"the collector exporting {expected}",
            interval=0.2,
        )
    finally:
        subprocess.run(
            ["bash", str(START_COLLECTOR), "--stop"],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
