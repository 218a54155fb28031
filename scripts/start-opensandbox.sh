#!/usr/bin/env bash
# Build and start an OpenSandbox server (alibaba/OpenSandbox, `opensandbox-server` 1.1.1 from
# PyPI) on loopback, with its Docker runtime on Podman's Docker-compatible service: the server
# NeMo Gym's `opensandbox` provider talks to in tests/test_opensandbox.py, and for users who try
# that provider on one machine.
#
# Idempotent, like scripts/start-collector.sh:
#   1. builds OpenSandbox's execd statically (CGO_ENABLED=0: the image has no libc) from
#      OpenSandbox's source (../shared/opensandbox/opensandbox-execd-4db3a993.tgz beside the
#      checkout, or NEMO_GYM_OPENSANDBOX_SOURCE) once per set of inputs, into a cache folder
#      outside the repository keyed by a hash of the source and the Go version (about 1
#      minute with Go's caches warm, about 7 cold);
#   2. imports the execd image (busybox, /execd, /bootstrap.sh) with `podman import` under a
#      local name holding that hash, so no registry is contacted;
#   3. installs opensandbox-server in a virtualenv of its own (pyenv's Python 3.12), cached
#      like the build;
#   4. writes the server's configuration (Docker runtime, SQLite store, an API key made here)
#      into the state folder, which belongs to this checkout, and starts the server on
#      127.0.0.1 at a free port unless the one this state folder started still answers.
# The API key is in $STATE_DIR/api_key (mode 600) and in the configuration (mode 600); it is
# never on a command line, in this script's output, or in a log line of ours.
# Logs go to stderr. Stdout is, as its last two lines,
#   OPENSANDBOX_DOMAIN=127.0.0.1:<port>         (NeMo Gym's `connection.domain`)
#   OPENSANDBOX_API_KEY_FILE=<state>/api_key    (read it into OPENSANDBOX_API_KEY)
# `--stop` ends the server this state folder started, and nothing else: a process counts as
# ours only while it has the start time the kernel gave it at our start (a reused PID has
# another) and runs this state folder's configuration. Sandboxes it made are the server's:
# remove them before stopping it (NeMo Gym's provider does, at close).
#
# Environment (all optional):
#   NEMO_GYM_OPENSANDBOX_DIR      state folder (default <checkout>/.opensandbox, gitignored)
#   NEMO_GYM_OPENSANDBOX_SOURCE   OpenSandbox's source: a .tgz holding components/execd, or a
#                                 folder (a clone of OpenSandbox's repository)
#   NEMO_GYM_OPENSANDBOX_CACHE    build cache (default ${XDG_CACHE_HOME:-~/.cache}/nemo-gym-otel/opensandbox)
#   DOCKER_HOST                   the engine the server's Docker runtime uses (default: Podman's
#                                 socket of scripts/start-podman.sh)
#   GO                            the Go to build with (default /usr/local/go/bin/go, else `go`)
#
# `--kubernetes` (with or without `--stop`): the server's Kubernetes runtime instead, on the
# single-node cluster of scripts/start-kubernetes.sh, which must be running (this script does
# not start or stop it). Then it also
#   - builds OpenSandbox's controller (`cmd/controller` of its `kubernetes/` module: the
#     BatchSandbox reconciler) from NEMO_GYM_OPENSANDBOX_K8S_SOURCE (default
#     ../shared/opensandbox/opensandbox-k8s-4db3a993.tgz beside the checkout), cached like
#     execd (minutes cold: controller-runtime and client-go come from the Go module proxy);
#   - applies its CRDs (`config/crd/bases`) with the cluster's kubectl, and makes the namespace
#     `opensandbox`;
#   - imports the execd image (as a `docker save` tar, scripts/kubernetes/image.py) into the
#     cluster's containerd; sandboxes use the cluster's busybox image
#     `localhost/nemo-gym-busybox:1` (`image_pull_policy = "Never"`);
#   - runs the controller's manager outside any pod, with the cluster's admin kubeconfig, and
#     the server with `[runtime] type = "kubernetes"`, both inside the cluster's network
#     namespace (the server reaches each sandbox's execd at its pod address; nothing listens
#     on the host). NeMo Gym's provider must run in there too
#     (`nsenter --net="$NEMO_GYM_KUBERNETES_NETNS"`).
# Its state folder is <checkout>/.opensandbox-kubernetes; `--kubernetes --stop` ends the server
# and the controller it started (the CRDs, the namespace and the images stay in the cluster,
# which start-kubernetes.sh --stop removes whole). Stdout adds
#   OPENSANDBOX_KUBERNETES_NAMESPACE=opensandbox
set -euo pipefail

