#!/usr/bin/env bash
# Build and start a single-node Kubernetes cluster on this machine, for the Kubernetes sandbox
# reader's tests (tests/test_kubernetes_reader.py) and for users who try it on one machine.
#
# Idempotent, like scripts/start-opensandbox.sh:
#   1. builds kube-apiserver, kube-scheduler, kube-controller-manager, kubelet, kubectl
#      (Kubernetes v1.34.4) and etcd (v3.6.4) in one `go build` from the Go module proxy,
#      through a wrapper module this script writes (k8s.io/kubernetes's module comes with its
#      staging/ empty: the wrapper points each staging module at its published v0.34.4), into a
#      cache folder outside the repository keyed by the versions and the Go version (8 to 15
#      minutes cold on a loaded 2-core machine, under a second warm; progress on stderr);
#   2. installs the Debian packages it runs with (containerd, runc, containernetworking-plugins,
#      busybox-static) when one is missing;
#   3. makes a certificate authority and the certificates and kubeconfigs of every component
#      (openssl) in the state folder, which belongs to this checkout;
#   4. makes a network namespace and runs the whole cluster in it: the kubelet refuses a
#      loopback node address, so the node gets 192.0.2.1 on the namespace's `lo`, and pods get
#      addresses from 198.18.0.0/24 on a CNI bridge inside it. Nothing there can ever be a real
#      host. The API server also listens on 127.0.0.1 of the host, at a free port, through a
#      socket this script opens in the host's namespace and hands to it (see below), so the
#      host's processes reach it on loopback only;
#   5. starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd and the
#      kubelet, waits for the node to be Ready, and imports two local images (no registry is
#      reachable): `localhost/nemo-gym-pause:1` (the pod sandbox image, a static binary that
#      sleeps until signalled) and `localhost/nemo-gym-busybox:1` (busybox-static, for tests).
#      Pods use them with `imagePullPolicy: Never`.
# The kubelet changes host settings (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops):
# their values before the first start are saved in the state folder and put back by --stop.
# Logs go to stderr. Stdout is, as its last line,
#   KUBECONFIG=<state>/admin.kubeconfig     (cluster-admin, https://127.0.0.1:<port>)
# or, with --env, `export KUBECONFIG=...` for a shell to take as it is:
#   eval "$(bash scripts/start-kubernetes.sh --env)"
# `--bin` prints the folder of the binaries (building them when missing): kubectl is there.
# `--stop` ends what this state folder started, and nothing else: a process counts as ours only
# while it has the start time the kernel gave it at our start (a reused PID has another) and
# runs the binary recorded then. It also removes the pods' containers (they are containerd's
# children), the network namespace, the kubelet's cgroups and the host folders the kubelet and
# containerd made (/var/lib/kubelet, /var/log/containers, /run/containerd) where they were not
# there before, and puts back the host settings.
#
# Environment (all optional):
#   NEMO_GYM_KUBERNETES_DIR    state folder (default <checkout>/.kubernetes, gitignored)
#   NEMO_GYM_KUBERNETES_CACHE  build cache (default ${XDG_CACHE_HOME:-~/.cache}/nemo-gym-otel/kubernetes)
#   GO                         the Go to build with (default /usr/local/go/bin/go, else `go`)
set -euo pipefail

log() { echo "start-kubernetes: $*" >&2; }
usage() { log "usage: start-kubernetes.sh [--env | --stop | --build | --bin]"; }

mode=lines
case "${1:-}" in
  "") ;;
  --env) mode="env" ;;
  --stop) mode=stop ;;
  --build) mode=build ;;
  --bin) mode=bin ;;
  *) usage; exit 2 ;;
