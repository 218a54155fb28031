#!/usr/bin/env bash
# Build the separate virtualenv in which tests/test_nemo_gym_server_client.py runs: NeMo Gym's
# server_utils (its global aiohttp client and ServerClient) imports far more than the standard
# library (about 600 MB: ray, wandb, mlflow-skinny, ...), so the main suite's .venv stays light
# and these tests get their own environment. Idempotent; prints the environment's python last.
#   VENV=.venv-nemo-gym-server (default)   the virtualenv to use or create
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv-nemo-gym-server}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt)
"${pip[@]}" --upgrade pip  # the venv's own pip gives up on the test extra (scripts/test.sh)
"${pip[@]}" -e '.[test]'
# The wheel declares Python >= 3.12 and pins its whole stack; its server_utils imports resolve
# on 3.11 with these, so the wheel itself is installed without its declared dependencies.
"${pip[@]}" --no-deps --ignore-requires-python 'nemo-gym==0.4.0'
# devtools and tqdm: nemo_gym.cli.env, which `nemo-gym-otel server-venvs` reads the configuration
# through (tests/test_server_venvs_config.py).
"${pip[@]}" orjson ray requests uvicorn fastapi omegaconf hydra-core pydantic yappi gprof2dot \
  pydot psutil wandb mlflow-skinny openai itsdangerous rich devtools tqdm
"$venv/bin/python" -c 'import nemo_gym.server_utils, nemo_gym.cli.env' >/dev/null
echo "$venv/bin/python"
