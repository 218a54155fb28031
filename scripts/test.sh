#!/usr/bin/env bash
# Run the test suite in a project virtualenv, creating it and installing the package with its
# test extra first, and the nemo-gym wheel (nemo_gym.sandbox only). Arguments go to pytest.
#   VENV=.venv (default)        the virtualenv to use or create
#   PYTHON=python3 (default)    the interpreter that creates it, e.g. PYTHON=python3.13
#                               VENV=.venv-py313 (pyenv's interpreters are found too)
#   AIOHTTP_SPEC='aiohttp==3.10.11'   pin aiohttp in that virtualenv (CI's lowest-version run)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip-install.sh  # pip_install: constraints.txt's releases; pip's reason on failure
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
if ! "$python" -c '' 2>/dev/null; then
  # pyenv's versions need not be on PATH (or its shim refuses one that is not selected):
  # python3.13 -> ~/.pyenv/versions/3.13.*/bin/python3.13
  found="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"${python#python}"*/bin/"$python" 2>/dev/null | sort -V | tail -n 1)"
  python="${found:?no $python on PATH or in pyenv}"
fi
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  # A bare Debian or Ubuntu has no ensurepip: venv then fails, or leaves a venv without pip.
  "$python" -m venv --clear "$venv" || {
    echo "could not create $venv: on Debian or Ubuntu, install python3-venv first" \
      "(sudo apt-get install python3-venv)" >&2
    exit 1
  }
fi
# A current pip first (a venv starts with its Python's: 23.2 in 3.11.7), then everything with
# constraints.txt's OpenTelemetry releases: without them pip gives up with ResolutionImpossible
# whenever the registry holds contrib packages a release apart.
pip_install "$venv/bin/python" --upgrade pip
pip_install "$venv/bin/python" -e '.[test]' ${AIOHTTP_SPEC:+"$AIOHTTP_SPEC"}
# The pressure extra's process metrics, at the release of the opentelemetry-instrumentation just
# installed (pyproject.toml's test extra says why it is not listed there).
pip_install "$venv/bin/python" \
  "opentelemetry-instrumentation-system-metrics==$("$venv/bin/python" -c \
    'import importlib.metadata as m; print(m.version("opentelemetry-instrumentation"))')"
# NeMo Gym's sandbox API, which the tests run our hook and providers against
# (last: pip's check after a later install would list the wheel's missing dependencies). The wheel
# asks for Python 3.12 and a heavy stack, but its nemo_gym.sandbox package needs only the standard
# library, so it is installed alone (tests needing more use scripts/nemo-gym-server-env.sh).
pip_install "$venv/bin/python" --no-deps --ignore-requires-python 'nemo-gym==0.4.0'
"$venv/bin/python" -c 'import aiohttp, sys; print(f"aiohttp {aiohttp.__version__}, python {sys.version.split()[0]}")'
# Each sandbox isolated by bubblewrap holds six descriptors in this process (docs/sandboxes.md),
# and one test opens 200 at once: take the soft descriptor limit up to the hard one (a login's
# soft limit is often 1024, its hard limit far above).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
exec "$venv/bin/python" -m pytest "$@"
