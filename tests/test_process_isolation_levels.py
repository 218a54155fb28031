"""ProcessSandboxProvider's isolation levels: no bwrap on PATH is a one-line refusal, the
opt-in (``isolation="none"``) is loud, and every span and record says which level it ran at."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import require_service
from isolation_support import bwrap_on_path, run_server
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxCreateError,
    SandboxSpec,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ISOLATION,
    ProcessSandboxProvider,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.tracing import traced_provider

# --- without bubblewrap: a refusal, or the explicit opt-in -------------------------------------

MISSING = r"""
import asyncio, sys
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxCreateError
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
    ProcessSandboxProvider,
)


async def main():
    provider = ProcessSandboxProvider(isolation=sys.argv[1])
    try:
        sandbox = await provider.create({})
        print((await provider.exec(sandbox, "echo ran")).stdout, end="")
    except SandboxCreateError as error:
        print(f"{type(error).__name__}: {error}")
    finally:
        await provider.aclose()

asyncio.run(main())
"""


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_process_isolation_without_bwrap_refuses_unless_opted_out(
    isolation: str, tmp_path: Path
) -> None:
    """With no bwrap on PATH, create raises one line naming the program, the package and the
    opt-in; with isolation="none" the sandbox runs, with the warning on stderr."""
    empty = tmp_path / "bin"
    empty.mkdir()
    server = run_server(tmp_path, {"PATH": str(empty)}, isolation, script=MISSING)
    assert server.returncode == 0, server.stderr
    if isolation == "bwrap":
        assert server.stdout == (
            "SandboxCreateError: process sandbox isolation needs bubblewrap: no 'bwrap' on PATH;"
            " install it (apt-get install bubblewrap) or opt into unisolated processes with"
            ' ProcessSandboxProvider(isolation="none")\n'
        )
    else:
        assert server.stdout == "ran\n"
        assert "is not isolated (isolation='none')" in server.stderr


async def test_process_isolation_none_warns_per_sandbox_and_says_so_in_records(
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every sandbox made with isolation="none" logs one warning naming it, and every span and
    resource record of it carries nemo.gym.sandbox.isolation = "none"."""
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0.1")
    provider = traced_provider(ProcessSandboxProvider(isolation="none", cgroups=False))
    with caplog.at_level(logging.WARNING):
        first = await provider.create(SandboxSpec())
        second = await provider.create(SandboxSpec())
    await provider.exec(first, "true")
    await provider.close(first)
    await provider.close(second)
    await provider.aclose()
    warnings = [r.getMessage() for r in caplog.records if "is not isolated" in r.getMessage()]
    assert len(warnings) == 2
    assert first.sandbox_id in warnings[0]
    assert second.sandbox_id in warnings[1]
    spans = [
        s
        for s in span_exporter.get_finished_spans()
        if s.name.startswith("sandbox.") and s.name != "sandbox.aclose"
    ]
    names = {s.name for s in spans}
    assert {"sandbox.create", "sandbox.exec", "sandbox.close", "sandbox.resources"} <= names
    assert {(s.attributes or {}).get(ISOLATION) for s in spans} == {"none"}


async def test_process_isolation_bwrap_is_on_every_span_and_record(
    global_tracer_provider: TracerProvider,
    span_exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default every span and resource record of a sandbox says isolation = "bwrap"."""
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    monkeypatch.setenv("OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL", "0.1")
    provider = traced_provider(ProcessSandboxProvider(cgroups=False))
    sandbox = await provider.create(SandboxSpec())
    await provider.exec(sandbox, "true")
    await provider.close(sandbox)
    await provider.aclose()
    spans = [
        s
        for s in span_exporter.get_finished_spans()
        if s.name.startswith("sandbox.") and s.name != "sandbox.aclose"
    ]
    names = {s.name for s in spans}
    assert {"sandbox.create", "sandbox.exec", "sandbox.close", "sandbox.resources"} <= names
    assert {(s.attributes or {}).get(ISOLATION) for s in spans} == {"bwrap"}


def test_process_isolation_option_is_checked() -> None:
    """An isolation other than "bwrap" or "none" raises ValueError naming the option and value."""
    with pytest.raises(ValueError, match="isolation='docker' must be 'bwrap' or 'none'"):
        ProcessSandboxProvider(isolation="docker")
    with pytest.raises(ValueError, match="network='yes' must be true or false"):
        ProcessSandboxProvider(network="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read_only_paths entry 'venv' must be an absolute path"):
        ProcessSandboxProvider(read_only_paths=["venv"])
    with pytest.raises(ValueError, match="pids_limit=0 must be a positive integer or None"):
        ProcessSandboxProvider(pids_limit=0)


@pytest.fixture
def checkout_in_tmp() -> Iterator[Path]:
    """A directory under the host's /tmp that any user may pass (as a checkout there is; a
    root server's sandboxes must reach what they bind, and pytest's tmp_path is root's)."""
    checkout = Path(tempfile.mkdtemp(prefix="nemo-gym-checkout-"))
    checkout.chmod(0o755)
    yield checkout
    shutil.rmtree(checkout)


async def test_process_isolation_read_only_path_under_tmp_is_visible(
    checkout_in_tmp: Path,
) -> None:
    """A read_only_paths entry under the host's /tmp (a virtualenv in a checkout there) shows
    inside the sandbox, read-only, over its private /tmp."""
    require_service(bwrap_on_path(), "bwrap not on PATH (apt-get install bubblewrap)")
    shared = checkout_in_tmp / "venv"
    shared.mkdir()
    (shared / "marker").write_text("seen\n")
    assert str(shared).startswith("/tmp/")
    provider = ProcessSandboxProvider(cgroups=False, read_only_paths=[str(shared)])
    try:
        sandbox = await provider.create(SandboxSpec())
        seen = await provider.exec(sandbox, f"cat {shared}/marker")
        written = await provider.exec(sandbox, f"echo x > {shared}/marker")
        await provider.close(sandbox)
    finally:
        await provider.aclose()
    assert (seen.return_code, seen.stdout) == (0, "seen\n")
    assert written.return_code != 0
    assert (shared / "marker").read_text() == "seen\n"


async def test_process_isolation_create_error_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused create (no bwrap) makes no directory and no cgroup."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    provider = ProcessSandboxProvider(base_dir=tmp_path)
    with pytest.raises(SandboxCreateError, match="apt-get install bubblewrap"):
        await provider.create(SandboxSpec())
    await provider.aclose()
    assert not any(tmp_path.iterdir())  # noqa: ASYNC240 - a test's own directory