log() { echo "start-opensandbox: $*" >&2; }

mode=start
runtime=docker
for arg in "$@"; do
  case "$arg" in
    --stop) mode=stop ;;
    --kubernetes) runtime=kubernetes ;;
    *) log "usage: start-opensandbox.sh [--kubernetes] [--stop]"; exit 2 ;;
  esac
done

CHECKOUT="$(cd "$(dirname "$0")/.." && pwd -P)"
uid="$(id -u)"
if [ "$runtime" = kubernetes ]; then
  state_dir="${NEMO_GYM_OPENSANDBOX_DIR:-$CHECKOUT/.opensandbox-kubernetes}"
else
  state_dir="${NEMO_GYM_OPENSANDBOX_DIR:-$CHECKOUT/.opensandbox}"
fi
k8s_source="${NEMO_GYM_OPENSANDBOX_K8S_SOURCE:-$CHECKOUT/../shared/opensandbox/opensandbox-k8s-4db3a993.tgz}"
K8S_NAMESPACE=opensandbox
cache="${NEMO_GYM_OPENSANDBOX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-gym-otel/opensandbox}"
source_path="${NEMO_GYM_OPENSANDBOX_SOURCE:-$CHECKOUT/../shared/opensandbox/opensandbox-execd-4db3a993.tgz}"
export DOCKER_HOST="${DOCKER_HOST:-unix:///run/nemo-gym-podman/podman.sock}"
SERVER_VERSION=1.1.1

if [ "$mode" = stop ] && [ ! -d "$state_dir" ]; then
  log "no state folder $state_dir: no server started from it"
  exit 0
fi
mkdir -p -m 700 "$state_dir"
STATE_DIR="$(cd "$state_dir" && pwd -P)"
if [ "$(stat -c %u "$STATE_DIR")" != "$uid" ]; then
  log "the state folder $STATE_DIR belongs to uid $(stat -c %u "$STATE_DIR"), not to you; set NEMO_GYM_OPENSANDBOX_DIR"
  exit 1
fi
CONFIG="$STATE_DIR/config.toml"
KEY_FILE="$STATE_DIR/api_key"
PID_FILE="$STATE_DIR/server.pid"
IDENTITY_FILE="$STATE_DIR/server.identity"
PORT_FILE="$STATE_DIR/server.env"
CONTROLLER_PID_FILE="$STATE_DIR/controller.pid"
CONTROLLER_IDENTITY_FILE="$STATE_DIR/controller.identity"

exec 9>"$STATE_DIR/lock"
flock 9

# shellcheck source=scripts/owned-process.sh
source "$CHECKOUT/scripts/owned-process.sh"
identity() { sed -n "s/^$1=//p" "$IDENTITY_FILE" 2>/dev/null | head -n 1; }

# The PID of the server this state folder started, while it still runs; fails otherwise.
our_server() {
  local pid arg
  pid="$(cat "$PID_FILE" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[1-9][0-9]*$ ]] || return 1
  [ "$(identity PID)" = "$pid" ] || return 1
  [ "$(start_time "$pid")" = "$(identity START_TIME)" ] || return 1
  while IFS= read -r -d '' arg; do
    if [ "$arg" = "$CONFIG" ]; then
      echo "$pid"
      return 0
    fi
  done <"/proc/$pid/cmdline"
  return 1
}

end_server() { end_owned "$1" our_server; }

