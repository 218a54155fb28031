"""``NemoGymResourceDetector``: each NeMo Gym server, uvicorn worker and Ray process names itself.

The configuration is written exactly as ``gym env start`` writes it (``OmegaConf.to_yaml`` of
the merged config into ``NEMO_GYM_CONFIG_DICT``, the server's key in ``NEMO_GYM_CONFIG_PATH``);
the Ray command lines are the ones Ray 2.60 gives its processes. End to end, real
``opentelemetry-instrument`` subprocesses build their SDK resource through the entry point.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.version import __version__ as sdk_version

from conftest import run_under_instrument
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor, resource_detector
from opentelemetry.instrumentation.nemo_gym.ray._identity import (
    is_ray_system_process,
    ray_process_attributes,
)
from opentelemetry.instrumentation.nemo_gym.resource_detector import (
    NemoGymResourceDetector,
    process_attributes,
)

APP = Path(__file__).parent / "apps" / "identify.py"
SECRET = "sk-RECOGNISABLE-0xC0FFEE"
NODE_ID = "af036bc1a572e890bc24014de5e647eb4c8c29e735b216ac545e7b91"
WORKER_ID = "80ab809157a4ae6c91e6706928493c69beeb93d6fd8dce7bcf6597cd"
SESSION = "session_2026-12-01_19-55-45_800421_26306"
RAY = "/venv/lib/python3.12/site-packages/ray"
# The resource every test compares whole: what the SDK itself adds (its own telemetry.sdk.*,
# and the default service name where nothing names one), and gym_config()'s policy_model
# server and a Ray 2.60 worker as the detector names them.
SDK_DEFAULTS = {
    "telemetry.sdk.language": "python",
    "telemetry.sdk.name": "opentelemetry",
    "telemetry.sdk.version": sdk_version,
}
POLICY_MODEL = {
    "service.name": "nemo-gym/policy_model",
    "nemo.gym.service_group": "nemo-gym",
    "nemo.gym.server.name": "policy_model",
    "nemo.gym.server.type": "responses_api_models",
    "nemo.gym.server.implementation": "openai_model",
    "nemo.gym.server.workers": 2,
    "nemo.gym.server.uvicorn_worker": False,
}
RAY_WORKER = {
    "service.name": "ray.worker",
    "ray.component": "worker",
    "ray.node.id": NODE_ID,
    "ray.worker.id": WORKER_ID,
    "ray.session.name": SESSION,
}


def per_process(attributes: Mapping[str, Any], pid: int | None = None) -> dict[str, Any]:
    """``attributes`` without the three every process of ours carries, each checked here (a
    UUID instance id, the process's pid, this one's by default, and a parent pid): the rest is
    for the test to compare whole."""
    rest = dict(attributes)
    uuid.UUID(str(rest.pop("service.instance.id")))
    assert rest.pop("process.pid") == (os.getpid() if pid is None else pid)
    parent = rest.pop("process.parent_pid")
    assert parent == os.getppid() if pid is None else isinstance(parent, int)
    return rest


def gym_config(num_workers: object = 2) -> dict[str, Any]:
    """A NeMo Gym 0.4.0 configuration: the head server, a model, an agent, credentials."""
    return {
        "head_server": {"host": "127.0.0.1", "port": 11000},
        "policy_api_key": "sk-policy",
        "hf_token": "hf_token_value",
        "policy_model": {
            "responses_api_models": {
                "openai_model": {
                    "entrypoint": "app.py",
                    "openai_base_url": "http://127.0.0.1:8000/v1",
                    "openai_api_key": "${policy_api_key}",
                    "openai_model": "stub",
                    "num_workers": num_workers,
                    "host": "127.0.0.1",
                    "port": 12001,
                }
            }
        },
        "example_single_tool_call_simple_agent": {
            "responses_api_agents": {
                "simple_agent": {
                    "entrypoint": "app.py",
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "datasets": [{"name": "train", "license": "Apache 2.0"}],
                }
            }
        },
    }


def server_environment(config: dict[str, Any], name: str, **extra: str) -> dict[str, str]:
    """The variables ``gym env start`` sets for server ``name``."""
    return {
        "NEMO_GYM_CONFIG_DICT": OmegaConf.to_yaml(OmegaConf.create(config)),
        "NEMO_GYM_CONFIG_PATH": name,
        **extra,
    }


def with_secret_everywhere(value: Any, path: str = "") -> Any:
    """``value`` with every string leaf replaced by the secret (and its path, to tell apart)."""
    if isinstance(value, dict):
        return {key: with_secret_everywhere(item, f"{path}.{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [with_secret_everywhere(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, str):
        return f"{SECRET}{path}"
    return value


def ray_worker_argv() -> list[str]:
    """A Ray 2.60 worker's command line, credentials included."""
    return [
        f"{RAY}/_private/workers/default_worker.py",
        "--node-ip-address=127.0.0.1",
        "--node-manager-port=46873",
        f"--redis-password={SECRET}",
        "--redis-username",
        SECRET,
        "--gcs-address=127.0.0.1:43399",
        f"--session-name={SESSION}",
        f"--worker-id={WORKER_ID}",
        f"--node-id={NODE_ID}",
        "--runtime-env-hash=0",
    ]


