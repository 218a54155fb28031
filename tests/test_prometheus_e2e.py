"""A real Prometheus server scrapes the example app and its HTTP API shows our series.

One module-scoped run: ``examples/prometheus/app.py`` (a subprocess) drives three saturated
pools, exposes its metrics through ``opentelemetry-exporter-prometheus`` on a loopback port and
writes a scrape configuration; Debian's ``prometheus`` binary is started on another loopback
port with that configuration and a temporary data directory; the tests query Prometheus.
"""

from __future__ import annotations

import json
import math
import select
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import require_service

pytestmark = pytest.mark.integration

APP = Path(__file__).resolve().parent.parent / "examples" / "prometheus" / "app.py"

# The names Prometheus gives our instruments (checked against a real server): dots become
# underscores, the unit ``ms`` is appended to the histogram as ``milliseconds``, the counter's
# ``{connection}`` annotation is dropped, and ``_total`` is not doubled.
QUEUE_COUNT = "gym_http_connection_pool_queue_duration_ms_milliseconds_count"
QUEUE_SUM = "gym_http_connection_pool_queue_duration_ms_milliseconds_sum"
QUEUE_BUCKET = "gym_http_connection_pool_queue_duration_ms_milliseconds_bucket"
CONNECT_TOTAL = "gym_http_connection_pool_connect_total"
SERVER = "nemo_gym_http_destination_server_name"
CONSTRAINT = "nemo_gym_http_connection_pool_queue_constraint"
OUTCOME = "nemo_gym_http_connection_pool_queue_outcome"
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 5000, 30000)
EXPECTED_QUEUE_SERIES = {
    ("policy", "total", "ok"),
    ("resources", "per_host", "ok"),
    ("judge", "total", "abandoned"),
}
DEADLINE_S = 60.0


