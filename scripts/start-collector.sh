#!/usr/bin/env bash
# Build and start an OpenTelemetry Collector on loopback: the one the docs export to
# (docs/nemo-gym-deployment.md) and the OTLP tests send to.
#
# Idempotent, like scripts/start-podman.sh: builds the collector from scripts/collector/
# (main.go, go.mod, go.sum: the collector's own Go modules, no downloaded binary) with the
# machine's Go once, into a cache folder outside the repository keyed by a hash of those
# inputs and the Go version; starts it unless the one it started earlier from the same state
# folder still answers. It listens on the standard ports (OTLP/HTTP 4318, OTLP/gRPC 4317, its
# Prometheus exporter on 8889) where they are free, says so, and takes a free port for each one
# that is not. Logs go to stderr. Stdout is, as its last two lines,
#   COLLECTOR_PROMETHEUS=http://127.0.0.1:<port>/metrics   (the collector's Prometheus exporter)
#   OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:<port>    (OTLP over HTTP)
# or, with --env, only `export KEY=VALUE` lines for a shell to take as they are:
#   eval "$(bash scripts/start-collector.sh --env)"
# `--stop` ends the collector this state folder started, and nothing else: a process counts as
# ours only while it runs the binary recorded at its start, with the start time the kernel
# gave it then (a reused PID has another) and this state folder's configuration.
#
# Environment (all optional; relative paths are taken from the caller's working directory):
#   NEMO_GYM_COLLECTOR_DIR    state folder: config, PID, ports, log
#                             (default /tmp/nemo-gym-collector-<uid>: one per user; it must
#                             belong to you)
#   NEMO_GYM_COLLECTOR_CACHE  build cache (default ${XDG_CACHE_HOME:-~/.cache}/nemo-gym-otel/collector)
#   NEMO_GYM_COLLECTOR_PORTS  the ports to try first, OTLP/HTTP,OTLP/gRPC,Prometheus
#                             (default 4318,4317,8889; 0 means any free port: 0,0,0)
#   GO                        the Go to build with (default /usr/local/go/bin/go, else `go`)
set -euo pipefail

log() { echo "start-collector: $*" >&2; }
usage() { log "usage: start-collector.sh [--env | --stop]"; }

mode=lines
case "${1:-}" in
  "") ;;
  --env) mode=env ;;
  --stop) mode=stop ;;
  *) log "unknown argument: $1"; usage; exit 2 ;;
