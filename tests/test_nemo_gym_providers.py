"""The post-import hook that passes every provider NeMo Gym builds through a wrapping function,
against the installed ``nemo-gym`` wheel: its registry, ``create_provider``, ``AsyncSandbox``
and ``Sandbox``, imported before and after the patch (``provider_patch``) is installed."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import wrapt

from nemo_gym_support import nemo_gym_sandbox
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch
from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym import _providers as hook

pytestmark = pytest.mark.nemo_gym  # also run on NeMo Gym main (nemo_gym_support)

SRC = str(Path(__file__).resolve().parents[1] / "src")


class Marked:
    """What the test's wrapping function returns: the provider, delegated to, and marked."""

    def __init__(self, provider: Any) -> None:
        self.wrapped = provider

    def __getattr__(self, item: str) -> Any:
        return getattr(self.wrapped, item)


def mark(provider: Any) -> Any:
    return provider if isinstance(provider, Marked) else Marked(provider)


class EchoProvider:
    """A provider of the test's own: sandboxes are ids, ``exec`` echoes the command back."""

    name = "echo"
    create_error: BaseException | None = None

    def __init__(self, greeting: str = "hello") -> None:
        self.greeting = greeting
        self.closed: list[str] = []

    async def create(self, spec: Any) -> Any:
        if self.create_error is not None:
            raise self.create_error
        from nemo_gym.sandbox import SandboxHandle

        return SandboxHandle(sandbox_id=uuid.uuid4().hex, provider_name=self.name, raw=None)

    async def exec(self, handle: Any, command: str, **kwargs: Any) -> Any:
        from nemo_gym.sandbox import SandboxExecResult

        return SandboxExecResult(stdout=f"{self.greeting} {command}", stderr="", return_code=0)

    async def upload_file(self, handle: Any, source_path: Path, target_path: str) -> None:
        return None

    async def download_file(self, handle: Any, source_path: str, target_path: Path) -> None:
        return None

    async def status(self, handle: Any) -> Any:
        from nemo_gym.sandbox import SandboxStatus

        return SandboxStatus.RUNNING

    async def close(self, handle: Any) -> None:
        self.closed.append(handle.sandbox_id)

    async def aclose(self) -> None:
        return None


_INSTALLED: list[Patch] = []


def install(wrap: Any) -> Patch:
    """A provider patch made and installed, as ``instrument()`` makes one and keeps it."""
    patch = hook.provider_patch(wrap)
    patch.install()
    _INSTALLED.append(patch)
    return patch


def uninstall() -> None:
    """Every patch ``install`` made taken off, the latest first, as ``uninstrument()`` does."""
    while _INSTALLED:
        _INSTALLED.pop().uninstall()


@pytest.fixture
def nemo_gym() -> Iterator[ModuleType]:
    """``nemo_gym.sandbox``; the hook is uninstalled after the test whatever happened."""
    module = nemo_gym_sandbox()
    yield module
    uninstall()


def register(nemo_gym: ModuleType, cls: type = EchoProvider) -> str:
    """Register ``cls`` under a fresh name (NeMo Gym's registry has no removal)."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    nemo_gym.register_provider(name, cls)
    return name


def holders() -> dict[str, Any]:
    """What each module that binds ``create_provider`` holds now."""
    return {name: sys.modules[name].create_provider for name in hook.PATCHED_MODULES}


def test_install_create_provider_result_wrapped(nemo_gym: ModuleType) -> None:
    """After install, create_provider returns the wrapping function's result around the
    provider NeMo Gym built from the config."""
    name = register(nemo_gym)
    install(mark)
    provider = nemo_gym.create_provider({name: {"greeting": "hi"}})
    assert isinstance(provider, Marked)
    assert isinstance(provider.wrapped, EchoProvider)
    assert provider.wrapped.greeting == "hi"


def test_install_every_binding_patched(nemo_gym: ModuleType) -> None:
    """The defining module and the three that bind create_provider by name all hold the one
    wrapper, including nemo_gym.sandbox.api, where AsyncSandbox looks it up."""
    install(mark)
    bound = holders()
    assert len({id(value) for value in bound.values()}) == 1
    assert isinstance(bound["nemo_gym.sandbox.api"], wrapt.FunctionWrapper)


async def test_async_sandbox_config_provider_wrapped(nemo_gym: ModuleType) -> None:
    """AsyncSandbox built from a config uses the wrapped provider through start, exec, stop."""
    name = register(nemo_gym)
    install(mark)
    sandbox = nemo_gym.AsyncSandbox({name: {}}, nemo_gym.SandboxSpec())
    assert isinstance(sandbox._provider, Marked)
    async with sandbox:
        await sandbox.start()
        result = await sandbox.exec("ls")
    assert result.stdout == "hello ls"
    assert len(sandbox._provider.wrapped.closed) == 1


def test_sandbox_sync_config_provider_wrapped(nemo_gym: ModuleType) -> None:
    """The synchronous Sandbox (which builds an AsyncSandbox on its own loop) is covered too."""
    name = register(nemo_gym)
    install(mark)
    with nemo_gym.Sandbox({name: {}}, nemo_gym.SandboxSpec()) as sandbox:
        sandbox.start()
        assert isinstance(sandbox._async_sandbox._provider, Marked)
        assert sandbox.exec("pwd").stdout == "hello pwd"


def test_uninstall_functions_restored_identically(nemo_gym: ModuleType) -> None:
    """uninstall puts NeMo Gym's own function object back in every module."""
    before = holders()
    install(mark)
    assert all(holders()[name] is not before[name] for name in before)
    uninstall()
    after = holders()
    assert all(after[name] is before[name] for name in before)
    assert not isinstance(nemo_gym.create_provider({register(nemo_gym): {}}), Marked)


