#!/usr/bin/env bash
# Run the test suite in a project virtualenv, creating it and installing the package with its
# test extra first, and the nemo-gym wheel (nemo_gym.sandbox only). Arguments go to pytest.
#   VENV=.venv (default)        the virtualenv to use or create
#   AIOHTTP_SPEC='aiohttp==3.10.11'   pin aiohttp in that virtualenv (CI's lowest-version run)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test]' ${AIOHTTP_SPEC:+"$AIOHTTP_SPEC"}
# NeMo Gym's sandbox API, which the tests run our hook and providers against. The wheel asks
# for Python 3.12 and a heavy stack, but its nemo_gym.sandbox package needs only the standard
# library, so it is installed alone (tests needing more use scripts/nemo-gym-server-env.sh).
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python 'nemo-gym==0.4.0'
"$venv/bin/python" -c 'import aiohttp, sys; print(f"aiohttp {aiohttp.__version__}, python {sys.version.split()[0]}")'
exec "$venv/bin/python" -m pytest "$@"