# The PID of the controller this state folder started, while it still runs (the same checks,
# its marker being this state folder's controller flag file).
our_controller() {
  local pid arg
  pid="$(cat "$CONTROLLER_PID_FILE" 2>/dev/null)" || return 1
  [[ "$pid" =~ ^[1-9][0-9]*$ ]] || return 1
  [ "$(sed -n 's/^PID=//p' "$CONTROLLER_IDENTITY_FILE" 2>/dev/null)" = "$pid" ] || return 1
  [ "$(start_time "$pid")" = "$(sed -n 's/^START_TIME=//p' "$CONTROLLER_IDENTITY_FILE" 2>/dev/null)" ] || return 1
  while IFS= read -r -d '' arg; do
    if [ "$arg" = "--log-file-path=$STATE_DIR/controller-file.log" ]; then
      echo "$pid"
      return 0
    fi
  done <"/proc/$pid/cmdline"
  return 1
}

if [ "$mode" = stop ]; then
  if pid="$(our_server)"; then
    end_server "$pid"
    log "stopped the OpenSandbox server (pid $pid)"
  else
    log "no OpenSandbox server started from $STATE_DIR is running"
  fi
  if pid="$(our_controller)"; then
    end_owned "$pid" our_controller
    log "stopped OpenSandbox's controller (pid $pid)"
  fi
  # server.env stays: a later start takes the same port where it is free.
  rm -f "$PID_FILE" "$IDENTITY_FILE" "$CONTROLLER_PID_FILE" "$CONTROLLER_IDENTITY_FILE"
  exit 0
fi

if [ "$runtime" = kubernetes ]; then
  # The cluster of start-kubernetes.sh, running already: its kubectl, admin kubeconfig,
  # network namespace and containerd.
  KUBE_STATE="$(cd "${NEMO_GYM_KUBERNETES_DIR:-$CHECKOUT/.kubernetes}" 2>/dev/null && pwd -P)" || {
    log "no cluster state folder: start the cluster first (bash scripts/start-kubernetes.sh)"
    exit 1
  }
  KUBECTL="$(bash "$CHECKOUT/scripts/start-kubernetes.sh" --bin)/kubectl"
  CLUSTER_KUBECONFIG="$KUBE_STATE/admin.kubeconfig"
  if ! "$KUBECTL" --kubeconfig "$CLUSTER_KUBECONFIG" get --raw /readyz >/dev/null 2>&1; then
    log "the cluster of $KUBE_STATE does not answer: start it first (bash scripts/start-kubernetes.sh)"
    exit 1
  fi
  NETNS="$(bash "$CHECKOUT/scripts/start-kubernetes.sh" --env 2>/dev/null |
    sed -n 's/^export NEMO_GYM_KUBERNETES_NETNS=//p')"
  [ -e "$NETNS" ] || { log "the cluster's network namespace ($NETNS) is missing"; exit 1; }
  kubectl_() { "$KUBECTL" --kubeconfig "$CLUSTER_KUBECONFIG" "$@"; }
  ctr_() { ctr --address "$KUBE_STATE/containerd/containerd.sock" --namespace k8s.io "$@"; }
fi

# 1. execd, built once per source and Go version.
# shellcheck source=scripts/find-go.sh
source "$CHECKOUT/scripts/find-go.sh"
find_go
if [ -f "$source_path" ]; then
  source_id="archive $(sha256sum "$source_path" | cut -d' ' -f1)"
elif [ -d "$source_path/components/execd" ]; then
  source_id="tree $(cd "$source_path" && find components/execd components/internal -type f \
    -not -path '*/.git/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
else
  log "NEMO_GYM_OPENSANDBOX_SOURCE=$source_path: neither a .tgz nor a folder with components/execd"
  exit 1
