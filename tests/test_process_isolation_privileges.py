"""ProcessSandboxProvider against a command that tries to change the host through /proc.

The host's kernel settings sit in ``/proc/sys``. Root on the host may write them, and a
command whose uid maps to the host's root could too, capabilities or not. Each attempt runs
from a sandbox made with the provider's defaults by a server process running as root and as
an ordinary user (``nobody``), and each has a control: the test, as root on the host, does
the same and succeeds (so the attempt fails because of the sandbox, not because this host
allows nobody anything).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from conftest import require_service
from isolation_support import NOBODY, bwrap_on_path, run_server_as
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

OVERCOMMIT_RATIO = Path("/proc/sys/vm/overcommit_ratio")
CORE_PATTERN = Path("/proc/sys/kernel/core_pattern")

# A harmless sysctl write: the value the setting has, written back.
SYSCTL_WRITE = (
    f"v=$(cat {OVERCOMMIT_RATIO}) && echo $v > {OVERCOMMIT_RATIO} && echo WROTE; id -u; true"
)
# Whether the setting that names the program the kernel runs (as root) on a crash is writable.
CORE_PATTERN_PROBE = f"test -w {CORE_PATTERN} && echo WRITABLE; id -u; true"

# A server with the provider's defaults: one sandbox, one command, its result as JSON.
SERVER = r"""
import asyncio, json, sys
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

async def main():
    provider = ProcessSandboxProvider()
    try:
        sandbox = await provider.create({})
        result = await provider.exec(sandbox, sys.argv[1], timeout_s=60)
    finally:
        await provider.aclose()
    print(json.dumps([result.stdout, result.stderr, result.return_code]))

asyncio.run(main())
"""


def run_sandboxed(server_user: str, command: str) -> tuple[str, str, int]:
    """``command`` in a sandbox of a server running as ``server_user`` (root or nobody):
    (stdout, stderr, return code)."""
    server = run_server_as(server_user, SERVER, command)
    assert server.returncode == 0, server.stderr
    stdout, stderr, code = json.loads(server.stdout)
    return stdout, stderr, code


@pytest.mark.parametrize("server_user", ["root", "nobody"])
def test_process_isolation_sysctl_write_is_refused(server_user: str) -> None:
    """Writing a kernel setting (its own value, back) fails from a sandbox, read-only,
    whichever user runs the server; root on the host writes it (the control)."""
    stdout, stderr, code = run_sandboxed(server_user, SYSCTL_WRITE)
    assert (stdout, code) == (f"{NOBODY}\n", 0)
    assert f"{OVERCOMMIT_RATIO}: Read-only file system" in stderr
    # Control: the same write, as root on the host.
    OVERCOMMIT_RATIO.write_text(OVERCOMMIT_RATIO.read_text())


@pytest.mark.parametrize("server_user", ["root", "nobody"])
def test_process_isolation_core_pattern_is_not_writable(server_user: str) -> None:
    """kernel.core_pattern (a program the kernel runs as root) is not writable from a sandbox,
    whichever user runs the server; it is for root on the host (the control)."""
    stdout, _, code = run_sandboxed(server_user, CORE_PATTERN_PROBE)
    assert (stdout, code) == (f"{NOBODY}\n", 0)
    assert os.access(CORE_PATTERN, os.W_OK)  # control


@pytest.fixture
async def root_provider() -> AsyncIterator[ProcessSandboxProvider]:
    """An isolated provider in this (root) process."""
    require_service(os.geteuid() == 0, "a root server's sandboxes (run as root)")
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    made = ProcessSandboxProvider(cgroups=False, sandbox_uid=4242)
    yield made
    await made.aclose()


async def test_process_isolation_root_server_runs_commands_as_sandbox_uid(
    root_provider: ProcessSandboxProvider, tmp_path: Path
) -> None:
    """A root server's commands run as sandbox_uid on the host (what they write is its), and
    still read and write what the server uploads, in directories the upload made."""
    sandbox = await root_provider.create(SandboxSpec(files={"given/spec.txt": "from the spec\n"}))
    source = tmp_path / "upload.txt"
    source.write_text("uploaded\n")
    await root_provider.upload_file(sandbox, source, "deep/er/upload.txt")
    result = await root_provider.exec(
        sandbox,
        "id -u; echo more >> deep/er/upload.txt; echo made > deep/er/made.txt; "
        "echo too >> given/spec.txt; echo tmp > /tmp/t && cat /tmp/t",
    )
    assert (result.stdout, result.stderr, result.return_code) == ("4242\ntmp\n", "", 0)
    root = sandbox.raw.workdir
    made = root / "deep/er/made.txt"
    assert (made.stat().st_uid, made.stat().st_gid) == (4242, 4242)
    target = tmp_path / "download.txt"
    await root_provider.download_file(sandbox, "deep/er/upload.txt", target)
    assert target.read_text() == "uploaded\nmore\n"
    assert (root / "given/spec.txt").read_text() == "from the spec\ntoo\n"


@pytest.fixture
def private_directory() -> Iterator[Path]:
    """A directory under /tmp that only root may pass, with a searchable one inside."""
    outer = Path(tempfile.mkdtemp(prefix="nemo-gym-private-"))
    inner = outer / "venv"
    inner.mkdir(mode=0o755)
    yield inner
    shutil.rmtree(outer)


async def test_process_isolation_root_server_refuses_paths_out_of_reach(
    root_provider: ProcessSandboxProvider, private_directory: Path
) -> None:
    """A read_only_paths entry that sandbox_uid cannot reach (bwrap binds it as that uid) is
    refused at create, naming the entry, the uid and the directory in the way."""
    provider = ProcessSandboxProvider(cgroups=False, read_only_paths=[str(private_directory)])
    try:
        with pytest.raises(SandboxCreateError) as raised:
            await provider.create(SandboxSpec())
    finally:
        await provider.aclose()
    assert str(raised.value).startswith(
        f"read_only_paths entry {str(private_directory)!r} is out of reach of sandbox_uid "
        f"{NOBODY}, which may not pass {str(private_directory.parent)!r}"
    )


def test_process_isolation_sandbox_uid_is_checked() -> None:
    """sandbox_uid must be a positive integer: never 0, the host's root."""
    for bad in (0, -1, True, "65534"):
        with pytest.raises(ValueError, match=f"sandbox_uid={bad!r} must be a positive integer"):
            ProcessSandboxProvider(sandbox_uid=bad)  # type: ignore[arg-type]
