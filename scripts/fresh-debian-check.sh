#!/usr/bin/env bash
# The README's two commands on a fresh Debian 12, as a new user meets them: a Debian 12
# (bookworm) root filesystem made by mmdebstrap from Debian's packages alone, run in Podman,
# a fresh clone of this checkout's HEAD (committed work only) in it, nothing cached (no pip
# cache, no virtualenv: pip fetches everything from the registry as it is today). Runs
#   bash scripts/quickstart.sh      then      bash scripts/test.sh
# as root in the container and prints each one's output, exit status and wall time. Exits 1 if
# either fails. Not part of .ci/run (it takes several minutes: see CONTRIBUTING.md).
#
#   bash scripts/fresh-debian-check.sh [--unprivileged] [--quickstart-only] [--log FILE]
#
# Needs root, mmdebstrap and podman on the machine, and the network to reach Debian's mirror
# (DEBIAN_MIRROR, default http://deb.debian.org/debian) and the package index. The machine's
# own local certificate authorities (/usr/local/share/ca-certificates/*.crt, for example a
# TLS-intercepting proxy's between this machine and the index) are trusted in the container too
# (update-ca-certificates, as its administrator would on a fresh machine behind that proxy).
# By default the container is --privileged, as root on a fresh machine is: it may make cgroups
# (the quickstart's sandbox limits and OOM kill) and namespaces (bubblewrap's isolation).
# --unprivileged runs it as an ordinary container, where neither works: the quickstart then
# says what is missing and shows what it can. --quickstart-only leaves out the tests.
# --log FILE also writes the whole run to FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
privileged=(--privileged)
commands='"bash scripts/quickstart.sh" "bash scripts/test.sh"'
log=/dev/null
while [ $# -gt 0 ]; do
  case "$1" in
    --unprivileged) privileged=() ;;
    --quickstart-only) commands='"bash scripts/quickstart.sh"' ;;
    --log) log="${2:?--log needs a file}"; shift ;;
    *)
      echo "usage: bash scripts/fresh-debian-check.sh [--unprivileged] [--quickstart-only]" \
        "[--log FILE]" >&2
      exit 2
      ;;
  esac
  shift
done
# What the README asks a user to install on a bare Debian 12, and git to clone with.
packages=python3,python3-venv,git,ca-certificates,bubblewrap
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
work="$(mktemp -d "${TMPDIR:-/tmp}/fresh-debian.XXXXXX")"
image="localhost/nemo-gym-fresh-debian:$(basename "$work" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' -)"
cleanup() {
  podman rmi -f "$image" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

exec > >(tee -a "$log") 2>&1
echo "== $(date -u +%FT%TZ) fresh Debian 12: mmdebstrap bookworm ($packages) from $mirror"
SECONDS=0
mmdebstrap --quiet --variant=minbase --include="$packages" bookworm "$work/rootfs.tar" "$mirror"
podman import --quiet "$work/rootfs.tar" "$image" >/dev/null
rm -f "$work/rootfs.tar"
echo "== root filesystem built and imported in ${SECONDS} s"
git clone --quiet --no-hardlinks "$PWD" "$work/clone"
echo "== the clone: $(git -C "$work/clone" log -1 --format='%h %s')"
local_cas=()
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  local_cas=(--volume /usr/local/share/ca-certificates:/usr/local/share/ca-certificates:ro)
  echo "== trusting this machine's local CAs: $(cd /usr/local/share/ca-certificates && echo *.crt)"
fi
echo "== podman run --rm ${privileged[*]:-(unprivileged)}"

# Each command's output, then one line with its exit status and wall time.
status=0
# --cgroupns=private: the container's cgroups are its own tree, rooted at /, as on a machine
# (Podman's default on a cgroup v1 host shares the host's view in /proc/<pid>/cgroup).
# --ulimit nofile=1024:HARD: a fresh Debian 12's soft descriptor limit (1024) under a hard one
# far above it (systemd's default is 524288; here as high as this machine's own hard limit),
# not the 1024:1024 that scripts/start-podman.sh gives containers.
# (Any --ulimit replaces containers.conf's list, so its process limit is given again.)
podman run --rm "${privileged[@]}" --cgroupns=private --ulimit "nofile=1024:$(ulimit -Hn)" \
  --ulimit nproc=1024:1024 \
  "${local_cas[@]}" \
  --volume "$work/clone:/root/clone" --workdir /root/clone --env HOME=/root --env LANG=C.UTF-8 "$image" bash -c '
    update-ca-certificates >/dev/null 2>&1
    echo "$(. /etc/os-release; echo "$PRETTY_NAME") (Debian $(cat /etc/debian_version)), $(python3 --version)"
    status=0
    for command in '"$commands"'; do
      echo; echo "== $ $command"
      start=$(date +%s)
      code=0
      $command || code=$?
      echo "== $command: exit $code, $(( $(date +%s) - start )) s wall"
      [ "$code" -eq 0 ] || status=1
    done
    exit "$status"
  ' || status=$?
echo "== fresh Debian 12 check: $([ "$status" -eq 0 ] && echo passed || echo FAILED), ${SECONDS} s in all"
exit "$status"