fi
mkdir -p "$cache"
CACHE="$(cd "$cache" && pwd -P)"
key="$(echo "$source_id $("$go_bin" version)" | sha256sum | cut -c1-16)"
BUILD="$CACHE/execd-$key"
if [ ! -x "$BUILD/execd" ]; then
  log "building execd with $("$go_bin" version) into $BUILD (1-7 minutes the first time)"
  rm -rf "$BUILD.tmp.$$"
  mkdir -p "$BUILD.tmp.$$/src"
  if [ -f "$source_path" ]; then
    tar -xzf "$source_path" -C "$BUILD.tmp.$$/src"
  else
    cp -r "$source_path/components" "$BUILD.tmp.$$/src/"
  fi
  started=$SECONDS
  (cd "$BUILD.tmp.$$/src/components/execd" && GOTOOLCHAIN=local CGO_ENABLED=0 \
    nice -n 10 "$go_bin" build -trimpath -o "$BUILD.tmp.$$/execd" .) >&2
  cp "$BUILD.tmp.$$/src/components/execd/bootstrap.sh" "$BUILD.tmp.$$/bootstrap.sh"
  rm -rf "$BUILD.tmp.$$/src"
  rm -rf "$BUILD"
  mv "$BUILD.tmp.$$" "$BUILD"
  log "built execd in $((SECONDS - started)) s"
fi

# 2. The execd image: busybox with /execd and /bootstrap.sh, imported under a local name (into
# Podman, or the cluster's containerd as a `docker save` tar).
EXECD_IMAGE="localhost/nemo-gym-opensandbox-execd:$key"
execd_rootfs() {
  [ -x /bin/busybox ] || { log "no /bin/busybox (apt-get install busybox-static)"; exit 1; }
  rootfs="$(mktemp -d)"
  mkdir -p "$rootfs/bin"
  cp /bin/busybox "$rootfs/bin/busybox"
  for tool in $("$rootfs/bin/busybox" --list); do
    [ -e "$rootfs/bin/$tool" ] || ln -s busybox "$rootfs/bin/$tool"
  done
  install -m 755 "$BUILD/execd" "$rootfs/execd"
  install -m 755 "$BUILD/bootstrap.sh" "$rootfs/bootstrap.sh"
}
if [ "$runtime" = kubernetes ]; then
  if ! ctr_ images ls -q | grep -qxF "$EXECD_IMAGE"; then
    execd_rootfs
    python3 "$CHECKOUT/scripts/kubernetes/image.py" "$rootfs" "$EXECD_IMAGE" '["/bin/sh"]' "$rootfs.tar"
    ctr_ images import "$rootfs.tar" >/dev/null
    rm -rf "$rootfs" "$rootfs.tar"
    log "imported $EXECD_IMAGE into the cluster's containerd"
  fi
elif ! podman image exists "$EXECD_IMAGE"; then
  execd_rootfs
  tar -C "$rootfs" -cf "$rootfs.tar" .
  podman import --change 'ENV PATH=/bin' "$rootfs.tar" "$EXECD_IMAGE" >&2
  rm -rf "$rootfs" "$rootfs.tar"
  log "imported $EXECD_IMAGE"
fi

