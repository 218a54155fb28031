#!/usr/bin/env bash
# Build and start the OpenTelemetry Collector that the OTLP tests send to.
#
# Idempotent, like scripts/start-podman.sh: builds the collector from scripts/collector/
# (main.go, go.mod, go.sum: the collector's own Go modules, no downloaded binary) with the
# machine's Go once, into a cache folder outside the repository keyed by a hash of those
# inputs and the Go version; starts it on free loopback ports unless the one it started
# earlier still answers; and prints, as its last two lines,
#   COLLECTOR_PROMETHEUS=http://127.0.0.1:<port>/metrics   (the collector's Prometheus exporter)
#   OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:<port>    (OTLP over HTTP)
# `--stop` ends the collector this script started, by the PID it recorded, and nothing else.
#
# Environment (all optional):
#   NEMO_GYM_COLLECTOR_DIR    state folder: config, PID, ports, log (default /tmp/nemo-gym-collector)
#   NEMO_GYM_COLLECTOR_CACHE  build cache   (default ${XDG_CACHE_HOME:-~/.cache}/nemo-gym-otel/collector)
#   GO                        the Go to build with (default /usr/local/go/bin/go, else `go`)
#
# Usage:  eval "export $(scripts/start-collector.sh | tail -n 2 | tr '\n' ' ')"
set -euo pipefail

SRC="$(cd "$(dirname "$0")/collector" && pwd)"
STATE_DIR="${NEMO_GYM_COLLECTOR_DIR:-/tmp/nemo-gym-collector}"
CACHE="${NEMO_GYM_COLLECTOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-gym-otel/collector}"
PID_FILE="$STATE_DIR/collector.pid"
PORTS_FILE="$STATE_DIR/ports.env"

log() { echo "start-collector: $*" >&2; }

mkdir -p "$STATE_DIR"
# One invocation at a time: two tests (or two engineers) starting it at once get one collector.
exec 9>"$STATE_DIR/lock"
flock 9

recorded_pid() { [ -f "$PID_FILE" ] && cat "$PID_FILE" || true; }
# The recorded PID is ours only while it still runs our binary (PIDs are reused).
ours_running() {
  local pid
  pid="$(recorded_pid)"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "nemo-gym-otelcol"
}

if [ "${1:-}" = "--stop" ]; then
  if ours_running; then
    pid="$(recorded_pid)"
    kill "$pid"
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid still runs after 10 s; sending SIGKILL"
      kill -9 "$pid" 2>/dev/null || true
    fi
    log "stopped the collector (pid $pid)"
  else
    log "no collector started by this script is running"
  fi
  rm -f "$PID_FILE" "$PORTS_FILE"
  exit 0
fi
if [ -n "${1:-}" ]; then
  log "unknown argument: $1 (the only option is --stop)"
  exit 2
fi

# 1. Go: the collector's modules need a newer Go than Debian's.
go_bin="${GO:-}"
if [ -z "$go_bin" ]; then
  if [ -x /usr/local/go/bin/go ]; then go_bin=/usr/local/go/bin/go; else go_bin="$(command -v go || true)"; fi
fi
if [ -z "$go_bin" ] || ! "$go_bin" version >/dev/null 2>&1; then
  log "no Go found (set GO=/path/to/go; the collector modules need go >= $(sed -n 's/^go //p' "$SRC/go.mod"))"
  exit 1
fi

# 2. The binary, built once per set of build inputs.
key="$( (cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go"; "$go_bin" version) | sha256sum | cut -c1-16)"
BIN="$CACHE/$key/nemo-gym-otelcol"
if [ ! -x "$BIN" ]; then
  log "building the collector with $("$go_bin" version) into $BIN (a few minutes the first time)"
  mkdir -p "$CACHE/$key"
  started=$SECONDS
  # -mod=readonly: go.sum in the repository is the pin; a build never rewrites it.
  (cd "$SRC" && GOTOOLCHAIN=local GOFLAGS=-mod=readonly CGO_ENABLED=0 \
    nice -n 10 "$go_bin" build -trimpath -o "$BIN.tmp.$$" .) >&2
  mv "$BIN.tmp.$$" "$BIN"
  log "built in $((SECONDS - started)) s"
fi

# 3. The collector, unless the one started earlier still answers.
answers() {
  # shellcheck disable=SC1090
  [ -f "$PORTS_FILE" ] && . "$PORTS_FILE" &&
    curl -fsS --max-time 2 "$COLLECTOR_PROMETHEUS" >/dev/null 2>&1 &&
    # OTLP/HTTP answers a GET on its path with 405: the receiver is up.
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$OTEL_EXPORTER_OTLP_ENDPOINT/v1/metrics")" = 405 ]
}
if ! ours_running || ! answers; then
  if ours_running; then
    log "pid $(recorded_pid) runs but does not answer; restarting it"
    kill "$(recorded_pid)" 2>/dev/null || true
    sleep 1
  fi
  # Four free loopback ports, held by nobody once this returns (the collector binds them next).
  read -r otlp_http otlp_grpc prom self <<<"$(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
for s in socks:
    s.close()
PY
)"
  sed -e "s/@OTLP_HTTP_PORT@/$otlp_http/" -e "s/@OTLP_GRPC_PORT@/$otlp_grpc/" \
    -e "s/@PROMETHEUS_PORT@/$prom/" -e "s/@SELF_METRICS_PORT@/$self/" \
    "$SRC/config.yaml.in" >"$STATE_DIR/config.yaml"
  {
    echo "COLLECTOR_PROMETHEUS=http://127.0.0.1:$prom/metrics"
    echo "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$otlp_http"
    echo "COLLECTOR_SELF_METRICS=http://127.0.0.1:$self/metrics"
    echo "COLLECTOR_OTLP_GRPC=127.0.0.1:$otlp_grpc"
  } >"$PORTS_FILE"
  # setsid + nohup: it outlives this script and the CI step that ran it; it runs in its state
  # folder so nothing it writes lands in a checkout. The lock is not inherited (9>&-).
  (cd "$STATE_DIR" && exec setsid nohup "$BIN" --config "file:$STATE_DIR/config.yaml" \
    >"$STATE_DIR/collector.log" 2>&1 </dev/null 9>&-) &
  echo $! >"$PID_FILE"
  for _ in $(seq 1 100); do
    answers && break
    kill -0 "$(recorded_pid)" 2>/dev/null || break
    sleep 0.2
  done
  if ! answers; then
    log "the collector did not answer; its log ($STATE_DIR/collector.log):"
    tail -n 30 "$STATE_DIR/collector.log" >&2 || true
    exit 1
  fi
  log "collector started (pid $(recorded_pid), log $STATE_DIR/collector.log)"
fi

# shellcheck disable=SC1090
. "$PORTS_FILE"
echo "COLLECTOR_PROMETHEUS=$COLLECTOR_PROMETHEUS"
echo "OTEL_EXPORTER_OTLP_ENDPOINT=$OTEL_EXPORTER_OTLP_ENDPOINT"
