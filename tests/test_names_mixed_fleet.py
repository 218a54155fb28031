"""One name per thing: a server under this plugin and the same server under NeMo Gym 0.6+'s own
telemetry report the same ``service.name``, service group, server name and run id, and NeMo
Gym's command line hands its run id to every server it starts.

Real ``opentelemetry-instrument`` processes: ``apps/mixed_fleet_gym.py``, run as a program
named ``gym``, starts ``apps/identify.py`` (this plugin) and ``apps/newer_nemo_gym_server.py``
(NeMo Gym's telemetry, the stand-in of ``stand_ins/nemo_gym_telemetry``: no NeMo Gym release
with it installs here) as the server ``policy_model``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import run_under_instrument
from test_resource_detector import gym_config, server_environment

APPS = Path(__file__).parent / "apps"
NEWER_NEMO_GYM = Path(__file__).parent / "stand_ins" / "nemo_gym_telemetry"
# What NeMo Gym 0.6+'s orchestrator exports to its servers with its telemetry switched on
# (`configure_telemetry_env`, its `telemetry:` block's defaults), the run id aside.
NEMO_GYM_TELEMETRY_ON = {"NEMO_GYM_OTEL_ENABLED": "1", "OTEL_SERVICE_NAME": "nemo-gym"}
AGREED = ("service.name", "nemo.gym.service_group", "nemo.gym.server.name", "nemo.run.id")


def run_fleet(tmp_path: Path, **settings: str) -> dict[str, dict[str, Any]]:
    """Run the fleet under ``gym``; each process's resource by ``gym``, ``ours``, ``newer``."""
    gym = tmp_path / "gym"
    shutil.copy(APPS / "mixed_fleet_gym.py", gym)
    config = server_environment(gym_config(), "policy_model")["NEMO_GYM_CONFIG_DICT"]
    result = run_under_instrument(
        gym,
        SERVER_CONFIG_YAML=config,
        NEWER_NEMO_GYM_PATH=str(NEWER_NEMO_GYM),
        OURS_SCRIPT=str(APPS / "identify.py"),
        NEWER_SCRIPT=str(APPS / "newer_nemo_gym_server.py"),
        **settings,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(out) for out in result.stdout.splitlines() if out.startswith('{"process')]
    return {line["process"]: line["resource"] for line in lines}


def test_names_mixed_fleet_server_agrees_with_nemo_gym_telemetry(tmp_path: Path) -> None:
    """With NeMo Gym's telemetry on, our server and NeMo Gym's agree on every shared name."""
    fleet = run_fleet(
        tmp_path,
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,nemo_gym",
        **NEMO_GYM_TELEMETRY_ON,
    )
    ours, newer = fleet["ours"], fleet["newer"]
    assert {key: ours[key] for key in AGREED} == {key: newer[key] for key in AGREED}
    assert ours["service.name"] == "nemo-gym/policy_model"
    assert ours["nemo.gym.server.type"] == newer["nemo.gym.server.type"] == "responses_api_models"
    assert "service.namespace" not in ours  # NeMo Gym sets none: see docs/names.md
    assert "service.namespace" not in newer
    # The run began in the command line, NeMo Gym's orchestrator, named as NeMo Gym names it.
    assert fleet["gym"]["nemo.run.id"] == ours["nemo.run.id"]
    assert fleet["gym"]["service.name"] == "nemo-gym/orchestrator"
    assert fleet["gym"]["nemo.gym.server.type"] == "orchestrator"
    # Each process of ours is its own instance; NeMo Gym's is "<run id>-rank0" in every process.
    assert ours["service.instance.id"] != fleet["gym"]["service.instance.id"]
    assert newer["service.instance.id"] == f"{ours['nemo.run.id']}-rank0"


def test_names_cli_run_id_reaches_server(tmp_path: Path) -> None:
    """Without NeMo Gym's telemetry: the command line mints a run id that its server reports."""
    fleet = run_fleet(tmp_path, OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="nemo_gym")
    gym, ours = fleet["gym"], fleet["ours"]
    run_id = gym["nemo.run.id"]
    assert re.fullmatch("[0-9a-f]{12}", run_id), run_id
    assert ours["nemo.run.id"] == run_id
    assert (gym["service.name"], ours["service.name"]) == (
        "nemo-gym/orchestrator",
        "nemo-gym/policy_model",
    )
    assert gym["nemo.gym.service_group"] == ours["nemo.gym.service_group"] == "nemo-gym"


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"NEMO_GYM_OTEL_RUN_ID": "run-7"}, "run-7"),
        ({"SLURM_JOB_ID": "4242"}, "4242"),
        ({"NEMO_GYM_OTEL_RUN_ID": "run-7", "SLURM_JOB_ID": "4242"}, "run-7"),
    ],
    ids=["given", "slurm-job", "given-over-slurm"],
)
def test_names_cli_run_id_taken_as_nemo_gym_takes_it(
    tmp_path: Path, settings: dict[str, str], expected: str
) -> None:
    """A run id given (``NEMO_GYM_OTEL_RUN_ID``, else Slurm's job id) is every process's."""
    fleet = run_fleet(tmp_path, OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="nemo_gym", **settings)
    assert fleet["gym"]["nemo.run.id"] == fleet["ours"]["nemo.run.id"] == expected


def test_names_default_detector_order_otel_service_name_whole(tmp_path: Path) -> None:
    """Detectors in the default order: NeMo Gym's exported ``OTEL_SERVICE_NAME`` names ours."""
    fleet = run_fleet(
        tmp_path, OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="nemo_gym", **NEMO_GYM_TELEMETRY_ON
    )
    # The SDK's `otel` detector runs last unless listed: docs/names.md says to list it first.
    assert fleet["ours"]["service.name"] == "nemo-gym"
    assert fleet["ours"]["nemo.gym.server.name"] == fleet["newer"]["nemo.gym.server.name"]
    assert fleet["ours"]["nemo.run.id"] == fleet["newer"]["nemo.run.id"]
