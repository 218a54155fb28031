# Sourced by the scripts that install into a virtualenv (quickstart.sh, test.sh).
#   pip_install PYTHON ARGS...
# runs `PYTHON -m pip install ARGS...` with the repository's constraints.txt (one consistent set
# of OpenTelemetry releases), silent when it works. When it fails it prints the end of pip's
# whole output, where pip says why (the conflicting requirements, the release it could not
# find, the network error), keeps that output in a file, and exits with pip's status: pip's
# `-q` would hide the reason, which it logs at INFO level ("The conflict is caused by: ...").
PIP_CONSTRAINTS="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/constraints.txt"

pip_install() {
  local python="$1" log status=0
  shift
  log="$(mktemp "${TMPDIR:-/tmp}/pip-install.XXXXXX.log")"
  "$python" -m pip install --disable-pip-version-check -c "$PIP_CONSTRAINTS" "$@" >"$log" 2>&1 ||
    status=$?
  if [ "$status" -ne 0 ]; then
    {
      echo "pip install $* failed (exit $status). The end of pip's output (all of it: $log):"
      tail -n 40 "$log"
    } >&2
    exit "$status"
  fi
  rm -f "$log"
}
