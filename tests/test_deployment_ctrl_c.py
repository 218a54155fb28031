"""The deployment test's Ctrl-C reaches the page's shells even when the test process was
started with SIGINT ignored (a background job of a non-interactive shell): the harness's
``ctrl_c_reaches_the_shells``, checked with real bash and Python children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_deployment import ctrl_c_reaches_the_shells

SIGINT_BIT = 1 << (signal.SIGINT - 1)
# A command typed into the page's shell: a Python process that says when it runs, then waits.
WAITING_PYTHON = (
    f"exec {sys.executable} -c \"import time; print('ready', flush=True); time.sleep(600)\""
)


@pytest.fixture
def sigint_ignored() -> Iterator[None]:
    """This process as ``pytest ... &`` in a non-interactive shell starts it: SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_shell() -> subprocess.Popen[str]:
    """A shell like the harness's (bash, a session of its own) running a Python command."""
    shell = subprocess.Popen(
        ["bash", "-e", "-c", f"true; {WAITING_PYTHON}"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert shell.stdout is not None
    assert shell.stdout.readline() == "ready\n"
    return shell


def _ignored_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)


def test_ctrl_c_reaches_the_shells_ends_the_command(sigint_ignored: None) -> None:
    """Started inside it, the shell's command has SIGINT's default action and ends by Ctrl-C."""
    with ctrl_c_reaches_the_shells():
        shell = _start_shell()
    try:
        assert _ignored_signals(shell.pid) & SIGINT_BIT == 0
        os.killpg(shell.pid, signal.SIGINT)
        assert shell.wait(timeout=60) == -signal.SIGINT  # KeyboardInterrupt, as at a terminal
    finally:
        if shell.poll() is None:
            shell.kill()
        shell.communicate()  # reaps it and closes its pipe
    # This process's own disposition is given back.
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_ctrl_c_reaches_the_shells_without_it_sigint_stays_ignored(sigint_ignored: None) -> None:
    """Without it, the command inherits the ignored SIGINT: the Ctrl-C the test sends is lost."""
    shell = _start_shell()
    try:
        assert _ignored_signals(shell.pid) & SIGINT_BIT == SIGINT_BIT
    finally:
        shell.kill()
        shell.communicate()


def test_ctrl_c_reaches_the_shells_leaves_a_handler_alone() -> None:
    """Where SIGINT is not ignored, this process's handler is left as it is."""
    before = signal.getsignal(signal.SIGINT)
    with ctrl_c_reaches_the_shells():
        assert signal.getsignal(signal.SIGINT) is before
    assert signal.getsignal(signal.SIGINT) is before