esac
[ $# -le 1 ] || { usage; exit 2; }

KUBE_VERSION=v1.34.4
STAGING_VERSION=v0.34.4
ETCD_VERSION=v3.6.4
CHECKOUT="$(cd "$(dirname "$0")/.." && pwd -P)"
cache="${NEMO_GYM_KUBERNETES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-gym-otel/kubernetes}"

# 1. The binaries, once per version and Go version: BIN is their folder.
locate_binaries() {
  # shellcheck source=scripts/find-go.sh
  source "$CHECKOUT/scripts/find-go.sh"
  find_go
  mkdir -p "$cache"
  CACHE="$(cd "$cache" && pwd -P)"
  BIN="$CACHE/bin-$KUBE_VERSION-$(echo "$KUBE_VERSION $ETCD_VERSION $("$go_bin" version)" | sha256sum | cut -c1-12)"
}

build_binaries() {
  locate_binaries
  [ -f "$BIN/complete" ] && return 0
  local module
  exec 8>"$CACHE/build.lock"
  flock 8
  [ -f "$BIN/complete" ] && return 0
  export GOTOOLCHAIN=local CGO_ENABLED=0
  # The wrapper module: k8s.io/kubernetes at its version, each module its go.mod replaces with
  # ./staging/src/k8s.io/X replaced by the published k8s.io/X at the matching v0.x, and a
  # tools.go naming the programs so that `go mod tidy` records every module they need.
  module="$CACHE/module-$KUBE_VERSION"
  if [ ! -f "$module/complete" ]; then
    log "writing the wrapper module $module and resolving its modules (about a minute)"
    rm -rf "$module"
    mkdir -p "$module"
    local kube_mod
    kube_mod="$(cd "$module" && "$go_bin" mod download -json "k8s.io/kubernetes@$KUBE_VERSION" |
      sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
    [ -f "$kube_mod" ] || { log "go mod download k8s.io/kubernetes@$KUBE_VERSION gave no go.mod"; exit 1; }
    {
      echo "module nemo-gym-otel/kubernetes-binaries"
      echo
      echo "go 1.24.0"
      echo
      echo "godebug default=go1.24"
      echo
      echo "require ("
      echo "	k8s.io/kubernetes $KUBE_VERSION"
      echo "	go.etcd.io/etcd/server/v3 $ETCD_VERSION"
      echo ")"
      echo
      echo "replace ("
      sed -n 's|^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/src/k8s.io/.*$|	\1 => \1 '"$STAGING_VERSION"'|p' "$kube_mod"
      echo ")"
    } >"$module/go.mod"
    {
      echo "//go:build tools"
      echo
      echo "package tools"
      echo
      echo "import ("
      for program in kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl; do
        echo "	_ \"k8s.io/kubernetes/cmd/$program\""
      done
      echo "	_ \"go.etcd.io/etcd/server/v3\""
      echo ")"
    } >"$module/tools.go"
    (cd "$module" && "$go_bin" mod tidy) >&2
    touch "$module/complete"
  fi
  local version_flags="" package
  for package in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    version_flags+=" -X $package.gitVersion=$KUBE_VERSION -X $package.gitMajor=1"
    version_flags+=" -X $package.gitMinor=34 -X $package.gitTreeState=clean"
  done
  log "building Kubernetes $KUBE_VERSION and etcd $ETCD_VERSION with $("$go_bin" version) into $BIN"
  log "(one go build of six programs: 8 to 15 minutes the first time on a loaded 2-core machine)"
  rm -rf "$BIN.tmp"
  mkdir -p "$BIN.tmp"
  local started=$SECONDS build_pid
  (cd "$module" && exec "$go_bin" build -v -trimpath -ldflags "-s -w$version_flags" \
    -o "$BIN.tmp/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kubectl go.etcd.io/etcd/server/v3) 2>"$BIN.tmp/build.log" &
  build_pid=$!
  # `go build -v` names each package as it compiles it: its count is the progress.
  while alive "$build_pid"; do
    for _ in $(seq 1 30); do
      alive "$build_pid" || break
      sleep 1
    done
    alive "$build_pid" && log "still building: $((SECONDS - started)) s, $(wc -l <"$BIN.tmp/build.log") packages compiled"
  done
  if ! wait "$build_pid"; then
    log "go build failed; the end of its output ($BIN.tmp/build.log):"
    tail -n 30 "$BIN.tmp/build.log" >&2
    exit 1
  fi
  mv "$BIN.tmp/server" "$BIN.tmp/etcd"
  rm -rf "$BIN"
  mv "$BIN.tmp" "$BIN"
  touch "$BIN/complete"
  log "built in $((SECONDS - started)) s: $(cd "$BIN" && echo kube* etcd)"
}

# shellcheck source=scripts/owned-process.sh
source "$CHECKOUT/scripts/owned-process.sh"

if [ "$mode" = build ]; then
  build_binaries
  exit 0
fi
# The folder of the built binaries (kubectl among them), for scripts driving this cluster.
if [ "$mode" = bin ]; then
  build_binaries
  echo "$BIN"
  exit 0
fi

uid="$(id -u)"
[ "$uid" = 0 ] || { log "a kubelet and containerd need root (uid 0), not uid $uid"; exit 1; }
state_dir="${NEMO_GYM_KUBERNETES_DIR:-$CHECKOUT/.kubernetes}"
if [ "$mode" = stop ] && [ ! -d "$state_dir" ]; then
  log "no state folder $state_dir: no cluster started from it"
  exit 0
fi
mkdir -p -m 700 "$state_dir"
STATE="$(cd "$state_dir" && pwd -P)"
exec 9>"$STATE/lock"
flock 9

# Per state folder: the network namespace's name, the containerd socket, the node's name.
STATE_KEY="$(printf '%s' "$STATE" | sha256sum | cut -c1-8)"
NETNS_NAME="nemo-gym-k8s-$STATE_KEY"
NETNS="/run/netns/$NETNS_NAME"
NODE_IP=192.0.2.1
POD_SUBNET=198.18.0.0/24
POD_GATEWAY=198.18.0.1
SERVICE_RANGE=198.19.0.0/24
NODE_NAME=nemo-gym-node
CLUSTER_NAME=nemo-gym-kubernetes
PAUSE_IMAGE=localhost/nemo-gym-pause:1
TEST_IMAGE=localhost/nemo-gym-busybox:1
CONTAINERD_SOCK="$STATE/containerd/containerd.sock"
PIDS="$STATE/pids"
PKI="$STATE/pki"
ADMIN_KUBECONFIG="$STATE/admin.kubeconfig"
PORT_FILE="$STATE/apiserver.port"
SYSCTL_FILE="$STATE/host-sysctls"
# The host settings the kubelet changes (pkg/kubelet/cm: setupKernelTunables).
HOST_SYSCTLS="vm.overcommit_memory kernel.panic kernel.panic_on_oops"
# Made on the host by the kubelet (its device plugin socket, its links to the pods' logs) and
# by containerd (its shims' sockets), whatever their configuration says.
HOST_FOLDERS="/var/lib/kubelet /var/log/containers /run/containerd"
# Started in this order, stopped in the reverse one.
COMPONENTS="etcd kube-apiserver forward kube-controller-manager kube-scheduler containerd kubelet"

# --- processes: started by us, recognised by PID, start time and binary ---------------------

identity() { sed -n "s/^$2=//p" "$PIDS/$1" 2>/dev/null | head -n 1; }

# The PID of component $1 while the process this state folder started still runs it.
our_process() {
  local pid
  pid="$(identity "$1" PID)"
  [[ "$pid" =~ ^[1-9][0-9]*$ ]] || return 1
  alive "$pid" || return 1
  [ "$(start_time "$pid")" = "$(identity "$1" START_TIME)" ] || return 1
  [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(identity "$1" EXE)" ] || return 1
  echo "$pid"
}

# run_component NAME LOG BINARY ARGS...: started in the cluster's network namespace (only that:
# the kubelet and containerd must share the host's mounts), in a session of its own.
run_component() {
  local name="$1" log_file="$2" pid exe
  shift 2
  if [ "$name" = forward ]; then
    # The forwarder starts in the host's namespace and enters the cluster's itself.
    (exec setsid nohup "$@" >"$log_file" 2>&1 </dev/null 9>&- 8>&-) &
  else
    (exec setsid nohup nsenter "--net=$NETNS" -- "$@" >"$log_file" 2>&1 </dev/null 9>&- 8>&-) &
  fi
  pid=$!
  exe="$(readlink -f "$1")"
  for _ in $(seq 1 100); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$exe" ] && break
    alive "$pid" || break
    sleep 0.05
  done
  mkdir -p "$PIDS"
  printf 'PID=%s\nSTART_TIME=%s\nEXE=%s\n' "$pid" "$(start_time "$pid")" "$exe" >"$PIDS/$name"
}

# Containerd's shims (one per pod): started by our containerd, daemons of their own, known by
# its socket on their command line.
our_shims() {
  local pid
  for pid in $(pgrep containerd-shim 2>/dev/null); do
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "-address $CONTAINERD_SOCK " && echo "$pid"
  done
  return 0
}

kubectl_() { "$BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }
ctr_() { ctr --address "$CONTAINERD_SOCK" --namespace k8s.io "$@"; }

stop_cluster() {
  local name pid component
  # Pods first, while the kubelet runs: it tears their sandboxes down through the CRI (CNI
  # addresses and pod network namespaces freed).
  if our_process kubelet >/dev/null && our_process kube-apiserver >/dev/null; then
    kubectl_ delete pods --all --all-namespaces --grace-period=1 --wait=true --timeout=60s \
      >/dev/null 2>&1 || log "some pods did not end within 60 s; their containers are killed below"
  fi
  for component in $(echo "$COMPONENTS" | tr ' ' '\n' | tac); do
    if [ "$component" = containerd ] && our_process containerd >/dev/null; then
      # What the kubelet left: every task killed and removed, so the shims end.
      for task in $(ctr_ tasks ls -q 2>/dev/null); do
        ctr_ tasks kill -s SIGKILL "$task" >/dev/null 2>&1 || true
        ctr_ tasks delete -f "$task" >/dev/null 2>&1 || true
      done
    fi
    if pid="$(our_process "$component")"; then
      end_owned "$pid" our_process "$component"
      log "stopped $component (pid $pid)"
    fi
    rm -f "$PIDS/$component"
  done
  for pid in $(our_shims); do
    log "ending containerd's shim $pid"
    kill -9 "$pid" 2>/dev/null || true
  done
  # Mounts the kubelet and containerd made under the state folder (pod volumes, container
  # root filesystems, /dev/shm of pods), deepest first.
  { findmnt -rn -o TARGET | grep -F "$STATE/" || true; } | sort -r | while read -r target; do
    umount -l "$target" 2>/dev/null || true
  done
  if [ -e "$NETNS" ]; then
    ip netns delete "$NETNS_NAME" 2>/dev/null || log "could not delete network namespace $NETNS_NAME"
  fi
  # The kubelet's cgroups (it made them: kubepods did not exist before, see start), emptied.
  if [ -f "$STATE/kubepods-ours" ]; then
    find /sys/fs/cgroup -depth -type d -path '*/kubepods*' -exec rmdir {} \; 2>/dev/null || true
    rm -f "$STATE/kubepods-ours"
  fi
  # The kubelet's links to our pods' logs, its device plugin socket; then the host folders it
  # and containerd made, where they are empty (emptied of ours) and were not there before.
  find /var/log/containers -maxdepth 1 -type l -lname "$STATE/*" -delete 2>/dev/null || true
  rm -f /var/lib/kubelet/device-plugins/kubelet.sock
  if [ -f "$STATE/host-folders-ours" ]; then
    while read -r folder; do
      [ -d "$folder" ] && find "$folder" -depth -type d -empty -delete 2>/dev/null
    done <"$STATE/host-folders-ours"
    rm -f "$STATE/host-folders-ours"
  fi
  if [ -f "$SYSCTL_FILE" ]; then
    while read -r name value; do
      [ -n "$name" ] && sysctl -q -w "$name=$value" >/dev/null
    done <"$SYSCTL_FILE"
    log "host settings put back: $(tr '\n' ' ' <"$SYSCTL_FILE")"
    rm -f "$SYSCTL_FILE"
  fi
}

if [ "$mode" = stop ]; then
  locate_binaries
  stop_cluster
  log "stopped (state folder $STATE)"
  exit 0
fi

print_env() {
  if [ "$mode" = env ]; then
    echo "export KUBECONFIG=$ADMIN_KUBECONFIG"
    echo "export NEMO_GYM_KUBERNETES_NETNS=$NETNS"
  else
    echo "NEMO_GYM_KUBERNETES_NETNS=$NETNS"
    echo "KUBECONFIG=$ADMIN_KUBECONFIG"
  fi
}

build_binaries

# Running already, and answering: nothing to do.
running=yes
for component in $COMPONENTS; do
  our_process "$component" >/dev/null || running=no
done
if [ "$running" = yes ] && kubectl_ get --raw /readyz >/dev/null 2>&1; then
  log "the cluster started earlier still runs (state folder $STATE)"
  print_env
  exit 0
fi
# Partly running (a component died, the machine was half stopped): start again from clean.
stop_cluster

# 2. Debian packages.
missing=""
command -v containerd >/dev/null || missing+=" containerd"
command -v runc >/dev/null || missing+=" runc"
[ -x /usr/lib/cni/bridge ] || missing+=" containernetworking-plugins"
[ -x /bin/busybox ] || missing+=" busybox-static"
command -v openssl >/dev/null || missing+=" openssl"
if [ -n "$missing" ]; then
  log "installing Debian packages:$missing"
  apt-get update -qq >&2
  # shellcheck disable=SC2086 # a list of package names, split on purpose
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >&2
fi

# 3. Certificates (ECDSA P-256) and kubeconfigs, made once per state folder.
umask 077
# The authority carries its key usage, and every certificate its key identifiers: Python 3.13's
# default TLS context verifies strictly (VERIFY_X509_STRICT) and refuses an authority without
# them ("CA cert does not include key usage extension"). A folder made before that is remade.
strict_pki() {
  openssl x509 -in "$PKI/ca.crt" -noout -ext keyUsage 2>/dev/null | grep -q "Certificate Sign"
}
if [ ! -f "$PKI/complete" ] || ! strict_pki; then
  log "making the certificates in $PKI"
  rm -rf "$PKI"
  mkdir -p "$PKI"
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -days 3650 \
    -subj "/CN=nemo-gym-kubernetes-ca" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" -addext "subjectKeyIdentifier=hash" \
    -keyout "$PKI/ca.key" -out "$PKI/ca.crt" 2>/dev/null
  # certificate NAME SUBJECT [SUBJECT_ALT_NAMES]
  certificate() {
    local extensions="$PKI/$1.ext"
    {
      echo "basicConstraints=CA:FALSE"
      echo "keyUsage=critical,digitalSignature,keyEncipherment"
      echo "extendedKeyUsage=serverAuth,clientAuth"
      echo "subjectKeyIdentifier=hash"
      echo "authorityKeyIdentifier=keyid,issuer"
      [ -n "${3:-}" ] && echo "subjectAltName=$3"
    } >"$extensions"
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -subj "$2" \
      -keyout "$PKI/$1.key" -out "$PKI/$1.csr" 2>/dev/null
    openssl x509 -req -in "$PKI/$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
      -CAcreateserial -days 3650 -extfile "$extensions" -out "$PKI/$1.crt" 2>/dev/null
    rm -f "$PKI/$1.csr" "$extensions"
  }
  certificate apiserver "/CN=kube-apiserver" \
    "IP:127.0.0.1,IP:$NODE_IP,IP:198.19.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  certificate apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  certificate admin "/O=system:masters/CN=nemo-gym-admin"
  certificate controller-manager "/CN=system:kube-controller-manager"
  certificate scheduler "/CN=system:kube-scheduler"
  certificate kubelet-client "/O=system:nodes/CN=system:node:$NODE_NAME"
  certificate kubelet "/CN=$NODE_NAME" "IP:$NODE_IP,DNS:$NODE_NAME"
  openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/service-account.key"
  openssl ec -in "$PKI/service-account.key" -pubout -out "$PKI/service-account.pub" 2>/dev/null
  touch "$PKI/complete"
fi

# The API server's port: the same on the host's loopback (the forwarder) and inside the
# namespace (the API server itself), so one kubeconfig serves both. The previous one where free.
port="$(python3 "$CHECKOUT/scripts/free_port.py" "$(cat "$PORT_FILE" 2>/dev/null || echo 0)")"
echo "$port" >"$PORT_FILE"

# kubeconfig FILE CERTIFICATE: a kubeconfig of https://127.0.0.1:$port with that client certificate.
kubeconfig() {
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: $CLUSTER_NAME
  cluster:
    server: https://127.0.0.1:$port
    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(base64 -w0 "$PKI/$2.crt")
    client-key-data: $(base64 -w0 "$PKI/$2.key")
contexts:
- name: $CLUSTER_NAME
  context:
    cluster: $CLUSTER_NAME
    user: $2
current-context: $CLUSTER_NAME
EOF
}
kubeconfig "$ADMIN_KUBECONFIG" admin
kubeconfig "$STATE/controller-manager.kubeconfig" controller-manager
kubeconfig "$STATE/scheduler.kubeconfig" scheduler
kubeconfig "$STATE/kubelet.kubeconfig" kubelet-client

# 4. The network namespace: the node's address on its lo, pods on a CNI bridge inside it. A pod
# has one route beyond its subnet, to the node's address through the bridge: the API server and
# the kubelet are there, as in any cluster (a reader running in a pod, in-cluster); nothing else
# is reachable from the namespace, so no default route.
ip netns add "$NETNS_NAME"
ip -n "$NETNS_NAME" link set lo up
ip -n "$NETNS_NAME" addr add "$NODE_IP/32" dev lo
mkdir -p "$STATE/cni/net.d"
cat >"$STATE/cni/net.d/10-nemo-gym.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "nemo-gym",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_SUBNET", "gateway": "$POD_GATEWAY"}]],
        "routes": [{"dst": "$NODE_IP/32"}],
        "dataDir": "$STATE/cni/ipam"
      }
    }
  ]
}
EOF

