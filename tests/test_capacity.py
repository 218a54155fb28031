"""Connection-pool capacity arithmetic, the once-per-configuration report and its warnings."""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from opentelemetry.instrumentation.nemo_gym.telemetry import _capacity, connection_pool
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    ConnectionPoolCapacity,
    connection_pool_capacity,
    report_connection_pool_capacity,
)

POOL_LOGGER = connection_pool.__name__


@dataclass
class Config:
    """A plain object satisfying ConnectionPoolConfig, as nemo_gym's settings do."""

    global_aiohttp_connector_limit: int = 100
    global_aiohttp_connector_limit_per_host: int = 0
    global_aiohttp_intended_concurrency: int | None = None
    global_aiohttp_intended_concurrency_per_host: int | None = None


@pytest.fixture(autouse=True)
def _fresh_reports() -> Iterator[None]:
    """Each test may report every configuration afresh."""
    connection_pool._REPORTED_CAPACITIES.clear()
    yield
    connection_pool._REPORTED_CAPACITIES.clear()


def _report(
    caplog: pytest.LogCaptureFixture, cfg: Config, workers: int = 1, visible: bool = False
) -> tuple[list[str], list[str]]:
    """Report ``cfg`` and return the INFO lines and WARNING messages it logged."""
    caplog.clear()
    caplog.set_level(logging.INFO, logger=POOL_LOGGER)
    report_connection_pool_capacity(cfg, connection_pool_capacity(cfg, workers), visible=visible)
    records = [r for r in caplog.records if r.name == POOL_LOGGER]
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    return infos, warnings


def _fd_soft_limit() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


# --- arithmetic -------------------------------------------------------------------------------


def test_connection_pool_capacity_divides_limits_down_and_demand_up() -> None:
    """Limits round down per worker; intended demand rounds up."""
    cfg = Config(100, 30, 10, 5)
    assert connection_pool_capacity(cfg, 4) == ConnectionPoolCapacity(
        workers=4, total=25, per_host=7, intended=3, intended_per_host=2
    )


def test_connection_pool_capacity_single_worker_is_identity() -> None:
    """With one worker the capacity equals the configuration."""
    cfg = Config(64, 8, 40, 8)
    assert connection_pool_capacity(cfg, 1) == (1, 64, 8, 40, 8)


def test_connection_pool_capacity_preserves_unlimited() -> None:
    """A limit of 0 stays 0 (unlimited) however many workers share it."""
    capacity = connection_pool_capacity(Config(0, 0), 8)
    assert (capacity.total, capacity.per_host) == (0, 0)
    assert (capacity.intended, capacity.intended_per_host) == (None, None)


def test_connection_pool_capacity_field_order() -> None:
    """The tuple reads workers, limits, then demand."""
    assert ConnectionPoolCapacity._fields == (
        "workers",
        "total",
        "per_host",
        "intended",
        "intended_per_host",
    )


@pytest.mark.parametrize(
    ("cfg", "workers", "pattern"),
    [
        (Config(), 0, r"^worker count must be at least 1, got workers=0"),
        (Config(), -2, r"worker count must be at least 1, got workers=-2"),
        (Config(-1, 0), 1, r"global_aiohttp_connector_limit=-1 .*0 for unlimited"),
        (Config(10, -5), 1, r"global_aiohttp_connector_limit_per_host=-5 .*0 for unlimited"),
        (
            Config(3, 0),
            4,
            r"^positive aiohttp connector limits must remain at least 1 after division by "
            r"workers: global_aiohttp_connector_limit=3 divided across workers=4 ",
        ),
        (Config(0, 1), 2, r"connector_limit_per_host=1 divided across workers=2 .*0 for unlimited"),
        (Config(10, 0, 0), 1, r"global_aiohttp_intended_concurrency=0 .*set it to None"),
        (Config(10, 0, -3), 1, r"global_aiohttp_intended_concurrency=-3 "),
        (Config(10, 0, None, 0), 1, r"global_aiohttp_intended_concurrency_per_host=0 "),
        (Config(True, 0), 1, r"global_aiohttp_connector_limit=True "),
        (Config(10, 0), True, r"got workers=True"),
    ],
)
def test_connection_pool_capacity_rejects_bad_values(
    cfg: Config, workers: int, pattern: str
) -> None:
    """Bad workers, negative limits, non-positive demand and limits flooring to 0 raise."""
    with pytest.raises(ValueError, match=pattern):
        connection_pool_capacity(cfg, workers)


