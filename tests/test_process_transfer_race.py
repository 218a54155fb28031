"""A sandboxed command racing the process provider's file transfers and exec cwd with symlinks.

The attack: a path the server is about to copy flips, again and again, between a regular file
(or directory) of the sandbox and a symlink to a host file (or directory). A check-then-copy
(resolve, check that it stays inside, copy by name: the provider before the no-follow open)
loses as soon as a flip lands between the check and the copy; the provider must never read
or write a host file whatever the flips.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import shutil
import subprocess
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import require_service
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import _bwrap
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._process_sandbox import Sandbox
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxExecResult,
    SandboxHandle,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from symlink_flipper import AT_FDCWD, FLIPPER, FLIPS, RENAME_EXCHANGE
from waiting import eventually

# Rounds of transfers beside the flipping command (a download and an upload by the provider,
# the same by the old check-then-copy): at least MIN_ROUNDS, and on until the old one has been
# beaten both ways (after 1 to 981 rounds in 12 runs on a 2-core machine at a load of 55).
MIN_ROUNDS = 1_000
MAX_ROUNDS = 20_000
# Execs in the flipping directory, after the rounds.
EXECS = 40


@dataclass(frozen=True)
class Host:
    """The host's files the attacker points at: a file, and a directory holding ``f``."""

    secret: Path
    directory: Path
    text: str

    def untouched(self) -> bool:
        """Both files still hold the secret, and the directory nothing else."""
        return (
            self.secret.read_text() == self.text
            and (self.directory / "f").read_text() == self.text
            and sorted(p.name for p in self.directory.iterdir()) == ["f"]
        )


def plant_host(tmp_path: Path) -> Host:
    text = f"host secret {uuid.uuid4().hex}\n"
    secret = tmp_path / "secret.txt"
    secret.write_text(text)
    directory = tmp_path / "secret_dir"
    directory.mkdir()
    (directory / "f").write_text(text)
    return Host(secret, directory, text)


def sandbox_python() -> str:
    """The system's Python, which an isolated command sees under ``/usr``."""
    found = shutil.which("python3", path=_bwrap.SANDBOX_PATH)
    require_service(found is not None, "no python3 under /usr (apt-get install python3)")
    assert found is not None
    return found


# Each attempt against isolated and unisolated sandboxes: the transfers are the same code.
@pytest.fixture(params=["bwrap", "none"])
async def provider(request: pytest.FixtureRequest) -> AsyncIterator[ProcessSandboxProvider]:
    if request.param == "bwrap":
        require_service(shutil.which("bwrap") is not None, "bwrap not on PATH (bubblewrap)")
    made = ProcessSandboxProvider(cgroups=False, isolation=request.param)
    yield made
    await made.aclose()


async def sandbox_with_targets(provider: ProcessSandboxProvider) -> tuple[SandboxHandle, Sandbox]:
    """A sandbox holding x (a regular file) and d/f (a regular file in a directory)."""
    sandbox = await provider.create(SandboxSpec(files={"x": "sandbox x\n", "d/f": "sandbox f\n"}))
    return sandbox, sandbox.raw


def swap(state: Sandbox, name: str) -> None:
    """Swap ``name`` and ``name.swap`` in the sandbox directory at once, as the flipper does."""
    libc = ctypes.CDLL(None, use_errno=True)
    old, new = os.fsencode(state.workdir / name), os.fsencode(state.workdir / f"{name}.swap")
    assert libc.renameat2(AT_FDCWD, old, AT_FDCWD, new, RENAME_EXCHANGE) == 0, ctypes.get_errno()


# --- the provider before the no-follow open, kept here as the control --------------------------


def checked(state: Sandbox, value: str) -> Path:
    """The old check: resolve the path, symlinks included, and refuse it outside the sandbox."""
    resolved = (state.workdir / value).resolve()
    if not resolved.is_relative_to(state.root):
        raise ValueError(f"{value!r} is outside sandbox {state.sandbox_id}")
    return resolved


async def check_then_download(state: Sandbox, value: str, target: Path) -> None:
    """The old download: the check on the loop, the copy by name in a thread."""
    source = checked(state, value)
    await asyncio.to_thread(shutil.copyfile, source, target)


async def check_then_upload(state: Sandbox, source: Path, value: str) -> None:
    """The old upload: the check on the loop, the copy by name in a thread."""
    target = checked(state, value)
    await asyncio.to_thread(shutil.copyfile, source, target)


def check_then_run(state: Sandbox, cwd: str, between: Callable[[], None]) -> str:
    """The old unisolated exec in ``cwd``: check, then start ``cat f`` there by name."""
    directory = checked(state, cwd)
    between()
    return subprocess.run(
        ["cat", "f"], cwd=directory, capture_output=True, text=True, check=True, timeout=60
    ).stdout


# --- one interleaving, driven step by step ----------------------------------------------------


