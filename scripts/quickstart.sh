#!/usr/bin/env bash
# The main job: install the package into .venv (created if missing) and run the quickstart.
# Arguments go to examples/quickstart.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]'
exec "$venv/bin/python" examples/quickstart.py "$@"
