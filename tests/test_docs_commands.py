"""Every shell command in the README and the pages beside it runs, as written, and does what
the page says.

The commands are read from the ``console`` blocks (``$ `` starts one, a trailing backslash
continues it; other lines are the output the page shows) of ``PAGES``: README.md,
CONTRIBUTING.md and every page of docs/. Each is run once, however many pages show it, with
``bash -c`` from the repository root, exactly as written, with only these exceptions:

* commands listed in ``NOT_RUN_HERE`` are not run, for the reason given beside each;
* the install lines (``INSTALL_SEQUENCE``) run in order in a throwaway virtualenv, as a user
  with that virtualenv active would run them, ending with the zero-code command;
* the NeMo Gym deployment walk-through's commands are run by
  tests/test_nemo_gym_deployment.py, its two shells in order, and the Kubernetes one's
  (docs/nemo-gym-kubernetes.md) by tests/test_nemo_gym_kubernetes.py;
* the Ray walk-through's commands (docs/identity-and-ray.md) are run by
  tests/test_ray_walkthrough.py, on a Ray cluster of its own.

``test_docs_commands_all_accounted_for`` fails when a page gains a command this file does not
know, or loses one it does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import test_nemo_gym_kubernetes as kubernetes_walk
from conftest import require_service
from nemo_gym_deployment import (
    CLONE,
    EXPORT_INTERVAL,
    HEAD_PORT,
    MODEL_ENDPOINT,
    STUB_PORT,
    TRACING_PAGE,
    WORKING_FOLDER,
    console_blocks,
    deployment_section,
    deployment_shells,
    fill,
    page_section,
    report_output_on_page,
    shells_of,
)
from ray_walkthrough import RAY_PAGE, walkthrough_commands

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")))
QUEUE_METRIC = "gym.http.connection_pool.queue_duration_ms"

# The pages' commands use .venv: run them once, from the suite run in .venv, not again
# from CI's other virtualenvs (lowest aiohttp, other Pythons), where they would test the same.
IN_DOT_VENV = Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
once = pytest.mark.skipif(
    not IN_DOT_VENV, reason="run once, by the suite in .venv (the pages' commands use it)"
)

pytestmark = pytest.mark.integration

_RECURSES = "it runs this very test suite: running it from here would recurse"
_DEPLOYMENT = (
    "the NeMo Gym deployment walk-through (Python 3.12, nemo-gym 0.4.0, Ray, a collector, two "
    "shells): tests/test_nemo_gym_deployment.py runs its console blocks as written, in .ci/run's "
    "own section"
)
NOT_RUN_HERE = {
    "opentelemetry-instrument --traces_exporter console --metrics_exporter console "
    "--logs_exporter none python your_nemo_gym_app.py": (
        "a placeholder for the user's application; the same command on "
        "examples/nemo_gym_sandbox.py is run"
    ),
    "bash scripts/test.sh": _RECURSES,
    "bash scripts/test.sh -x -q": _RECURSES,
    "bash scripts/fresh-debian-check.sh --log /tmp/fresh-run.txt": (
        "it builds a Debian root filesystem and runs the README's commands in Podman, minutes "
        "of work run by hand (CONTRIBUTING.md), not by the suite it runs"
    ),
    "CI=true bash .ci/run": (
        "it is CI itself (installs Debian packages, starts Podman, and runs this suite)"
    ),
}

# Run in this order in one fresh virtualenv, from the repository root.
INSTALL_SEQUENCE = (
    "pip install -c constraints.txt .",
    "pip install -c constraints.txt opentelemetry-distro",
    "opentelemetry-instrument --metrics_exporter console --traces_exporter none "
    "--logs_exporter none python examples/quickstart.py",
)

# What a run must show beyond its exit status (0 unless EXIT_STATUS says otherwise).
EXIT_STATUS = {
    "nemo-gym-otel capacity --limit 256 --limit-per-host 64 --workers 4 --intended 1024": 1,
}
MUST_SHOW = {
    "bash scripts/quickstart.sh": (
        "Sent 300 requests",
        "Pool state at saturation",
        "What to do:",
        "nemo-gym-otel capacity",
        "== 2. A sandbox: what it asked for, what it got, what it used ==",
        "  requested       0.25         32  the spec (SandboxSpec)",
        "Usage samples (sandbox.resources records)",
    ),
    "examples/quickstart.py": (
        QUEUE_METRIC,
        "Using the meter provider configured by",
        "Pool state at saturation",
    ),
    "examples/nemo_gym_sandbox.py": ('"name": "sandbox.create"', '"name": "sandbox.resources"'),
    "examples/sandbox.py": ("How to read it:",),
    "--json": ('"safe": true', '"exit_code": 0'),
}
MUST_NOT_SHOW = {
    "opentelemetry-instrument": (
        "Failed to auto initialize OpenTelemetry",
        "Attempting to instrument while already instrumented",
        "Traceback",
    ),
    "quickstart": ("Traceback",),
}
# Values that differ between machines, in output lines the pages show.
MACHINE_VALUES = re.compile(r"(file_descriptor_soft_limit|ephemeral_ports_per_destination)=\S+")


def page_commands(text: str) -> list[tuple[str, list[str]]]:
    """Each ``console`` command in a page's ``text`` with the output lines shown under it."""
    found: list[tuple[str, list[str]]] = []
    in_console = False
    pending: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            in_console = line.strip() == "```console"
            continue
        if not in_console:
            continue
        if pending:  # a continued command
            pending.append(line.strip())
        elif line.startswith("$ "):
            pending = [line[2:].strip()]
        elif found:
            found[-1][1].append(line)
            continue
        if pending and not pending[-1].endswith("\\"):
            command = " ".join(part.removesuffix("\\").strip() for part in pending)
            # A trailing "# comment" is the shell's business, but not part of the name.
            found.append((re.sub(r"\s+#\s.*$", "", command).strip(), []))
            pending = []
    return found


