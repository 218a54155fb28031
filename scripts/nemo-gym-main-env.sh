#!/usr/bin/env bash
# Build (or reuse) the Python 3.13 virtualenv in which the tests run against NeMo Gym's
# repository main (0.5.1) with all its dependencies and the OpenSandbox SDK: `pytest -m
# nemo_gym_main` and `pytest -m opensandbox` in .ci/run.
#   NEMO_GYM_MAIN_REQUIREMENT   what to install as NeMo Gym main: a pip requirement (default
#                               the upstream commit below), or the path of a .tgz/.tar.gz of the
#                               repository (../shared/nemo-gym/nemo-gym-main-07d6b0d.tgz here)
#   VENV=.venv-nemo-gym-main    the virtualenv to use or create
# Main's requires-python is >=3.13.14 and pyenv here has 3.13.0, so it is installed with
# --ignore-requires-python. The heavy part (NeMo Gym with ray, mlflow, wandb, ... and this
# project's test dependencies, about 3-4 minutes on 2 cores) is built once per machine, keyed
# by the interpreter and the requirement (a file by its content), in
#   ${NEMO_GYM_OTEL_CACHE:-~/.cache/nemo-gym-otel}/main-<key>/venv
# and never changed afterwards. $VENV is a light virtualenv of the same interpreter that sees
# that one's packages through a .pth file and holds this checkout's editable install, so
# several checkouts share the cache without pointing it at each other. Prints $VENV last.
set -euo pipefail
requirement="${NEMO_GYM_MAIN_REQUIREMENT:-nemo-gym @ git+https://github.com/NVIDIA-NeMo/Gym@07d6b0d}"
archive=""
case "$requirement" in
  *.tgz | *.tar.gz)
    # A relative archive path means the caller's directory, not the repository root.
    archive="$(realpath -e -- "$requirement" 2>/dev/null)" || {
      echo "NEMO_GYM_MAIN_REQUIREMENT=$requirement: no such archive" >&2
      exit 2
    }
    ;;
esac
cd "$(dirname "$0")/.."
venv="${VENV:-.venv-nemo-gym-main}"

python=python3.13
if ! "$python" -c '' 2>/dev/null; then
  # As scripts/test.sh finds pyenv's interpreters (they need not be on PATH).
  found="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 2>/dev/null | sort -V | tail -n 1)"
  python="${found:?no python3.13 on PATH or in pyenv (pyenv install 3.13)}"
fi
python="$(realpath -e "$(command -v "$python")")"

# An archive by its content, anything else by the requirement's text.
if [ -n "$archive" ]; then
  source_id="archive sha256=$(sha256sum "$archive" | cut -d' ' -f1)"
else
  source_id="requirement=$requirement"
fi
# The key: what the shared virtualenv holds. Bump recipe when the installation below changes.
recipe=1
# constraints.txt (the OpenTelemetry releases every install here takes) is part of the key too.
constraints_id="constraints sha256=$(sha256sum constraints.txt | cut -d' ' -f1)"
key="$(echo "recipe=$recipe python=$python $("$python" -VV) $source_id $constraints_id" | sha256sum | cut -c1-12)"
cache="${NEMO_GYM_OTEL_CACHE:-$HOME/.cache/nemo-gym-otel}"
base_dir="$cache/main-$key"
base="$base_dir/venv"
pip_flags=(-q --disable-pip-version-check --ignore-requires-python -c constraints.txt)

mkdir -p "$cache"
# One builder at a time per key (two checkouts or CI runs on one machine).
exec {lock}>"$base_dir.lock"
flock "$lock"
if [ ! -f "$base_dir/complete" ]; then
  rm -rf "$base_dir"
  mkdir -p "$base_dir"
  "$python" -m venv "$base"
  "$base/bin/python" -m pip install "${pip_flags[@]}" --upgrade pip
  if [ -n "$archive" ]; then
    # The archive is the repository without .git: setuptools-scm is told the version.
    src="$base_dir/src"
    mkdir -p "$src"
    tar -xzf "$archive" -C "$src"
    SETUPTOOLS_SCM_PRETEND_VERSION=0.5.1 "$base/bin/python" -m pip install "${pip_flags[@]}" "$src" -e '.[test]'
    rm -rf "$src"
  else
    "$base/bin/python" -m pip install "${pip_flags[@]}" "$requirement" -e '.[test]'
  fi
  # The shared virtualenv keeps this project's dependencies, resolved together with NeMo Gym's,
  # but not this checkout: each $VENV installs its own.
  "$base/bin/python" -m pip uninstall -q -y opentelemetry-instrumentation-nemo-gym
  "$base/bin/python" -c 'import nemo_gym.server_utils, nemo_gym.sandbox.providers.docker' >/dev/null
  touch "$base_dir/complete"
fi
flock -u "$lock"

if [ "$(cat "$venv/nemo-gym-main-base" 2>/dev/null)" != "$base" ]; then
  "$python" -m venv --clear "$venv"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  # addsitedir, not a bare path: the shared site-packages' own .pth files are read too.
  echo "import site; site.addsitedir('$base_site')" >"$site/nemo_gym_main_base.pth"
  # The shared virtualenv's console scripts (opentelemetry-instrument, gym, ray, ...) run its
  # own interpreter, which does not see this checkout: write them again for this one.
  "$venv/bin/python" - "$venv/bin" <<'PY'
import importlib.metadata
import os
import sys

bin_dir = sys.argv[1]
for entry in importlib.metadata.entry_points(group="console_scripts"):
    path = os.path.join(bin_dir, entry.name)
    if os.path.exists(path):
        continue
    with open(path, "w") as script:
        script.write(
            f"#!{sys.executable}\nimport sys\n"
            f"from {entry.module} import {entry.attr.split('.')[0]}\n"
            f"sys.exit({entry.attr}())\n"
        )
    os.chmod(path, 0o755)
PY
  echo "$base" >"$venv/nemo-gym-main-base"
fi
# Dependencies the shared virtualenv already has are satisfied from it; what this checkout's
# pyproject.toml added since is installed here.
"$venv/bin/python" -m pip install "${pip_flags[@]}" -e '.[test]'
# NeMo Gym's opensandbox provider needs its `sandbox` extra's OpenSandbox SDK (and tenacity);
# the rest of that extra (daytona, ...) is not needed here. Installed in $VENV, beside the
# shared virtualenv, so that one stays as its key says.
"$venv/bin/python" -m pip install "${pip_flags[@]}" 'opensandbox==1.1.1' 'tenacity>=9.1.4'
"$venv/bin/python" -c 'import nemo_gym, sys; print(f"nemo_gym {nemo_gym.__version__}, python {sys.version.split()[0]}")' >&2
echo "$venv"
