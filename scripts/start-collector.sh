#!/usr/bin/env bash
# Build and start an OpenTelemetry Collector on loopback: the one the docs export to
# (docs/nemo-gym-deployment.md) and the OTLP tests send to.
#
# Idempotent, like scripts/start-podman.sh: builds one Go binary with the machine's Go once,
# Jaeger v1.76.0 (scripts/jaeger/: its Go module from the Go module proxy, pinned by go.mod and
# go.sum, no downloaded binary), into a cache folder outside the repository keyed by a hash of
# those inputs and the Go version. Jaeger v2 is a distribution of the OpenTelemetry Collector
# whose binary also holds the components the collector needs (the OTLP receiver, the batch
# processor, the Prometheus and debug exporters, the OTLP exporter), so that one build runs
# both processes: the collector (scripts/collector/config.yaml.in) and, with --jaeger, Jaeger
# (scripts/jaeger/jaeger.yaml.in). It starts the collector unless the one it started earlier
# from the same state folder still answers. It listens on the standard ports (OTLP/HTTP 4318,
# OTLP/gRPC 4317, its Prometheus exporter on 8889) where they are free, says so, and takes a
# free port for each one that is not. Logs go to stderr. Stdout is, as its last two lines,
#   COLLECTOR_PROMETHEUS=http://127.0.0.1:<port>/metrics   (the collector's Prometheus exporter)
#   OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:<port>    (OTLP over HTTP)
# or, with --env, only `export KEY=VALUE` lines for a shell to take as they are:
#   eval "$(bash scripts/start-collector.sh --env)"
# `--jaeger` also starts Jaeger first, a second process of the same binary, on loopback, with an
# in-memory trace store, and the collector sends it every trace it receives (OTLP/gRPC). Its
# query service and UI (http://127.0.0.1:16686 where that port is free) is printed before the
# last two lines as
#   JAEGER_QUERY=http://127.0.0.1:<port>
# and with --env as `export JAEGER_QUERY=...`. A collector started earlier without Jaeger is
# replaced by one that sends to it; without --jaeger, a running collector is kept as it is.
# `--build` only builds the binary (or finds it built) and starts nothing: run it where the Go
# module proxy is reachable when the collector itself is then started in a network that has
# none (docs/nemo-gym-kubernetes.md starts it in the Kubernetes cluster's network namespace);
# a start from the same state folder meanwhile waits for it.
# `--stop` ends the collector (and the Jaeger) this state folder started, and nothing else: a
# process counts as ours only while it runs the binary recorded at its start, with the start
# time the kernel gave it then (a reused PID has another) and this state folder's
# configuration.
#
# Environment (all optional; relative paths are taken from the caller's working directory):
#   NEMO_GYM_COLLECTOR_DIR    state folder: config, PID, ports, log (default
#                             /tmp/nemo-gym-collector-<uid>-<checkout>, <checkout> the first 12
#                             hex digits of the SHA-256 of this checkout's absolute path: one
#                             per user and checkout, so two checkouts never stop each other's
#                             collector; it must belong to you)
#   NEMO_GYM_COLLECTOR_CACHE  the build cache of the one binary (default
#                             ${XDG_CACHE_HOME:-~/.cache}/nemo-gym-otel/collector); the former
#                             NEMO_GYM_JAEGER_CACHE is no longer read (said so on stderr)
#   NEMO_GYM_JAEGER_PORT      the port to try first for Jaeger's query service and UI
#                             (default 16686; 0 means any free port); its other ports are free ones
#   NEMO_GYM_COLLECTOR_PORTS  the ports to try first, OTLP/HTTP,OTLP/gRPC,Prometheus
#                             (default 4318,4317,8889; 0 means any free port: 0,0,0)
#   GO                        the Go to build with (default /usr/local/go/bin/go, else `go`)
set -euo pipefail

log() { echo "start-collector: $*" >&2; }
usage() { log "usage: start-collector.sh [--jaeger] [--env] | --build | --stop"; }

mode=lines
jaeger=no
for argument in "$@"; do
  case "$argument" in
    --env) [ "$mode" = lines ] || { log "--env and --stop exclude each other"; usage; exit 2; }; mode=env ;;
    --stop) [ "$mode" = lines ] || { log "--env and --stop exclude each other"; usage; exit 2; }; mode=stop ;;
    --build) [ "$mode" = lines ] || { log "--build stands alone"; usage; exit 2; }; mode=build ;;
    --jaeger) jaeger=yes ;;
    *) log "unknown argument: $argument"; usage; exit 2 ;;
  esac