def _each_command_once(
    page_commands: dict[Path, list[tuple[str, list[str]]]],
) -> dict[str, list[str]]:
    """Each command once, with the output lines every page shows under it."""
    commands: dict[str, list[str]] = {}
    for found in page_commands.values():
        for command, shown in found:
            commands.setdefault(command, []).extend(shown)
    return commands


PAGE_COMMANDS = {page: page_commands(page.read_text(encoding="utf-8")) for page in PAGES}
COMMANDS = _each_command_once(PAGE_COMMANDS)
# The deployment walk-through's commands: run by tests/test_nemo_gym_deployment.py, its two
# shells in order (the second repeats the first's setup lines, as a user types them again).
_NEMO_GYM_DEPLOYMENT = {command for command, _ in page_commands(deployment_section())} | {
    command
    for command, _ in page_commands(page_section(kubernetes_walk.PAGE, kubernetes_walk.SECTION))
}
# docs/tracing.md queries the deployment's Jaeger: tests/test_nemo_gym_deployment.py runs it
# against that run's 300 traces (test_deployment_tracing_page_lists_the_slowest_rollouts).
_NEMO_GYM_TRACING = {command for command, _ in page_commands(TRACING_PAGE.read_text("utf-8"))}
# docs/identity-and-ray.md's Ray walk-through needs Ray (.venv-ray) and starts a cluster:
# tests/test_ray_walkthrough.py runs it as written, in .ci/run's ray_cluster section.
_RAY_WALKTHROUGH = {
    command
    for command, _ in page_commands(RAY_PAGE.read_text("utf-8"))
    if any(typed.startswith(command) for typed in walkthrough_commands())
}
RUN_AS_WRITTEN = [
    (command, shown)
    for command, shown in COMMANDS.items()
    if command not in NOT_RUN_HERE
    and command not in INSTALL_SEQUENCE
    and command not in _NEMO_GYM_DEPLOYMENT
    and command not in _NEMO_GYM_TRACING
    and command not in _RAY_WALKTHROUGH
]


