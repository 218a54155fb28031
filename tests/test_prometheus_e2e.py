"""A real Prometheus scrapes the example app, evaluates the shipped rules, and answers every
query of the rules and the dashboard, in both naming modes.

One run per naming mode (``OTEL_SEMCONV_STABILITY_OPT_IN`` unset, then ``http``):
``examples/prometheus/app.py`` (a subprocess, driven step by step over its standard input)
serves its metrics on a loopback port; Debian's ``prometheus`` binary scrapes it every second
and evaluates ``examples/prometheus/rules.yml`` as often, with a temporary data directory.
The test waits on Prometheus' own state, never on the clock: after each step it waits for a
scrape that started after the step ended (and for the rules to have run on it).

1. Two rounds of traffic, so every counter is seen before and after it grew (rates need
   both): saturated pools on the ``total`` and ``per_host`` limits, an abandoned wait, an
   OOM-killed sandbox command and a sandbox whose request nothing enforces.
2. A hold: one pool left with 2 idle connections, 2 active ones and 3 requests waiting, while
   Prometheus scrapes it and the tests run.

Then every PromQL expression in rules.yml and in examples/grafana/nemo-gym.json (see
``promql_sources``) must succeed and return data; each is its own test, so a failure names
the expression. Expressions that read only one naming mode's histogram must return data in
that mode and nothing in the other.

Some series come from instruments that other branches add: the pool-state gauges
(``http_client_open_connections``, ``gym_http_connection_pool_waiting_requests``,
``gym_http_connection_pool_limit``, ``gym_http_connection_pool_connections_created_total``),
the ``http`` naming mode itself, and the sandbox fleet counters (``gym_sandbox_*``). Until
they are merged, the expressions that read them fail here with "returned no data".
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from collector_support import Prometheus, prometheus_server, stop
from conftest import require_service
from promql_sources import MODES, QUIET_ALERTS, RULES, Expression, all_expressions

pytestmark = pytest.mark.integration

APP = Path(__file__).resolve().parent.parent / "examples" / "prometheus" / "app.py"

# The names Prometheus gives our instruments (checked against a real server): dots become
# underscores, the unit is appended (``ms`` as ``milliseconds``, ``s`` as ``seconds``),
# ``{...}`` annotation units are dropped, counters get ``_total`` once.
HISTOGRAM = {
    "default": "gym_http_connection_pool_queue_duration_ms_milliseconds",
    "http": "http_client_request_time_in_queue_seconds",
}
BUCKETS = {
    "default": "0.01 0.05 0.1 0.25 0.5 1 2.5 5 10 25 50 100 250 500 1000 5000 30000",
    "http": "0.005 0.01 0.025 0.05 0.075 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10",  # .NET's
}
# The app's own reader holds the instrument's name; its samples are in the unit above.
INSTRUMENT = {
    "default": "gym.http.connection_pool.queue_duration_ms",
    "http": "http.client.request.time_in_queue",
}
CONNECT_TOTAL = "gym_http_connection_pool_connect_total"
SCOPE = "opentelemetry.instrumentation.nemo_gym"
SERVER = "nemo_gym_http_destination_server_name"
CONSTRAINT = "nemo_gym_http_connection_pool_queue_constraint"
OUTCOME = "nemo_gym_http_connection_pool_queue_outcome"
# (destination, binding limit, how the wait ended). nemo_gym.telemetry.connection_pool names the end
# in an outcome label; the semantic conventions set error.type (the exception's class) on abandoned
# waits.
EXPECTED_QUEUE_SERIES = {
    ("policy", "total", "ok"),
    ("resources", "per_host", "ok"),
    ("judge", "total", "abandoned"),
}
ROUNDS = 2
SCRAPE_INTERVAL_S = 1.0  # the app's default, for scrapes and rule evaluation alike
RULE_CHAIN = 3
STEP_DEADLINE_S = 90.0


@dataclass
class Run(Prometheus):
    """The app and the Prometheus at ``url`` scraping it, in one naming mode, after traffic and
    a hold."""

    mode: str
    metrics_url: str
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def observed(self) -> dict[str, Any]:
        """What the app's own reader saw when the hold was in place."""
        result: dict[str, Any] = self.reports["hold"]["observed"]
        return result