@pytest.fixture
def detector_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record at DEBUG and above, with the once-only memo forgotten before and after."""
    resource_detector._ONCE.reset()
    caplog.set_level(logging.DEBUG)
    yield caplog
    resource_detector._ONCE.reset()


def test_entry_point_published_in_resource_detector_group() -> None:
    """``nemo_gym`` in ``opentelemetry_resource_detector`` loads ``NemoGymResourceDetector``."""
    (found,) = entry_points(group="opentelemetry_resource_detector", name="nemo_gym")
    assert found.load() is NemoGymResourceDetector


def test_resource_create_runs_detector_only_when_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK runs it for ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=nemo_gym``, not by default."""
    for key, value in server_environment(gym_config(), "policy_model").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.delenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", raising=False)
    sdk_only = dict(Resource.create().attributes)
    sdk_only.pop("service.instance.id", None)  # the SDK's own, where it makes one (newer SDKs)
    assert str(sdk_only.pop("service.name")).startswith("unknown_service")
    assert sdk_only == SDK_DEFAULTS
    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "nemo_gym")
    assert per_process(Resource.create().attributes) == {**SDK_DEFAULTS, **POLICY_MODEL}


def test_resource_create_otel_service_name_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OTEL_SERVICE_NAME`` overrides the detected service name; the server name stays."""
    for key, value in server_environment(gym_config(), "policy_model").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", "nemo_gym")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "rl-fleet")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert per_process(Resource.create().attributes) == {
        **SDK_DEFAULTS,
        **POLICY_MODEL,
        "service.name": "rl-fleet",
        "nemo.gym.service_group": "rl-fleet",  # OTEL_SERVICE_NAME is NeMo Gym's group
    }


@pytest.mark.parametrize(
    "setting",
    [
        {"OTEL_SERVICE_NAME": "rl-fleet"},
        {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci, service.name=rl-fleet"},
    ],
    ids=["service-name", "resource-attributes"],
)
def test_detector_configured_service_name_not_overridden(setting: dict[str, str]) -> None:
    """A service name the user configured: the detector names none, in any detector order."""
    attributes = process_attributes(
        {**server_environment(gym_config(), "policy_model"), **setting}, ["app.py"]
    )
    expected = {k: v for k, v in POLICY_MODEL.items() if k != "service.name"}
    # OTEL_SERVICE_NAME is also NeMo Gym's service group; a service.name attribute is not.
    group = setting.get("OTEL_SERVICE_NAME", "nemo-gym")
    assert per_process(attributes) == {**expected, "nemo.gym.service_group": group}


def test_detector_server_process_named_from_config(
    detector_warnings: pytest.LogCaptureFixture,
) -> None:
    """A server process gets its name, type, implementation and configured worker count."""
    attributes = process_attributes(
        server_environment(gym_config(), "policy_model"), ["app.py"], []
    )
    assert per_process(attributes) == POLICY_MODEL
    assert detector_warnings.records == []


def test_detector_uvicorn_worker_marked() -> None:
    """A process uvicorn spawned for ``num_workers > 1`` says it is a uvicorn worker."""
    environ = server_environment(gym_config(), "policy_model", IS_NEMO_GYM_FASTAPI_WORKER="1")
    attributes = process_attributes(environ, ["-c"], [])
    assert per_process(attributes) == {**POLICY_MODEL, "nemo.gym.server.uvicorn_worker": True}


def test_detector_second_block_found_after_a_list() -> None:
    """A server after one with lists and nested mappings is still found at its own level."""
    attributes = process_attributes(
        server_environment(gym_config(), "example_single_tool_call_simple_agent"), ["app.py"]
    )
    assert per_process(attributes) == {
        "service.name": "nemo-gym/example_single_tool_call_simple_agent",
        "nemo.gym.service_group": "nemo-gym",
        "nemo.gym.server.name": "example_single_tool_call_simple_agent",
        "nemo.gym.server.type": "responses_api_agents",
        "nemo.gym.server.implementation": "simple_agent",
        "nemo.gym.server.uvicorn_worker": False,
    }


def test_detector_quoted_server_name_found() -> None:
    """A server key that YAML has to quote is matched by its unquoted name."""
    config = gym_config()
    config["judge: it's"] = config.pop("policy_model")
    attributes = process_attributes(server_environment(config, "judge: it's"), ["app.py"])
    assert per_process(attributes) == {
        **POLICY_MODEL,
        "service.name": "nemo-gym/judge: it's",
        "nemo.gym.server.name": "judge: it's",
    }


def test_detector_secret_in_every_string_field_found_nowhere(
    detector_warnings: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret in every string field reaches neither the resource nor a log line."""
    config = with_secret_everywhere(gym_config(num_workers=SECRET))
    environ = server_environment(config, "policy_model")
    assert SECRET in environ["NEMO_GYM_CONFIG_DICT"]
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    attributes = process_attributes(environ, ["app.py"], [])
    resource = NemoGymResourceDetector().detect()
    without_workers = {k: v for k, v in POLICY_MODEL.items() if k != "nemo.gym.server.workers"}
    assert per_process(attributes) == without_workers
    assert {k: v for k, v in per_process(resource.attributes).items() if k != "nemo.run.id"} == (
        without_workers
    )
    messages = [record.getMessage() for record in detector_warnings.records]
    assert len(messages) == 1
    assert "policy_model.responses_api_models.openai_model.num_workers" in messages[0]
    assert "NEMO_GYM_CONFIG_DICT" in messages[0]
    for text in [*messages, json.dumps(attributes), resource.to_json()]:
        assert SECRET not in text