# Python examples that need what a page leaves to the reader; every other ``python`` block runs.
PYTHON_NOT_RUN = {
    "set_server_name(": (
        "a fragment inside the reader's coroutine (its session, url and payload); "
        "tests/test_connection_pool.py and tests/test_pool_telemetry.py make these calls"
    ),
    "ray.init(": (
        "ray_task.py of the Ray walk-through: tests/test_ray_walkthrough.py runs it as written "
        "on a Ray cluster, in .ci/run's ray_cluster section"
    ),
}
# Runs a page's python block as a module would, top-level ``await`` included.
_RUN_BLOCK = """
import ast, asyncio, sys
code = compile(sys.stdin.read(), "<page>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
result = eval(code, {"__name__": "__main__"})
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""


def python_blocks(page: Path) -> list[str]:
    """The ``python`` code blocks of ``page``."""
    text = page.read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


PYTHON_BLOCKS = [
    (f"{page.relative_to(ROOT)}, python block {number}", block)
    for page in PAGES
    for number, block in enumerate(python_blocks(page), start=1)
]
PYTHON_RUN = [
    (where, block)
    for where, block in PYTHON_BLOCKS
    if not any(fragment in block for fragment in PYTHON_NOT_RUN)
]


def _environment() -> dict[str, str]:
    """This process's environment, less anything that would configure OpenTelemetry."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OTEL_", "PYTEST_", "VIRTUAL_ENV"))
    }


