"""``nemo-gym-otel server-venvs``: put OpenTelemetry into every NeMo Gym server virtualenv.

``gym env start`` runs each server in its own uv virtualenv (``<uv_venv_dir>/<type>/<name>/.venv``)
holding NeMo Gym's dependencies only. Under ``opentelemetry-instrument`` the servers still
inherit its ``sitecustomize`` through ``PYTHONPATH``, which then fails in each server with
``ModuleNotFoundError: No module named 'opentelemetry.instrumentation'`` and the server runs
without telemetry. This command builds those virtualenvs ahead of time with NeMo Gym's own
installation command (``nemo_gym.cli.setup_command.setup_env_command``, so the path, the
interpreter and NeMo Gym's pins are NeMo Gym's), adds the OpenTelemetry packages of the
environment it runs in (at the same versions; a local or editable install by its path), and
checks that each server interpreter can import the plugin. ``gym env start ...
+skip_venv_if_present=true`` then uses them as they are.

``--tracing`` (before the ``gym env start`` arguments) is for one trace per rollout: contrib's
``opentelemetry-instrumentation-aiohttp-client`` and ``-fastapi`` must then be installed here
(they carry the context from the CLI to the agent and from server to server; installed here,
they go into every server virtualenv with the rest), and
``opentelemetry-instrumentation-system-metrics`` (the process metrics) goes into the server
virtualenvs too, at this environment's ``opentelemetry-instrumentation`` release where it is
not installed here.

It takes the same arguments as ``gym env start`` and reads the configuration with NeMo Gym's
own parser, so it needs ``nemo-gym`` installed beside it (as ``gym`` does). Nothing here runs
at import time of the plugin: ``cli.py`` imports this module only for the subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DISTRIBUTION = "opentelemetry-instrumentation-nemo-gym"
# What a server interpreter must import for opentelemetry-instrument's sitecustomize to load
# this plugin: the auto-instrumentation package (opentelemetry-instrumentation), the distro
# that configures the SDK from OTEL_* variables, and this package.
_IMPORT_CHECK = (
    "import opentelemetry.instrumentation.auto_instrumentation, opentelemetry.distro, "
    "opentelemetry.sdk, opentelemetry.instrumentation.nemo_gym"
)


# What --tracing needs in this environment (the CLI's own spans and context) and, through the
# copy, in each server's; and what it adds to the servers beside them.
TRACING_INSTRUMENTATIONS = (
    "opentelemetry-instrumentation-aiohttp-client",
    "opentelemetry-instrumentation-fastapi",
)
PROCESS_METRICS = "opentelemetry-instrumentation-system-metrics"
_INSTRUMENTATION = "opentelemetry-instrumentation"


@dataclass(frozen=True)
class ServerVenv:
    """One server's virtualenv as ``gym env start`` will use it."""

    server: str  # the top-level config key, e.g. ``policy_model``
    server_dir: Path  # e.g. ``.../resources_servers/example_single_tool_call``
    venv: Path
    setup_command: str  # NeMo Gym's own: ``cd <dir> && uv venv ... && uv pip install ...``


def opentelemetry_requirements() -> list[str]:
    """The OpenTelemetry distributions of this environment as requirements for another one.

    Every installed ``opentelemetry-*`` distribution, pinned to its version; one installed
    from a local directory (this package from a checkout) by its path, ``-e`` when editable.
    """
    requirements: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if not name.startswith("opentelemetry-") or name in requirements:
            continue
        requirements[name] = _requirement(dist, name)
    if DISTRIBUTION not in requirements:
        raise RuntimeError(f"{DISTRIBUTION} is not installed in {sys.prefix}")
    return [requirements[name] for name in sorted(requirements)]


def tracing_requirements(installed: Sequence[str]) -> list[str]:
    """What ``--tracing`` adds to ``installed`` (``opentelemetry_requirements()``): the process
    metrics at this environment's ``opentelemetry-instrumentation`` release, unless installed
    here already. Raises ``ValueError`` naming what to install when a tracing instrumentation
    is missing here."""
    names = {requirement.split("==", 1)[0] for requirement in installed}
    missing = [name for name in TRACING_INSTRUMENTATIONS if name not in names]
    if missing:
        # One pip command with the distro, so that pip picks one contrib release for all
        # (contrib publishes its packages apart: the newest of one may lack another).
        raise ValueError(
            f"--tracing: {', '.join(missing)} not installed in {sys.prefix}; install "
            f"{' '.join(TRACING_INSTRUMENTATIONS)} beside opentelemetry-distro, in one pip "
            "command, and run this again"
        )
    if PROCESS_METRICS in names:
        return []
    # The same release as the instrumentation package, as scripts/test.sh installs it: pip
    # cannot resolve the newest system-metrics against an older aiohttp-client.
    return [f"{PROCESS_METRICS}=={importlib.metadata.version(_INSTRUMENTATION)}"]


