"""``opentelemetry-instrument`` loads the plugin through its entry point, in a real subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_under_instrument
from opentelemetry.instrumentation.nemo_gym import environment_variables

APP = Path(__file__).parent / "apps" / "saturated_client.py"
QUEUE_METRIC = "gym.http.connection_pool.queue_duration_ms"

pytestmark = pytest.mark.integration


def run_instrumented(**overrides: str) -> subprocess.CompletedProcess[str]:
    """Run the app under ``opentelemetry-instrument`` with console exporters by default."""
    return run_under_instrument(APP, **{"OTEL_SERVICE_NAME": "nemo-gym-auto-test", **overrides})


def test_opentelemetry_instrument_exports_queue_histogram() -> None:
    """With the console exporter, the queue histogram and its attributes appear in the output."""
    result = run_instrumented()
    assert result.returncode == 0, result.stderr
    assert "connector=QueueTimedTCPConnector" in result.stdout
    assert QUEUE_METRIC in result.stdout
    assert '"nemo.gym.http.connection_pool.queue_constraint": "total"' in result.stdout
    assert '"nemo.gym.http.destination.server.name": "external"' in result.stdout


@pytest.mark.parametrize(
    "setting",
    [
        # The standard switch for one instrumentation: aiohttp is left untouched.
        {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "nemo_gym"},
        # Nothing is exported, so there is nothing to time.
        {"OTEL_METRICS_EXPORTER": "none"},
        {"OTEL_SDK_DISABLED": "true"},
    ],
    ids=["disabled-instrumentation", "metrics-exporter-none", "sdk-disabled"],
)
def test_opentelemetry_instrument_without_export_builds_plain_connectors(
    setting: dict[str, str],
) -> None:
    """Disabled, or exporting nowhere: connectors stay plain and no queue metric appears."""
    result = run_instrumented(**setting)
    assert result.returncode == 0, result.stderr
    assert "connector=TCPConnector" in result.stdout
    assert QUEUE_METRIC not in result.stdout


def test_opentelemetry_instrument_bad_setting_warns_and_runs() -> None:
    """A malformed variable is named in one warning and the app runs with the default."""
    result = run_instrumented(OTEL_PYTHON_NEMO_GYM_WORKERS="three")
    assert result.returncode == 0, result.stderr
    assert "connector=QueueTimedTCPConnector" in result.stdout
    assert result.stderr.count("OTEL_PYTHON_NEMO_GYM_WORKERS='three'") == 1


def test_opentelemetry_instrument_bad_interval_warns_without_sandboxes() -> None:
    """A bad sampling interval is reported at start-up although the app creates no sandbox."""
    result = run_instrumented(OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL="often")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL='often'") == 1


def test_opentelemetry_instrument_help_lists_every_flag() -> None:
    """``opentelemetry-instrument --help`` offers a flag for each of our variables."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "opentelemetry-instrument"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    ours = sorted(
        "--" + name.removeprefix("OTEL_PYTHON_").lower()
        for name in vars(environment_variables)
        if name.startswith("OTEL_PYTHON_NEMO_GYM_")
    )
    assert len(ours) == 15
    offered = sorted(set(re.findall(r"--nemo_gym_[a-z_]+", result.stdout)))
    assert offered == ours