def _run(command: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_docs_commands_all_accounted_for() -> None:
    """Every command of the pages is run here or has a stated reason; no entry here is stale."""
    names = list(COMMANDS)
    for page, commands in PAGE_COMMANDS.items():
        once_each = [name for name, _ in commands if name not in _NEMO_GYM_DEPLOYMENT]
        assert len(once_each) == len(set(once_each)), f"a command appears twice in {page.name}"
    assert len(_NEMO_GYM_DEPLOYMENT) >= 10, _NEMO_GYM_DEPLOYMENT
    assert len(_RAY_WALKTHROUGH) == 3, _RAY_WALKTHROUGH
    for command in [*NOT_RUN_HERE, *INSTALL_SEQUENCE]:
        assert command in names, f"{command!r} is no longer on any page"
    for fragment in [*EXIT_STATUS, *MUST_SHOW, *MUST_NOT_SHOW]:
        assert any(fragment in name for name in names), f"{fragment!r} matches no command"
    assert len(RUN_AS_WRITTEN) >= 6


@once
@pytest.mark.parametrize(("command", "shown"), RUN_AS_WRITTEN, ids=[c for c, _ in RUN_AS_WRITTEN])
def test_docs_command_runs_as_written(command: str, shown: list[str]) -> None:
    """The command succeeds from the repository root and prints what its pages show."""
    require_service(
        (ROOT / ".venv" / "bin" / "python").exists(),
        "the pages' commands use .venv, which `bash scripts/quickstart.sh` creates",
    )
    result = _run(command, _environment(), timeout=540)
    output = result.stdout + result.stderr
    expected = next((code for fragment, code in EXIT_STATUS.items() if fragment in command), 0)
    assert result.returncode == expected, output[-4000:]
    for fragment, needles in MUST_SHOW.items():
        if fragment in command:
            for needle in needles:
                assert needle in output, f"{needle!r} missing from the output:\n{output[-4000:]}"
    for fragment, needles in MUST_NOT_SHOW.items():
        if fragment in command:
            for needle in needles:
                assert needle not in output, f"{needle!r} in the output:\n{output[-4000:]}"
    actual_lines = {MACHINE_VALUES.sub(r"\1=…", line) for line in output.splitlines()}
    for line in shown:
        assert MACHINE_VALUES.sub(r"\1=…", line) in actual_lines, f"a page shows {line!r}"


@once
def test_docs_install_lines_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    """From source plus the distro, in a new virtualenv: the zero-code command prints metrics.

    The PyPI line is replaced by the install-from-source line next to it (not published yet).
    """
    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(home)
    env = _environment()
    env.update(PATH=f"{home / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(home))
    for command in INSTALL_SEQUENCE:
        result = _run(command, env, timeout=540)
        assert result.returncode == 0, f"{command}\n{(result.stdout + result.stderr)[-4000:]}"
    # The last one is the zero-code run: console metrics on stdout, no SDK failure.
    assert QUEUE_METRIC in result.stdout
    assert '"nemo.gym.http.connection_pool.queue_constraint": "total"' in result.stdout
    assert "Failed to auto initialize OpenTelemetry" not in result.stderr
    assert "Attempting to instrument while already instrumented" not in result.stderr
    installed = subprocess.run(
        [str(home / "bin" / "python"), "-c", "import opentelemetry.instrumentation.nemo_gym"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    assert sys.prefix != str(home)


def test_docs_deployment_walkthrough_has_three_shells_and_every_placeholder() -> None:
    """The deployment page still has what tests/test_nemo_gym_deployment.py fills and runs (its
    own section is heavy; this fails in the main suite the moment the page loses a piece): two
    shells, the report typed into the second afterwards, and the output the report printed."""
    shells = deployment_shells()
    assert len(shells) == 3, shells
    values = {placeholder: f"<{placeholder}>" for placeholder in (CLONE, WORKING_FOLDER)}
    values |= {MODEL_ENDPOINT: "<model>", STUB_PORT: "<stub>", HEAD_PORT: "<port>"}
    values |= {EXPORT_INTERVAL: "<interval>"}
    first, second, report = fill(shells, values)
    assert "gym env start" in first
    assert "<stub>" in first
    assert "gym eval run" in second
    assert report.splitlines()[-1].startswith("nemo-gym-otel report")
    assert "gym eval run" not in report
    assert HEAD_PORT not in first + second
    assert report_output_on_page().startswith("run ")


def test_docs_kubernetes_walkthrough_has_three_shells_and_every_placeholder() -> None:
    """docs/nemo-gym-kubernetes.md still has what tests/test_nemo_gym_kubernetes.py fills and
    runs: two shells, the report typed into the second afterwards, and what it printed."""
    body = page_section(kubernetes_walk.PAGE, kubernetes_walk.SECTION)
    shells = shells_of(console_blocks(body))
    values = {
        CLONE: "<clone>",
        kubernetes_walk.WORKING_FOLDER: "<folder>",
        MODEL_ENDPOINT: "<model>",
    }
    values |= {STUB_PORT: "<stub>", HEAD_PORT: "<port>"}
    first, second, report = fill(shells, values)
    assert "gym env start" in first
    assert "<stub>" in first
    assert "gym eval run" in second
    assert report.splitlines()[-1].startswith(kubernetes_walk.REPORT_COMMAND.removeprefix("$ "))
    assert HEAD_PORT not in first + second
    assert report_output_on_page(body, kubernetes_walk.REPORT_COMMAND).startswith("run ")


def test_docs_python_blocks_all_accounted_for() -> None:
    """Every ``python`` block of the pages runs here or has a stated reason; none is stale."""
    for fragment in PYTHON_NOT_RUN:
        matching = [block for _, block in PYTHON_BLOCKS if fragment in block]
        assert len(matching) == 1, (fragment, matching)
    assert len(PYTHON_RUN) >= 2, PYTHON_RUN


@once
@pytest.mark.parametrize(("where", "block"), PYTHON_RUN, ids=[where for where, _ in PYTHON_RUN])
def test_docs_python_block_runs_as_written(where: str, block: str, tmp_path: Path) -> None:
    """The block runs to its end, as written, in a fresh folder."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN_BLOCK],
        input=block,
        cwd=tmp_path,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{where}:\n{result.stdout}{result.stderr}"
    assert "Traceback" not in result.stderr, f"{where}:\n{result.stderr}"