@dataclass
class Scrape:
    """What the app reported about itself, and a way to ask Prometheus."""

    report: dict[str, Any]
    prometheus_url: str

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Run an instant query; return its vector (a list of ``{metric, value}``)."""
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _read_line(process: subprocess.Popen[str], deadline: float) -> str:
    """The child's first stdout line, or a failure once ``deadline`` passes."""
    assert process.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            return process.stdout.readline()
        if process.poll() is not None:
            break
    stderr = process.stderr.read() if process.stderr and process.poll() is not None else ""
    pytest.fail(f"example app produced no report (exit {process.poll()}): {stderr}")


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _final_values_visible(scrape: Scrape) -> bool:
    """Whether Prometheus holds every series with the values the app reported."""
    try:
        connects = scrape.query(CONNECT_TOTAL)
        counts = scrape.query(QUEUE_COUNT)
    except (OSError, urllib.error.URLError, AssertionError):
        return False
    expected_connects: dict[str, int] = scrape.report["observed"]["connects"]
    seen_connects = {s["metric"].get(SERVER): float(s["value"][1]) for s in connects}
    seen_counts = {
        (s["metric"].get(SERVER), s["metric"].get(CONSTRAINT), s["metric"].get(OUTCOME))
        for s in counts
    }
    return (
        seen_connects == {k: float(v) for k, v in expected_connects.items()}
        and seen_counts == EXPECTED_QUEUE_SERIES
    )


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    """Run the app and a Prometheus that scrapes it every second; stop both afterwards."""
    prometheus = shutil.which("prometheus")
    require_service(
        prometheus is not None, "the prometheus binary is not on PATH (apt-get install prometheus)"
    )
    assert prometheus is not None
    workdir = tmp_path_factory.mktemp("prometheus")
    config = workdir / "prometheus.yml"
    app = subprocess.Popen(
        [
            sys.executable,
            str(APP),
            "--prometheus-config",
            str(config),
            "--until-stdin-closes",
            "--linger",
            str(DEADLINE_S * 3),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    server: subprocess.Popen[str] | None = None
    log = (workdir / "prometheus.log").open("w")
    try:
        report = json.loads(_read_line(app, time.monotonic() + DEADLINE_S))
        port = _free_port()
        server = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        result = Scrape(report=report, prometheus_url=f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + DEADLINE_S
        while not _final_values_visible(result):
            if server.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(
                    "Prometheus did not show the app's series in time; its log:\n"
                    + (workdir / "prometheus.log").read_text()[-4000:]
                )
            time.sleep(0.5)
        yield result
    finally:
        if server is not None:
            _stop(server)
        log.close()
        if app.stdin is not None:
            app.stdin.close()
        try:
            app.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _stop(app)
        for stream in (app.stdout, app.stderr):
            if stream is not None:
                stream.close()


def _labels(series: dict[str, Any]) -> tuple[str, str, str]:
    metric = series["metric"]
    return metric.get(SERVER), metric.get(CONSTRAINT), metric.get(OUTCOME)


def _app_queue(scrape: Scrape) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {
        (q["server"], q["constraint"], q["outcome"]): q for q in scrape.report["observed"]["queue"]
    }


def test_prometheus_connect_counter_counts_every_request(scrape: Scrape) -> None:
    """``connect_total`` per destination equals the number of requests the app sent there."""
    seen = {s["metric"][SERVER]: float(s["value"][1]) for s in scrape.query(CONNECT_TOTAL)}
    sent = {name: float(done["requests"]) for name, done in scrape.report["done"].items()}
    assert seen == sent == {"policy": 20.0, "resources": 10.0, "judge": 2.0}


def test_prometheus_queue_series_name_the_binding_limit_and_outcome(scrape: Scrape) -> None:
    """Histogram series name the binding limit (total, per_host) and the outcome (ok, abandoned)."""
    assert {_labels(s) for s in scrape.query(QUEUE_COUNT)} == EXPECTED_QUEUE_SERIES
    assert scrape.report["done"]["judge"]["abandoned"] == 1


def test_prometheus_queue_counts_match_what_the_app_did(scrape: Scrape) -> None:
    """Sample counts equal the app's own reader, and no more requests queued than could."""
    app = _app_queue(scrape)
    counts = {_labels(s): float(s["value"][1]) for s in scrape.query(QUEUE_COUNT)}
    for labels, count in counts.items():
        assert count == app[labels]["count"], labels
    # The first `limit` requests of a burst find free slots; the rest may queue.
    assert 1 <= counts[("policy", "total", "ok")] <= 20 - 2
    assert 1 <= counts[("resources", "per_host", "ok")] <= 10 - 1
    assert counts[("judge", "total", "abandoned")] == 1


def test_prometheus_queue_sums_match_the_app_in_milliseconds(scrape: Scrape) -> None:
    """Sums equal the app's own, and the abandoned wait lasted about its 0.2 s timeout."""
    app = _app_queue(scrape)
    sums = {_labels(s): float(s["value"][1]) for s in scrape.query(QUEUE_SUM)}
    for labels, total in sums.items():
        assert math.isclose(total, app[labels]["sum"], rel_tol=1e-9), labels
    assert 150.0 <= sums[("judge", "total", "abandoned")] <= 1000.0
    # 18 or so waits behind 20 ms responses on two slots: well over a millisecond in all.
    assert sums[("policy", "total", "ok")] > 20.0


def test_prometheus_buckets_are_the_advisory_ones_and_cumulative(scrape: Scrape) -> None:
    """Bucket bounds are the documented ones; counts never fall and ``+Inf`` equals the count."""
    count_by_labels = {_labels(s): float(s["value"][1]) for s in scrape.query(QUEUE_COUNT)}
    buckets: dict[tuple[str, str, str], dict[float, float]] = {}
    for series in scrape.query(QUEUE_BUCKET):
        bound = float(series["metric"]["le"])
        buckets.setdefault(_labels(series), {})[bound] = float(series["value"][1])
    assert set(buckets) == EXPECTED_QUEUE_SERIES
    for labels, by_bound in buckets.items():
        assert sorted(by_bound) == [*map(float, BUCKETS), math.inf], labels
        cumulative = [by_bound[bound] for bound in sorted(by_bound)]
        assert cumulative == sorted(cumulative), labels
        assert by_bound[math.inf] == count_by_labels[labels], labels


def test_prometheus_series_carry_scope_and_scrape_job(scrape: Scrape) -> None:
    """Every series names our instrumentation scope and the scrape job that collected it."""
    for series in scrape.query(CONNECT_TOTAL) + scrape.query(QUEUE_COUNT):
        assert series["metric"]["otel_scope_name"] == "opentelemetry.instrumentation.nemo_gym"
        assert series["metric"]["job"] == "nemo_gym_app"
