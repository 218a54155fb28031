"""Connection-pool capacity arithmetic: pure functions over a connector configuration.

No I/O, no logging, no OpenTelemetry: callers pass in the system budgets (open-file soft
limit, ephemeral ports) they read. ``connection_pool`` re-exports the documented names and
owns the reporting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol


class ConnectionPoolConfig(Protocol):
    """Connector budgets and optional demand estimates for one server or rollout CLI.

    Configured limits apply to one server process group before division across its workers,
    not the whole deployment. An explicit limit of zero is unlimited. Intended concurrency is
    optional expected outbound demand for that same group; ``None`` disables the
    corresponding sizing check.
    """

    global_aiohttp_connector_limit: int
    global_aiohttp_connector_limit_per_host: int
    global_aiohttp_intended_concurrency: int | None
    global_aiohttp_intended_concurrency_per_host: int | None


@dataclass  # not frozen: the protocol's members are plain (settable) attributes
class _PoolConfig:
    """A concrete ``ConnectionPoolConfig``: the command line's flags, or one connector's
    limits scaled to its process group by the instrumentor."""

    global_aiohttp_connector_limit: int
    global_aiohttp_connector_limit_per_host: int
    global_aiohttp_intended_concurrency: int | None
    global_aiohttp_intended_concurrency_per_host: int | None


class ConnectionPoolCapacity(NamedTuple):
    """Per-process connector limits and demand after division across ``workers``.

    ``workers`` is the size of one server's process group, or one for the CLI. Positive
    ``total`` and ``per_host`` limits are rounded down; zero means explicitly unlimited.
    ``per_host`` is the divided configured value, before a finite ``total`` constrains
    effective per-host capacity. ``intended`` and ``intended_per_host`` are expected demand
    rounded up per worker, or ``None`` when the estimate is not configured.
    """

    workers: int
    total: int
    per_host: int
    intended: int | None
    intended_per_host: int | None


def _display_limit(limit: int) -> str:
    return "unlimited" if limit == 0 else str(limit)


def _effective_per_host_limit(total: int, per_host: int) -> int:
    # 0 is unlimited, so min() only applies where both limits are finite.
    if total == 0:
        return per_host
    if per_host == 0:
        return total
    return min(total, per_host)


def _divided_limit(name: str, limit: object, workers: int) -> int:
    # bool is an int subclass; True as a limit is a configuration mistake, not 1.
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(
            f"{name}={limit!r} is invalid: a connector limit is an integer >= 0; "
            "use 0 for unlimited"
        )
    per_worker = limit // workers
    if limit > 0 and per_worker == 0:
        raise ValueError(
            f"{name}={limit} divided across workers={workers} leaves 0 connections per "
            f"worker; set it to at least {workers}, or to 0 for unlimited"
        )
    return per_worker


def _divided_demand(name: str, intended: object, workers: int) -> int | None:
    if intended is None:
        return None
    if not isinstance(intended, int) or isinstance(intended, bool) or intended <= 0:
        raise ValueError(
            f"{name}={intended!r} is invalid: intended concurrency is a positive integer, "
            "or None to skip the check; for unlimited connections set the connector "
            "limit to 0 instead"
        )
    # Demand rounds up: a worker that may get one more request than the average must fit it.
    return -(-intended // workers)


def connection_pool_capacity(cfg: ConnectionPoolConfig, workers: int) -> ConnectionPoolCapacity:
    """Calculate aiohttp limits for one process, preserving explicit unlimited values.

    Limits divide across ``workers`` rounding down, intended demand rounding up; 0 stays 0
    (unlimited). Raises ``ValueError`` naming the values for ``workers < 1``, a negative
    limit, a non-positive intended value, or a positive limit that floors to 0.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(
            f"workers={workers!r} is invalid: a server process group has at least 1 worker "
            "(limits use 0 for unlimited, workers cannot)"
        )
    return ConnectionPoolCapacity(
        workers=workers,
        total=_divided_limit(
            "global_aiohttp_connector_limit", cfg.global_aiohttp_connector_limit, workers
        ),
        per_host=_divided_limit(
            "global_aiohttp_connector_limit_per_host",
            cfg.global_aiohttp_connector_limit_per_host,
            workers,
        ),
        intended=_divided_demand(
            "global_aiohttp_intended_concurrency",
            cfg.global_aiohttp_intended_concurrency,
            workers,
        ),
        intended_per_host=_divided_demand(
            "global_aiohttp_intended_concurrency_per_host",
            cfg.global_aiohttp_intended_concurrency_per_host,
            workers,
        ),
    )


