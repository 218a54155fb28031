"""The ``nemo-gym-otel`` command: check aiohttp pool sizing before a deployment runs.

``nemo-gym-otel capacity --limit N --limit-per-host N --workers N [--intended N]
[--intended-per-host N]`` prints the capacity report and any warnings to stderr and exits 0
when the configuration is safe, 1 on an unsafe mismatch between intended demand and capacity,
and 2 on bad input (with the reason).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

from opentelemetry.instrumentation.nemo_gym.telemetry import connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry._capacity import (
    _PoolConfig,
    capacity_warnings,
)

EXIT_SAFE = 0
EXIT_UNSAFE = 1
EXIT_BAD_INPUT = 2

_PROG = "nemo-gym-otel"


class _UsageError(Exception):
    """Raised instead of argparse's own exit, so ``main`` can return 2 with the reason."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description="OpenTelemetry nemo_gym instrumentation tools.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    capacity = commands.add_parser(
        "capacity",
        help="check aiohttp connector limits against workers and intended concurrency",
        description=(
            "Divide one server's aiohttp connector limits across its workers and check them "
            "against intended concurrency, the open-file limit and the ephemeral-port "
            "budget. Limits of 0 mean unlimited."
        ),
    )
    capacity.add_argument("--limit", type=int, required=True, help="total connector limit")
    capacity.add_argument(
        "--limit-per-host", type=int, required=True, help="per-host connector limit"
    )
    capacity.add_argument(
        "--workers", type=int, required=True, help="worker processes sharing these limits"
    )
    capacity.add_argument(
        "--intended", type=int, default=None, help="intended concurrent requests, all workers"
    )
    capacity.add_argument(
        "--intended-per-host",
        type=int,
        default=None,
        help="intended concurrent requests to one destination, all workers",
    )
    return parser


@contextmanager
def _quiet_unconfigured_logging() -> Iterator[None]:
    # The report prints its warnings itself (visible=True). With no logging configured,
    # Python's last-resort handler would print each warning a second time.
    pool_logger = connection_pool.logger
    if pool_logger.hasHandlers():
        yield
        return
    handler = logging.NullHandler()
    pool_logger.addHandler(handler)
    try:
        yield
    finally:
        pool_logger.removeHandler(handler)


def _capacity(args: argparse.Namespace) -> int:
    cfg = _PoolConfig(
        global_aiohttp_connector_limit=args.limit,
        global_aiohttp_connector_limit_per_host=args.limit_per_host,
        global_aiohttp_intended_concurrency=args.intended,
        global_aiohttp_intended_concurrency_per_host=args.intended_per_host,
    )
    capacity = connection_pool.connection_pool_capacity(cfg, args.workers)
    with _quiet_unconfigured_logging():
        connection_pool.report_connection_pool_capacity(cfg, capacity, visible=True)
    warnings = capacity_warnings(
        cfg,
        capacity,
        connection_pool._fd_soft_limit(),
        connection_pool._ephemeral_port_capacity(),
    )
    return EXIT_UNSAFE if warnings else EXIT_SAFE


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nemo-gym-otel`` with ``argv`` (default ``sys.argv[1:]``) and return the exit code.

    0 safe, 1 unsafe mismatch, 2 bad input; the reason for 1 or 2 is printed to stderr.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as error:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as done:
        # --help and --version exit through argparse; turn that into a return value.
        return done.code if isinstance(done.code, int) else EXIT_SAFE
    try:
        return _capacity(args)
    except ValueError as error:
        print(f"{_PROG}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