@pytest.mark.parametrize(
    ("total", "per_host", "effective"),
    [(0, 0, 0), (10, 0, 10), (0, 5, 5), (10, 5, 5), (3, 5, 3)],
)
def test_effective_per_host_limit_min_where_both_finite(
    total: int, per_host: int, effective: int
) -> None:
    """Effective per-host capacity is min(total, per_host) where both are finite."""
    assert connection_pool._effective_per_host_limit(total, per_host) == effective


def test_display_limit_names_unlimited() -> None:
    """0 displays as `unlimited`, other limits as their number."""
    assert connection_pool._display_limit(0) == "unlimited"
    assert connection_pool._display_limit(12) == "12"


# --- system budgets ---------------------------------------------------------------------------


def test_ephemeral_port_capacity_reads_linux_range() -> None:
    """The budget is the size of /proc/sys/net/ipv4/ip_local_port_range."""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not path.exists():
        pytest.skip("no ip_local_port_range on this system")
    low, high = (int(part) for part in path.read_text().split())
    assert connection_pool._ephemeral_port_capacity() == high - low + 1


@pytest.mark.parametrize(("content", "expected"), [("1024\t1033\n", 10), ("oops", None)])
def test_ephemeral_port_capacity_parses_or_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str, expected: int | None
) -> None:
    """A readable range gives its size; unparsable content gives None."""
    fake = tmp_path / "ip_local_port_range"
    fake.write_text(content)
    monkeypatch.setattr(connection_pool, "_PORT_RANGE_PATH", str(fake))
    assert connection_pool._ephemeral_port_capacity() == expected


def test_ephemeral_port_capacity_unreadable_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the range cannot be read the budget is unknown (None)."""
    monkeypatch.setattr(connection_pool, "_PORT_RANGE_PATH", str(tmp_path / "missing"))
    assert connection_pool._ephemeral_port_capacity() is None


# --- the report -------------------------------------------------------------------------------


def test_report_connection_pool_capacity_logs_key_value_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The report is one INFO line of key=value pairs in NeMo Gym's words and key names."""
    infos, warnings = _report(caplog, Config(100, 0, 40, None), workers=2)
    assert warnings == []
    (line,) = infos
    prefix = "aiohttp connection pool capacity for this server/CLI process group: "
    assert line.startswith(prefix)
    pairs = line.removeprefix(prefix).split(" ")
    values = dict(pair.split("=", 1) for pair in pairs)
    fd_limit = _fd_soft_limit()
    ports = connection_pool._ephemeral_port_capacity()
    assert values == {
        "workers": "2",
        "aggregate_total": "100",
        "aggregate_per_host": "unlimited",
        "effective_total": "50",
        "effective_per_host": "50",
        "per_worker_per_host": "unlimited",
        "intended_per_worker": "20",
        "intended_per_host_per_worker": "unset",
        "file_descriptor_soft_limit": "unlimited" if fd_limit is None else str(fd_limit),
        "ephemeral_ports_per_destination": "unknown" if ports is None else str(ports),
    }


def test_report_connection_pool_capacity_keys_match_nemo_gym_order() -> None:
    """The keys appear in NeMo Gym's order, so its log parsers read ours."""
    line = _capacity.capacity_line(
        Config(256, 64, 1024, 128),
        connection_pool_capacity(Config(256, 64, 1024, 128), 4),
        1024,
        None,
    )
    keys = [pair.split("=", 1)[0] for pair in line.split(": ", 1)[1].split(" ")]
    assert keys == [
        "workers",
        "aggregate_total",
        "aggregate_per_host",
        "effective_total",
        "effective_per_host",
        "per_worker_per_host",
        "intended_per_worker",
        "intended_per_host_per_worker",
        "file_descriptor_soft_limit",
        "ephemeral_ports_per_destination",
    ]
    assert "effective_per_host=16 per_worker_per_host=16 intended_per_worker=256" in line