# The host settings the kubelet will change, saved once (a start after an unclean stop keeps
# the values from before the first start).
if [ ! -f "$SYSCTL_FILE" ]; then
  for name in $HOST_SYSCTLS; do
    echo "$name $(sysctl -n "$name")"
  done >"$SYSCTL_FILE.tmp"
  mv "$SYSCTL_FILE.tmp" "$SYSCTL_FILE"
fi
[ -d /sys/fs/cgroup/memory/kubepods ] || [ -d /sys/fs/cgroup/kubepods ] || touch "$STATE/kubepods-ours"
# Host folders the kubelet and containerd make whatever their configuration says: removed by
# --stop when they were not there before (what it leaves in them is named in stop_cluster).
for folder in $HOST_FOLDERS; do
  [ -e "$folder" ] || grep -qxF "$folder" "$STATE/host-folders-ours" 2>/dev/null ||
    echo "$folder" >>"$STATE/host-folders-ours"
done

# 5. The components, each waited for before the next.
rm -rf "$STATE/etcd" "$STATE/kubelet" "$STATE/pod-logs" "$STATE/cni/ipam"
mkdir -p "$STATE/logs" "$STATE/kubelet" "$STATE/pod-logs" "$STATE/containerd"
started=$SECONDS

wait_for() { # wait_for WHAT SECONDS COMPONENT COMMAND...
  local what="$1" seconds="$2" component="$3"
  shift 3
  for _ in $(seq 1 $((seconds * 4))); do
    "$@" >/dev/null 2>&1 && return 0
    if ! our_process "$component" >/dev/null; then
      log "$component ended; its log ($STATE/logs/$component.log):"
      tail -n 30 "$STATE/logs/$component.log" >&2 || true
      exit 1
    fi
    sleep 0.25
  done
  log "$what did not come within $seconds s; the log of $component ($STATE/logs/$component.log):"
  tail -n 30 "$STATE/logs/$component.log" >&2 || true
  exit 1
}

