"""``nemo-gym-otel server-venvs`` on bad input: one line naming the file or argument, exit 2.

The command reads the configuration with NeMo Gym's own parser, which needs NeMo Gym's stack
(Hydra, OmegaConf, ...). These tests run in the virtualenv ``scripts/nemo-gym-server-env.sh``
builds: marked ``nemo_gym_server``, which the main suite leaves out (``SECTIONS`` in
``conftest.py``), they run in ``.ci/run``'s section with ``-m nemo_gym_server``, where a
parser that does not import fails them. Each runs the real command in a process of
its own, so its exit status and every line it prints are the ones a user sees.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not importable in the light main virtualenv, which collects this module only to leave it
# out; where the section is selected, conftest.SECTIONS fails the tests with the import error.
with contextlib.suppress(ImportError):
    import nemo_gym.cli.env
    import nemo_gym.global_config  # noqa: F401

pytestmark = pytest.mark.nemo_gym_server

PREFIX = "nemo-gym-otel server-venvs: error: "


CLI = "opentelemetry.instrumentation.nemo_gym.tools.cli"


def _server_venvs(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NEMO_GYM")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "opentelemetry.instrumentation.nemo_gym.tools.cli",
            "server-venvs",
            *args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def spaced(tmp_path: Path) -> Path:
    """A working directory whose path has a space."""
    folder = tmp_path / "my checkout"
    folder.mkdir()
    return folder


def test_server_venvs_missing_config_file_one_line_exit_2(spaced: Path) -> None:
    """A --config file that does not exist: one line with the paths looked at, exit 2."""
    done = _server_venvs(spaced, "--config", "missing.yaml")

    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [done.stderr.rstrip("\n")]
    assert done.stderr.startswith(
        f"{PREFIX}config_paths entry 'missing.yaml' was not found. Looked in: "
        f"{spaced / 'missing.yaml'} "
    )


def test_server_venvs_malformed_yaml_one_line_exit_2(spaced: Path) -> None:
    """A --config file that is not YAML: one line naming it, the line and the problem, exit 2."""
    (spaced / "bad.yaml").write_text("servers: [1, 2\n")

    done = _server_venvs(spaced, "--config", "bad.yaml")

    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"{PREFIX}Malformed YAML in '{spaced / 'bad.yaml'}' at line 2, column 1: "
        "expected ',' or ']', but got '<stream end>'\n"
    )


def test_server_venvs_config_is_a_folder_one_line_exit_2(spaced: Path) -> None:
    """A --config path that is a folder: one line naming it, exit 2."""
    done = _server_venvs(spaced, "--config", str(spaced))

    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"{PREFIX}{spaced}: Is a directory\n"


def test_server_venvs_malformed_override_one_line_exit_2(spaced: Path) -> None:
    """A Hydra override that does not parse: one line naming it, exit 2 (Hydra's own is 1)."""
    done = _server_venvs(spaced, "+head_server={host:127.0.0.1")

    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [done.stderr.rstrip("\n")]
    assert done.stderr.startswith(f"{PREFIX}not a valid override: +head_server={{host:127.0.0.1: ")


def test_server_venvs_no_servers_exit_2(spaced: Path) -> None:
    """A configuration without a server is bad input too: one line, exit 2."""
    (spaced / "empty.yaml").write_text("some_setting: 1\n")

    done = _server_venvs(spaced, "--config", "empty.yaml")

    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"{PREFIX}no servers in this configuration\n"