done
if [ "$mode" = stop ] && [ "$jaeger" = yes ]; then
  log "--stop stops the Jaeger too; --jaeger has no place beside it"; usage; exit 2
fi
if [ "$mode" = build ] && [ "$jaeger" = yes ]; then
  log "--build builds the one binary that runs Jaeger too; --jaeger has no place beside it"
  usage
  exit 2
fi

uid="$(id -u)"
# The checkout this script belongs to (symlinks resolved: one checkout, one folder, however it
# is reached). Its state folder lives outside it: the collector writes there.
checkout="$(cd "$(dirname "$0")/.." && pwd -P)"
checkout_key="$(printf '%s' "$checkout" | sha256sum | cut -c1-12)"
state_dir="${NEMO_GYM_COLLECTOR_DIR:-/tmp/nemo-gym-collector-$uid-$checkout_key}"
cache="${NEMO_GYM_COLLECTOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-gym-otel/collector}"
preferred_ports="${NEMO_GYM_COLLECTOR_PORTS:-4318,4317,8889}"
preferred_jaeger_port="${NEMO_GYM_JAEGER_PORT:-16686}"

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
PORTS_FILE="$STATE_DIR/ports.env"
JAEGER_FILE="$STATE_DIR/jaeger.env"
# Each process this script starts, by name (collector, jaeger): its PID file, its identity
# file (what it was at its start) and the configuration argument it runs with.
pid_file() { echo "$STATE_DIR/$1.pid"; }
identity_file() { echo "$STATE_DIR/$1.identity"; }
config_arg() {
  if [ "$1" = collector ]; then echo "file:$STATE_DIR/config.yaml"; else echo "file:$STATE_DIR/$1.yaml"; fi
}

# One invocation at a time: two tests (or two shells) starting it at once get one collector.
# One that waits says so on stderr, and every 30 s what the other is doing (PROGRESS_FILE,
# written by build while it builds): `eval "$(... --env)"` shows only stderr meanwhile.
PROGRESS_FILE="$STATE_DIR/progress"
exec 9>"$STATE_DIR/lock"
if ! flock -n 9; then
  other() { cat "$PROGRESS_FILE" 2>/dev/null || echo "starting it"; }
  log "another start of this collector is under way ($(other)); waiting for it"
  waiting_since=$SECONDS
  until flock -w 30 9; do
    log "still waiting after $((SECONDS - waiting_since)) s: the other start is $(other)"
  done
fi

# shellcheck source=scripts/owned-process.sh
source "$checkout/scripts/owned-process.sh"

# identity NAME KEY: what NAME's identity file recorded at its start.
identity() { sed -n "s/^$2=//p" "$(identity_file "$1")" 2>/dev/null | head -n 1; }

# The PID of the process NAME this state folder started, printed when it still runs; fails
# otherwise. Every check must hold: a PID file edited by hand or copied from another state
# folder, a reused PID, or another program whose command line mentions ours is not ours.
our_process() {
  local name="$1" pid exe arg config
  config="$(config_arg "$name")"
  pid="$(cat "$(pid_file "$name")" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[1-9][0-9]*$ ]] || return 1
  [ "$(identity "$name" PID)" = "$pid" ] || return 1
  [ "$(identity "$name" CONFIG)" = "$config" ] || return 1
  [ "$(start_time "$pid")" = "$(identity "$name" START_TIME)" ] || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
  # A binary removed from the cache while it runs shows as "<path> (deleted)".
  [ "${exe% (deleted)}" = "$(identity "$name" EXE)" ] || return 1
  while IFS= read -r -d '' arg; do
    if [ "$arg" = "$config" ]; then
      echo "$pid"
      return 0
    fi
  done <"/proc/$pid/cmdline"
  return 1
}
our_collector() { our_process collector; }

# end_process NAME PID: SIGTERM, then SIGKILL if it is still NAME's after 10 s.
end_process() { end_owned "$2" our_process "$1"; }
end_collector() { end_process collector "$1"; }

if [ "$mode" = stop ]; then
  if pid="$(our_collector)"; then
    end_collector "$pid"
    log "stopped the collector (pid $pid)"
  else
    log "no collector started from $STATE_DIR is running"
  fi
  if pid="$(our_process jaeger)"; then
    end_process jaeger "$pid"
    log "stopped Jaeger (pid $pid)"
  fi
  rm -f "$(pid_file collector)" "$(identity_file collector)" "$PORTS_FILE" \
    "$(pid_file jaeger)" "$(identity_file jaeger)" "$JAEGER_FILE"
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