# 2b. Kubernetes: OpenSandbox's controller, built once per source and Go version, its CRDs and
# namespace applied, and its manager running in the cluster's network namespace.
if [ "$runtime" = kubernetes ]; then
  [ -f "$k8s_source" ] || {
    log "NEMO_GYM_OPENSANDBOX_K8S_SOURCE=$k8s_source: not a .tgz of OpenSandbox's kubernetes/ folder"
    exit 1
  }
  controller_key="$(echo "archive $(sha256sum "$k8s_source" | cut -d' ' -f1) $("$go_bin" version)" | sha256sum | cut -c1-16)"
  CONTROLLER="$CACHE/controller-$controller_key"
  if [ ! -x "$CONTROLLER/controller" ]; then
    log "building OpenSandbox's controller with $("$go_bin" version) into $CONTROLLER (10+ minutes cold)"
    rm -rf "$CONTROLLER.tmp.$$"
    mkdir -p "$CONTROLLER.tmp.$$/src"
    tar -xzf "$k8s_source" -C "$CONTROLLER.tmp.$$/src"
    started=$SECONDS
    (cd "$CONTROLLER.tmp.$$/src/kubernetes" && GOTOOLCHAIN=local CGO_ENABLED=0 \
      nice -n 10 "$go_bin" build -trimpath -o "$CONTROLLER.tmp.$$/controller" ./cmd/controller) >&2
    cp -r "$CONTROLLER.tmp.$$/src/kubernetes/config/crd/bases" "$CONTROLLER.tmp.$$/crd"
    rm -rf "$CONTROLLER.tmp.$$/src"
    rm -rf "$CONTROLLER"
    mv "$CONTROLLER.tmp.$$" "$CONTROLLER"
    log "built the controller in $((SECONDS - started)) s"
  fi
  kubectl_ apply --server-side --force-conflicts -f "$CONTROLLER/crd" >/dev/null
  kubectl_ wait --for condition=established --timeout=60s -f "$CONTROLLER/crd" >/dev/null
  kubectl_ get namespace "$K8S_NAMESPACE" >/dev/null 2>&1 || kubectl_ create namespace "$K8S_NAMESPACE" >/dev/null
  if ! our_controller >/dev/null; then
    rm -f "$CONTROLLER_PID_FILE" "$CONTROLLER_IDENTITY_FILE"
    # No metrics or probe listener (0); --log-file-path marks the process as this folder's.
    (cd "$STATE_DIR" && exec setsid nohup nsenter --net="$NETNS" "$CONTROLLER/controller" \
      --kubeconfig "$CLUSTER_KUBECONFIG" --metrics-bind-address=0 \
      --health-probe-bind-address=0 --log-file-path="$STATE_DIR/controller-file.log" \
      >"$STATE_DIR/controller.log" 2>&1 </dev/null 9>&-) &
    pid=$!
    for _ in $(seq 1 100); do
      grep -qzF -- "--log-file-path=$STATE_DIR/controller-file.log" "/proc/$pid/cmdline" 2>/dev/null && break
      alive "$pid" || break
      sleep 0.05
    done
    {
      echo "PID=$pid"
      echo "START_TIME=$(start_time "$pid")"
    } >"$CONTROLLER_IDENTITY_FILE"
    echo "$pid" >"$CONTROLLER_PID_FILE"
    for _ in $(seq 1 300); do
      grep -q '"Starting workers".*"BatchSandbox"' "$STATE_DIR/controller.log" 2>/dev/null && break
      alive "$pid" || break
      sleep 0.2
    done
    if ! grep -q '"Starting workers".*"BatchSandbox"' "$STATE_DIR/controller.log" 2>/dev/null; then
      log "the controller did not start its BatchSandbox workers; its log ($STATE_DIR/controller.log):"
      tail -n 30 "$STATE_DIR/controller.log" >&2 || true
      exit 1
    fi
    log "controller started (pid $pid, log $STATE_DIR/controller.log)"
  fi
fi

# 3. The server, in a virtualenv of its own (Python 3.12), once per version.
python=python3.12
if ! "$python" -c '' 2>/dev/null; then
  python="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1)"
  [ -n "$python" ] || { log "no python3.12 on PATH or in pyenv (pyenv install 3.12)"; exit 1; }
fi
# Keyed by the interpreter and constraints.txt: the server brings the OpenTelemetry SDK, pinned
# to the repository's one consistent set like every other install.
# shellcheck source=scripts/pip-install.sh
source "$CHECKOUT/scripts/pip-install.sh"
SERVER_VENV="$CACHE/server-$SERVER_VERSION-$({ "$python" -VV; cat "$PIP_CONSTRAINTS"; } | sha256sum | cut -c1-8)"
if [ ! -f "$SERVER_VENV/complete" ]; then
  log "installing opensandbox-server==$SERVER_VERSION into $SERVER_VENV"
  rm -rf "$SERVER_VENV"
  "$python" -m venv "$SERVER_VENV"
  pip_install "$SERVER_VENV/bin/python" "opensandbox-server==$SERVER_VERSION"
  touch "$SERVER_VENV/complete"
fi

# 4. The key and the configuration (both mode 600), then the server.
umask 077
if [ ! -s "$KEY_FILE" ]; then
  od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$KEY_FILE"
fi
chmod 600 "$KEY_FILE"

# Kubernetes: the server lives in the cluster's network namespace, and is asked in there.
in_place=()
[ "$runtime" = kubernetes ] && in_place=(nsenter --net="$NETNS")

