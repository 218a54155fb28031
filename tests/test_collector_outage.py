"""A collector that is down, slow, or restarted costs the application nothing.

What bounds exit: ``opentelemetry-instrument``'s SDK shuts the meter provider down at exit;
the periodic reader first waits for an export in flight, then runs a last collection and
export. Each OTLP/HTTP export retries with backoff until ``OTEL_EXPORTER_OTLP_TIMEOUT`` (or
``OTEL_EXPORTER_OTLP_METRICS_TIMEOUT``; 10 s by default) has passed, so with the collector
unreachable exit costs at most about two such timeouts; the plugin's exit flush starts the
last of them early and adds none. The tests set 3 s and check the extra exit time against a
plain run, with a margin under one more timeout; the requests' results are the same.
(tests/test_exit_time.py times exit alone, against the plugin switched off.)

Restarted: metrics are cumulative, so the first export that reaches a collector started
after the traffic carries every count; nothing buffered is lost.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from collector_support import (
    collector_config,
    fleet_worker_command,
    free_port,
    otlp_environment,
    read_ports,
    running_collector,
)
from exit_support import hung_collector
from waiting import eventually_blocking

pytestmark = [pytest.mark.integration, pytest.mark.collector]

TRAFFIC = ("--policy=5", "--resources=4")
OTLP_TIMEOUT_S = 3
# Extra exit time allowed over a plain run: two bounded exports plus a margin for a shared,
# busy machine that stays under one timeout, so a third export at exit fails the test.
# Unbounded (the default 10 s timeout), the extra is about 11 s.
EXIT_MARGIN_S = 2 * OTLP_TIMEOUT_S + 1.5


def _run(env: dict[str, str], linger: float) -> tuple[dict[str, object], float]:
    started = time.monotonic()
    done = subprocess.run(
        fleet_worker_command(*TRAFFIC, f"--linger={linger}"),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result, elapsed


def _env(endpoint: str, exporter: str = "otlp") -> dict[str, str]:
    collector = running_collector()
    env = otlp_environment(collector, "outage", f"outage-{uuid.uuid4().hex[:6]}")
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    env["OTEL_EXPORTER_OTLP_TIMEOUT"] = str(OTLP_TIMEOUT_S)
    env["OTEL_METRICS_EXPORTER"] = exporter
    return env


def test_collector_down_exit_bounded_and_requests_unchanged() -> None:
    """With nothing on the OTLP port, results match a plain run and exit costs ~2 timeouts."""
    closed = f"http://127.0.0.1:{free_port()}"
    plain, plain_s = _run(_env(closed, exporter="none"), linger=2)
    down, down_s = _run(_env(closed), linger=2)
    assert down["connector"] == "QueueTimedTCPConnector"
    assert _traffic(down) == _traffic(plain)
    assert down_s - plain_s < EXIT_MARGIN_S, (plain_s, down_s)


def test_collector_slow_exit_bounded_and_requests_unchanged() -> None:
    """With a collector that accepts and never answers, the same bound holds."""
    with hung_collector() as hung:
        plain, plain_s = _run(_env(f"http://127.0.0.1:{hung.port}", exporter="none"), linger=2)
        slow, slow_s = _run(_env(f"http://127.0.0.1:{hung.port}"), linger=2)
    assert slow["connector"] == "QueueTimedTCPConnector"
    assert _traffic(slow) == _traffic(plain)
    assert slow_s - plain_s < EXIT_MARGIN_S, (plain_s, slow_s)


def test_collector_started_mid_run_receives_every_count(tmp_path: Path) -> None:
    """Counts made while no collector listened arrive once one does (cumulative temporality)."""
    binary = read_ports().get("COLLECTOR_BINARY", "")
    otlp_port, prometheus_port = free_port(), free_port()
    job = f"restart-{uuid.uuid4().hex[:6]}"
    env = _env(f"http://127.0.0.1:{otlp_port}")
    env["OTEL_SERVICE_NAME"] = job
    worker = subprocess.Popen(
        fleet_worker_command(*TRAFFIC, "--linger=20"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    collector: subprocess.Popen[bytes] | None = None
    log = (tmp_path / "collector.log").open("wb")
    try:
        assert worker.stdout is not None
        truth = json.loads(worker.stdout.readline())  # the traffic is done, nothing listening
        config = tmp_path / "config.yaml"
        config.write_text(collector_config(otlp_port, prometheus_port))
        collector = subprocess.Popen(
            [binary, f"--config=file:{config}"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{prometheus_port}/metrics"
        expected = {
            f"gym_http_connection_pool_connect_total{{{_labels(job, server)}}} {count}"
            for server, count in truth["connects"].items()
        }
        eventually_blocking(
            lambda: expected <= _lines(url),
            f"the collector exporting {sorted(expected)}",
            timeout=60,
            interval=0.25,
        )
    finally:
        worker.kill()
        worker.wait(timeout=10)
        for stream in (worker.stdout, worker.stderr):
            if stream is not None:
                stream.close()
        if collector is not None:
            collector.terminate()
            collector.wait(timeout=10)
        log.close()


def _traffic(result: dict[str, object]) -> tuple[object, object]:
    """What the requests did (the connector class differs: a plain run exports nothing)."""
    return result["connects"], result["queued"]


def _labels(job: str, server: str) -> str:
    return f'job="{job}",nemo_gym_http_destination_server_name="{server}"'


def _lines(url: str) -> set[str]:
    """Exposition lines, with ``instance`` and the ``otel_scope_*`` labels left out."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return set()
    found = set()
    for line in text.splitlines():
        if not line.startswith("gym_http_connection_pool_connect_total{"):
            continue
        name, rest = line.split("{", 1)
        labels, value = rest.rsplit("} ", 1)
        kept = [p for p in labels.split(",") if not p.startswith(("instance=", "otel_scope_"))]
        found.add(f"{name}{{{','.join(sorted(kept))}}} {value}")
    return found