if [ "$jaeger" = yes ] && { ! [[ "$preferred_jaeger_port" =~ ^[0-9]{1,5}$ ]] ||
  [ "$((10#$preferred_jaeger_port))" -gt 65535 ]; }; then
  log "NEMO_GYM_JAEGER_PORT=$preferred_jaeger_port: expected a port (0 to 65535; 0 for any free one)"
  exit 2
fi

# The collector's configuration template, and the Go module (and Jaeger's configuration
# template) of the one binary that runs both processes.
COLLECTOR_SRC="$checkout/scripts/collector"
JAEGER_SRC="$checkout/scripts/jaeger"

# 1. Go: Jaeger's modules need a newer Go than Debian's.
# shellcheck source=scripts/find-go.sh
source "$checkout/scripts/find-go.sh"
find_go "Jaeger's modules need go >= $(sed -n 's/^go //p' "$JAEGER_SRC/go.mod")"
if [ -n "${NEMO_GYM_JAEGER_CACHE:-}" ]; then
  log "NEMO_GYM_JAEGER_CACHE is no longer read: the collector and Jaeger are one build, cached" \
    "in NEMO_GYM_COLLECTOR_CACHE"
fi

# build NAME SOURCE_DIR BINARY TARGET KEY_FILES...: build TARGET (a package, or . for the module
# itself) of the Go module in SOURCE_DIR into BINARY, once per set of build inputs.
build() {
  local name="$1" src="$2" bin="$3" target="$4"
  shift 4
  if [ ! -x "$bin" ]; then
    log "building $name with $("$go_bin" version) into $bin (minutes the first time)"
    mkdir -p "$(dirname "$bin")"
    local started=$SECONDS
    echo "building $name since $(date -u +%H:%M:%S) UTC (pid $$)" >"$PROGRESS_FILE"
    # -mod=readonly: go.sum in the repository is the pin; a build never rewrites it. Go says
    # nothing until it is done: a line every 30 s says it still builds.
    (cd "$src" && GOTOOLCHAIN=local GOFLAGS=-mod=readonly CGO_ENABLED=0 \
      nice -n 10 "$go_bin" build -trimpath -o "$bin.tmp.$$" "$target") >&2 &
    local building=$! ticks=0
    while kill -0 "$building" 2>/dev/null; do
      sleep 1
      ticks=$((ticks + 1))
      if [ $((ticks % 30)) = 0 ] && kill -0 "$building" 2>/dev/null; then
        log "still building $name: $((SECONDS - started)) s"
      fi
    done
    wait "$building" || { rm -f "$PROGRESS_FILE"; log "building $name failed"; exit 1; }
    rm -f "$PROGRESS_FILE"
    mv "$bin.tmp.$$" "$bin"
    log "built $name in $((SECONDS - started)) s"
  fi
}

# pick_ports WANTED...: for each wanted port, itself when nobody listens on it, else (and for
# 0) a free one; each held until all are chosen, then released for the process to bind.
# SO_REUSEADDR, as the collector binds: a connection in TIME_WAIT does not hold a port, a
# listener does.
pick_ports() {
  python3 - "$*" <<'PY'
import socket
import sys

held = []
for wanted in [int(port) for port in sys.argv[1].split()]:
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
}

port_log() {
  local what="$1" wanted="$2" got="$3"
  if [ "$wanted" = 0 ]; then
    log "$what on free port $got"
  elif [ "$wanted" = "$got" ]; then
    log "$what on its standard port $got"
  else
    log "$what: port $wanted is taken; on free port $got instead"
  fi
}

