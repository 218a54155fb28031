#!/usr/bin/env bash
# Build the virtualenv of tests/test_ray_cluster.py: the package with its test extra, Ray
# (`ray[default]`, the release NeMo Gym 0.4.0 asks for or newer: a test dependency, never a
# runtime one) and the OTLP/HTTP exporter its workers export with. Idempotent; prints the
# environment's python last.
#   VENV=.venv-ray (default)   the virtualenv to use or create
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv-ray}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt)
"${pip[@]}" --upgrade pip  # the venv's own pip gives up on the test extra (scripts/test.sh)
"${pip[@]}" -e '.[test]'
# Ray and the OTLP exporter ask for the newest OpenTelemetry packages, and pip's resolver then
# backtracks over opentelemetry-* releases that were never published together and gives up;
# they are installed with the OpenTelemetry releases the first step chose held fixed.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$venv/bin/python" -m pip freeze --disable-pip-version-check |
  grep -i '^opentelemetry-' | grep -vi 'nemo' >"$constraints"
"${pip[@]}" -c "$constraints" 'ray[default] >= 2.55.1' opentelemetry-exporter-otlp-proto-http
"$venv/bin/python" -c 'import ray, opentelemetry.exporter.otlp.proto.http, opentelemetry.proto'
echo "$venv/bin/python"
