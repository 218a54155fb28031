"""Helpers of the process isolation tests: is bwrap on PATH, and a server process of a script
(run as this user, or as root and as nobody)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import require_service

NOBODY = 65534


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


def run_server_as(
    server_user: str, script: str, *arguments: str
) -> subprocess.CompletedProcess[str]:
    """``script`` as a server process running as ``server_user``: "root" (this interpreter)
    or "nobody" (through setpriv, with an interpreter of this version that nobody can run).
    Both need this test to run as root, and bwrap on PATH."""
    require_service(os.geteuid() == 0, "runs servers as root and as nobody (run as root)")
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    prefix: tuple[str, ...] = ()
    interpreter = sys.executable
    if server_user == "nobody":
        setpriv = shutil.which("setpriv")
        require_service(setpriv is not None, "setpriv not on PATH (util-linux)")
        assert setpriv is not None
        prefix = (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")
        found = _interpreter_for(NOBODY)
        if found is None:  # pyenv's Python under /root, and no system Python of its version
            pytest.skip(f"no Python {sys.version_info[:2]} that uid {NOBODY} can run")
        interpreter = found
    # The script where nobody can read it (pytest's tmp_path is root's alone).
    scripts = Path(tempfile.mkdtemp(prefix="nemo-gym-server-"))
    try:
        scripts.chmod(0o755)
        env = {"PATH": os.environ["PATH"]}
        return run_server(
            scripts, env, *arguments, script=script, interpreter=interpreter, prefix=prefix
        )
    finally:
        shutil.rmtree(scripts)


def _interpreter_for(uid: int) -> str | None:
    """This Python's binary, or the system's of the same version, where ``uid`` may run it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (os.path.realpath(sys.executable), f"/usr/bin/python{version}"):
        path = Path(candidate)
        if path.is_file() and all(_passable(d, uid) for d in path.parents):
            return candidate
    return None


def _passable(directory: Path, uid: int) -> bool:
    info = directory.stat()
    bit = stat.S_IXUSR if info.st_uid == uid else stat.S_IXOTH
    return bool(info.st_mode & bit)


def cgroup_mounts() -> dict[str, Path]:
    """Controller -> mount point of this machine's cgroup hierarchies, read independently of
    the code under test ("" is the v2 hierarchy)."""
    mounts: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fs = right.split()
        if fs[0] == "cgroup":
            for option in fs[2].split(","):
                mounts.setdefault(option, Path(left.split()[4]))
        elif fs[0] == "cgroup2":
            mounts.setdefault("", Path(left.split()[4]))
    return mounts


def own_cgroup_paths() -> dict[str, str]:
    """Controller -> this process's cgroup path ("" is the v2 one), from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path
    return paths