def _report(app: subprocess.Popen[str], step: str) -> dict[str, Any]:
    """The app's JSON line for ``step``, or a failure with its stderr once the deadline passes."""
    assert app.stdout is not None
    deadline = time.monotonic() + STEP_DEADLINE_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([app.stdout], [], [], 0.5)
        if ready:
            line = app.stdout.readline()
            if line:
                report: dict[str, Any] = json.loads(line)
                assert report["step"] == step, report
                return report
        if app.poll() is not None:
            break
    stderr = app.stderr.read() if app.stderr and app.poll() is not None else ""
    pytest.fail(f"example app gave no {step!r} report (exit {app.poll()}): {stderr[-4000:]}")


def _command(app: subprocess.Popen[str], command: str) -> dict[str, Any]:
    assert app.stdin is not None
    app.stdin.write(command + "\n")
    app.stdin.flush()
    return _report(app, command)


def _epoch(rfc3339: str) -> float:
    """Prometheus' RFC 3339 timestamps (nanoseconds, ``Z``) as seconds since the epoch."""
    trimmed = re.sub(r"(\.\d{6})\d*", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(trimmed).timestamp()


def _last_scrape(run: Run) -> float:
    samples = run.query('timestamp(up{job="nemo_gym_app"} == 1)')
    return float(samples[0]["value"][1]) if samples else 0.0


def _settle(run: Run, after: float) -> None:
    """Wait until Prometheus holds what the app had at ``after`` and its rules ran on it.

    Two scrapes that started after ``after`` (the first is surely stored once the second has
    started). Then every rule group evaluated at least ``RULE_CHAIN`` intervals after the
    second: a group evaluates at a timestamp up to one interval before it runs, and the
    alerts read series that the recording groups write, one evaluation later.
    """
    run.wait_for("scraped the app after a step", lambda: _last_scrape(run) > after, STEP_DEADLINE_S)
    first = _last_scrape(run)
    run.wait_for("scraped the app again", lambda: _last_scrape(run) > first, STEP_DEADLINE_S)
    ready = _last_scrape(run) + RULE_CHAIN * SCRAPE_INTERVAL_S

    def rules_ran() -> bool:
        groups = run.api("rules")["groups"]
        return bool(groups) and all(_epoch(g["lastEvaluation"]) > ready for g in groups)

    run.wait_for("evaluated the rules after the step", rules_ran, STEP_DEADLINE_S)


@contextmanager
def app_scraped(
    mode: str, workdir: Path, app_args: tuple[str, ...] = (), metrics_url: str | None = None
) -> Iterator[Run]:
    """The app (with ``app_args``) in one naming mode after two rounds and a hold, scraped by
    Prometheus as it configures it; ``metrics_url`` is where its series are (default: its own
    endpoint). Both end afterwards."""
    config = workdir / "prometheus.yml"
    env = dict(os.environ)
    env.pop("OTEL_SEMCONV_STABILITY_OPT_IN", None)
    if mode != "default":
        env["OTEL_SEMCONV_STABILITY_OPT_IN"] = mode
    app = subprocess.Popen(
        [
            sys.executable,
            str(APP),
            "--control=stdin",
            f"--prometheus-config={config}",
            f"--rule-file={RULES}",
            *app_args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready = _report(app, "ready")
        with prometheus_server(config, workdir) as prometheus:
            result = Run(
                url=prometheus.url,
                log=prometheus.log,
                mode=mode,
                metrics_url=metrics_url or f"http://127.0.0.1:{ready['metrics_port']}/metrics",
            )
            # Rates need a sample from before the traffic: the first round starts after a
            # scrape.
            _settle(result, time.time())
            for _ in range(ROUNDS):
                result.reports["round"] = _command(app, "round")
                _settle(result, result.reports["round"]["time"])
            result.reports["hold"] = _command(app, "hold")
            _settle(result, result.reports["hold"]["time"])
            yield result
    finally:
        if app.stdin is not None and app.poll() is None:
            try:
                app.stdin.write("release\nquit\n")
                app.stdin.close()
            except BrokenPipeError:
                pass
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            stop(app)
        for stream in (app.stdout, app.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture(scope="module", params=MODES)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The app in one naming mode after two rounds and a hold, scraped by Prometheus."""
    mode: str = request.param
    with app_scraped(mode, tmp_path_factory.mktemp(f"prometheus-{mode}")) as result:
        yield result


# --- every expression the examples ship ---------------------------------------------------


EXPRESSIONS = all_expressions()
# Where to append each expression's result as one JSON line, for reading after a run.
REPORT_PATH = os.environ.get("NEMO_GYM_PROMQL_REPORT")


def _report_result(mode: str, expression: Expression, found: Any) -> None:
    if not REPORT_PATH:
        return
    if expression.label is not None:
        summary: list[Any] = list(found)[:6]
    else:
        summary = [
            {
                "labels": {k: v for k, v in item["metric"].items() if k != "__name__"},
                "value": item["value"][1],
            }
            for item in found[:3]
        ]
    line = {"mode": mode, "source": expression.source, "series": len(found), "first": summary}
    with open(REPORT_PATH, "a", encoding="utf-8") as report:
        report.write(json.dumps(line) + "\n")


@pytest.mark.parametrize("expression", EXPRESSIONS, ids=[e.source for e in EXPRESSIONS])
def test_prometheus_expression_returns_data(run: Run, expression: Expression) -> None:
    """The expression succeeds; it returns data in the modes whose series it reads, and
    nothing in the other."""
    if expression.label is not None:
        found = run.api(f"label/{expression.label}/values", **{"match[]": expression.promql})
    else:
        found = run.query(expression.promql)
    _report_result(run.mode, expression, found)
    if run.mode in expression.modes:
        assert found, f"returned no data in mode {run.mode}: {expression.promql}"
    else:
        assert not found, f"returned data in mode {run.mode}, which has no such series"


def test_prometheus_loads_every_rule_healthy(run: Run) -> None:
    """Prometheus loaded every rule of rules.yml and each evaluates without error."""
    rules = [r for g in run.api("rules")["groups"] for r in g["rules"]]
    kinds = ("rules.yml record", "rules.yml alert")
    expected = [e for e in EXPRESSIONS if e.source.startswith(kinds)]
    assert len(rules) == len(expected)
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


def test_prometheus_every_alert_goes_off_with_usable_advice(run: Run) -> None:
    """Each alert but the quiet ones is pending or firing after the traffic, its annotations
    expanded without a template error, and the capacity command it suggests reports a safe
    sizing; the quiet ones are inactive."""
    alerts = run.api("alerts")["alerts"]
    cli = Path(sys.executable).with_name("nemo-gym-otel")
    for alert in alerts:
        for text in alert["annotations"].values():
            assert "error expanding template" not in text, (alert["labels"], text)
        action = alert["annotations"].get("action")
        if action is None:
            continue
        assert re.fullmatch(r"nemo-gym-otel capacity( --[a-z-]+ \d+)+", action), action
        checked = subprocess.run(
            [str(cli), *action.split()[1:]], capture_output=True, text=True, timeout=60, check=False
        )
        assert checked.returncode == 0, (action, checked.stderr)
    names = {e.source.split()[-1] for e in EXPRESSIONS if e.source.startswith("rules.yml alert")}
    assert names >= QUIET_ALERTS
    assert {a["labels"]["alertname"] for a in alerts} == names - QUIET_ALERTS


# --- the scraped series themselves ----------------------------------------------------------


# NeMo Gym's own sandbox duration histograms: their names (``..._duration_ms``, unit ``ms``)
# are NeMo Gym's, kept so that one dashboard reads NeMo Gym's series and ours, and fail
# promtool's lint (abbreviated unit, milliseconds) in every mode, as NeMo Gym's own do.
# The same for the pressure metrics: NeMo Gym's observer's names (``..._lag_ms``,
# ``..._pause_duration_ms``, the ``gym.gc.count`` gauge) and the semantic conventions' own
# ``process.*.count`` names, which promtool's ``_count`` lint reads as a histogram's part.
NEMO_GYM_FIXED_NAMES = (
    *(f"gym_sandbox_{what}_duration_ms_milliseconds" for what in ("startup", "exec", "transfer")),
    "gym_event_loop_lag_ms_milliseconds",
    "gym_gc_pause_duration_ms_milliseconds",
    "gym_gc_count",
    "process_open_file_descriptor_count",
    "process_thread_count",
)


def _without_nemo_gym_fixed_names(text: bytes) -> bytes:
    """The exposition text without the families of ``NEMO_GYM_FIXED_NAMES``."""
    kept = []
    for line in text.decode().splitlines(keepends=True):
        name = line.split()[2] if line.startswith("# ") else line
        if not name.startswith(NEMO_GYM_FIXED_NAMES):
            kept.append(line)
    return "".join(kept).encode()


def test_prometheus_scrape_passes_promtool_check_metrics(run: Run) -> None:
    """In the semantic-convention mode the /metrics text passes ``promtool check metrics``,
    but for NeMo Gym's own sandbox duration names, which are present and NeMo Gym's."""
    if run.mode != "http":
        pytest.skip("promtool's naming lint is asked of the http mode")
    promtool = shutil.which("promtool")
    require_service(promtool is not None, "promtool is not on PATH (apt-get install prometheus)")
    assert promtool is not None
    with urllib.request.urlopen(run.metrics_url, timeout=10) as response:
        scraped = response.read()
    text = _without_nemo_gym_fixed_names(scraped)
    assert len(text) < len(scraped)  # NeMo Gym's names were there, and only they are left out
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


def test_prometheus_connect_counter_counts_every_pool_acquisition(run: Run) -> None:
    """``connect_total`` per destination equals the requests sent there: two rounds, plus the
    hold's 2 requests to ``resources`` and 5 to ``policy``."""
    seen = {k[0]: v for k, v in run.values(CONNECT_TOTAL, SERVER).items()}
    done = run.reports["round"]["done"]
    sent = {name: float(ROUNDS * d["requests"]) for name, d in done.items()}
    sent["resources"] += 2
    sent["policy"] += 5
    assert seen == sent == {"policy": 45.0, "resources": 22.0, "judge": 4.0}
    assert seen == {k: float(v) for k, v in run.observed["connects"].items()}


def _ended(outcome_or_error_type: str | None) -> str:
    """``ok`` or ``abandoned``, from the pool API's outcome or the conventions' error type."""
    if outcome_or_error_type in (None, "", "ok"):
        return "ok"
    return "abandoned"


def _queue_labels(run: Run, suffix: str, *more: str) -> dict[tuple[str, ...], float]:
    """The mode's histogram series ``suffix`` by (destination, limit, ended, *more)."""
    third = OUTCOME if run.mode == "default" else "error_type"
    found = run.values(f"{HISTOGRAM[run.mode]}_{suffix}", SERVER, CONSTRAINT, third, *more)
    return {(k[0], k[1], _ended(k[2]), *k[3:]): value for k, value in found.items()}


def _app_queue(run: Run) -> dict[tuple[str, str, str], dict[str, Any]]:
    third = "outcome" if run.mode == "default" else "error_type"
    return {
        (q["server"], q["constraint"], _ended(q[third])): q
        for q in run.observed["queue"]
        if q["name"] == INSTRUMENT[run.mode]
    }


def test_prometheus_queue_series_name_the_binding_limit_and_outcome(run: Run) -> None:
    """The mode's histogram names the binding limit and how each wait ended; the other
    mode's histogram is absent."""
    assert set(_queue_labels(run, "count")) == EXPECTED_QUEUE_SERIES
    other = next(name for mode, name in HISTOGRAM.items() if mode != run.mode)
    assert run.query(f"{other}_count") == []
    if run.mode == "http":
        # The abandoned wait names its exception's class (a timeout cancels the wait).
        error_types = run.values(f"{HISTOGRAM['http']}_count", "error_type")
        assert {k[0].rsplit(".", 1)[-1] for k in error_types if k[0]} <= {
            "CancelledError",
            "TimeoutError",
        }


def test_prometheus_queue_counts_and_sums_match_the_app(run: Run) -> None:
    """Sample counts and sums equal the app's own reader; no more waits than could queue."""
    app = _app_queue(run)
    counts = _queue_labels(run, "count")
    sums = _queue_labels(run, "sum")
    assert set(app) == set(counts)
    for labels, count in counts.items():
        assert count == app[labels]["count"], labels
        assert math.isclose(sums[labels], app[labels]["sum"], rel_tol=1e-9), labels
    by_server = {labels[0]: value for labels, value in counts.items()}
    # The first `limit` requests of a burst find free slots; the rest may queue.
    assert ROUNDS <= by_server["policy"] <= ROUNDS * (20 - 2)
    assert ROUNDS <= by_server["resources"] <= ROUNDS * (10 - 1)
    assert by_server["judge"] == ROUNDS


def test_prometheus_buckets_are_the_advisory_ones_and_cumulative(run: Run) -> None:
    """Bucket bounds are the mode's documented ones; counts never fall; ``+Inf`` is the count."""
    counts = _queue_labels(run, "count")
    buckets: dict[tuple[str, ...], dict[float, float]] = {}
    for (server, constraint, ended, le), value in _queue_labels(run, "bucket", "le").items():
        buckets.setdefault((server, constraint, ended), {})[float(le)] = value
    assert set(buckets) == EXPECTED_QUEUE_SERIES
    for labels, by_bound in buckets.items():
        assert sorted(by_bound) == [*map(float, BUCKETS[run.mode].split()), math.inf], labels
        cumulative = [by_bound[bound] for bound in sorted(by_bound)]
        assert cumulative == sorted(cumulative), labels
        assert by_bound[math.inf] == counts[labels], labels


def test_prometheus_series_carry_scope_and_scrape_job(run: Run) -> None:
    """Every series of ours names our instrumentation scope and the scrape job."""
    series = run.query(f'{{otel_scope_name="{SCOPE}"}}')
    assert series
    assert {s["metric"]["job"] for s in series} == {"nemo_gym_app"}
    assert {s["metric"]["otel_scope_name"] for s in series} == {SCOPE}


# --- the pool state while the hold is in place ----------------------------------------------


def _non_zero(values: dict[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    return {labels: value for labels, value in values.items() if value}


def test_prometheus_open_connections_are_the_held_ones(run: Run) -> None:
    """2 active connections to 127.0.0.1 (held by the server) and 2 idle ones to 127.0.0.2."""
    held = run.reports["hold"]["held"]
    seen = run.values(
        "sum by (server_address, http_connection_state)"
        f' (http_client_open_connections{{otel_scope_name="{SCOPE}"}})',
        "server_address",
        "http_connection_state",
    )
    assert _non_zero(seen) == {
        ("127.0.0.1", "active"): held["active"],
        ("127.0.0.2", "idle"): held["idle"],
    }


def test_prometheus_waiting_requests_and_limits_are_the_held_pools(run: Run) -> None:
    """3 requests wait for 127.0.0.1; the one live pool's limits are 3 in all and 2 per host."""
    held = run.reports["hold"]["held"]
    waiting = run.values(
        "sum by (server_address) (gym_http_connection_pool_waiting_requests)", "server_address"
    )
    assert _non_zero(waiting) == {("127.0.0.1",): held["waiting"]}
    limits = run.values(
        "sum by (nemo_gym_http_connection_pool_limit_kind) (gym_http_connection_pool_limit)",
        "nemo_gym_http_connection_pool_limit_kind",
    )
    assert limits == {("total",): held["limit"], ("per_host",): held["limit_per_host"]}


def test_prometheus_connections_created_count_real_connections(run: Run) -> None:
    """New TCP connections per address are far fewer than pool acquisitions (keep-alive reuse)
    and at least the held pool's own (2 to each address)."""
    created = run.values(
        "sum by (server_address) (gym_http_connection_pool_connections_created_total)",
        "server_address",
    )
    assert created.get(("127.0.0.1",), 0) >= 2
    assert created.get(("127.0.0.2",), 0) >= 2
    acquisitions = sum(run.values(CONNECT_TOTAL, SERVER).values())
    assert sum(created.values()) < acquisitions / 2


# --- the sandboxes' lifecycle and usage -----------------------------------------------------


def test_prometheus_sandbox_lifecycle_matches_the_app(run: Run) -> None:
    """Per round two sandboxes started and closed and one command ran, in NeMo Gym's names,
    exactly as the app's own reader counted; none is held at the end."""
    app = run.observed["sandboxes"]
    starts = run.values("sum(gym_sandbox_startup_duration_ms_milliseconds_count)")
    commands = run.values("sum(gym_sandbox_exec_duration_ms_milliseconds_count)")
    assert starts == {(): app["gym.sandbox.startup_duration_ms"]} == {(): 2.0 * ROUNDS}
    assert commands == {(): app["gym.sandbox.exec_duration_ms"]} == {(): 1.0 * ROUNDS}
    assert run.values("sum(gym_sandbox_active)") == {(): 0.0} == {(): app["gym.sandbox.active"]}


def test_prometheus_sandbox_usage_is_per_nemo_gym_server(run: Run) -> None:
    """The sandboxes' CPU time and memory peak reach Prometheus labelled with the NeMo Gym
    server the app stands for, and are not zero."""
    cpu = run.values(
        "sum by (nemo_gym_server_name) (gym_sandbox_cpu_time_seconds_total)",
        "nemo_gym_server_name",
    )
    peak = run.values(
        "max by (nemo_gym_server_name) (gym_sandbox_memory_peak_bytes)", "nemo_gym_server_name"
    )
    assert set(cpu) == set(peak) == {("sandbox_example",)}
    assert cpu[("sandbox_example",)] > 0
    assert peak[("sandbox_example",)] > 0
