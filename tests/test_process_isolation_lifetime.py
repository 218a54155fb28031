"""How long an isolated sandbox's processes live: a command is never killed by bubblewrap's own
process juggling, and nothing of a sandbox outlives the server that made it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from conftest import require_service
from isolation_support import bwrap_on_path
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from waiting import eventually, eventually_blocking

# prctl(2): PR_GET_PDEATHSIG writes the caller's parent-death signal (0: none) into an int.
READ_PARENT_DEATH_SIGNAL = (
    "import ctypes; libc = ctypes.CDLL(None, use_errno=True); sig = ctypes.c_int(-1); "
    "assert libc.prctl(2, ctypes.byref(sig), 0, 0, 0) == 0, ctypes.get_errno(); print(sig.value)"
)


# The system's Python, inside the sandbox's system directories. This interpreter may live
# where a root server's sandbox_uid cannot reach (pyenv's, under /root).
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
async def provider() -> AsyncIterator[ProcessSandboxProvider]:
    """An isolated provider whose commands can run a Python: the system's, else this one's
    (its installation then bound read-only)."""
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    extra = [] if _interpreter() == SYSTEM_PYTHON else [sys.base_prefix]
    made = ProcessSandboxProvider(cgroups=False, read_only_paths=extra)
    yield made
    await made.aclose()


def _interpreter() -> str:
    """The system's Python where there is one, else this interpreter's own binary (a
    virtualenv's python is a link into sys.base_prefix)."""
    return SYSTEM_PYTHON if Path(SYSTEM_PYTHON).is_file() else os.path.realpath(sys.executable)


async def test_process_isolation_command_has_no_parent_death_signal(
    provider: ProcessSandboxProvider,
) -> None:
    """A command runs with no parent-death signal: bubblewrap joins the holder's PID namespace
    through an intermediate process that exits when the scheduler lets it, and a SIGKILL tied
    to that exit killed commands that had already run (137 with their output, under load)."""
    python = _interpreter()
    sandbox = await provider.create(SandboxSpec())
    # exec: Python is then bwrap's own child, with what bwrap set (a fork would clear it).
    result = await provider.exec(sandbox, f"exec {python} -c '{READ_PARENT_DEATH_SIGNAL}'")
    assert (result.return_code, result.stdout, result.stderr) == (0, "0\n", "")


# A server that makes an isolated sandbox, leaves a background process in it, and then waits in
# an exec of a command that never ends. It prints its PID namespace's inode once both run.
SERVER = r"""
import asyncio, os, sys
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

async def main():
    provider = ProcessSandboxProvider(cgroups=False)
    sandbox = await provider.create({})
    await provider.exec(sandbox, "sleep 1000 >/dev/null 2>&1 &")
    waiting = asyncio.ensure_future(provider.exec(sandbox, "touch started; exec sleep 1001"))
    started = sandbox.raw.workdir / "started"
    for _ in range(600):  # bounded: 60 s
        if started.exists():
            break
        await asyncio.sleep(0.1)
    print(os.fstat(sandbox.raw.jail.pidns_fd).st_ino, flush=True)
    await waiting

asyncio.run(main())
"""


def _processes() -> list[tuple[int, int, int | None]]:
    """(PID, parent PID, PID namespace inode) of every process this host shows."""
    found = []
    with os.scandir("/proc") as entries:
        pids = [int(e.name) for e in entries if e.name.isdigit()]
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            namespace: int | None = os.stat(f"/proc/{pid}/ns/pid").st_ino
        except OSError:
            continue
        parent = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("PPid:"))
        found.append((pid, parent, namespace))
    return found


def _descendants(root: int, table: list[tuple[int, int, int | None]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, parent, _ in table:
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; ``None`` if it has ended already."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def test_process_isolation_sandbox_ends_with_its_server(tmp_path: Path) -> None:
    """SIGKILL the server: every process of its sandbox ends (the holder, its init, a
    background process, the command being waited for, and that command's bwrap), although
    only the holder is tied to the server's life."""
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server = subprocess.Popen(
        [sys.executable, str(script)],
        env={
            "PATH": os.environ["PATH"],
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 60)
        assert ready, "the server did not start its sandbox within 60 s"
        namespace = int(server.stdout.readline())
        table = _processes()
        ours = _descendants(server.pid, table)
        inside = {pid for pid, _, ns in table if ns == namespace}
        # The holder's bwrap and init, sleep infinity, the background sleep, the waited-for
        # sleep, and the exec's bwrap (its monitor, outside the namespace) at least.
        assert len(inside) >= 4, (inside, ours)
        assert inside <= ours, (inside, ours)
        assert len(ours - inside) >= 2, (inside, ours)
        pidfds = [fd for fd in map(_pidfd, ours) if fd is not None]
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=60)

        def all_ended() -> bool:
            # A pidfd reads as ready once its process has ended.
            return all(select.select([fd], [], [], 0)[0] for fd in pidfds)

        try:
            eventually_blocking(all_ended, "every process of the sandbox ended", 60, 0.1)
        finally:
            for fd in pidfds:
                os.close(fd)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()


def _sleepers(sessions: set[int]) -> list[int]:
    """pidfds of the ``sleep 60`` processes in ``sessions`` (the host's view)."""
    found = []
    with os.scandir("/proc") as entries:
        pids = [int(e.name) for e in entries if e.name.isdigit()]
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        session = int(stat.rsplit(")", 1)[1].split()[3])
        if session in sessions and command == b"sleep\x0060\x00":
            pidfd = _pidfd(pid)
            if pidfd is not None:
                found.append(pidfd)
    return found


def _ended(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has ended (a pidfd reads as ready then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_process_isolation_exec_returns_when_its_command_exits(isolation: str) -> None:
    """``sleep 60 & echo started`` returns "started" and 0 when the shell exits, not at the
    timeout: the background sleep, which holds the output pipes, still runs after the exec
    returned, and is gone once the sandbox has closed."""
    if isolation == "bwrap":
        require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    provider = ProcessSandboxProvider(isolation=isolation, cgroups=False)
    pidfds: list[int] = []
    try:
        sandbox = await provider.create(SandboxSpec())
        result = await provider.exec(sandbox, "sleep 60 & echo started", timeout_s=30)
        # The background shell may not have exec'd sleep yet when the foreground one exits.
        pidfds = await eventually(
            lambda: _sleepers(sandbox.raw.sessions), "the background sleep", interval=0.01
        )
        alive_after_exec = [not _ended(fd) for fd in pidfds]
        await provider.close(sandbox)
        ended_after_close = [_ended(fd) for fd in pidfds]
    finally:
        await provider.aclose()
        for fd in pidfds:
            os.close(fd)
    assert (result.stdout, result.stderr, result.return_code, result.error_type) == (
        "started\n",
        "",
        0,
        None,
    )
    assert alive_after_exec == [True]
    assert ended_after_close == [True]