def test_detector_ray_command_line_secret_found_nowhere() -> None:
    """A Ray worker's ``--redis-password``/``--redis-username`` never reach the resource."""
    attributes = process_attributes({}, ray_worker_argv(), [])
    assert SECRET not in json.dumps(attributes)
    assert per_process(attributes) == RAY_WORKER


# What a server's configuration still tells when it is bad: nothing, or all but the worker count.
_TYPE_KNOWN = {
    "nemo.gym.server.type": "responses_api_models",
    "nemo.gym.server.implementation": "openai_model",
}


@pytest.mark.parametrize(
    ("environ", "expected", "known"),
    [
        (
            {"NEMO_GYM_CONFIG_PATH": "policy_model"},
            "NEMO_GYM_CONFIG_PATH names the NeMo Gym server 'policy_model' but "
            "NEMO_GYM_CONFIG_DICT is unset",
            {},
        ),
        (
            {"NEMO_GYM_CONFIG_PATH": "policy_model", "NEMO_GYM_CONFIG_DICT": "{not: [yaml"},
            "NEMO_GYM_CONFIG_DICT has no server block 'policy_model' (from NEMO_GYM_CONFIG_PATH)",
            {},
        ),
        (
            server_environment(gym_config(), "missing_server"),
            "NEMO_GYM_CONFIG_DICT has no server block 'missing_server'",
            {},
        ),
        (
            server_environment(gym_config(num_workers="two"), "policy_model"),
            "NEMO_GYM_CONFIG_DICT: policy_model.responses_api_models.openai_model.num_workers "
            "is not a positive integer (value not shown)",
            _TYPE_KNOWN,
        ),
    ],
    ids=["no-config", "not-yaml", "no-such-server", "bad-num-workers"],
)
def test_detector_bad_input_warns_naming_variable(
    detector_warnings: pytest.LogCaptureFixture,
    environ: dict[str, str],
    expected: str,
    known: dict[str, str],
) -> None:
    """Bad or missing configuration: one warning naming the variable; the name is still used."""
    attributes = process_attributes(environ, ["app.py"], [])
    named = environ["NEMO_GYM_CONFIG_PATH"]
    assert per_process(attributes) == {
        "service.name": f"nemo-gym/{named}",
        "nemo.gym.service_group": "nemo-gym",
        "nemo.gym.server.name": named,
        "nemo.gym.server.uvicorn_worker": False,
        **known,
    }
    (record,) = detector_warnings.records
    assert record.levelno == logging.WARNING
    assert expected in record.getMessage()