def _requirement(dist: importlib.metadata.Distribution, name: str) -> str:
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        direct = None
    if isinstance(direct, dict):
        url = direct.get("url", "")
        if isinstance(url, str) and url.startswith("file://"):
            # A URL: a checkout at "/work/my checkout" is recorded as "file:///work/my%20checkout".
            path = urllib.request.url2pathname(urllib.parse.urlsplit(url).path)
            editable = bool((direct.get("dir_info") or {}).get("editable"))
            return f"-e {path}" if editable else path
    return f"{name}=={dist.version}"


def _nemo_gym(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise RuntimeError(
            f"needs nemo-gym in this environment ({error}); "
            "run it from the virtualenv that runs `gym`"
        ) from error


def gym_overrides(argv: Sequence[str]) -> list[str]:
    """Turn ``gym env start`` arguments (flags and Hydra overrides) into Hydra overrides, as
    NeMo Gym's own command line does."""
    cli_main = _nemo_gym("nemo_gym.cli.main")
    parser = cli_main.build_parser()
    args, overrides = parser.parse_known_args(["env", "start", *argv])
    unknown = [token for token in overrides if token.startswith("-")]
    if unknown:
        raise ValueError(f"not a `gym env start` argument: {' '.join(unknown)}")
    command = args._command
    translated = [token for flag in command.flags for token in flag.translate_to_hydra(args)]
    merged: list[str] = cli_main._merge_config_paths(translated + overrides)
    return merged


def server_venvs(argv: Sequence[str]) -> list[ServerVenv]:
    """The virtualenvs ``gym env start <argv>`` would use, with NeMo Gym's setup commands."""
    global_config = _nemo_gym("nemo_gym.global_config")
    setup_command = _nemo_gym("nemo_gym.cli.setup_command")
    env_cli = _nemo_gym("nemo_gym.cli.env")
    config_types = _nemo_gym("nemo_gym.config_types")
    overrides = gym_overrides(argv)
    _check_override_grammar(overrides)
    saved = sys.argv
    sys.argv = [saved[0], *overrides]
    try:
        config = global_config.get_global_config_dict()
    except (config_types.ConfigError, OSError) as error:
        # A missing or malformed --config file: NeMo Gym's own message (it names the file and
        # the problem, over several lines), as one line and bad input rather than a traceback.
        raise ValueError(_one_line(error)) from error
    except SystemExit as stopped:
        # Hydra reports what it refuses itself, then exits 1 (the status of a FAILED server).
        raise ValueError(
            f"NeMo Gym's configuration parser stopped (exit {stopped.code}); its message is above"
        ) from stopped
    finally:
        sys.argv = saved
    venvs: dict[Path, ServerVenv] = {}
    for server in global_config.GlobalConfigDictParser().filter_for_server_instance_configs(config):
        server_type = server.SERVER_TYPE
        implementation = next(iter(getattr(server, server_type)))
        server_dir = env_cli._resolve_server_dir(Path(server_type, implementation))
        root = Path(config[global_config.UV_VENV_DIR_KEY_NAME])
        # The same rule as setup_env_command: beside the server unless uv_venv_dir moves it.
        if root.resolve() != Path(_nemo_gym("nemo_gym").PARENT_DIR).resolve():
            venv = Path(root, server_type, implementation, ".venv").absolute()
        else:
            venv = (server_dir / ".venv").absolute()
        if venv in venvs:
            continue  # two server instances of one implementation share its virtualenv
        command = setup_command.setup_env_command(server_dir, config, server.name)
        venvs[venv] = ServerVenv(server.name, server_dir, venv, command)
    return list(venvs.values())


def _check_override_grammar(overrides: Sequence[str]) -> None:
    """Hydra's own grammar check of ``key=value`` overrides, so that a malformed one is a line
    naming it (under Hydra's parser it would print several lines and exit 1)."""
    overrides_parser = _nemo_gym("hydra.core.override_parser.overrides_parser")
    hydra_errors = _nemo_gym("hydra.errors")
    try:
        overrides_parser.OverridesParser.create().parse_overrides(list(overrides))
    except hydra_errors.OverrideParseException as error:
        problem = str(error.message).splitlines()[0]
        raise ValueError(f"not a valid override: {error.override}: {problem}") from error


def _one_line(error: Exception) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    lines = (line.strip().removeprefix("- ").strip() for line in str(error).splitlines())
    return " ".join(line for line in lines if line)


def _environment(config_uv_cache: str | None) -> dict[str, str]:
    env = dict(os.environ)
    # NeMo Gym asks uv for this interpreter's exact version; uv does not build a virtualenv on
    # top of another virtualenv's interpreter, so the base installation's goes first on PATH
    # (with UV_PYTHON_DOWNLOADS=never, uv would otherwise find none and stop).
    env["PATH"] = f"{Path(sys.base_prefix, 'bin')}{os.pathsep}{env.get('PATH', '')}"
    if config_uv_cache:
        env["UV_CACHE_DIR"] = config_uv_cache
    return env


def prepare(
    argv: Sequence[str], *, requirements: Sequence[str] | None = None, tracing: bool = False
) -> int:
    """Build every server virtualenv of ``gym env start <argv>`` with OpenTelemetry in it
    (``tracing``: with ``tracing_requirements()`` too).

    Prints one line per server; returns 0 when every server interpreter imports the plugin,
    1 otherwise (the failing server's output is shown above its line). Raises ``ValueError``
    (one line naming the file or argument and the problem) on bad input: a missing or
    malformed configuration file, an argument ``gym env start`` does not take, a
    configuration without servers, ``tracing`` without its instrumentations here;
    ``RuntimeError`` without NeMo Gym here.
    """
    wanted = list(requirements) if requirements is not None else opentelemetry_requirements()
    if tracing:
        wanted += tracing_requirements(wanted)
    venvs = server_venvs(argv)
    if not venvs:
        raise ValueError("no servers in this configuration")
    env = _environment(os.environ.get("UV_CACHE_DIR"))
    install = " ".join(shlex.quote(token) for token in _split(wanted))
    failed = 0
    for item in venvs:
        python = shlex.quote(str(item.venv / "bin" / "python"))
        script = (
            f"set -e\n({item.setup_command}) || exit $?\n"
            f"uv pip install --python {python} {install}\n"
            f"{python} -c {shlex.quote(_IMPORT_CHECK)}\n"
        )
        done = subprocess.run(["/bin/bash", "-c", script], env=env, check=False)
        ok = done.returncode == 0
        failed += not ok
        state = "ready" if ok else f"FAILED (exit {done.returncode})"
        print(f"nemo-gym-otel server-venvs: {item.server}: {item.venv}: {state}", flush=True)
    if failed:
        return 1
    print(
        "nemo-gym-otel server-venvs: every server virtualenv has OpenTelemetry; start with the "
        "same arguments and +skip_venv_if_present=true",
        flush=True,
    )
    return 0


def _split(requirements: Sequence[str]) -> list[str]:
    tokens: list[str] = []
    for requirement in requirements:
        tokens.extend(requirement.split(" ", 1) if requirement.startswith("-e ") else [requirement])
    return tokens


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the ``server-venvs`` subcommand on ``nemo-gym-otel``'s subparsers."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "server-venvs",
        help="put OpenTelemetry and this plugin into every NeMo Gym server virtualenv",
        description=(
            "Build the uv virtualenvs `gym env start` runs its servers in, with NeMo Gym's own "
            "installation, plus the OpenTelemetry packages of this environment (same "
            "versions). Takes the arguments of `gym env start`; start it afterwards with the "
            "same arguments and +skip_venv_if_present=true. Exit status 0 when every server "
            "can load the plugin, 1 when a server failed (its output is shown above its line), "
            "2 on bad input (a missing or malformed configuration file, an argument that "
            "`gym env start` does not take, no servers, no nemo-gym in this environment, "
            "--tracing without its instrumentations here)."
        ),
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help=(
            "one trace per rollout: needs opentelemetry-instrumentation-aiohttp-client and "
            "-fastapi installed here (they go into the servers with the rest), and adds "
            "opentelemetry-instrumentation-system-metrics (the process metrics) to the servers "
            "at this environment's opentelemetry-instrumentation release; before the gym "
            "arguments"
        ),
    )
    parser.add_argument(
        "gym_args",
        nargs=argparse.REMAINDER,
        metavar="GYM_ENV_START_ARGS",
        help="the arguments of `gym env start`, e.g. --config a.yaml --config b.yaml",
    )
    return parser
