"""``scripts/start-collector.sh`` waiting for another start of the same collector says so.

``eval "$(bash scripts/start-collector.sh --env)"`` shows only the script's stderr until it
ends; while another start (a build of minutes, the first time) holds the state folder's lock,
the waiting one must say what it waits for. The lock is held here, by the test, as the other
start would hold it: no Go, no build, no collector needed.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import threading
from pathlib import Path

from collector_support import START_COLLECTOR


def test_start_collector_env_waiting_for_another_start_says_so_on_stderr(
    tmp_path: Path,
) -> None:
    """With the lock held by another start that is building, ``--env`` prints at once on stderr
    that it waits and what the other start is doing, and nothing on stdout."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "progress").write_text("building the collector since 07:00:00 UTC (pid 1)\n")
    env = dict(os.environ, NEMO_GYM_COLLECTOR_DIR=str(state), NEMO_GYM_COLLECTOR_PORTS="0,0,0")
    with open(state / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = subprocess.Popen(
            ["bash", str(START_COLLECTOR), "--jaeger", "--env"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        # Bounded: a script that waits silently is ended after 60 s, and says nothing.
        silent = threading.Timer(60, os.killpg, (waiting.pid, signal.SIGKILL))
        silent.start()
        try:
            assert waiting.stderr is not None
            first = waiting.stderr.readline()  # until the script says something, or ends
        finally:
            silent.cancel()
            os.killpg(waiting.pid, signal.SIGKILL)  # the script and its flock: our session
            stdout, _ = waiting.communicate(timeout=60)
    assert first == (
        "start-collector: another start of this collector is under way (building the "
        "collector since 07:00:00 UTC (pid 1)); waiting for it\n"
    )
    assert stdout == ""
