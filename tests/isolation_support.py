"""Helpers of the process isolation tests: is bwrap on PATH, and a server process of a script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def bwrap_on_path() -> bool:
    """Whether this process's PATH has a ``bwrap``."""
    return any(Path(d, "bwrap").is_file() for d in os.environ.get("PATH", "").split(os.pathsep))


def run_server(
    tmp_path: Path,
    env: dict[str, str],
    *arguments: str,
    script: str,
    interpreter: str = sys.executable,
    prefix: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``script`` as a server process of its own, with exactly ``env`` (and this test's
    Python path), run by ``interpreter`` (this one by default) by its absolute path, after
    ``prefix`` (a command that changes the user, say)."""
    path = tmp_path / "server.py"
    path.write_text(script)
    path.chmod(0o644)
    return subprocess.run(
        [*prefix, interpreter, str(path), *arguments],
        env={**env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
