#!/usr/bin/env bash
# Build the collector of builder-config.yaml (the contrib dockerstats receiver) with the
# OpenTelemetry Collector Builder, for benchmarks/sampler_cost.py --dockerstats only: CI never
# builds it. Idempotent: the binary is cached under
#   ${NEMO_GYM_DOCKERSTATS_CACHE:-${XDG_CACHE_HOME:-~/.cache}/nemo-gym-otel/dockerstats}/<key>/
# keyed by a hash of the manifest and the Go version, as scripts/start-collector.sh keys its
# collector. Prints the binary's path as its last line; logs go to stderr.
#
# Environment: GO, the Go to build with (default /usr/local/go/bin/go, else `go`).
set -euo pipefail

log() { echo "dockerstats/build: $*" >&2; }

HERE="$(cd "$(dirname "$0")" && pwd -P)"
BUILDER_VERSION=v0.149.0
cache="${NEMO_GYM_DOCKERSTATS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nemo-gym-otel/dockerstats}"

# shellcheck source=scripts/find-go.sh
source "$HERE/../../scripts/find-go.sh"
find_go
# The builder runs `go` from PATH: make it the one chosen here.
export PATH="$(dirname "$go_bin"):$PATH"

mkdir -p "$cache"
CACHE="$(cd "$cache" && pwd -P)"
key="$( (cat "$HERE/builder-config.yaml"; echo "$BUILDER_VERSION"; "$go_bin" version) | sha256sum | cut -c1-16)"
OUT="$CACHE/$key"
BIN="$OUT/nemo-gym-dockerstats-otelcol"
if [ ! -x "$BIN" ]; then
  # One build at a time per cache.
  exec 9>"$CACHE/lock"
  flock 9
fi
if [ ! -x "$BIN" ]; then
  BUILDER="$CACHE/bin/builder-$BUILDER_VERSION"
  if [ ! -x "$BUILDER" ]; then
    log "installing the OpenTelemetry Collector Builder $BUILDER_VERSION"
    mkdir -p "$CACHE/bin.tmp.$$"
    GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$CACHE/bin.tmp.$$" \
      nice -n 10 "$go_bin" install "go.opentelemetry.io/collector/cmd/builder@$BUILDER_VERSION" >&2
    mkdir -p "$CACHE/bin"
    mv "$CACHE/bin.tmp.$$/builder" "$BUILDER"
    rmdir "$CACHE/bin.tmp.$$"
  fi
  log "building with $("$go_bin" version) into $OUT (several minutes the first time)"
  started=$SECONDS
  rm -rf "$OUT.tmp"
  mkdir -p "$OUT.tmp"
  # The manifest with its output folder, outside the repository.
  { cat "$HERE/builder-config.yaml"; } | sed "s|^  # build.sh sets output_path.*|  output_path: $OUT.tmp|" \
    >"$OUT.tmp/builder-config.yaml"
  (cd "$OUT.tmp" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false \
    nice -n 10 "$BUILDER" --config "$OUT.tmp/builder-config.yaml") >&2
  rm -rf "$OUT"
  mv "$OUT.tmp" "$OUT"
  log "built in $((SECONDS - started)) s"
fi
echo "$BIN"
