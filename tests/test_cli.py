"""The ``nemo-gym-otel capacity`` command: report, warnings and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_support import nemo_gym_main
from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.tools.cli import main
from opentelemetry.instrumentation.nemo_gym.version import __version__


@pytest.fixture(autouse=True)
def _fresh_reports() -> Iterator[None]:
    """Each invocation reports as a fresh process would."""
    connection_pool._REPORTED_CAPACITIES.clear()
    yield
    connection_pool._REPORTED_CAPACITIES.clear()


def _capacity_args(limit: str, per_host: str, workers: str, *extra: str) -> list[str]:
    return [
        "capacity",
        "--limit",
        limit,
        "--limit-per-host",
        per_host,
        "--workers",
        workers,
        *extra,
    ]


PREFIX = "aiohttp connection pool capacity for this server/CLI process group: "


def test_main_safe_configuration_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """Demand within every limit prints the report on stdout, nothing on stderr, and exits 0."""
    code = main(_capacity_args("100", "20", "4", "--intended", "100", "--intended-per-host", "20"))
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.startswith(
        PREFIX + "workers=4 aggregate_total=100 aggregate_per_host=20 effective_total=25 "
        "effective_per_host=5 per_worker_per_host=5 intended_per_worker=25 "
        "intended_per_host_per_worker=5 "
    )
    assert captured.out.count("\n") == 1
    assert captured.err == ""


def test_main_limits_only_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """Limits without intended demand are never unsafe; unset demand reads `unset`."""
    assert main(_capacity_args("0", "0", "1")) == 0
    out = capsys.readouterr().out
    assert "aggregate_total=unlimited" in out
    assert "intended_per_worker=unset" in out


def test_main_workers_and_limit_per_host_default(capsys: pytest.CaptureFixture[str]) -> None:
    """--workers defaults to 1 and --limit-per-host to 0 (unlimited)."""
    assert main(["capacity", "--limit", "64"]) == 0
    out = capsys.readouterr().out
    assert "workers=1 aggregate_total=64 aggregate_per_host=unlimited " in out


def test_main_unsafe_mismatch_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """Demand above the per-worker limit: report on stdout, warning on stderr, exit 1."""
    code = main(_capacity_args("100", "0", "4", "--intended", "300"))
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.startswith(PREFIX + "workers=4 ")
    assert captured.err.splitlines() == [
        "warning: intended per-worker concurrency 75 exceeds effective total limit 25 "
        "(4 workers): the excess requests queue for a pool slot and the wait looks like "
        "server latency; raise --limit to at least 300 (0 for unlimited)"
    ]


def test_main_json_prints_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the values, the warnings and the exit code as one JSON object."""
    code = main(["capacity", "--limit", "10", "--intended", "20", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == report["exit_code"] == 1
    assert captured.err == ""
    assert report["safe"] is False
    assert (report["workers"], report["aggregate_total"], report["aggregate_per_host"]) == (
        1,
        10,
        0,
    )
    assert report["intended_per_worker"] == 20
    assert report["intended_per_host_per_worker"] is None
    (warning,) = report["warnings"]
    assert warning.startswith("intended per-worker concurrency 20 exceeds effective total limit 10")


def test_main_json_safe_has_no_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    """A safe sizing in JSON: safe true, no warnings, exit code 0."""
    assert main(["capacity", "--limit", "10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["safe"], report["warnings"], report["exit_code"]) == (True, [], 0)


def test_main_version_prints_version(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the program name and the package version and returns 0."""
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"nemo-gym-otel {__version__}\n"


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (
            _capacity_args("100", "0", "0"),
            "worker count must be at least 1, got --workers=0",
        ),
        (_capacity_args("-1", "0", "1"), "--limit=-1 is invalid"),
        (_capacity_args("10", "-1", "1"), "--limit-per-host=-1 is invalid"),
        (
            _capacity_args("3", "0", "4"),
            "positive aiohttp connector limits must remain at least 1 after division by "
            "workers: --limit=3 divided across --workers=4",
        ),
        (
            _capacity_args("10", "0", "1", "--intended", "-10"),
            "--intended=-10 is invalid: intended concurrency is a positive integer; to skip "
            "this check, omit it;",
        ),
        (_capacity_args("10", "0", "1", "--intended-per-host", "0"), "--intended-per-host=0 "),
        (_capacity_args("ten", "0", "1"), "argument --limit: invalid int value: 'ten'"),
        (["capacity", "--workers", "2"], "the following arguments are required: --limit"),
    ],
)
def test_main_bad_capacity_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    """Bad input to capacity exits 2 and names the flag as typed, never an internal field."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "nemo-gym-otel capacity: error:" in captured.err
    assert reason in captured.err
    assert "global_aiohttp" not in captured.err
    assert "None" not in captured.err


def test_main_usage_error_prints_the_subcommand_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """An argparse error in `capacity` prints capacity's usage, not the top-level one."""
    assert main(["capacity", "--limit", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nemo-gym-otel capacity [-h] --limit LIMIT")


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        ([], "the following arguments are required: command"),
        (["sizing"], "invalid choice: 'sizing'"),
    ],
)
def test_main_bad_command_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    """No command or an unknown one exits 2 with the top-level usage."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nemo-gym-otel [-h] [--version]")
    assert "nemo-gym-otel: error:" in err
    assert reason in err


def test_main_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """--help prints usage and returns 0 instead of exiting the caller."""
    assert main(["capacity", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--intended-per-host" in out
    assert "default 1" in out


@pytest.mark.integration
def test_nemo_gym_otel_script_runs_as_installed() -> None:
    """The installed console script reports an unsafe mismatch with exit code 1."""
    script = Path(sys.executable).with_name("nemo-gym-otel")
    if not script.exists():
        pytest.fail(f"console script not installed next to {sys.executable}")
    result = subprocess.run(
        [str(script), *_capacity_args("8", "0", "2", "--intended", "10")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith(PREFIX + "workers=2 aggregate_total=8 ")
    # Printed once, on stderr: no logging handler repeats it.
    (warning,) = result.stderr.splitlines()
    assert warning.startswith("warning: intended per-worker concurrency 5 exceeds")


@pytest.mark.integration
def test_nemo_gym_otel_report_is_pipeable() -> None:
    """The report line goes through a pipe while the warning stays on the terminal's stderr."""
    script = Path(sys.executable).with_name("nemo-gym-otel")
    result = subprocess.run(
        [
            "sh",
            "-c",
            f"'{script}' capacity --limit 8 --intended 10 | tr ' ' '\\n' | grep ^aggregate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.stdout.splitlines() == ["aggregate_total=8", "aggregate_per_host=unlimited"]
    assert "warning: intended per-worker concurrency 10" in result.stderr


def test_server_venvs_without_nemo_gym_stack_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Without NeMo Gym's configuration stack it says what is missing and where to run it."""
    pytest.importorskip("nemo_gym")  # the suite installs the wheel alone, without hydra
    try:
        import hydra  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("NeMo Gym's full stack is installed here; see test_nemo_gym_deployment.py")
    assert main(["server-venvs", "--config", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nemo-gym-otel server-venvs: error: needs nemo-gym in this environment")
    assert "run it from the virtualenv that runs `gym`" in err


def test_server_venvs_help_lists_gym_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """`server-venvs --help` explains the step and the flag to start with afterwards."""
    assert main(["server-venvs", "--help"]) == 0
    out = capsys.readouterr().out
    assert "GYM_ENV_START_ARGS" in out
    assert "+skip_venv_if_present=true" in out


def test_opentelemetry_requirements_pins_this_environment() -> None:
    """The server venvs get this environment's OpenTelemetry packages, at its versions."""
    from importlib.metadata import version

    from opentelemetry.instrumentation.nemo_gym.tools._server_venvs import (
        opentelemetry_requirements,
    )

    wanted = opentelemetry_requirements()
    assert f"opentelemetry-sdk=={version('opentelemetry-sdk')}" in wanted
    assert f"opentelemetry-api=={version('opentelemetry-api')}" in wanted
    # Every other entry is `opentelemetry-<name>==<version>`; this package may be a path.
    ours = [r for r in wanted if not r.startswith("opentelemetry-") or "nemo-gym" in r]
    # This checkout is installed editable by scripts/test.sh: it goes in by its path.
    root = str(Path(__file__).resolve().parent.parent)
    assert ours == [f"-e {root}"] or ours == [
        f"opentelemetry-instrumentation-nemo-gym=={__version__}"
    ]


def test_opentelemetry_requirements_checkout_path_with_a_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution installed from a folder whose path has a space goes in by that path."""
    from opentelemetry.instrumentation.nemo_gym.tools._server_venvs import (
        opentelemetry_requirements,
    )

    checkout = tmp_path / "my checkout é"
    checkout.mkdir()
    site = tmp_path / "site"
    for name, editable in (
        ("opentelemetry_spaced_editable", True),
        ("opentelemetry_spaced", False),
    ):
        dist_info = site / f"{name}-1.0.dist-info"
        dist_info.mkdir(parents=True)
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        # What pip records: a file:// URL, percent-encoded.
        (dist_info / "direct_url.json").write_text(
            json.dumps({"url": checkout.as_uri(), "dir_info": {"editable": editable}})
        )
    monkeypatch.syspath_prepend(str(site))

    wanted = opentelemetry_requirements()

    assert "%20" in checkout.as_uri()
    assert f"-e {checkout}" in wanted
    assert str(checkout) in wanted


@pytest.mark.nemo_gym_main
@pytest.mark.parametrize("moved", [False, True], ids=["default_root", "uv_venv_dir"])
def test_server_venvs_on_nemo_gym_main_where_its_setup_puts_them(
    moved: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NeMo Gym main, server-venvs reads the configuration with NeMo Gym's parser and names
    each server's virtualenv where NeMo Gym's own rule (get_venv_path, new in main) and setup
    command put it."""
    nemo_gym_main()
    from nemo_gym import global_config
    from nemo_gym.cli.setup_command import get_venv_path

    from opentelemetry.instrumentation.nemo_gym.tools._server_venvs import (
        server_venvs,
    )

    server_dir = tmp_path / "resources_servers" / "echo"
    (server_dir / "configs").mkdir(parents=True)
    (server_dir / "requirements.txt").write_text("fastapi\n")
    (server_dir / "configs" / "echo.yaml").write_text(
        "echo_resources:\n  resources_servers:\n    echo:\n      entrypoint: app.py\n"
        "      domain: other\n"
    )
    monkeypatch.chdir(tmp_path)  # NeMo Gym looks for a local server under the cwd first
    monkeypatch.setattr(global_config, "_GLOBAL_CONFIG_DICT", None)  # read once per process
    args = ["--config", "resources_servers/echo/configs/echo.yaml"]
    if moved:
        args.append(f"+uv_venv_dir={tmp_path / 'venvs'}")
    (found,) = server_venvs(args)
    config = global_config.get_global_config_dict()  # the one server_venvs read
    assert (found.server, found.server_dir) == ("echo_resources", server_dir)
    assert found.venv == get_venv_path(server_dir, config)
    assert f"--allow-existing --python {config['python_version']} {found.venv} " in (
        found.setup_command
    )
    if moved:
        assert found.venv == tmp_path / "venvs" / "resources_servers" / "echo" / ".venv"


def test_tracing_requirements_add_process_metrics_at_instrumentation_release() -> None:
    """--tracing adds system-metrics at this environment's opentelemetry-instrumentation
    release when it is not among the requirements, and nothing when it is."""
    from importlib.metadata import version

    from opentelemetry.instrumentation.nemo_gym.tools._server_venvs import (
        tracing_requirements,
    )

    tracing = [
        "opentelemetry-instrumentation-aiohttp-client==0.66b1",
        "opentelemetry-instrumentation-fastapi==0.66b1",
    ]
    release = version("opentelemetry-instrumentation")
    assert tracing_requirements(["opentelemetry-sdk==1.45.1", *tracing]) == [
        f"opentelemetry-instrumentation-system-metrics=={release}"
    ]
    with_metrics = [*tracing, "opentelemetry-instrumentation-system-metrics==0.66b1"]
    assert tracing_requirements(with_metrics) == []


def test_tracing_requirements_missing_instrumentation_names_it() -> None:
    """--tracing without the fastapi instrumentation here is bad input naming the package and
    the one pip command that installs the set."""
    from opentelemetry.instrumentation.nemo_gym.tools._server_venvs import (
        tracing_requirements,
    )

    with pytest.raises(ValueError, match=r"^--tracing: ") as refused:
        tracing_requirements(["opentelemetry-instrumentation-aiohttp-client==0.66b1"])
    message = str(refused.value)
    assert message.startswith(
        f"--tracing: opentelemetry-instrumentation-fastapi not installed in {sys.prefix}; "
    )
    assert "beside opentelemetry-distro, in one pip command" in message


def test_server_venvs_tracing_flag_before_gym_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`server-venvs --tracing ARGS` hands ARGS to gym's parser and asks for tracing; without
    the flag, tracing stays off and every argument is gym's."""
    from opentelemetry.instrumentation.nemo_gym.tools import _server_venvs

    calls: list[tuple[list[str], bool]] = []

    def prepare(argv: list[str], *, tracing: bool = False) -> int:
        calls.append((list(argv), tracing))
        return 0

    monkeypatch.setattr(_server_venvs, "prepare", prepare)
    assert main(["server-venvs", "--tracing", "--config", "a.yaml", "+x=1"]) == 0
    assert main(["server-venvs", "--config", "a.yaml"]) == 0
    assert calls == [(["--config", "a.yaml", "+x=1"], True), (["--config", "a.yaml"], False)]
