#!/usr/bin/env bash
# The main job: install the package into .venv (created if missing) and run the quickstart.
# Installs what the quickstart runs, no more: a current pip, then the package (not its test
# extra), with the OpenTelemetry releases of constraints.txt. Arguments go to
# examples/quickstart.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip-install.sh
venv="${VENV:-.venv}"
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  # A bare Debian or Ubuntu has no ensurepip: venv then fails, or leaves a venv without pip.
  python3 -m venv --clear "$venv" || {
    echo "could not create $venv: on Debian or Ubuntu, install python3-venv first" \
      "(sudo apt-get install python3-venv)" >&2
    exit 1
  }
fi
# A venv's own pip is as old as its Python (23.2 in 3.11.7): take a current one first.
pip_install "$venv/bin/python" --upgrade pip
pip_install "$venv/bin/python" -e .
exec "$venv/bin/python" examples/quickstart.py "$@"
