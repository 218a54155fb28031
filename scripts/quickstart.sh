#!/usr/bin/env bash
# The main job: install the package into .venv (created if missing) and run the quickstart.
# Arguments go to examples/quickstart.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  # A bare Debian or Ubuntu has no ensurepip: venv then fails, or leaves a venv without pip.
  python3 -m venv --clear "$venv" || {
    echo "could not create $venv: on Debian or Ubuntu, install python3-venv first" \
      "(sudo apt-get install python3-venv)" >&2
    exit 1
  }
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'
exec "$venv/bin/python" examples/quickstart.py "$@"