def test_detector_plain_process_has_only_its_instance() -> None:
    """Outside NeMo Gym and Ray: an instance id and pids, no service name of ours."""
    attributes = process_attributes({}, ["/usr/bin/python3", "app.py"], [])
    assert per_process(attributes) == {}


def test_detector_nemo_gym_cli_named_orchestrator() -> None:
    """NeMo Gym's own commands (``gym``, ``ng_run``) are its orchestrator, as NeMo Gym names it."""
    for argv in (["/venv/bin/gym", "eval", "run"], ["/venv/bin/ng_run"]):
        attributes = process_attributes({}, argv)
        assert per_process(attributes) == {
            "service.name": "nemo-gym/orchestrator",
            "nemo.gym.service_group": "nemo-gym",
            "nemo.gym.server.name": "orchestrator",
            "nemo.gym.server.type": "orchestrator",
        }


def test_detector_ray_worker_named_with_node_and_worker() -> None:
    """A Ray worker: component, node id, worker id and session from its command line."""
    attributes = ray_process_attributes(ray_worker_argv())
    assert attributes == {
        "service.name": "ray.worker",
        "ray.component": "worker",
        "ray.node.id": NODE_ID,
        "ray.worker.id": WORKER_ID,
        "ray.session.name": SESSION,
    }
    assert not is_ray_system_process(ray_worker_argv())


def test_detector_ray_worker_ignores_inherited_nemo_gym_server() -> None:
    """A Ray worker that inherited a server's variables is a Ray worker, not that server."""
    environ = server_environment(gym_config(), "policy_model")
    attributes = process_attributes(environ, ray_worker_argv(), [])
    assert per_process(attributes) == RAY_WORKER


@pytest.mark.parametrize(
    ("argv", "parent_argv", "component"),
    [
        ([f"{RAY}/dashboard/agent.py", f"--node-id={NODE_ID}"], [], "dashboard_agent"),
        ([f"{RAY}/dashboard/dashboard.py", "--host=127.0.0.1"], [], "dashboard"),
        ([f"{RAY}/_private/runtime_env/agent/main.py"], [], "runtime_env_agent"),
        ([f"{RAY}/_private/log_monitor.py"], [], "log_monitor"),
        ([f"{RAY}/autoscaler/_private/monitor.py"], [], "monitor"),
        # The dashboard's module processes come from its multiprocessing forkserver.
        (["-c"], [f"{RAY}/dashboard/dashboard.py", "--port=8265"], "dashboard"),
    ],
    ids=["agent", "dashboard", "runtime-env-agent", "log-monitor", "monitor", "forkserver"],
)
def test_detector_ray_system_process_named(
    argv: list[str], parent_argv: list[str], component: str
) -> None:
    """Ray's own daemons are named by component, and count as system processes."""
    attributes = ray_process_attributes(argv, parent_argv)
    node = {"ray.node.id": NODE_ID} if f"--node-id={NODE_ID}" in argv else {}
    assert attributes == {"service.name": f"ray.{component}", "ray.component": component, **node}
    assert is_ray_system_process(argv, parent_argv)


def test_detector_forkserver_of_something_else_not_ray() -> None:
    """``python -c`` under a parent that is not Ray's dashboard is not a Ray process."""
    assert ray_process_attributes(["-c"], ["/srv/app.py"]) == {}
    assert ray_process_attributes(["-c"], []) == {}


def run_identify(script: Path, **overrides: str) -> dict[str, Any]:
    """Run ``script`` under ``opentelemetry-instrument``; its one JSON line, parsed."""
    result = run_under_instrument(
        script, **{"OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "nemo_gym", **overrides}
    )
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith('{"connector"'))
    parsed: dict[str, Any] = json.loads(line)
    return parsed