async def swapped_while_queued(transfer: Awaitable[None], swap_in: Callable[[], None]) -> None:
    """Run ``transfer`` with the loop's one worker thread held: what it does on the loop
    happens first (the old check did), then ``swap_in()``, then its work in the thread (the
    old copy; all of the provider's transfer)."""
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    held = loop.run_in_executor(None, gate.wait)
    task = asyncio.ensure_future(transfer)
    # One turn of the loop runs the new task up to its first suspension: handing its
    # thread work to the executor, where it queues behind the held worker.
    await asyncio.sleep(0)
    swap_in()
    gate.set()
    await held
    await task


async def test_process_provider_transfers_refuse_a_symlink_swapped_in_after_a_check(
    provider: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """A symlink to a host file swapped in between the check on the loop and the copy in a
    thread makes the old check-then-copy read and overwrite the host file; the provider, in
    the same interleaving, refuses both (its check is the open, in the thread)."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
    host = plant_host(tmp_path)
    sandbox, state = await sandbox_with_targets(provider)
    os.symlink(host.secret, state.workdir / "x.swap")
    os.symlink(host.directory, state.workdir / "d.swap")
    attack = tmp_path / "attack.txt"
    attack.write_text("attack\n")

    for path, name, host_file in (("x", "x", host.secret), ("d/f", "d", host.directory / "f")):
        flip = functools.partial(swap, state, name)
        # Control: the flip lands between the old check and its copy.
        copied = tmp_path / f"old-{name}.txt"
        await swapped_while_queued(check_then_download(state, path, copied), flip)
        assert copied.read_text() == host.text  # a host file read
        flip()
        await swapped_while_queued(check_then_upload(state, attack, path), flip)
        assert host_file.read_text() == "attack\n"  # a host file overwritten
        host_file.write_text(host.text)
        flip()

        copy = tmp_path / f"new-{name}.txt"
        with pytest.raises(ValueError, match="outside sandbox") as refused:
            await swapped_while_queued(provider.download_file(sandbox, path, copy), flip)
        assert f"source_path={path!r}" in str(refused.value)
        flip()
        with pytest.raises(ValueError, match="outside sandbox") as refused:
            await swapped_while_queued(provider.upload_file(sandbox, attack, path), flip)
        assert f"target_path={path!r}" in str(refused.value)
        assert not copy.exists()
        assert host.untouched()
        flip()  # back to the sandbox's own
        await provider.download_file(sandbox, path, copy)
        assert copy.read_text() == f"sandbox {path[-1]}\n"


async def test_process_provider_exec_refuses_a_cwd_swapped_to_a_symlink(
    provider: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """A directory swapped for a symlink to a host directory after a check makes the old
    unisolated exec run there; the provider refuses that cwd, and runs in the directory (by
    its path) once it is one again. (Isolated, bwrap changes directory inside the command's
    own mount namespace, where the host's directory is not.)"""
    host = plant_host(tmp_path)
    sandbox, state = await sandbox_with_targets(provider)
    os.symlink(host.directory, state.workdir / "d.swap")
    flip = functools.partial(swap, state, "d")
    assert check_then_run(state, "d", flip) == host.text
    with pytest.raises(ValueError, match="outside sandbox") as refused:
        await provider.exec(sandbox, "cat f", cwd="d")
    assert "cwd='d'" in str(refused.value)
    flip()
    assert (await provider.exec(sandbox, "cat f; pwd", cwd="d")).stdout == (
        f"sandbox f\n{state.workdir / 'd'}\n"
    )


async def test_process_provider_transfer_of_a_fifo_or_directory_fails_at_once(
    provider: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """A FIFO where a file was expected fails the transfer at once, with the error
    shutil.copyfile gave, instead of holding a thread until some writer or reader comes; a
    directory (the sandbox's own too) raises IsADirectoryError naming the field."""
    sandbox, _ = await sandbox_with_targets(provider)
    assert (await provider.exec(sandbox, "mkfifo pipe")).return_code == 0
    with pytest.raises(shutil.SpecialFileError, match="source_path='pipe'"):
        await provider.download_file(sandbox, "pipe", tmp_path / "copy")
    source = tmp_path / "source"
    source.write_text("data")
    with pytest.raises(OSError, match="No such device or address"):  # no reader: ENXIO
        await provider.upload_file(sandbox, source, "pipe")
    for directory in ("d", "."):
        with pytest.raises(IsADirectoryError, match=f"source_path='{directory}'"):
            await provider.download_file(sandbox, directory, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


async def test_process_provider_command_cannot_hard_link_a_host_file(
    provider: ProcessSandboxProvider,
) -> None:
    """Isolated, a command cannot hard-link a host file into the sandbox directory for an
    upload to write through: the directory is a mount of its own in the command's namespace,
    and link(2) does not cross mounts. Unisolated (the control) the same link is made."""
    sandbox, state = await sandbox_with_targets(provider)
    result = await provider.exec(sandbox, "ln /etc/passwd linked")
    if provider.isolation == "bwrap":
        assert result.return_code == 1
        assert "Invalid cross-device link" in result.stderr
        assert not (state.workdir / "linked").exists()
    else:
        assert (result.return_code, result.stderr) == (0, "")
        assert (state.workdir / "linked").stat().st_nlink > 1
        (state.workdir / "linked").unlink()


# --- a real command flipping in a tight loop ------------------------------------------------


async def start_flipper(
    provider: ProcessSandboxProvider, sandbox: SandboxHandle, state: Sandbox, host: Host
) -> asyncio.Task[SandboxExecResult]:
    """The flipper, running in the sandbox once this returns."""
    (state.workdir / "flipper.py").write_text(FLIPPER)
    command = f"exec {sandbox_python()} flipper.py {host.secret} {host.directory} {FLIPS}"
    task = asyncio.ensure_future(provider.exec(sandbox, command, timeout_s=600))
    await eventually(lambda: (state.workdir / "started").exists() or task.done(), "flipper up")
    assert not task.done(), task.result()
    return task


async def stop_flipper(state: Sandbox, task: asyncio.Task[SandboxExecResult]) -> int:
    """Stop the flipper; the number of flips it made (each swaps x and d once)."""
    (state.workdir / "stop").touch()
    result = await task
    assert (result.return_code, result.stderr) == (0, ""), result
    return int(result.stdout or "0")


async def test_process_provider_transfers_never_follow_a_flipping_symlink(
    provider: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """Beside a sandboxed command that swaps symlinks to host files in and out in a tight loop,
    the provider's downloads and uploads never read or write a host file (some meet the
    symlink and are refused, some the sandbox's own file), while the old check-then-copy,
    taking turns with them in the same loop, is beaten both ways; then 40 execs in the
    flipping directory never run in the host's."""
    host = plant_host(tmp_path)
    sandbox, state = await sandbox_with_targets(provider)
    attack = tmp_path / "attack.txt"
    attack.write_text("attack\n")
    copy = tmp_path / "copy.txt"
    provider_saw: Counter[str] = Counter()
    control_saw: Counter[str] = Counter()
    rounds = 0
    flipper = await start_flipper(provider, sandbox, state, host)
    try:
        while rounds < MAX_ROUNDS and not (rounds >= MIN_ROUNDS and beaten_both_ways(control_saw)):
            path = ("x", "d/f")[rounds % 2]
            rounds += 1
            provider_saw[
                await download(provider.download_file(sandbox, path, copy), copy, host)
            ] += 1
            provider_saw[await upload(provider.upload_file(sandbox, attack, path), host)] += 1
            control_saw[await download(check_then_download(state, path, copy), copy, host)] += 1
            control_saw[await upload(check_then_upload(state, attack, path), host)] += 1
        for _ in range(EXECS):
            provider_saw[await exec_in_flipping_directory(provider, sandbox, host)] += 1
    finally:
        flips = await stop_flipper(state, flipper)
    assert flips > 0
    assert beaten_both_ways(control_saw), (rounds, control_saw)
    for escaped in ("download read the host", "upload wrote the host", "exec read the host"):
        assert provider_saw[escaped] == 0, provider_saw
    assert host.untouched()
    assert provider_saw["download refused"] + provider_saw["download read"] == rounds
    assert provider_saw["upload refused"] + provider_saw["upload written"] == rounds
    # The race was on: the provider's transfers met both the symlink and the sandbox's file.
    for seen in ("download refused", "download read", "upload refused", "upload written"):
        assert provider_saw[seen] > 0, provider_saw
    assert provider_saw["exec refused"] + provider_saw["exec ran"] == EXECS, provider_saw


def beaten_both_ways(outcomes: Counter[str]) -> bool:
    return outcomes["download read the host"] > 0 and outcomes["upload wrote the host"] > 0


async def download(copying: Awaitable[None], copy: Path, host: Host) -> str:
    """What one download came to."""
    try:
        await copying
    except ValueError:
        return "download refused"
    except OSError:  # the old resolution or copy, meeting a swap half-way
        return "download failed"
    read = await asyncio.to_thread(copy.read_text)
    return "download read the host" if read == host.text else "download read"


async def upload(copying: Awaitable[None], host: Host) -> str:
    """What one upload came to; a host file it overwrote is restored."""
    try:
        await copying
    except ValueError:
        return "upload refused"
    except OSError:
        return "upload failed"
    if host.untouched():
        return "upload written"
    for host_file in (host.secret, host.directory / "f"):
        host_file.write_text(host.text)
    return "upload wrote the host"


async def exec_in_flipping_directory(
    provider: ProcessSandboxProvider, sandbox: SandboxHandle, host: Host
) -> str:
    """What one ``cat f`` with ``cwd="d"`` came to."""
    try:
        result = await provider.exec(sandbox, "cat f", cwd="d")
    except ValueError:
        return "exec refused"
    # Isolated, a swap after the check leaves bwrap unable to change to a host directory that
    # its namespace lacks (status 1): never the host's f.
    return "exec read the host" if host.text in result.stdout else "exec ran"
