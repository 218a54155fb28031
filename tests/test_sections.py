"""The heavy sections (``SECTIONS`` in ``conftest.py``): left out of the main suite by marker,
and a failure, never a skip, when selected without what they need.

Each case runs pytest itself in a real subprocess, with ``CI`` unset: that ``CI=true`` is not
what turns a missing service into a failure is the point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import SECTIONS

ROOT = Path(__file__).resolve().parent.parent
NO_TESTS_RAN = 5  # pytest's exit status when nothing was selected
USAGE_ERROR = 4  # pytest 9's, for an unknown marker in -m under --strict-markers


def pytest_run(*args: str, **environment: str) -> subprocess.CompletedProcess[str]:
    """``python -m pytest args`` from the checkout, ``CI`` and the sections' variables unset."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "CI" and not key.startswith(("NEMO_GYM_", "PYTEST_"))
    }
    env.update(environment)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_sections_main_suite_deselects_not_skips() -> None:
    """Without ``-m``, every section's tests are deselected and counted, none skipped or run."""
    files = [
        "tests/test_collector_script.py",
        "tests/test_nemo_gym_deployment.py",
        "tests/test_nemo_gym_server_client.py",
        "tests/test_ray_cluster.py",
        "tests/test_ray_walkthrough.py",
    ]
    done = pytest_run("--co", *files)
    assert done.returncode == NO_TESTS_RAN, done.stdout + done.stderr
    assert "skipped" not in done.stdout
    summary = done.stdout.splitlines()
    left_out = [line for line in summary if line.startswith("sections left out")]
    assert len(left_out) == 1
    for marker in ("collector", "deployment", "nemo_gym_server", "ray_cluster"):
        assert f"{marker} (" in left_out[0]
    assert any("deselected" in line for line in summary), summary


def test_sections_deployment_without_python312_fails(tmp_path: Path) -> None:
    """``-m deployment`` where the deployment page's ``python=`` line finds no Python 3.12
    fails, naming where it looked."""
    # The page's other place for it; on a machine that has it, this check cannot fail.
    assert not Path("/usr/bin/python3.12").exists(), "precondition: no Debian python3.12"
    done = pytest_run(
        "-m", "deployment", "tests/test_nemo_gym_deployment.py", PYENV_ROOT=str(tmp_path)
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "skipped" not in done.stdout
    assert f"no Python 3.12 in {tmp_path}/versions/3.12.* or /usr/bin" in done.stdout


def test_sections_collector_not_running_fails(tmp_path: Path) -> None:
    """``-m collector`` where no collector answers fails, with ``CI`` unset (it used to skip)."""
    done = pytest_run(
        "-m",
        "collector",
        "-x",
        "tests/test_collector_fleet.py",
        NEMO_GYM_COLLECTOR_DIR=str(tmp_path / "no-collector"),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "skipped" not in done.stdout
    assert "required service missing in section 'collector': no collector answers" in done.stdout


def test_sections_mistyped_marker_runs_nothing_and_fails() -> None:
    """A marker name with a typo runs no test and exits non-zero, which fails CI's run."""
    done = pytest_run("-m", "ray_clustr", "tests/test_ray_cluster.py")
    # pytest 9 refuses the unknown marker; pytest 8 selects nothing.
    assert done.returncode in (USAGE_ERROR, NO_TESTS_RAN), done.stdout + done.stderr
    assert "passed" not in done.stdout


def test_sections_markers_registered_with_requirement() -> None:
    """Each section's marker is registered (``--strict-markers``) with what it needs."""
    done = pytest_run("--markers")
    for marker, section in SECTIONS.items():
        prefix = f"@pytest.mark.{marker}:"
        lines = [line for line in done.stdout.splitlines() if line.startswith(prefix)]
        assert lines == [f"{prefix} {section.description}"]