def _or(value: int | None, missing: str) -> str:
    return missing if value is None else str(value)


def capacity_line(
    cfg: ConnectionPoolConfig,
    capacity: ConnectionPoolCapacity,
    fd_soft_limit: int | None,
    ephemeral_ports: int | None,
) -> str:
    """The one-line ``key=value`` report: group limits, per-worker limits, demand, budgets."""
    effective = _effective_per_host_limit(capacity.total, capacity.per_host)
    pairs = (
        ("workers", str(capacity.workers)),
        ("limit", _display_limit(cfg.global_aiohttp_connector_limit)),
        ("limit_per_host", _display_limit(cfg.global_aiohttp_connector_limit_per_host)),
        ("limit_per_worker", _display_limit(capacity.total)),
        ("limit_per_host_per_worker", _display_limit(capacity.per_host)),
        ("effective_limit_per_host_per_worker", _display_limit(effective)),
        ("intended_per_worker", _or(capacity.intended, "unset")),
        ("intended_per_host_per_worker", _or(capacity.intended_per_host, "unset")),
        ("fd_soft_limit", _or(fd_soft_limit, "unlimited")),
        ("ephemeral_ports", _or(ephemeral_ports, "unknown")),
    )
    return "connection_pool_capacity " + " ".join(f"{key}={value}" for key, value in pairs)


def capacity_warnings(
    cfg: ConnectionPoolConfig,
    capacity: ConnectionPoolCapacity,
    fd_soft_limit: int | None,
    ephemeral_ports: int | None,
) -> list[str]:
    """The unsafe mismatches between intended demand and capacity; limits alone never warn."""
    warnings: list[str] = []
    effective = _effective_per_host_limit(capacity.total, capacity.per_host)
    workers = f"{capacity.workers} worker{'' if capacity.workers == 1 else 's'}"
    if capacity.intended is not None and capacity.total and capacity.intended > capacity.total:
        warnings.append(
            f"intended concurrency per worker {capacity.intended} exceeds the connector "
            f"limit per worker {capacity.total} ({workers}); the excess "
            "requests queue for a pool slot and the wait looks like server latency"
        )
    if (
        capacity.intended_per_host is not None
        and effective
        and capacity.intended_per_host > effective
    ):
        warnings.append(
            f"intended per-host concurrency per worker {capacity.intended_per_host} exceeds "
            f"the effective per-host limit per worker {effective} "
            f"({workers}); requests to one destination will queue"
        )
    aggregate_per_host = cfg.global_aiohttp_intended_concurrency_per_host
    if (
        aggregate_per_host is not None
        and ephemeral_ports is not None
        and aggregate_per_host > ephemeral_ports
    ):
        warnings.append(
            f"intended per-host concurrency {aggregate_per_host} across all workers exceeds "
            f"the ephemeral-port budget {ephemeral_ports} (net.ipv4.ip_local_port_range); new "
            "connections to one destination can fail with EADDRNOTAVAIL"
        )
    if (
        capacity.intended is not None
        and fd_soft_limit is not None
        and capacity.intended >= fd_soft_limit
    ):
        warnings.append(
            f"intended concurrency per worker {capacity.intended} is at or above the "
            f"open-file soft limit {fd_soft_limit}; sockets will fail with EMFILE "
            "(raise ulimit -n)"
        )
    return warnings
