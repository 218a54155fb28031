#!/usr/bin/env bash
# aiohttp's own client and connector tests, and contrib's aiohttp-client instrumentation tests,
# each run twice: plain, and with NemoGymInstrumentor instrumented and exporting (SDK meter and
# tracer providers with an in-memory reader and exporter). Fails when any test's outcome
# (passed, failed, error, skipped, xfailed, xpassed) differs between the two runs.
#
#   bash scripts/aiohttp-suite.sh [AIOHTTP_VERSION...]     (default: 3.10.11 3.14.5)
#
# Per aiohttp version: aiohttp's source package from PyPI (its tests are not in the wheel),
# unpacked in .aiohttp-suite/<version>/; a virtualenv .venv-aiohttp-suite-<version> with that
# aiohttp (the wheel), this checkout, the test tools the selected files need at the versions of
# the sdist's requirements/test.txt, pytest-timeout, and contrib's aiohttp-client
# instrumentation with its source package's tests (constraints.txt's release). Both runs use
# aiohttp's own conftest and pytest configuration; its addopts (xdist, coverage, doctests) are
# replaced by the same options in both modes. The plugins are in scripts/aiohttp_suite/:
# _suite_outcomes.py records each test's outcome (both runs), _suite_instrumented.py
# instruments (second run only, with -p) and also times the BaseConnector(...) pools aiohttp's
# tests build (see its docstring), and compare_outcomes.py compares, reruns the modules of
# differing tests twice in each mode (a flake is reported, not failed), and checks that the
# instrumented run did go through the timed connector.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/pip-install.sh
root="$PWD"
read -r -a versions <<<"${*:-3.10.11 3.14.5}"
contrib_version="$(sed -n 's/^opentelemetry-instrumentation-aiohttp-client==//p' constraints.txt)"
python="${PYTHON:-python3}"
# The client and connector test files (aiohttp 3.14.5 has 16, 3.10.11 14; the benchmarks'
# files are left out: they time, they do not test).
test_globs=(tests/test_client_*.py tests/test_connector.py tests/test_proxy.py
  tests/test_proxy_functional.py tests/test_resolver.py)
# aiohttp's test tools for those files (requirements/test.txt names the ones each release uses,
# pinned; a name it does not list is not installed, except pytest-timeout below). coverage is
# not run: 3.14's pytest.ini filters one of its warnings by class, which pytest must import.
tools=(pytest pytest-mock freezegun trustme proxy-py re-assert blockbuster uvloop isal zlib-ng
  aiodns pycares brotli backports-zstd coverage)
# The same in both modes: aiohttp's own marker selection, a per-test timeout (a test that needs
# the outside network fails or skips instead of hanging), no cache between the runs.
common_args=(-o addopts= -p no:cacheprovider -p _suite_outcomes --strict-markers -ra -q
  -m "not dev_mode and not autobahn and not internal" --timeout=60)
export PYTHONPATH="$root/scripts/aiohttp_suite"
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

status=0
for version in "${versions[@]}"; do
  work="$root/.aiohttp-suite/$version"
  venv="$root/.venv-aiohttp-suite-$version"
  sdist="$work/aiohttp-$version"
  contrib="$work/opentelemetry_instrumentation_aiohttp_client-$contrib_version"
  mkdir -p "$work"
  if [ ! -d "$sdist/tests" ]; then
    "$python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      -d "$work" "aiohttp==$version"
    tar -xzf "$work/aiohttp-$version.tar.gz" -C "$work"
  fi
  if [ ! -d "$contrib/tests" ]; then
    "$python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      -d "$work" "opentelemetry-instrumentation-aiohttp-client==$contrib_version"
    tar -xzf "$work/opentelemetry_instrumentation_aiohttp_client-$contrib_version.tar.gz" -C "$work"
  fi
  # Contrib's source package has no pytest configuration: without one of its own, pytest would
  # take this checkout's pyproject.toml, above it (our filterwarnings, our asyncio options).
  [ -f "$contrib/pytest.ini" ] || printf '[pytest]\n' >"$contrib/pytest.ini"
  # Installed again whenever what it installs changes: this list, the package's requirements,
  # the constraints.
  stamp="$( (printf '%s\n' "$version" "${tools[@]}"; cat pyproject.toml constraints.txt) |
    sha256sum | cut -c1-16)"
  if [ "$(cat "$venv/.aiohttp-suite-installed" 2>/dev/null)" != "$stamp" ]; then
    "$python" -m venv --clear "$venv"
    pip_install "$venv/bin/python" --upgrade pip
    pins="$work/test-tool-pins.txt"
    names=()
    : >"$pins"
    for tool in "${tools[@]}"; do
      line="$(grep -i -m 1 "^$tool==" "$sdist/requirements/test.txt" || true)"
      [ -n "$line" ] || continue
      echo "$line" >>"$pins"
      names+=("$tool")
    done
    grep -qi '^pytest-timeout==' "$pins" || names+=(pytest-timeout)
    pip_install "$venv/bin/python" -c "$pins" -e . "aiohttp==$version" "${names[@]}" \
      opentelemetry-instrumentation-aiohttp-client opentelemetry-test-utils http-server-mock
    echo "$stamp" >"$venv/.aiohttp-suite-installed"
  fi
  "$venv/bin/python" -c \
    'import aiohttp, sys; print(f"aiohttp {aiohttp.__version__}, python {sys.version.split()[0]}")'
  files=()
  for glob in "${test_globs[@]}"; do
    for file in "$sdist"/$glob; do
      case "$file" in *benchmark*) ;; *) [ -f "$file" ] && files+=("${file#"$sdist"/}") ;; esac
    done
  done
  echo "aiohttp $version: ${#files[@]} test files"
  # -P: the sdist's own aiohttp/ folder (pure Python, no extensions) must not shadow the
  # installed package; _suite_outcomes checks that it did not.
  "$venv/bin/python" scripts/aiohttp_suite/compare_outcomes.py --name "aiohttp $version" \
    --python "$venv/bin/python" --cwd "$sdist" --results "$work/aiohttp" \
    -- "${common_args[@]}" -- "${files[@]}" || status=1
  "$venv/bin/python" scripts/aiohttp_suite/compare_outcomes.py \
    --name "contrib aiohttp-client $contrib_version on aiohttp $version" \
    --python "$venv/bin/python" --cwd "$contrib" --results "$work/contrib" --contrib \
    -- "${common_args[@]}" -- tests/ || status=1
done
exit "$status"
