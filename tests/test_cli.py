"""The ``nemo-gym-otel capacity`` command: report, warnings and exit codes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from opentelemetry.instrumentation.nemo_gym.cli import main
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool


@pytest.fixture(autouse=True)
def _fresh_reports() -> Iterator[None]:
    """Each invocation reports as a fresh process would."""
    connection_pool._REPORTED_CAPACITIES.clear()
    yield
    connection_pool._REPORTED_CAPACITIES.clear()


def _capacity_args(limit: str, per_host: str, workers: str, *extra: str) -> list[str]:
    return [
        "capacity",
        "--limit",
        limit,
        "--limit-per-host",
        per_host,
        "--workers",
        workers,
        *extra,
    ]


def test_main_safe_configuration_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """Demand within every limit prints the report, no warning, and exits 0."""
    code = main(_capacity_args("100", "20", "4", "--intended", "100", "--intended-per-host", "20"))
    err = capsys.readouterr().err
    assert code == 0
    assert err.startswith("connection_pool_capacity workers=4 limit=100 limit_per_host=20 ")
    assert "warning:" not in err


def test_main_limits_only_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """Limits without intended demand are never unsafe."""
    assert main(_capacity_args("0", "0", "1")) == 0
    assert "limit=unlimited" in capsys.readouterr().err


def test_main_unsafe_mismatch_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """Intended demand above the per-worker limit prints a warning and exits 1."""
    code = main(_capacity_args("100", "0", "4", "--intended", "300"))
    err = capsys.readouterr().err
    assert code == 1
    assert "warning: intended concurrency per worker 75 exceeds the connector limit" in err


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (_capacity_args("100", "0", "0"), "workers=0"),
        (_capacity_args("-1", "0", "1"), "global_aiohttp_connector_limit=-1"),
        (_capacity_args("3", "0", "4"), "divided across workers=4"),
        (_capacity_args("10", "0", "1", "--intended", "0"), "intended_concurrency=0"),
        (_capacity_args("ten", "0", "1"), "invalid int value: 'ten'"),
        (["capacity", "--limit", "10"], "the following arguments are required"),
        ([], "the following arguments are required: command"),
        (["sizing"], "invalid choice: 'sizing'"),
    ],
)
def test_main_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    """Bad input exits 2 and says why on stderr."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "nemo-gym-otel: error:" in err
    assert reason in err


def test_main_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """--help prints usage and returns 0 instead of exiting the caller."""
    assert main(["capacity", "--help"]) == 0
    assert "--intended-per-host" in capsys.readouterr().out


@pytest.mark.integration
def test_nemo_gym_otel_script_runs_as_installed() -> None:
    """The installed console script reports an unsafe mismatch with exit code 1."""
    script = Path(sys.executable).with_name("nemo-gym-otel")
    if not script.exists():
        pytest.fail(f"console script not installed next to {sys.executable}")
    result = subprocess.run(
        [str(script), *_capacity_args("8", "0", "2", "--intended", "10")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith("connection_pool_capacity workers=2 limit=8 ")
    # Printed once: the unconfigured logger must not repeat the warning.
    assert len([line for line in lines if "exceeds the connector limit" in line]) == 1
    assert lines[1].startswith("warning: intended concurrency per worker 5 exceeds")
