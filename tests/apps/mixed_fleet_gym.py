"""NeMo Gym's command line starting one server twice: under this plugin and as a newer NeMo
Gym server with its own telemetry. Prints its own resource and each server's, one JSON line
each (``{"process": ..., "resource": ...}``).

Copied to a file named ``gym`` and run under ``opentelemetry-instrument`` by
``tests/test_names_mixed_fleet.py``. Like ``gym env start`` it hands each server its
environment, ``NEMO_GYM_CONFIG_DICT`` (``SERVER_CONFIG_YAML``) and ``NEMO_GYM_CONFIG_PATH``;
the newer server's venv has NeMo Gym's telemetry (``NEWER_NEMO_GYM_PATH``) and not this
plugin, so it runs without ``opentelemetry-instrument``'s start-up hook and its detectors.
The two servers' scripts are ``OURS_SCRIPT`` and ``NEWER_SCRIPT``.
"""

import json
import os
import subprocess
import sys

from opentelemetry import metrics

OURS, NEWER = os.environ["OURS_SCRIPT"], os.environ["NEWER_SCRIPT"]


def own_resource() -> dict[str, object]:
    config = getattr(metrics.get_meter_provider(), "_sdk_config", None)
    return dict(config.resource.attributes) if config is not None else {}


def run(script: str, environ: dict[str, str]) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, script], env=environ, capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        raise SystemExit(f"{script} failed: {result.stderr}")
    line = next(line for line in result.stdout.splitlines() if line.startswith("{"))
    resource: dict[str, object] = json.loads(line)["resource"]
    return resource


server = {
    **os.environ,
    "NEMO_GYM_CONFIG_DICT": os.environ["SERVER_CONFIG_YAML"],
    "NEMO_GYM_CONFIG_PATH": "policy_model",
}
newer = {
    key: value
    for key, value in server.items()
    if key not in ("PYTHONPATH", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS")
}
newer["PYTHONPATH"] = os.environ["NEWER_NEMO_GYM_PATH"]
print(json.dumps({"process": "gym", "resource": own_resource()}))
print(json.dumps({"process": "ours", "resource": run(OURS, server)}))
print(json.dumps({"process": "newer", "resource": run(NEWER, newer)}))