@pytest.mark.integration
def test_opentelemetry_instrument_two_uvicorn_workers_distinct_instances() -> None:
    """Two worker processes of one server: same server, different ``service.instance.id``."""
    config = with_secret_everywhere(gym_config())
    environ = server_environment(config, "policy_model", IS_NEMO_GYM_FASTAPI_WORKER="1")
    first, second = (run_identify(APP, **environ)["resource"] for _ in range(2))
    assert first["service.instance.id"] != second["service.instance.id"]
    assert first["process.pid"] != second["process.pid"]
    for resource in (first, second):
        ours = per_process(resource, pid=resource["process.pid"])
        # telemetry.* is the SDK's and opentelemetry-instrument's own.
        assert {k: v for k, v in ours.items() if not k.startswith("telemetry.")} == {
            **POLICY_MODEL,
            "nemo.gym.server.uvicorn_worker": True,
        }


@pytest.mark.integration
def test_opentelemetry_instrument_ray_system_process_left_plain(tmp_path: Path) -> None:
    """In a Ray daemon (here: a script at ray/dashboard/agent.py) connectors stay plain."""
    agent = tmp_path / "ray" / "dashboard" / "agent.py"
    agent.parent.mkdir(parents=True)
    shutil.copy(APP, agent)
    ours = run_identify(APP)
    ray_agent = run_identify(agent)
    assert ours["connector"] == "QueueTimedTCPConnector"
    assert ray_agent["connector"] == "TCPConnector"
    agent_resource = per_process(ray_agent["resource"], pid=ray_agent["resource"]["process.pid"])
    assert {k: v for k, v in agent_resource.items() if not k.startswith("telemetry.")} == {
        "service.name": "ray.dashboard_agent",
        "ray.component": "dashboard_agent",
    }


def test_detector_long_server_name_cut_in_warning(
    detector_warnings: pytest.LogCaptureFixture,
) -> None:
    """A 5,000-character ``NEMO_GYM_CONFIG_PATH`` is quoted in the warning by 64 characters."""
    name = "s" * 5000
    process_attributes({"NEMO_GYM_CONFIG_PATH": name}, ["app.py"], [])
    (record,) = detector_warnings.records
    assert record.getMessage() == (
        f"nemo_gym resource detector: NEMO_GYM_CONFIG_PATH names the NeMo Gym server "
        f"{'s' * 64!r}... (5000 characters) but NEMO_GYM_CONFIG_DICT is unset: its type and "
        "implementation are not known"
    )


@pytest.mark.parametrize(
    "argv_tail",
    [
        ["--node-id", f"--redis-password={SECRET}"],
        ["--node-id", "--redis-password", SECRET],
        ["--worker-id", "-x", "--session-name"],
    ],
    ids=["flag-with-value", "flag-then-value", "short-flag-and-last"],
)
def test_detector_ray_flag_without_value_takes_no_other_flag(argv_tail: list[str]) -> None:
    """``--node-id`` followed by another flag has no value: the next flag is never taken."""
    argv = [f"{RAY}/_private/workers/default_worker.py", *argv_tail]
    attributes = ray_process_attributes(argv)
    assert attributes == {"service.name": "ray.worker", "ray.component": "worker"}
    assert SECRET not in json.dumps(attributes)


def test_detector_service_name_per_server_off_names_group() -> None:
    """NeMo Gym's ``NEMO_GYM_OTEL_SERVICE_NAME_PER_SERVER=0``: every server is the group."""
    environ = server_environment(
        gym_config(), "policy_model", NEMO_GYM_OTEL_SERVICE_NAME_PER_SERVER="0"
    )
    attributes = process_attributes(environ, ["app.py"])
    assert per_process(attributes) == {**POLICY_MODEL, "service.name": "nemo-gym"}


