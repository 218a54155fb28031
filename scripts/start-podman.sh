#!/usr/bin/env bash
# Start Podman's Docker-compatible API service for the DockerSandboxProvider tests.
#
# Idempotent: installs podman, runc and busybox-static when missing, writes the engine
# configuration, builds a local busybox image (no registry needed), starts
# `podman system service` on a unix socket unless it already answers, and prints the
# `DOCKER_HOST=...` line for the tests. Running it twice changes nothing the second time.
#
# Environment (all optional):
#   NEMO_GYM_PODMAN_SOCKET  socket path          (default /run/nemo-gym-podman/podman.sock)
#   NEMO_GYM_TEST_IMAGE     image name to import (default localhost/nemo-gym-busybox:latest)
#
# Usage:  eval "export $(scripts/start-podman.sh | tail -n 1)"
set -euo pipefail

SOCKET="${NEMO_GYM_PODMAN_SOCKET:-/run/nemo-gym-podman/podman.sock}"
IMAGE="${NEMO_GYM_TEST_IMAGE:-localhost/nemo-gym-busybox:latest}"
STATE_DIR="$(dirname "$SOCKET")"
CONF=/etc/containers/containers.conf

log() { echo "start-podman: $*" >&2; }

if [ "$(id -u)" != 0 ]; then
  log "run as root: it installs packages and writes $CONF"
  exit 2
fi

# 1. Packages. runc rather than crun: crun fails on cgroups in hybrid (v1 + unified) mode.
config_changed=0
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v curl >/dev/null || missing+=(curl)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq "${missing[@]}" >&2
fi

# 2. Engine configuration. Podman's default rlimits are refused in unprivileged CI
# containers, so the defaults are set to values every kernel accepts.
#
# conmon writes its "oom" marker into its working directory, but Podman 4.3 starts a
# container's conmon in the API service's directory and looks for the marker in the
# container's bundle directory, so State.OOMKilled would never be true. The wrapper runs
# conmon in the bundle directory (its -b argument).
CONMON_WRAPPER=/usr/local/libexec/nemo-gym/conmon
want_wrapper='#!/bin/sh
# Written by scripts/start-podman.sh: run conmon in the bundle directory (see there).
prev=
for arg in "$@"; do
  if [ "$prev" = "-b" ] || [ "$prev" = "--bundle" ]; then cd "$arg" 2>/dev/null || true; break; fi
  prev=$arg
done
exec /usr/bin/conmon "$@"'
if [ ! -f "$CONMON_WRAPPER" ] || [ "$(cat "$CONMON_WRAPPER")" != "$want_wrapper" ]; then
  mkdir -p "$(dirname "$CONMON_WRAPPER")"
  printf '%s\n' "$want_wrapper" >"$CONMON_WRAPPER"
  chmod 755 "$CONMON_WRAPPER"
  log "wrote $CONMON_WRAPPER"
fi
want_conf="# Written by scripts/start-podman.sh (opentelemetry-instrumentation-nemo-gym tests).
[containers]
default_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]

[engine]
runtime = \"runc\"
conmon_path = [\"$CONMON_WRAPPER\"]"
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$want_conf" ]; then
  if [ -f "$CONF" ] && ! grep -q 'scripts/start-podman.sh' "$CONF"; then
    cp "$CONF" "$CONF.before-nemo-gym"
    log "saved the previous $CONF as $CONF.before-nemo-gym"
  fi
  mkdir -p "$(dirname "$CONF")"
  printf '%s\n' "$want_conf" >"$CONF"
  log "wrote $CONF"
  config_changed=1
fi

# 3. A local image: a busybox root filesystem, imported, so no registry is contacted.
if ! podman image exists "$IMAGE"; then
  rootfs="$(mktemp -d)"
  trap 'rm -rf "$rootfs" "$rootfs.tar"' EXIT
  mkdir -p "$rootfs/bin" "$rootfs/tmp" "$rootfs/etc" "$rootfs/proc" "$rootfs/sys" \
    "$rootfs/dev" "$rootfs/root" "$rootfs/workspace"
  chmod 1777 "$rootfs/tmp"
  cp /bin/busybox "$rootfs/bin/busybox"
  for tool in sh ash cat sleep echo ls mkdir rm cp mv head tail dd yes env id printf \
    true false test sed grep wc tr seq expr kill ps top uname date touch chmod stat; do
    ln -s busybox "$rootfs/bin/$tool"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\n' >"$rootfs/etc/group"
  tar -C "$rootfs" -cf "$rootfs.tar" .
  podman import --change 'CMD ["/bin/sh"]' --change 'ENV PATH=/bin' "$rootfs.tar" "$IMAGE" >&2
  rm -f "$rootfs.tar"
  log "imported $IMAGE"
fi

# 4. The API service, unless one already answers on the socket.
ping() { curl -fsS --max-time 2 --unix-socket "$SOCKET" http://d/_ping >/dev/null 2>&1; }
if [ "$config_changed" = 1 ] && [ -f "$STATE_DIR/service.pid" ] && ping; then
  # A service this script started earlier runs with the old configuration: restart it.
  old_pid="$(cat "$STATE_DIR/service.pid")"
  log "configuration changed; restarting the service (pid $old_pid)"
  kill "$old_pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 "$old_pid" 2>/dev/null || break
    sleep 0.1
  done
fi
if ! ping; then
  mkdir -p "$STATE_DIR"
  rm -f "$SOCKET"
  # setsid + nohup: the service outlives this script and the CI step that ran it. It runs
  # in its state directory: its children's stray files must never land in a checkout.
  (cd "$STATE_DIR" && exec setsid nohup podman system service --time=0 "unix://$SOCKET" \
    >"$STATE_DIR/service.log" 2>&1 </dev/null) &
  echo $! >"$STATE_DIR/service.pid"
  for _ in $(seq 1 100); do
    ping && break
    sleep 0.2
  done
  if ! ping; then
    log "the service did not answer on $SOCKET; its log:"
    cat "$STATE_DIR/service.log" >&2 || true
    exit 1
  fi
  log "service started (pid $(cat "$STATE_DIR/service.pid"), log $STATE_DIR/service.log)"
fi

echo "DOCKER_HOST=unix://$SOCKET"
