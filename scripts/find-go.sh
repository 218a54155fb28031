# Sourced by the scripts that build Go programs (start-collector.sh, start-opensandbox.sh,
# benchmarks/dockerstats/build.sh). The caller defines log() first.
#   find_go [WHY]
# sets go_bin to the Go to build with: $GO, else /usr/local/go/bin/go (the Go these programs'
# modules need is newer than Debian's), else `go` on PATH; exits 1 with WHY when there is none.
find_go() {
  go_bin="${GO:-}"
  if [ -z "$go_bin" ]; then
    if [ -x /usr/local/go/bin/go ]; then go_bin=/usr/local/go/bin/go; else go_bin="$(command -v go || true)"; fi
  fi
  if [ -z "$go_bin" ] || ! "$go_bin" version >/dev/null 2>&1; then
    log "no Go found (set GO=/path/to/go${1:+; $1})"
    exit 1
  fi
}
