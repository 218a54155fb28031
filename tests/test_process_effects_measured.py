"""The measurement docs/process-effects.md quotes, run small: what the SIGTERM handler and the
exit flush keep, against the same process without them (scripts/sigterm_flush.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sigterm_flush.py"


def test_process_effects_sigterm_handler_and_exit_flush_keep_the_last_counts() -> None:
    """With the handler or the exit flush every count leaves; without, none do; the process
    ends by SIGTERM, or by the kill, either way. (The kill comes 4 s into a 5 s exit handler:
    a loaded machine still flushes in time, and without the flush still loses the counts.)"""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--counts", "10", "--rounds", "1", "--kill-after", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = {
        match[0]: (match[1], match[2])
        for match in re.findall(r"^(\S+)\s+exported \[(\d+)\] of 10, exit status \[(-?\d+)\]",
                                done.stdout, re.M)
    }  # fmt: skip
    assert found == {
        "sigterm-handler": ("10", "-15"),
        "sigterm-default": ("0", "-15"),
        "exit-killed": ("10", "-9"),
        "exit-killed-noflush": ("0", "-9"),
    }, done.stdout
