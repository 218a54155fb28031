"""The ``nemo-gym-otel`` command: check aiohttp pool sizing before a deployment runs.

``nemo-gym-otel capacity --limit N [--limit-per-host N] [--workers N] [--intended N]
[--intended-per-host N] [--json]`` prints the capacity report to stdout (so it can be piped)
and any warnings to stderr, and exits 0 when the configuration is safe, 1 on an unsafe
mismatch between intended demand and capacity, and 2 on bad input (with the reason, naming
the flag as typed). ``--json`` prints one JSON object instead, for scripts.

``nemo-gym-otel server-venvs <gym env start arguments>`` builds the virtualenvs ``gym env
start`` runs its servers in, with OpenTelemetry and this plugin in each (``_server_venvs``),
and exits 0 when every server is ready, 1 when a server failed, and 2 on bad input (one line
naming the file or argument and the problem).

``nemo-gym-otel stub-model [--port 8000]`` serves an OpenAI-compatible stub model on loopback
(``_stub_model``), for the deployment walk-through without a model server.

``nemo-gym-otel report [--run-id ID]`` prints one run's connections, queue waits, event-loop lag
and sandboxes from the collector's Prometheus exporter (``$COLLECTOR_PROMETHEUS``; ``_report``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import (
    FieldNames,
    _PoolConfig,
    capacity_fields,
    capacity_for,
    capacity_line,
    capacity_warnings,
)
from opentelemetry.instrumentation.nemo_gym.tools import _report, _server_venvs, _stub_model
from opentelemetry.instrumentation.nemo_gym.version import __version__

EXIT_SAFE = 0
EXIT_UNSAFE = 1
EXIT_BAD_INPUT = 2

_PROG = "nemo-gym-otel"

# Errors and suggestions call each input by the flag the user typed.
_FLAG_NAMES = FieldNames(
    limit="--limit",
    limit_per_host="--limit-per-host",
    intended="--intended",
    intended_per_host="--intended-per-host",
    workers="--workers",
    skip_check="omit it",
)


class _UsageError(Exception):
    """Raised instead of argparse's own exit, so ``main`` can return 2 with the reason."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser  # the (sub)command whose usage to print


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description="OpenTelemetry nemo_gym instrumentation tools.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    capacity = commands.add_parser(
        "capacity",
        help="check aiohttp connector limits against workers and intended concurrency",
        description=(
            "Divide one server's aiohttp connector limits across its workers and check them "
            "against intended concurrency, the open-file limit and the ephemeral-port "
            "budget. Limits of 0 mean unlimited. The report goes to stdout, warnings to "
            "stderr. Exit status: 0 safe, 1 unsafe mismatch, 2 bad input."
        ),
    )
    capacity.add_argument(
        "--limit", type=int, required=True, help="total connector limit, all workers (0: unlimited)"
    )
    capacity.add_argument(
        "--limit-per-host",
        type=int,
        default=0,
        help="per-host connector limit, all workers (default 0: unlimited)",
    )
    capacity.add_argument(
        "--workers", type=int, default=1, help="worker processes sharing these limits (default 1)"
    )
    capacity.add_argument(
        "--intended",
        type=int,
        default=None,
        help="intended concurrent requests, all workers (omit it: no check)",
    )
    capacity.add_argument(
        "--intended-per-host",
        type=int,
        default=None,
        help="intended concurrent requests to one destination, all workers (omit it: no check)",
    )
    capacity.add_argument(
        "--json", action="store_true", help="print one JSON object to stdout instead, for scripts"
    )
    _server_venvs.add_parser(commands)
    _stub_model.add_parser(commands)
    _report.add_parser(commands)
    return parser


def _capacity(args: argparse.Namespace) -> int:
    cfg = _PoolConfig(
        global_aiohttp_connector_limit=args.limit,
        global_aiohttp_connector_limit_per_host=args.limit_per_host,
        global_aiohttp_intended_concurrency=args.intended,
        global_aiohttp_intended_concurrency_per_host=args.intended_per_host,
    )
    capacity = capacity_for(cfg, args.workers, _FLAG_NAMES)
    fd_soft_limit = connection_pool._fd_soft_limit()
    ephemeral_ports = connection_pool._ephemeral_port_capacity()
    warnings = capacity_warnings(cfg, capacity, fd_soft_limit, ephemeral_ports, _FLAG_NAMES)
    code = EXIT_UNSAFE if warnings else EXIT_SAFE
    if args.json:
        report = {
            **capacity_fields(cfg, capacity, fd_soft_limit, ephemeral_ports),
            "safe": not warnings,
            "warnings": warnings,
            "exit_code": code,
        }
        print(json.dumps(report, indent=2))
        return code
    print(capacity_line(cfg, capacity, fd_soft_limit, ephemeral_ports))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nemo-gym-otel`` with ``argv`` (default ``sys.argv[1:]``) and return the exit code.

    0 safe, 1 unsafe mismatch, 2 bad input; the reason for 1 or 2 is printed to stderr.
    """
    parser = _parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["server-venvs"] and not {"-h", "--help"} & set(arguments[1:2]):
        # Everything after the subcommand is gym's (its flags look like ours to argparse).
        return _server_venvs_command(arguments[1:])
    try:
        args = parser.parse_args(arguments)
    except _UsageError as error:
        error.parser.print_usage(sys.stderr)
        print(f"{error.parser.prog}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as done:
        # --help and --version exit through argparse; turn that into a return value.
        return done.code if isinstance(done.code, int) else EXIT_SAFE
    if args.command == "stub-model":
        return _stub_model.run(args)
    if args.command == "report":
        return _report.run(args)
    try:
        return _capacity(args)
    except ValueError as error:
        print(f"{_PROG} capacity: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _server_venvs_command(arguments: list[str]) -> int:
    # Our own flag comes first; everything after it is gym's.
    tracing = arguments[:1] == ["--tracing"]
    gym_args = arguments[1:] if tracing else arguments
    try:
        return _server_venvs.prepare(gym_args, tracing=tracing)
    except (RuntimeError, ValueError) as error:
        print(f"{_PROG} server-venvs: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