run_component etcd "$STATE/logs/etcd.log" "$BIN/etcd" --name node --data-dir "$STATE/etcd" \
  --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster node=http://127.0.0.1:2380 --log-level warn
wait_for "etcd" 60 etcd nsenter "--net=$NETNS" curl -fsS --max-time 2 http://127.0.0.1:2379/health

run_component kube-apiserver "$STATE/logs/kube-apiserver.log" "$BIN/kube-apiserver" \
  --etcd-servers=http://127.0.0.1:2379 --bind-address=0.0.0.0 --secure-port="$port" \
  --advertise-address="$NODE_IP" --anonymous-auth=false \
  --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
  --client-ca-file="$PKI/ca.crt" --kubelet-certificate-authority="$PKI/ca.crt" \
  --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
  --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
  --kubelet-preferred-address-types=InternalIP \
  --service-account-issuer=https://kubernetes.default.svc \
  --service-account-key-file="$PKI/service-account.pub" \
  --service-account-signing-key-file="$PKI/service-account.key" \
  --service-cluster-ip-range="$SERVICE_RANGE" --authorization-mode=Node,RBAC \
  --endpoint-reconciler-type=none --allow-privileged=true --profiling=false
# The interpreter itself, not a wrapper (pyenv's python3 is a shell script): the binary the
# kernel shows for the process is what recognises it as ours.
python_bin="$(python3 -c 'import os, sys; print(os.path.realpath(sys.executable))')"
run_component forward "$STATE/logs/forward.log" "$python_bin" \
  "$CHECKOUT/scripts/kubernetes/forward.py" "$port" "$NETNS"
