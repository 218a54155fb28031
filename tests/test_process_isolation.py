"""ProcessSandboxProvider's isolation, attacked: each escape attempt runs inside a sandbox and
must fail under bubblewrap, and the same command must succeed with ``isolation="none"`` (so that
each test can fail). The isolation levels themselves: ``test_process_isolation_levels.py``."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from conftest import require_service, serve_on_loopback
from isolation_support import bwrap_on_path, run_server
from opentelemetry.instrumentation.nemo_gym.sandbox.providers import _cgroups
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxHandle,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX
from waiting import eventually

TOKEN = f"escape-{uuid.uuid4().hex}"
CONTAINED_NOTE = "must fail inside bubblewrap"


@pytest.fixture(params=["bwrap", "none"])
async def provider(request: pytest.FixtureRequest) -> AsyncIterator[ProcessSandboxProvider]:
    """A provider of each isolation level (bubblewrap's is required: fails under CI)."""
    if request.param == "bwrap":
        require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    made = ProcessSandboxProvider(isolation=request.param)
    yield made
    await made.aclose()


def isolated(provider: ProcessSandboxProvider) -> bool:
    return provider.isolation == "bwrap"


@pytest.fixture
def planted() -> Iterator[list[Path]]:
    """Paths a test plants on the host, removed after it (whatever it planted there)."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def plant(planted: list[Path], directory: Path, content: str = TOKEN) -> Path:
    """A file named for this test in ``directory`` holding ``content``."""
    path = directory / f".nemo-gym-escape-{uuid.uuid4().hex}"
    planted.append(path)
    path.write_text(content)
    return path


async def test_process_isolation_hides_the_users_home(
    provider: ProcessSandboxProvider, planted: list[Path]
) -> None:
    """A file in the invoking user's home is unreadable inside bubblewrap, readable without."""
    secret = plant(planted, Path.home())
    sandbox = await provider.create(SandboxSpec())
    result = await provider.exec(sandbox, f"cat {secret}")
    if isolated(provider):
        assert (result.return_code, result.stdout) == (1, ""), CONTAINED_NOTE
        assert "No such file or directory" in (result.stderr or "")
    else:
        assert (result.return_code, result.stdout) == (0, TOKEN)


async def test_process_isolation_hides_the_servers_working_directory(
    provider: ProcessSandboxProvider, planted: list[Path]
) -> None:
    """A file planted in the server's working directory is unreadable inside bubblewrap."""
    secret = plant(planted, Path.cwd())
    sandbox = await provider.create(SandboxSpec())
    result = await provider.exec(sandbox, f"cat {secret}; ls -a {Path.cwd()}")
    if isolated(provider):
        assert result.stdout == "", CONTAINED_NOTE
        assert result.return_code != 0
    else:
        assert (result.stdout or "").startswith(TOKEN)
        assert secret.name in (result.stdout or "")


async def test_process_isolation_keeps_writes_inside_the_sandbox(
    provider: ProcessSandboxProvider, planted: list[Path], tmp_path: Path
) -> None:
    """Writes to the server's directory, to the host's /tmp and to /usr never reach the host
    from inside bubblewrap (/tmp there is the sandbox's own); without it the first two land."""
    beside_server = Path.cwd() / f".nemo-gym-escape-{uuid.uuid4().hex}"
    in_host_tmp = tmp_path / "written-from-the-sandbox"
    in_usr = Path("/usr") / f".nemo-gym-escape-{uuid.uuid4().hex}"
    planted.extend([beside_server, in_host_tmp, in_usr])
    sandbox = await provider.create(SandboxSpec())
    await provider.exec(sandbox, f"echo pwned > {beside_server}")
    await provider.exec(sandbox, f"mkdir -p {tmp_path} && echo pwned > {in_host_tmp}")
    result = await provider.exec(sandbox, f"echo pwned > {in_usr}")
    if isolated(provider):
        assert not beside_server.exists(), CONTAINED_NOTE
        assert not in_host_tmp.exists(), CONTAINED_NOTE
        assert not in_usr.exists(), CONTAINED_NOTE
        assert "Read-only file system" in (result.stderr or "")
        # The sandbox's own /tmp took the second write, inside the sandbox.
        inside = await provider.exec(sandbox, f"cat {in_host_tmp}")
        assert inside.stdout == "pwned\n"
    else:
        assert beside_server.read_text() == "pwned\n"
        assert in_host_tmp.read_text() == "pwned\n"


# bash's /dev/tcp: an HTTP request from the shell, with nothing to install in the sandbox.
HTTP_GET = "exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3"


@pytest.fixture
async def host_server() -> AsyncIterator[int]:
    """A loopback aiohttp server on the host answering ``TOKEN``; its port."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(text=TOKEN)

    runner, port = await serve_on_loopback("127.0.0.1", answer)
    yield port
    await runner.cleanup()


async def test_process_isolation_has_no_network(
    provider: ProcessSandboxProvider, host_server: int
) -> None:
    """A loopback server on the host is unreachable inside bubblewrap, reachable without."""
    sandbox = await provider.create(SandboxSpec())
    command = f"bash -c {_quoted(HTTP_GET.format(port=host_server))}"
    result = await provider.exec(sandbox, command, timeout_s=30)
    if isolated(provider):
        assert TOKEN not in (result.stdout or ""), CONTAINED_NOTE
        assert "Connection refused" in (result.stderr or "")
    else:
        assert (result.stdout or "").endswith(TOKEN)


async def test_process_isolation_network_true_is_the_hosts(host_server: int) -> None:
    """network=True asks bubblewrap for the host's network: the loopback server answers."""
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    provider = ProcessSandboxProvider(network=True)
    try:
        sandbox = await provider.create(SandboxSpec())
        command = f"bash -c {_quoted(HTTP_GET.format(port=host_server))}"
        result = await provider.exec(sandbox, command, timeout_s=30)
    finally:
        await provider.aclose()
    assert (result.stdout or "").endswith(TOKEN)


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def test_process_isolation_hides_host_processes(provider: ProcessSandboxProvider) -> None:
    """The test's own process cannot be signalled (kill -0) inside bubblewrap, only without."""
    sandbox = await provider.create(SandboxSpec())
    result = await provider.exec(sandbox, f"kill -0 {os.getpid()}")
    if isolated(provider):
        assert result.return_code != 0, CONTAINED_NOTE
        assert "No such process" in (result.stderr or "")
    else:
        assert result.return_code == 0


# A server process with a secret in its environment (an API key, say) runs one sandbox command
# that looks for it: in its own environment, then in the server's through /proc (as its parent,
# and by the server's PID).
SERVER = r"""
import asyncio, os, sys
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)

READ = (
    'echo "${NEMO_GYM_ESCAPE_SECRET:-not inherited}"; '
    "for f in /proc/$PPID/environ /proc/%d/environ; do "
    "tr '\\0' '\\n' < $f | grep NEMO_GYM_ESCAPE_SECRET; done; true"
) % os.getpid()


async def main():
    provider = ProcessSandboxProvider(isolation=sys.argv[1])
    try:
        sandbox = await provider.create({})
        print((await provider.exec(sandbox, READ)).stdout, end="")
    finally:
        await provider.aclose()

asyncio.run(main())
"""


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_process_isolation_hides_the_servers_environment(isolation: str, tmp_path: Path) -> None:
    """A secret in the server's environment is out of reach inside bubblewrap (neither
    inherited nor readable in /proc); without it, /proc gives it away (by $PPID and by PID)."""
    if isolation == "bwrap":
        require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    env = {"PATH": os.environ["PATH"], "NEMO_GYM_ESCAPE_SECRET": TOKEN}
    server = run_server(tmp_path, env, isolation, script=SERVER)
    assert server.returncode == 0, server.stderr
    secret = f"NEMO_GYM_ESCAPE_SECRET={TOKEN}"
    if isolation == "bwrap":
        assert server.stdout == "not inherited\n", CONTAINED_NOTE
    else:
        assert server.stdout == f"not inherited\n{secret}\n{secret}\n"


# --- processes: a fork bomb against the pids limit ----------------------------------------------


def require_pids_controller(provider: ProcessSandboxProvider) -> None:
    layout = provider._layout
    require_service(
        layout is not None and (layout.version == 2 or "pids" in layout.bases),
        "no writable cgroup hierarchy with the pids controller (run as root)",
    )


def cgroup_of(sandbox: SandboxHandle) -> _cgroups.Cgroup:
    cgroup = sandbox.raw.cgroup
    assert cgroup is not None
    return cgroup


def pids_refused(cgroup: _cgroups.Cgroup) -> int:
    """How many forks the kernel refused the cgroup for its pids limit (pids.events max)."""
    events = cgroup.file("pids", "pids.events").read_text().split()
    return int(events[events.index("max") + 1])


SIXTY_FOUR_SLEEPERS = (
    "i=0; while [ $i -lt 64 ]; do sleep 300 >/dev/null 2>&1 & i=$((i+1)); done 2>/dev/null; true"
)


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_process_isolation_pids_limit_stops_forks(isolation: str) -> None:
    """Under pids_limit=32 a command that starts 64 processes gets no further than 32 (the
    kernel refuses the rest); without a limit all 64 run. Either way close ends them all."""
    if isolation == "bwrap":
        require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    capped = ProcessSandboxProvider(isolation=isolation, pids_limit=32)
    uncapped = ProcessSandboxProvider(isolation=isolation, pids_limit=None)
    require_pids_controller(capped)
    try:
        held = await capped.create(SandboxSpec())
        free = await uncapped.create(SandboxSpec())
        await capped.exec(held, SIXTY_FOUR_SLEEPERS, timeout_s=60)
        await uncapped.exec(free, SIXTY_FOUR_SLEEPERS, timeout_s=60)
        held_sample = await capped.resource_sample(held)
        free_sample = await uncapped.resource_sample(free)
        allocation = await capped.resource_allocation(held)
        assert pids_refused(cgroup_of(held)) > 0
        assert pids_refused(cgroup_of(free)) == 0
        directories = cgroup_of(held).unique_dirs() + cgroup_of(free).unique_dirs()
    finally:
        await capped.aclose()
        await uncapped.aclose()
    assert 0 < held_sample[PREFIX + "usage.pids"] <= 32  # type: ignore[operator]
    assert free_sample[PREFIX + "usage.pids"] == 64
    (component,) = allocation.components
    assert getattr(component.limits, "pids", None) == 32
    # A cgroup directory can only be removed once no process is left in it.
    assert [d for d in directories if d.exists()] == []


# A fork bomb: every shell starts two more, forever. bash retries a refused fork (for 15 s)
# instead of giving up, so the bomb keeps pressing on the limit until it is killed.
FORK_BOMB = "exec bash -c 'b() { b & b & wait; }; b'"


async def test_process_isolation_fork_bomb_is_contained() -> None:
    """A fork bomb inside bubblewrap under pids_limit=32 stays at 32 processes, the host keeps
    starting processes meanwhile, and closing the sandbox ends the bomb while it runs."""
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    provider = ProcessSandboxProvider(pids_limit=32)
    require_pids_controller(provider)
    try:
        sandbox = await provider.create(SandboxSpec(resources={"cpu": 0.5}))
        cgroup = cgroup_of(sandbox)
        directories = cgroup.unique_dirs()
        holder = sandbox.raw.jail.holder
        bomb = asyncio.ensure_future(provider.exec(sandbox, FORK_BOMB, timeout_s=120))
        # Until the kernel has refused a fork: the bomb hit the limit.
        await eventually(lambda: pids_refused(cgroup) > 0, "a fork refused by pids.max", 30, 0.01)
        assert len(_cgroups.cgroup_pids(cgroup)) <= 32
        host = await asyncio.create_subprocess_exec("/bin/true")
        assert await host.wait() == 0
        assert not bomb.done()
        await provider.close(sandbox)
        result = await asyncio.wait_for(bomb, 30)
    finally:
        await provider.aclose()
    assert result.error_type is None
    assert result.return_code == 128 + 9  # the bomb's first shell, killed with the sandbox
    assert holder.returncode is not None
    assert [d for d in directories if d.exists()] == []