def test_report_connection_pool_capacity_once_per_configuration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same (workers, configuration) is reported once; a different one is reported."""
    cfg = Config(100, 10, 50, 10)
    first, _ = _report(caplog, cfg, workers=2)
    again, _ = _report(caplog, cfg, workers=2)
    other_workers, _ = _report(caplog, cfg, workers=4)
    other_cfg, _ = _report(caplog, Config(100, 10, 50, 9), workers=2)
    assert (len(first), len(again), len(other_workers), len(other_cfg)) == (1, 0, 1, 1)
    assert len(connection_pool._REPORTED_CAPACITIES) == 3


def test_report_connection_pool_capacity_visible_prints_to_stdout(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """visible=True prints the line and each warning to stdout, as NeMo Gym does, and logs them."""
    infos, warnings = _report(caplog, Config(10, 0, 20, None), visible=True)
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    assert lines[0] == infos[0]
    assert len(warnings) == 1
    assert lines[1:] == [f"warning: {warnings[0].split(': ', 1)[1]}"]


def test_report_connection_pool_capacity_not_visible_prints_nothing(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without visible=True the report only logs."""
    _report(caplog, Config(10, 0, 20, None))
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")


# --- warnings ---------------------------------------------------------------------------------


def test_report_warns_intended_above_total(caplog: pytest.LogCaptureFixture) -> None:
    """Intended demand per worker above a finite total limit per worker warns."""
    _, warnings = _report(caplog, Config(20, 0, 30, None), workers=2)
    assert len(warnings) == 1
    assert (
        "intended per-worker concurrency 15 exceeds effective total limit 10 (2 workers)"
        in (warnings[0])
    )
    assert "raise the total limit to at least 30" in warnings[0]


def test_report_warns_intended_per_host_above_per_host_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Intended per-host demand per worker above the per-host limit warns."""
    _, warnings = _report(caplog, Config(0, 5, None, 6))
    assert len(warnings) == 1
    assert (
        "intended per-host concurrency 6 exceeds effective per-host limit 5 (1 worker)"
        in (warnings[0])
    )
    assert "raise the per-host limit to at least 6" in warnings[0]


def test_report_warns_intended_per_host_above_total_as_effective_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With an unlimited per-host limit, a finite total still bounds one destination."""
    _, warnings = _report(caplog, Config(4, 0, None, 5))
    assert len(warnings) == 1
    assert "exceeds effective per-host limit 4 " in warnings[0]
    # The total is what binds here, so the total is what to raise.
    assert "raise the total limit to at least 5 " in warnings[0]


def test_report_warns_intended_per_host_above_ephemeral_ports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Aggregate intended per-host demand above the ephemeral-port budget warns."""
    ports = connection_pool._ephemeral_port_capacity()
    if ports is None:
        pytest.skip("no readable ip_local_port_range on this system")
    _, warnings = _report(caplog, Config(0, 0, None, ports + 2), workers=2)
    assert len(warnings) == 1
    assert (
        f"aggregate intended per-host concurrency {ports + 2} exceeds the approximate "
        f"per-destination ephemeral-port budget {ports}"
    ) in warnings[0]


def test_report_warns_intended_at_fd_soft_limit(caplog: pytest.LogCaptureFixture) -> None:
    """Intended demand per worker at the open-file soft limit warns."""
    fd_limit = _fd_soft_limit()
    if fd_limit is None:
        pytest.skip("unlimited open-file soft limit")
    _, warnings = _report(caplog, Config(0, 0, fd_limit * 2, None), workers=2)
    assert len(warnings) == 1
    assert (
        f"intended per-worker concurrency {fd_limit} can exhaust the file-descriptor soft "
        f"limit {fd_limit}"
    ) in warnings[0]


def test_report_intended_within_capacity_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    """Demand that fits every limit and budget gives no warning."""
    _, warnings = _report(caplog, Config(100, 20, 100, 20), workers=4)
    assert warnings == []


@pytest.mark.parametrize(
    "cfg",
    [Config(1, 1), Config(0, 0), Config(10**9, 10**9), Config(2, 1)],
)
def test_report_limits_alone_never_warn(caplog: pytest.LogCaptureFixture, cfg: Config) -> None:
    """Without intended demand, no limit (however small or large) warns."""
    _, warnings = _report(caplog, cfg)
    assert warnings == []