wait_for "the API server" 120 kube-apiserver kubectl_ get --raw /readyz

run_component kube-controller-manager "$STATE/logs/kube-controller-manager.log" \
  "$BIN/kube-controller-manager" --kubeconfig="$STATE/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$STATE/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$STATE/controller-manager.kubeconfig" \
  --service-account-private-key-file="$PKI/service-account.key" --root-ca-file="$PKI/ca.crt" \
  --use-service-account-credentials=true --leader-elect=false --bind-address=127.0.0.1 \
  --profiling=false
run_component kube-scheduler "$STATE/logs/kube-scheduler.log" "$BIN/kube-scheduler" \
  --kubeconfig="$STATE/scheduler.kubeconfig" \
  --authentication-kubeconfig="$STATE/scheduler.kubeconfig" \
  --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
  --leader-elect=false --bind-address=127.0.0.1 --profiling=false

cat >"$STATE/containerd.toml" <<EOF
version = 2
root = "$STATE/containerd/root"
state = "$STATE/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This machine drops CAP_SYS_RESOURCE even for root: without it runc cannot start a pod.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$STATE/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
EOF
run_component containerd "$STATE/logs/containerd.log" "$(command -v containerd)" \
  --config "$STATE/containerd.toml"
wait_for "containerd" 60 containerd ctr_ version

