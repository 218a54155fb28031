# Sourced by start-collector.sh and start-opensandbox.sh: what lets a script end only a process
# it started, by PID. The caller defines log() first.

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

# end_owned PID STILL_OURS...: SIGTERM, then SIGKILL if it still runs after 10 s and the
# command STILL_OURS... still says it is ours (a PID reused meanwhile is somebody else's).
end_owned() {
  local pid="$1"
  shift
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    alive "$pid" || break
    sleep 0.1
  done
  if "$@" >/dev/null; then
    log "pid $pid still runs after 10 s; sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
  fi
}
