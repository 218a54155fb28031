"""The one patch helper: wrapt wrappers put on now or at import, and taken off exactly."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import wrapt
from opentelemetry.sdk.trace import TracerProvider

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch, methods_of
from opentelemetry.instrumentation.nemo_gym.sandbox import tracing
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import ProcessSandboxProvider

MODULE_SOURCE = """
class Greeter:
    def greet(self, name):
        return "hello " + name


def greet(name):
    return "hello " + name
"""


@pytest.fixture
def module_name(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, not yet imported module on sys.path, removed afterwards."""
    name = f"patching_target_{request.node.name}".replace("[", "_").replace("]", "_")
    (tmp_path / f"{name}.py").write_text(MODULE_SOURCE, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def shouting(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return wrapped(*args, **kwargs).upper()


def method_patch(module: str) -> Patch:
    once = OnceLog(logging.getLogger(__name__))
    return Patch((module,), methods_of("Greeter", ("greet",), shouting, once), once)


def test_patch_before_import_applies_once_at_import(module_name: str) -> None:
    """install, uninstall, install before the import: one wrapper, applied by the hook."""
    patch = method_patch(module_name)
    patch.install()
    patch.uninstall()
    patch.install()
    module = importlib.import_module(module_name)
    assert module.Greeter().greet("x") == "HELLO X"
    patch.uninstall()
    assert module.Greeter().greet("x") == "hello x"
    assert not isinstance(vars(module.Greeter)["greet"], wrapt.FunctionWrapper)


def test_patch_uninstall_before_import_leaves_module_alone(module_name: str) -> None:
    """A hook still pending when the patch is uninstalled does nothing at the import."""
    patch = method_patch(module_name)
    patch.install()
    patch.uninstall()
    module = importlib.import_module(module_name)
    assert not isinstance(vars(module.Greeter)["greet"], wrapt.FunctionWrapper)


@pytest.mark.parametrize("first_off", ["first", "second"])
def test_patch_two_installations_on_one_target_come_off_in_any_order(
    module_name: str, first_off: str
) -> None:
    """Two patches (two instrumentors') on one method, taken off in either order: each call
    runs every live wrapper once, and at the end the class holds its own function again."""
    module = importlib.import_module(module_name)
    original = vars(module.Greeter)["greet"]
    first, second = method_patch(module_name), method_patch(module_name)
    first.install()
    second.install()
    assert module.Greeter().greet("x") == "HELLO X"
    remaining = second if first_off == "first" else first
    (first if first_off == "first" else second).uninstall()
    assert module.Greeter().greet("x") == "HELLO X"
    remaining.uninstall()
    assert vars(module.Greeter)["greet"] is original
    assert module.Greeter().greet("x") == "hello x"


def test_patch_later_wrapt_wrapper_stays_pointed_past_ours(module_name: str) -> None:
    """Uninstall under a later wrapt wrapper keeps theirs, around the original function."""
    module = importlib.import_module(module_name)
    original = vars(module.Greeter)["greet"]
    patch = method_patch(module_name)
    patch.install()

    def exclaiming(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs) + "!"

    wrapt.wrap_function_wrapper(module.Greeter, "greet", exclaiming)
    theirs = vars(module.Greeter)["greet"]
    assert module.Greeter().greet("x") == "HELLO X!"
    patch.uninstall()
    assert vars(module.Greeter)["greet"] is theirs
    assert theirs.__wrapped__ is original
    assert module.Greeter().greet("x") == "hello x!"


def test_patch_unreachable_wrapper_goes_inert_and_reinstall_applies_once(
    module_name: str,
) -> None:
    """Under a plain (non-wrapt) replacement ours stays but passes through, and installing
    again wraps once more without waking the stranded wrapper."""
    module = importlib.import_module(module_name)
    patch = method_patch(module_name)
    patch.install()
    ours = vars(module.Greeter)["greet"]

    def replacement(self: Any, name: str) -> str:
        return str(ours(self, name)) + "?"

    module.Greeter.greet = replacement
    patch.uninstall()
    assert module.Greeter().greet("x") == "hello x?"
    patch.install()
    assert module.Greeter().greet("x") == "HELLO X?"
    patch.uninstall()
    assert vars(module.Greeter)["greet"] is replacement


def test_patch_bind_restores_a_module_that_imported_the_wrapper(module_name: str) -> None:
    """A second module that bound our wrapper by name gets the original function back."""
    module = importlib.import_module(module_name)
    original = module.greet
    other = ModuleType("holder")

    def apply(patch: Patch, target: ModuleType) -> None:
        other.greet = patch.wrap(target, "greet", shouting)
        patch.bind(other, "greet", other.greet)

    once = OnceLog(logging.getLogger(__name__))
    patch = Patch((module_name,), apply, once)
    patch.install()
    assert module.greet("x") == other.greet("x") == "HELLO X"
    patch.uninstall()
    assert module.greet is original
    assert other.greet is original


def test_patch_missing_class_logged_once_at_debug(
    module_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A module without the class is left alone, said once at debug level."""
    module = importlib.import_module(module_name)
    del module.Greeter
    caplog.set_level(logging.DEBUG, logger=__name__)
    patch = method_patch(module_name)
    patch.install()
    patch.uninstall()
    patch.install()
    patch.uninstall()
    assert [record.getMessage() for record in caplog.records] == [
        f"nemo_gym: {module_name} has no Greeter; left alone"
    ]


def test_sandbox_disable_under_a_later_wrapper_takes_only_ours_off() -> None:
    """disable() with another library's wrapt wrapper over a bundled provider's traced method
    keeps theirs, now around the provider's own method (wrapt 2's FunctionWrapper included)."""
    original = vars(ProcessSandboxProvider)["create"]

    def theirs(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    state = tracing.enable(TracerProvider())
    try:
        wrapt.wrap_function_wrapper(ProcessSandboxProvider, "create", theirs)
        their_wrapper = vars(ProcessSandboxProvider)["create"]
        tracing.disable(state)
        assert vars(ProcessSandboxProvider)["create"] is their_wrapper
        assert their_wrapper.__wrapped__ is original
    finally:
        tracing.disable(state)
        ProcessSandboxProvider.create = original  # type: ignore[method-assign]