answers() {
  # shellcheck disable=SC1090
  [ -f "$PORT_FILE" ] && . "$PORT_FILE" &&
    "${in_place[@]}" curl -fsS --max-time 2 "http://$OPENSANDBOX_DOMAIN/health" >/dev/null 2>&1
}

if pid="$(our_server)"; then
  if answers; then
    log "the server started earlier still answers (pid $pid, log $STATE_DIR/server.log)"
  else
    log "pid $pid does not answer; restarting it"
    end_server "$pid"
  fi
fi
if ! our_server >/dev/null; then
  # The port this state folder's server had before, where it is free (the sandboxes and SDK
  # objects made against it keep their domain across a restart), else a free one.
  previous="$(sed -n 's/^OPENSANDBOX_DOMAIN=127.0.0.1://p' "$PORT_FILE" 2>/dev/null || true)"
  rm -f "$PID_FILE" "$IDENTITY_FILE" "$PORT_FILE"
  port="$("${in_place[@]}" python3 "$CHECKOUT/scripts/free_port.py" "${previous:-0}")"
  # The key goes into the configuration from its file, never through an argument.
  {
    echo '[server]'
    echo 'host = "127.0.0.1"'
    echo "port = $port"
    printf 'api_key = "%s"\n' "$(cat "$KEY_FILE")"
    echo '[log]'
    echo 'level = "INFO"'
    echo '[runtime]'
    echo "type = \"$runtime\""
    echo "execd_image = \"$EXECD_IMAGE\""
    echo '[store]'
    echo 'type = "sqlite"'
    echo "path = \"$STATE_DIR/opensandbox.db\""
    if [ "$runtime" = kubernetes ]; then
      echo '[kubernetes]'
      echo "kubeconfig_path = \"$CLUSTER_KUBECONFIG\""
      echo "namespace = \"$K8S_NAMESPACE\""
      echo 'workload_provider = "batchsandbox"'
      echo 'image_pull_policy = "Never"'
    else
      echo '[docker]'
      echo 'network_mode = "bridge"'
      echo 'pids_limit = 256'
      echo 'publish_host = "127.0.0.1"'
    fi
    echo '[ingress]'
    echo 'mode = "direct"'
  } >"$CONFIG"
  chmod 600 "$CONFIG"
  echo "OPENSANDBOX_DOMAIN=127.0.0.1:$port" >"$PORT_FILE"
  (cd "$STATE_DIR" && exec setsid nohup "${in_place[@]}" "$SERVER_VENV/bin/python" \
    "$SERVER_VENV/bin/opensandbox-server" --config "$CONFIG" \
    >"$STATE_DIR/server.log" 2>&1 </dev/null 9>&-) &
  pid=$!
  for _ in $(seq 1 100); do
    grep -qzF -- "$CONFIG" "/proc/$pid/cmdline" 2>/dev/null && break
    alive "$pid" || break
    sleep 0.05
  done
  {
    echo "PID=$pid"
    echo "START_TIME=$(start_time "$pid")"
  } >"$IDENTITY_FILE"
  echo "$pid" >"$PID_FILE"
  for _ in $(seq 1 300); do
    answers && break
    alive "$pid" || break
    sleep 0.2
  done
  if ! answers; then
    log "the server did not answer; its log ($STATE_DIR/server.log):"
    tail -n 30 "$STATE_DIR/server.log" >&2 || true
    exit 1
  fi
  if [ "$runtime" = kubernetes ]; then
    log "server started (pid $pid, log $STATE_DIR/server.log, Kubernetes namespace $K8S_NAMESPACE, network namespace $NETNS)"
  else
    log "server started (pid $pid, log $STATE_DIR/server.log, engine $DOCKER_HOST)"
  fi
fi

# shellcheck disable=SC1090
. "$PORT_FILE"
[ "$runtime" = kubernetes ] && echo "OPENSANDBOX_KUBERNETES_NAMESPACE=$K8S_NAMESPACE"
echo "OPENSANDBOX_DOMAIN=$OPENSANDBOX_DOMAIN"
echo "OPENSANDBOX_API_KEY_FILE=$KEY_FILE"