esac
if [ $# -gt 1 ]; then
  log "one argument at most, got: $*"; usage; exit 2
fi

uid="$(id -u)"
state_dir="${NEMO_GYM_COLLECTOR_DIR:-/tmp/nemo-gym-collector-$uid}"
cache="${NEMO_GYM_COLLECTOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-gym-otel/collector}"
preferred_ports="${NEMO_GYM_COLLECTOR_PORTS:-4318,4317,8889}"

if [ "$mode" = stop ] && [ ! -d "$state_dir" ]; then
  log "no state folder $state_dir: no collector started from it"
  exit 0
fi
# Absolute and without symlinks, so that the paths recorded at a start compare equal to what
# /proc shows later (a symlinked cache must not make a healthy collector look stale), and the
# collector, which runs in its state folder, gets absolute paths.
mkdir -p -m 700 "$state_dir"
STATE_DIR="$(cd "$state_dir" && pwd -P)"
if [ "$(stat -c %u "$STATE_DIR")" != "$uid" ]; then
  log "the state folder $STATE_DIR belongs to uid $(stat -c %u "$STATE_DIR"), not to you (uid $uid);" \
    "set NEMO_GYM_COLLECTOR_DIR to a folder of your own"
  exit 1
fi
PID_FILE="$STATE_DIR/collector.pid"
IDENTITY_FILE="$STATE_DIR/collector.identity"
PORTS_FILE="$STATE_DIR/ports.env"
CONFIG_ARG="file:$STATE_DIR/config.yaml"

# One invocation at a time: two tests (or two shells) starting it at once get one collector.
exec 9>"$STATE_DIR/lock"
flock 9

# Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot. It does not
# change across exec, and a later process that reuses the PID has another.
start_time() {
  local stat fields
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  # Field 2 (the command name, in parentheses) may hold spaces: count from the last ')'.
  read -r -a fields <<<"${stat##*) }"
  echo "${fields[19]}"
}

# Whether the process runs (a zombie no longer does: it only waits for its parent to reap it).
alive() {
  local stat state
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  read -r state _ <<<"${stat##*) }"
  [ "$state" != Z ] && [ "$state" != X ]
}

identity() { sed -n "s/^$1=//p" "$IDENTITY_FILE" 2>/dev/null | head -n 1; }

# The PID of the collector this state folder started, printed when it still runs; fails
# otherwise. Every check must hold: a PID file edited by hand or copied from another state
# folder, a reused PID, or another program whose command line mentions ours is not ours.
our_collector() {
  local pid exe arg
  pid="$(cat "$PID_FILE" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[1-9][0-9]*$ ]] || return 1
  [ "$(identity PID)" = "$pid" ] || return 1
  [ "$(identity CONFIG)" = "$CONFIG_ARG" ] || return 1
  [ "$(start_time "$pid")" = "$(identity START_TIME)" ] || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
  # A binary removed from the cache while it runs shows as "<path> (deleted)".
  [ "${exe% (deleted)}" = "$(identity EXE)" ] || return 1
  while IFS= read -r -d '' arg; do
    if [ "$arg" = "$CONFIG_ARG" ]; then
      echo "$pid"
      return 0
    fi
  done <"/proc/$pid/cmdline"
  return 1
}

# Ends our collector: SIGTERM, then SIGKILL if it still runs after 10 s.
end_collector() {
  local pid="$1"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    alive "$pid" || break
    sleep 0.1
  done
  if our_collector >/dev/null; then
    log "pid $pid still runs after 10 s; sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
  fi
}

if [ "$mode" = stop ]; then
  if pid="$(our_collector)"; then
    end_collector "$pid"
    log "stopped the collector (pid $pid)"
  else
    log "no collector started from $STATE_DIR is running"
  fi
  rm -f "$PID_FILE" "$IDENTITY_FILE" "$PORTS_FILE"
  exit 0
fi

if ! [[ "$preferred_ports" =~ ^[0-9]{1,5},[0-9]{1,5},[0-9]{1,5}$ ]]; then
  log "NEMO_GYM_COLLECTOR_PORTS=$preferred_ports: expected three ports," \
    "OTLP/HTTP,OTLP/gRPC,Prometheus (e.g. 4318,4317,8889; 0 for any free one)"
  exit 2
fi
for port in ${preferred_ports//,/ }; do
  if [ "$((10#$port))" -gt 65535 ]; then
    log "NEMO_GYM_COLLECTOR_PORTS=$preferred_ports: $port is not a port (0 to 65535)"
    exit 2
  fi
done

SRC="$(cd "$(dirname "$0")/collector" && pwd -P)"

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
mkdir -p "$cache"
CACHE="$(cd "$cache" && pwd -P)"
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
if pid="$(our_collector)"; then
  if [ "$(identity EXE)" != "$BIN" ]; then
    log "pid $pid runs another build ($(identity EXE)); replacing it"
    end_collector "$pid"
  elif ! answers; then
    log "pid $pid does not answer; restarting it"
    end_collector "$pid"
  else
    log "the collector started earlier still answers (pid $pid, log $STATE_DIR/collector.log)"
  fi
elif [ -s "$PID_FILE" ]; then
  log "$PID_FILE names pid $(cat "$PID_FILE"), which is not a collector started from" \
    "$STATE_DIR (ended, or not ours): leaving it alone and starting one"
fi
if ! our_collector >/dev/null; then
  rm -f "$PID_FILE" "$IDENTITY_FILE" "$PORTS_FILE"
  # The preferred ports that nobody listens on, and free ones for the rest and for the
  # collector's own metrics; each held until all are chosen, then released for the collector
  # to bind. SO_REUSEADDR, as the collector binds: a connection in TIME_WAIT does not hold a
  # port, a listener does.
  read -r otlp_http otlp_grpc prom self <<<"$(python3 - "${preferred_ports//,/ }" <<'PY'
import socket
import sys

held = []
for wanted in [int(port) for port in sys.argv[1].split()] + [0]:
    probe = socket.socket()
    if wanted and wanted not in [other.getsockname()[1] for other in held]:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", wanted))
        except OSError:  # someone listens there
            probe.close()
            probe = socket.socket()
    if not probe.getsockname()[1]:
        probe.bind(("127.0.0.1", 0))
    held.append(probe)
print(*(probe.getsockname()[1] for probe in held))
for probe in held:
    probe.close()
PY
)"
  read -r want_http want_grpc want_prom <<<"${preferred_ports//,/ }"
  for pair in "OTLP/HTTP:$want_http:$otlp_http" "OTLP/gRPC:$want_grpc:$otlp_grpc" \
    "Prometheus exporter:$want_prom:$prom"; do
    IFS=: read -r what wanted got <<<"$pair"
    if [ "$wanted" = 0 ]; then
      log "$what on free port $got"
    elif [ "$wanted" = "$got" ]; then
      log "$what on its standard port $got"
    else
      log "$what: port $wanted is taken; on free port $got instead"
    fi
  done
  sed -e "s/@OTLP_HTTP_PORT@/$otlp_http/" -e "s/@OTLP_GRPC_PORT@/$otlp_grpc/" \
    -e "s/@PROMETHEUS_PORT@/$prom/" -e "s/@SELF_METRICS_PORT@/$self/" \
    "$SRC/config.yaml.in" >"$STATE_DIR/config.yaml"
  {
    echo "COLLECTOR_PROMETHEUS=http://127.0.0.1:$prom/metrics"
    echo "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$otlp_http"
    echo "COLLECTOR_SELF_METRICS=http://127.0.0.1:$self/metrics"
    echo "COLLECTOR_OTLP_GRPC=127.0.0.1:$otlp_grpc"
    echo "COLLECTOR_BINARY=$BIN"
  } >"$PORTS_FILE"
  # setsid + nohup: it outlives this script and the CI step that ran it; it runs in its state
  # folder so nothing it writes lands in a checkout. The lock is not inherited (9>&-). Both
  # exec in place (a non-interactive shell's background job leads no process group, so setsid
  # does not fork): $! is the collector's PID.
  (cd "$STATE_DIR" && exec setsid nohup "$BIN" --config "$CONFIG_ARG" \
    >"$STATE_DIR/collector.log" 2>&1 </dev/null 9>&-) &
  pid=$!
  # Its identity is recorded once the exec reached our binary (bounded: 10 s).
  for _ in $(seq 1 200); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$BIN" ] && break
    alive "$pid" || break
    sleep 0.05
  done
  if [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" != "$BIN" ]; then
    log "pid $pid never ran $BIN; its log ($STATE_DIR/collector.log):"
    tail -n 30 "$STATE_DIR/collector.log" >&2 || true
    exit 1
  fi
  {
    echo "PID=$pid"
    echo "START_TIME=$(start_time "$pid")"
    echo "EXE=$BIN"
    echo "CONFIG=$CONFIG_ARG"
  } >"$IDENTITY_FILE"
  echo "$pid" >"$PID_FILE"
  for _ in $(seq 1 100); do
    answers && break
    alive "$pid" || break
    sleep 0.2
  done
  if ! answers; then
    log "the collector did not answer; its log ($STATE_DIR/collector.log):"
    tail -n 30 "$STATE_DIR/collector.log" >&2 || true
    exit 1
  fi
  log "collector started (pid $pid, log $STATE_DIR/collector.log)"
fi

# shellcheck disable=SC1090
. "$PORTS_FILE"
if [ "$mode" = env ]; then
  # The endpoint is OTLP over HTTP, so the protocol goes with it (the SDK's default is gRPC).
  echo "export OTEL_EXPORTER_OTLP_ENDPOINT=$OTEL_EXPORTER_OTLP_ENDPOINT"
  echo "export OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
  echo "export COLLECTOR_PROMETHEUS=$COLLECTOR_PROMETHEUS"
else
  echo "COLLECTOR_PROMETHEUS=$COLLECTOR_PROMETHEUS"
  echo "OTEL_EXPORTER_OTLP_ENDPOINT=$OTEL_EXPORTER_OTLP_ENDPOINT"
fi