def test_install_two_patches_each_wraps_once_and_comes_off_alone(nemo_gym: ModuleType) -> None:
    """Two patches (two instrumentors') each pass a provider through their own function once;
    taking the first off leaves the second's in every binding."""
    calls: list[Any] = []

    def counting(provider: Any) -> Any:
        calls.append(provider)
        return Marked(provider)

    first = install(mark)
    install(counting)
    provider = nemo_gym.create_provider({register(nemo_gym): {}})
    assert isinstance(provider, Marked)
    assert isinstance(provider.wrapped, Marked)
    assert isinstance(provider.wrapped.wrapped, EchoProvider)
    assert len(calls) == 1

    first.uninstall()
    api = nemo_gym.AsyncSandbox({register(nemo_gym): {}}, nemo_gym.SandboxSpec())
    alone = nemo_gym.create_provider({register(nemo_gym): {}})
    assert isinstance(alone, Marked)
    assert isinstance(alone.wrapped, EchoProvider)
    assert isinstance(api._provider, Marked)
    assert isinstance(api._provider.wrapped, EchoProvider)
    assert len(calls) == 3


def test_create_provider_constructor_error_same_object(nemo_gym: ModuleType) -> None:
    """An exception from NeMo Gym's create_provider (a bad option) reaches the caller as is."""
    install(mark)
    name = register(nemo_gym)
    with pytest.raises(TypeError) as raised:
        nemo_gym.create_provider({name: {"no_such_option": 1}})
    assert "no_such_option" in str(raised.value)


async def test_sandbox_create_error_same_object(nemo_gym: ModuleType) -> None:
    """NeMo Gym's SandboxCreateError raised by a provider reaches AsyncSandbox's caller as the
    same object, through the wrapper."""
    error = nemo_gym.SandboxCreateError("quota exhausted")

    class Failing(EchoProvider):
        create_error = error

    install(mark)
    sandbox = nemo_gym.AsyncSandbox({register(nemo_gym, Failing): {}}, nemo_gym.SandboxSpec())
    with pytest.raises(nemo_gym.SandboxCreateError) as raised:
        await sandbox.start()
    assert raised.value is error
    await sandbox.stop()


