#!/usr/bin/env bash
# Build (or reuse) the Python 3.12 virtualenv in which tests/test_nemo_gym_deployment.py runs a
# real NeMo Gym deployment, as a user installs it: nemo-gym 0.4.0 with ALL its declared
# dependencies (ray[default], fastapi, uvicorn, openai, wandb, ...; they bring the OpenTelemetry
# SDK and the OTLP and Prometheus exporters), uv from PyPI (`gym env start` builds each
# server's virtualenv with it) and opentelemetry-distro (for opentelemetry-instrument).
# The registry packages are cached outside the repository, keyed by what is installed, so a
# rerun on the same machine takes seconds:
#   ${NEMO_GYM_OTEL_CACHE:-~/.cache/nemo-gym-otel}/deploy-<key>/venv
# This checkout's package is (re)installed into it, editable and without dependencies, on every
# call. Prints the virtualenv's directory last.
set -euo pipefail
cd "$(dirname "$0")/.."
nemo_gym_spec='nemo-gym==0.4.0'
python_version='3.12.1'
python="${PYENV_ROOT:-$HOME/.pyenv}/versions/$python_version/bin/python3.12"
[ -x "$python" ] || { echo "no Python $python_version at $python (pyenv install $python_version)" >&2; exit 1; }
cache="${NEMO_GYM_OTEL_CACHE:-$HOME/.cache/nemo-gym-otel}"
# The key: what is installed. Bump recipe when the installation below changes.
recipe=2
key="$(echo "recipe=$recipe python=$python_version $nemo_gym_spec uv opentelemetry-distro" | sha256sum | cut -c1-12)"
env_dir="$cache/deploy-$key"
venv="$env_dir/venv"
if [ ! -f "$env_dir/complete" ]; then
  rm -rf "$env_dir"
  mkdir -p "$env_dir"
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" "$nemo_gym_spec" uv opentelemetry-distro
  "$venv/bin/python" -c 'import nemo_gym.server_utils, nemo_gym.cli' >/dev/null
  touch "$env_dir/complete"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
echo "$venv"