# launch NAME BINARY: start BINARY --config <NAME's configuration> in the state folder, in a
# session of its own, and record its identity once it runs BINARY. setsid + nohup: it
# outlives this script and the CI step that ran it; it runs in its state folder so nothing it
# writes lands in a checkout. The lock is not inherited (9>&-). Both exec in place (a
# non-interactive shell's background job leads no process group, so setsid does not fork):
# $! is the process's PID.
launch() {
  local name="$1" bin="$2" config pid
  config="$(config_arg "$name")"
  (cd "$STATE_DIR" && exec setsid nohup "$bin" --config "$config" \
    >"$STATE_DIR/$name.log" 2>&1 </dev/null 9>&-) &
  pid=$!
  # Its identity is recorded once the exec reached our binary (bounded: 10 s).
  for _ in $(seq 1 200); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$bin" ] && break
    alive "$pid" || break
    sleep 0.05
  done
  if [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" != "$bin" ]; then
    log "pid $pid never ran $bin; its log ($STATE_DIR/$name.log):"
    tail -n 30 "$STATE_DIR/$name.log" >&2 || true
    exit 1
  fi
  {
    echo "PID=$pid"
    echo "START_TIME=$(start_time "$pid")"
    echo "EXE=$bin"
    echo "CONFIG=$config"
  } >"$(identity_file "$name")"
  echo "$pid" >"$(pid_file "$name")"
}

# wait_until NAME CHECK: poll CHECK every 0.2 s while NAME's process lives (20 s at most).
wait_until() {
  local name="$1" check="$2" pid
  pid="$(cat "$(pid_file "$name")")"
  for _ in $(seq 1 100); do
    "$check" && return 0
    alive "$pid" || break
    sleep 0.2
  done
  "$check" && return 0
  log "$name did not answer; its log ($STATE_DIR/$name.log):"
  tail -n 30 "$STATE_DIR/$name.log" >&2 || true
  exit 1
}

# 2. The binary, built once per set of build inputs: Jaeger's own module, at the version
# scripts/jaeger/go.mod's tool line pins. It runs the collector and, with --jaeger, Jaeger.
mkdir -p "$cache"
CACHE="$(cd "$cache" && pwd -P)"
key="$( (cat "$JAEGER_SRC/go.mod" "$JAEGER_SRC/go.sum"; "$go_bin" version) | sha256sum | cut -c1-16)"
BIN="$CACHE/$key/jaeger"
build "the collector (Jaeger v1.76.0's binary, which runs Jaeger too)" "$JAEGER_SRC" "$BIN" \
  github.com/jaegertracing/jaeger/cmd/jaeger
if [ "$mode" = build ]; then
  log "built: $BIN"
  exit 0
fi

# 3. Jaeger (with --jaeger), unless the one started earlier still answers.
jaeger_answers() {
  # shellcheck disable=SC1090
  [ -f "$JAEGER_FILE" ] && . "$JAEGER_FILE" &&
    curl -fsS --max-time 2 "$JAEGER_QUERY/api/services" >/dev/null 2>&1
}
if [ "$jaeger" = yes ]; then
  if pid="$(our_process jaeger)"; then
    if [ "$(identity jaeger EXE)" != "$BIN" ]; then
      log "Jaeger pid $pid runs another build ($(identity jaeger EXE)); replacing it"
      end_process jaeger "$pid"
    elif ! jaeger_answers; then
      log "Jaeger pid $pid does not answer; restarting it"
      end_process jaeger "$pid"
    else
      log "the Jaeger started earlier still answers (pid $pid, log $STATE_DIR/jaeger.log)"
    fi
  fi
  if ! our_process jaeger >/dev/null; then
    rm -f "$(pid_file jaeger)" "$(identity_file jaeger)" "$JAEGER_FILE"
    read -r query query_grpc jaeger_otlp <<<"$(pick_ports "$((10#$preferred_jaeger_port))" 0 0)"
    port_log "Jaeger's query service and UI" "$((10#$preferred_jaeger_port))" "$query"
    sed -e "s/@JAEGER_QUERY_PORT@/$query/" -e "s/@JAEGER_QUERY_GRPC_PORT@/$query_grpc/" \
      -e "s/@JAEGER_OTLP_GRPC_PORT@/$jaeger_otlp/" \
      "$JAEGER_SRC/jaeger.yaml.in" >"$STATE_DIR/jaeger.yaml"
    {
      echo "JAEGER_QUERY=http://127.0.0.1:$query"
      echo "JAEGER_OTLP_GRPC_PORT=$jaeger_otlp"
    } >"$JAEGER_FILE"
    launch jaeger "$BIN"
    wait_until jaeger jaeger_answers
    log "Jaeger started (pid $(cat "$(pid_file jaeger)"), log $STATE_DIR/jaeger.log)"
  fi
  # shellcheck disable=SC1090
  . "$JAEGER_FILE"
fi

# 4. The collector, unless the one started earlier still answers (and, with --jaeger, sends
# its traces to this Jaeger).
answers() {
  # shellcheck disable=SC1090
  [ -f "$PORTS_FILE" ] && . "$PORTS_FILE" &&
    curl -fsS --max-time 2 "$COLLECTOR_PROMETHEUS" >/dev/null 2>&1 &&
    # OTLP/HTTP answers a GET on its path with 405: the receiver is up.
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$OTEL_EXPORTER_OTLP_ENDPOINT/v1/metrics")" = 405 ]
}
traces_to() { sed -n 's/^TRACES_TO=//p' "$PORTS_FILE" 2>/dev/null | head -n 1; }
wanted_traces_to=debug
[ "$jaeger" = yes ] && wanted_traces_to="jaeger:$JAEGER_OTLP_GRPC_PORT"
if pid="$(our_collector)"; then
  if [ "$(identity collector EXE)" != "$BIN" ]; then
    log "pid $pid runs another build ($(identity collector EXE)); replacing it"
    end_collector "$pid"
  elif ! answers; then
    log "pid $pid does not answer; restarting it"
    end_collector "$pid"
  elif [ "$jaeger" = yes ] && [ "$(traces_to)" != "$wanted_traces_to" ]; then
    log "pid $pid does not send its traces to this Jaeger; replacing it"
    end_collector "$pid"
  else
    log "the collector started earlier still answers (pid $pid, log $STATE_DIR/collector.log)"
  fi
elif [ -s "$(pid_file collector)" ]; then
  log "$(pid_file collector) names pid $(cat "$(pid_file collector)"), which is not a collector" \
    "started from $STATE_DIR (ended, or not ours): leaving it alone and starting one"
fi
if ! our_collector >/dev/null; then
  rm -f "$(pid_file collector)" "$(identity_file collector)" "$PORTS_FILE"
  # The preferred ports that nobody listens on, and free ones for the rest and for the
  # collector's own metrics.
  read -r otlp_http otlp_grpc prom self <<<"$(pick_ports ${preferred_ports//,/ } 0)"
  read -r want_http want_grpc want_prom <<<"${preferred_ports//,/ }"
  port_log OTLP/HTTP "$want_http" "$otlp_http"
  port_log OTLP/gRPC "$want_grpc" "$otlp_grpc"
  port_log "Prometheus exporter" "$want_prom" "$prom"
  if [ "$jaeger" = yes ]; then
    # The traces pipeline exports to Jaeger; the exporter's block stays.
    traces_exporter=otlp/jaeger
    drop_jaeger='/@JAEGER_BEGIN@/d;/@JAEGER_END@/d'
  else
    traces_exporter=debug
    drop_jaeger='/@JAEGER_BEGIN@/,/@JAEGER_END@/d'
  fi
  sed -e "$drop_jaeger" -e "s/@OTLP_HTTP_PORT@/$otlp_http/" -e "s/@OTLP_GRPC_PORT@/$otlp_grpc/" \
    -e "s/@PROMETHEUS_PORT@/$prom/" -e "s/@SELF_METRICS_PORT@/$self/" \
    -e "s|@TRACES_EXPORTER@|$traces_exporter|" -e "s/@JAEGER_OTLP_GRPC_PORT@/${JAEGER_OTLP_GRPC_PORT:-}/" \
    "$COLLECTOR_SRC/config.yaml.in" >"$STATE_DIR/config.yaml"
  {
    echo "COLLECTOR_PROMETHEUS=http://127.0.0.1:$prom/metrics"
    echo "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$otlp_http"
    echo "COLLECTOR_SELF_METRICS=http://127.0.0.1:$self/metrics"
    echo "COLLECTOR_OTLP_GRPC=127.0.0.1:$otlp_grpc"
    echo "COLLECTOR_BINARY=$BIN"
    echo "TRACES_TO=$wanted_traces_to"
  } >"$PORTS_FILE"
  launch collector "$BIN"
  wait_until collector answers
  log "collector started (pid $(cat "$(pid_file collector)"), log $STATE_DIR/collector.log)"
fi

# shellcheck disable=SC1090
. "$PORTS_FILE"
# The Jaeger of this state folder, where the collector sends to it.
jaeger_query=""
if [ "$(traces_to)" != debug ] && [ -n "$(traces_to)" ] && our_process jaeger >/dev/null; then
  # shellcheck disable=SC1090
  . "$JAEGER_FILE"
  jaeger_query="$JAEGER_QUERY"
fi
if [ "$mode" = env ]; then
  # The endpoint is OTLP over HTTP, so the protocol goes with it (the SDK's default is gRPC).
  echo "export OTEL_EXPORTER_OTLP_ENDPOINT=$OTEL_EXPORTER_OTLP_ENDPOINT"
  echo "export OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
  echo "export COLLECTOR_PROMETHEUS=$COLLECTOR_PROMETHEUS"
  [ -z "$jaeger_query" ] || echo "export JAEGER_QUERY=$jaeger_query"
else
  [ -z "$jaeger_query" ] || echo "JAEGER_QUERY=$jaeger_query"
  echo "COLLECTOR_PROMETHEUS=$COLLECTOR_PROMETHEUS"
  echo "OTEL_EXPORTER_OTLP_ENDPOINT=$OTEL_EXPORTER_OTLP_ENDPOINT"
fi