@pytest.mark.parametrize(
    ("telemetry", "expected"),
    [({"NEMO_GYM_OTEL_ENABLED": "1"}, "rl-fleet/policy_model"), ({}, None)],
    ids=["nemo-gym-telemetry-on", "off"],
)
def test_detector_otel_service_name_group_only_with_nemo_gym_telemetry(
    telemetry: dict[str, str], expected: str | None
) -> None:
    """``OTEL_SERVICE_NAME`` is NeMo Gym's service group only where its telemetry is on."""
    environ = server_environment(
        gym_config(), "policy_model", OTEL_SERVICE_NAME="rl-fleet", **telemetry
    )
    attributes = process_attributes(environ, ["app.py"])
    named = {"service.name": expected} if expected is not None else {}
    rest = {k: v for k, v in POLICY_MODEL.items() if k != "service.name"}
    assert per_process(attributes) == {**rest, **named, "nemo.gym.service_group": "rl-fleet"}


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"NEMO_GYM_OTEL_RUN_ID": "a1", "NEMO_LENS_RUN_ID": "b2", "SLURM_JOB_ID": "3"}, "a1"),
        ({"NEMO_LENS_RUN_ID": "b2", "SLURM_JOB_ID": "3"}, "b2"),
        ({"SLURM_JOB_ID": "3"}, "3"),
        ({"NEMO_GYM_OTEL_RUN_ID": "  "}, None),
    ],
    ids=["nemo-gym", "nemo-lens", "slurm", "blank"],
)
def test_detector_server_run_id_from_environment(
    variables: dict[str, str], expected: str | None
) -> None:
    """A server's run id: NeMo Gym's variable, then nemo-lens's, then Slurm's job; else none."""
    attributes = process_attributes(
        server_environment(gym_config(), "policy_model", **variables), ["app.py"]
    )
    run = {"nemo.run.id": expected} if expected is not None else {}
    assert per_process(attributes) == {**POLICY_MODEL, **run}


def test_detector_ray_worker_keeps_inherited_run_id() -> None:
    """A Ray worker started inside a run reports that run; its name stays Ray's."""
    environ = server_environment(gym_config(), "policy_model", NEMO_GYM_OTEL_RUN_ID="a1")
    attributes = process_attributes(environ, ray_worker_argv(), [])
    assert per_process(attributes) == {**RAY_WORKER, "nemo.run.id": "a1"}


def test_detector_configured_instance_id_not_overridden() -> None:
    """A ``service.instance.id`` in ``OTEL_RESOURCE_ATTRIBUTES``: the detector sets none."""
    environ = {"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=mine"}
    assert process_attributes(environ, ["app.py"]) == {
        "process.pid": os.getpid(),
        "process.parent_pid": os.getppid(),
    }


def test_detect_changes_nothing_in_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``detect()`` twice in NeMo Gym's command line (where a run begins) leaves
    ``os.environ`` exactly as it was, and names the same run both times."""
    monkeypatch.setenv("NEMO_GYM_OTEL_RUN_ID", "to be removed")
    monkeypatch.delenv("NEMO_GYM_OTEL_RUN_ID")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr("sys.argv", ["/venv/bin/gym", "env", "start"])
    before = dict(os.environ)
    first = NemoGymResourceDetector().detect().attributes["nemo.run.id"]
    second = NemoGymResourceDetector().detect().attributes["nemo.run.id"]
    assert dict(os.environ) == before
    assert first == second
    monkeypatch.setattr("sys.argv", ["/srv/app.py"])
    assert "nemo.run.id" not in NemoGymResourceDetector().detect().attributes
    assert dict(os.environ) == before


def test_instrument_cli_hands_its_run_to_a_child_process(
    instrumentor: NemoGymInstrumentor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In NeMo Gym's command line ``instrument()`` begins the run: a child process started
    afterwards reports the same ``nemo.run.id`` as this process's resource."""
    monkeypatch.setenv("NEMO_GYM_OTEL_RUN_ID", "to be removed")
    monkeypatch.delenv("NEMO_GYM_OTEL_RUN_ID")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr("sys.argv", ["/venv/bin/gym", "env", "start"])
    instrumentor.instrument(connection_pool=False, sandbox_resources=False, pressure=False)
    child = subprocess.run(
        [sys.executable, "-c", CHILD_RUN_ID],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    ours = NemoGymResourceDetector().detect().attributes["nemo.run.id"]
    assert child.stdout.strip() == ours
    assert os.environ["NEMO_GYM_OTEL_RUN_ID"] == ours


# A child of the command line (a NeMo Gym server would be one): its resource's run id.
CHILD_RUN_ID = (
    "from opentelemetry.instrumentation.nemo_gym.resource_detector import "
    "NemoGymResourceDetector as D; print(D().detect().attributes.get('nemo.run.id'))"
)