def test_wrap_failure_provider_untouched_logged_once(
    nemo_gym: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider the wrapping function cannot wrap is returned as it is, logged once."""

    class Odd(EchoProvider):
        pass

    def refuse(provider: Any) -> Any:
        raise RuntimeError("cannot wrap")

    install(refuse)
    name = register(nemo_gym, Odd)
    with caplog.at_level(logging.WARNING, logger=hook.__name__):
        first = nemo_gym.create_provider({name: {}})
        second = nemo_gym.create_provider({name: {}})
    assert type(first) is Odd
    assert type(second) is Odd
    warnings = [r for r in caplog.records if "cannot be traced" in r.getMessage()]
    assert len(warnings) == 1
    assert "Odd" in warnings[0].getMessage()


def test_install_over_other_patcher_restores_theirs(nemo_gym: ModuleType) -> None:
    """Stacked on another wrapt patch, ours goes on top and uninstall restores theirs."""
    module = sys.modules[hook.DEFINING_MODULE]
    original = module.create_provider

    def theirs(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "create_provider", theirs)
    try:
        their_wrapper = module.create_provider
        install(mark)
        assert isinstance(nemo_gym.create_provider({register(nemo_gym): {}}), Marked)
        uninstall()
        assert module.create_provider is their_wrapper
    finally:
        module.create_provider = original


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (nemo_gym not yet imported); return its stdout."""
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip()


_SUBPROCESS_PRELUDE = """
    import asyncio, sys
    from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym import _providers as hook

    installed = []

    def install(wrap):
        installed.append(hook.provider_patch(wrap))
        installed[-1].install()

    def uninstall():
        while installed:
            installed.pop().uninstall()

    class Marked:
        def __init__(self, provider):
            self.wrapped = provider
        def __getattr__(self, item):
            return getattr(self.wrapped, item)

    class Provider:
        name = "fresh"
"""


def test_install_before_import_wraps_async_sandbox(nemo_gym: ModuleType) -> None:
    """Installed before nemo_gym is imported, the post-import hook still patches it."""
    output = run_python(
        _SUBPROCESS_PRELUDE
        + """
    install(Marked)
    assert "nemo_gym" not in sys.modules
    import nemo_gym.sandbox as sandbox
    sandbox.register_provider("fresh", Provider)
    box = sandbox.AsyncSandbox({"fresh": {}})
    print(type(box._provider).__name__, type(box._provider.wrapped).__name__)
    """
    )
    assert output == "Marked Provider"


def test_uninstall_before_import_hook_no_op(nemo_gym: ModuleType) -> None:
    """A hook left pending for a module imported after uninstall does nothing."""
    output = run_python(
        _SUBPROCESS_PRELUDE
        + """
    install(Marked)
    uninstall()
    import nemo_gym.sandbox as sandbox
    from nemo_gym.sandbox.providers import registry
    sandbox.register_provider("fresh", Provider)
    same = all(
        sys.modules[name].create_provider is registry.create_provider
        for name in hook.PATCHED_MODULES
    )
    print(same, type(sandbox.create_provider({"fresh": {}})).__name__)
    """
    )
    assert output == "True Provider"


def test_install_after_uninstall_before_import_one_hook(nemo_gym: ModuleType) -> None:
    """install, uninstall, install before the import: one wrapper, each provider wrapped once."""
    output = run_python(
        _SUBPROCESS_PRELUDE
        + """
    install(Marked)
    uninstall()
    install(Marked)
    import nemo_gym.sandbox as sandbox
    sandbox.register_provider("fresh", Provider)
    provider = sandbox.create_provider({"fresh": {}})
    print(type(provider).__name__, type(provider.wrapped).__name__)
    """
    )
    assert output == "Marked Provider"


def test_uninstall_after_import_restores_bindings_and_install_again_wraps(
    nemo_gym: ModuleType,
) -> None:
    """Installed before the import, every module that bound the wrapper gets NeMo Gym's function
    back at uninstall, and a second install wraps AsyncSandbox's providers again."""
    output = run_python(
        _SUBPROCESS_PRELUDE
        + """
    install(Marked)
    import nemo_gym.sandbox as sandbox
    from nemo_gym.sandbox.providers import registry
    sandbox.register_provider("fresh", Provider)
    uninstall()
    restored = [
        name for name in hook.PATCHED_MODULES
        if sys.modules[name].create_provider is registry.create_provider
    ]
    install(Marked)
    box = sandbox.AsyncSandbox({"fresh": {}})
    print(len(restored), type(box._provider).__name__, type(box._provider.wrapped).__name__)
    """
    )
    assert output == "4 Marked Provider"


def test_install_without_nemo_gym_never_raises() -> None:
    """Where nemo_gym is not importable, install and uninstall still succeed."""
    output = run_python(
        """
        import sys
        sys.modules["nemo_gym"] = None  # an import of it now raises ImportError
        from opentelemetry.instrumentation.nemo_gym.integrations.nemo_gym import _providers as hook
        patch = hook.provider_patch(lambda provider: provider)
        patch.install()
        patch.uninstall()
        print("ok")
        """
    )
    assert output == "ok"