# The images, built once into the cache (docker-save tars) and imported when missing.
IMAGES="$CACHE/images-$(cat "$CHECKOUT/scripts/kubernetes/pause.go" /bin/busybox "$CHECKOUT/scripts/kubernetes/image.py" | sha256sum | cut -c1-12)"
if [ ! -f "$IMAGES/complete" ]; then
  log "building the images $PAUSE_IMAGE and $TEST_IMAGE into $IMAGES"
  rm -rf "$IMAGES"
  mkdir -p "$IMAGES/pause/bin" "$IMAGES/busybox/bin"
  GOTOOLCHAIN=local CGO_ENABLED=0 "$go_bin" build -trimpath -ldflags "-s -w" \
    -o "$IMAGES/pause/bin/pause" "$CHECKOUT/scripts/kubernetes/pause.go" >&2
  cp /bin/busybox "$IMAGES/busybox/bin/busybox"
  for tool in $(/bin/busybox --list); do
    [ -e "$IMAGES/busybox/bin/$tool" ] || ln -s busybox "$IMAGES/busybox/bin/$tool"
  done
  python3 "$CHECKOUT/scripts/kubernetes/image.py" "$IMAGES/pause" "$PAUSE_IMAGE" '["/bin/pause"]' "$IMAGES/pause.tar"
  python3 "$CHECKOUT/scripts/kubernetes/image.py" "$IMAGES/busybox" "$TEST_IMAGE" '["/bin/sh"]' "$IMAGES/busybox.tar"
  rm -rf "$IMAGES/pause" "$IMAGES/busybox"
  touch "$IMAGES/complete"
fi
for image in pause busybox; do
  ctr_ images import "$IMAGES/$image.tar" >/dev/null
done

cat >"$STATE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $PKI/kubelet.crt
tlsPrivateKeyFile: $PKI/kubelet.key
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: $PKI/ca.crt
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
# No systemd here, and cgroup v1: Kubernetes 1.35 and later refuse it, 1.34 with this.
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
podLogsDir: $STATE/pod-logs
# The imported images are the only ones there are: never collected.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 2%
  imagefs.available: 2%
  nodefs.inodesFree: 2%
EOF
run_component kubelet "$STATE/logs/kubelet.log" "$BIN/kubelet" --config="$STATE/kubelet.yaml" \
  --kubeconfig="$STATE/kubelet.kubeconfig" --root-dir="$STATE/kubelet" \
  --node-ip="$NODE_IP" --hostname-override="$NODE_NAME" --cert-dir="$PKI/kubelet-certs"
wait_for "the node" 120 kubelet kubectl_ wait --for=condition=Ready "node/$NODE_NAME" --timeout=1s
wait_for "the default service account" 60 kube-controller-manager kubectl_ get serviceaccount default
log "cluster ready in $((SECONDS - started)) s (state folder $STATE, logs in $STATE/logs)"
print_env
