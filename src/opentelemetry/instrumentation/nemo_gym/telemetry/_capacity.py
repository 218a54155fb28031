"""Connection-pool capacity arithmetic: pure functions over a connector configuration.

No I/O, no logging, no OpenTelemetry: callers pass in the system budgets (open-file soft
limit, ephemeral ports) they read. ``connection_pool`` re-exports the documented names and
owns the reporting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeGuard


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


class FieldNames(NamedTuple):
    """What to call each input in an error or a suggestion: the names the caller typed.

    ``connection_pool_capacity`` speaks of the configuration's fields (NeMo Gym's own keys);
    the command line passes its flags, so a user reads back ``--intended``, not a field.
    """

    limit: str
    limit_per_host: str
    intended: str
    intended_per_host: str
    workers: str
    skip_check: str  # how to leave an intended value out


CONFIG_FIELD_NAMES = FieldNames(
    limit="global_aiohttp_connector_limit",
    limit_per_host="global_aiohttp_connector_limit_per_host",
    intended="global_aiohttp_intended_concurrency",
    intended_per_host="global_aiohttp_intended_concurrency_per_host",
    workers="workers",
    skip_check="set it to None",
)

# Suggestions in the logged report: the configuration may be NeMo Gym's fields or one
# aiohttp.TCPConnector(limit=..., limit_per_host=...) scaled to its group, so plain words.
PLAIN_NAMES = FieldNames(
    limit="the total limit",
    limit_per_host="the per-host limit",
    intended="the intended concurrency",
    intended_per_host="the intended per-host concurrency",
    workers="workers",
    skip_check="leave it unset",
)


def _display_limit(limit: int) -> str:
    return "unlimited" if limit == 0 else str(limit)


def _effective_per_host_limit(total: int, per_host: int) -> int:
    # 0 is unlimited, so min() only applies where both limits are finite.
    if total == 0:
        return per_host
    if per_host == 0:
        return total
    return min(total, per_host)


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass; True as a limit is a configuration mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _divided_limit(name: str, limit: object, workers: int, names: FieldNames) -> int:
    if not _is_int(limit) or limit < 0:
        raise ValueError(
            f"{name}={limit!r} is invalid: a connector limit is an integer >= 0; "
            "use 0 for unlimited"
        )
    per_worker = limit // workers
    if limit > 0 and per_worker == 0:
        # The opening words are NeMo Gym's own, so searches for its error keep matching.
        raise ValueError(
            "positive aiohttp connector limits must remain at least 1 after division by "
            f"workers: {name}={limit} divided across {names.workers}={workers} leaves 0 "
            f"connections per worker; set {name} to at least {workers}, reduce "
            f"{names.workers}, or set {name} to 0 for unlimited"
        )
    return per_worker


def _divided_demand(name: str, intended: object, workers: int, names: FieldNames) -> int | None:
    if intended is None:
        return None
    if not _is_int(intended) or intended <= 0:
        raise ValueError(
            f"{name}={intended!r} is invalid: intended concurrency is a positive integer; "
            f"to skip this check, {names.skip_check}; for unlimited connections set the "
            "connector limit to 0 instead"
        )
    # Demand rounds up: a worker that may get one more request than the average must fit it.
    return -(-intended // workers)


def capacity_for(
    cfg: ConnectionPoolConfig, workers: int, names: FieldNames = CONFIG_FIELD_NAMES
) -> ConnectionPoolCapacity:
    """``connection_pool_capacity`` whose errors call the inputs by ``names``."""
    if not _is_int(workers) or workers < 1:
        raise ValueError(
            f"worker count must be at least 1, got {names.workers}={workers!r}: it is the "
            "number of processes sharing these limits (limits use 0 for unlimited, "
            "workers cannot)"
        )
    return ConnectionPoolCapacity(
        workers=workers,
        total=_divided_limit(names.limit, cfg.global_aiohttp_connector_limit, workers, names),
        per_host=_divided_limit(
            names.limit_per_host, cfg.global_aiohttp_connector_limit_per_host, workers, names
        ),
        intended=_divided_demand(
            names.intended, cfg.global_aiohttp_intended_concurrency, workers, names
        ),
        intended_per_host=_divided_demand(
            names.intended_per_host,
            cfg.global_aiohttp_intended_concurrency_per_host,
            workers,
            names,
        ),
    )


def connection_pool_capacity(cfg: ConnectionPoolConfig, workers: int) -> ConnectionPoolCapacity:
    """Calculate aiohttp limits for one process, preserving explicit unlimited values.

    Limits divide across ``workers`` rounding down, intended demand rounding up; 0 stays 0
    (unlimited). Raises ``ValueError`` naming the values for ``workers < 1``, a negative
    limit, a non-positive intended value, or a positive limit that floors to 0.
    """
    return capacity_for(cfg, workers)


# The words NeMo Gym's own report starts with; log searches written for it keep matching.
CAPACITY_LINE_PREFIX = "aiohttp connection pool capacity for this server/CLI process group:"


def capacity_fields(
    cfg: ConnectionPoolConfig,
    capacity: ConnectionPoolCapacity,
    fd_soft_limit: int | None,
    ephemeral_ports: int | None,
) -> dict[str, int | None]:
    """The report's values under NeMo Gym's key names, as numbers.

    Limits keep 0 for unlimited; ``None`` is an intended value that is not configured (no
    check), an unlimited file-descriptor limit, or an unreadable port range.
    """
    return {
        "workers": capacity.workers,
        "aggregate_total": cfg.global_aiohttp_connector_limit,
        "aggregate_per_host": cfg.global_aiohttp_connector_limit_per_host,
        "effective_total": capacity.total,
        "effective_per_host": _effective_per_host_limit(capacity.total, capacity.per_host),
        "per_worker_per_host": capacity.per_host,
        "intended_per_worker": capacity.intended,
        "intended_per_host_per_worker": capacity.intended_per_host,
        "file_descriptor_soft_limit": fd_soft_limit,
        "ephemeral_ports_per_destination": ephemeral_ports,
    }


# How a None reads in the line, per key: intended demand that is not configured is not
# checked ("unset"), an fd limit of None is RLIM_INFINITY, a port range of None unreadable.
_NONE_DISPLAY = {
    "intended_per_worker": "unset",
    "intended_per_host_per_worker": "unset",
    "file_descriptor_soft_limit": "unlimited",
    "ephemeral_ports_per_destination": "unknown",
}
_LIMIT_KEYS = frozenset(
    {
        "aggregate_total",
        "aggregate_per_host",
        "effective_total",
        "effective_per_host",
        "per_worker_per_host",
    }
)


def capacity_line(
    cfg: ConnectionPoolConfig,
    capacity: ConnectionPoolCapacity,
    fd_soft_limit: int | None,
    ephemeral_ports: int | None,
) -> str:
    """The one-line ``key=value`` report, with NeMo Gym's opening words and key names.

    Limits of 0 read ``unlimited``; intended values that are not configured read ``unset``
    (that check is skipped).
    """
    pairs: list[str] = []
    for key, value in capacity_fields(cfg, capacity, fd_soft_limit, ephemeral_ports).items():
        if value is None:
            shown = _NONE_DISPLAY[key]
        elif key in _LIMIT_KEYS:
            shown = _display_limit(value)
        else:
            shown = str(value)
        pairs.append(f"{key}={shown}")
    return f"{CAPACITY_LINE_PREFIX} {' '.join(pairs)}"


def capacity_warnings(
    cfg: ConnectionPoolConfig,
    capacity: ConnectionPoolCapacity,
    fd_soft_limit: int | None,
    ephemeral_ports: int | None,
    names: FieldNames = PLAIN_NAMES,
) -> list[str]:
    """The unsafe mismatches between intended demand and capacity; limits alone never warn.

    Each message opens with NeMo Gym's own words for the mismatch, then says what happens
    and what to change, calling the inputs by ``names``.
    """
    warnings: list[str] = []
    workers = capacity.workers
    effective = _effective_per_host_limit(capacity.total, capacity.per_host)
    group = f"{workers} worker{'' if workers == 1 else 's'}"
    intended, intended_per_host = capacity.intended, capacity.intended_per_host
    if intended is not None and capacity.total and intended > capacity.total:
        warnings.append(
            f"intended per-worker concurrency {intended} exceeds effective total limit "
            f"{capacity.total} ({group}): the excess requests queue for a pool slot and the "
            f"wait looks like server latency; raise {names.limit} to at least "
            f"{intended * workers} (0 for unlimited)"
        )
    if intended_per_host is not None and effective and intended_per_host > effective:
        # Either limit may be what binds one destination; name each one that is too small.
        raise_ = [
            f"{name} to at least {intended_per_host * workers}"
            for name, per_worker in (
                (names.limit_per_host, capacity.per_host),
                (names.limit, capacity.total),
            )
            if per_worker and per_worker < intended_per_host
        ]
        warnings.append(
            f"intended per-host concurrency {intended_per_host} exceeds effective per-host "
            f"limit {effective} ({group}): requests to one destination queue; raise "
            f"{' and '.join(raise_)} (0 for unlimited)"
        )
    aggregate_per_host = cfg.global_aiohttp_intended_concurrency_per_host
    if (
        aggregate_per_host is not None
        and ephemeral_ports is not None
        and aggregate_per_host > ephemeral_ports
    ):
        warnings.append(
            f"aggregate intended per-host concurrency {aggregate_per_host} exceeds the "
            f"approximate per-destination ephemeral-port budget {ephemeral_ports} "
            "(net.ipv4.ip_local_port_range): new connections to one destination can fail with "
            f"EADDRNOTAVAIL; lower {names.intended_per_host} or widen the port range"
        )
    if intended is not None and fd_soft_limit is not None and intended >= fd_soft_limit:
        warnings.append(
            f"intended per-worker concurrency {intended} can exhaust the file-descriptor soft "
            f"limit {fd_soft_limit} before accounting for non-HTTP descriptors: sockets fail "
            f"with EMFILE; raise ulimit -n above {intended} plus the process's other files"
        )
    return warnings
