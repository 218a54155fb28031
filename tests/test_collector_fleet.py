"""Several processes under ``opentelemetry-instrument`` export over OTLP into one collector,
which a real Prometheus scrapes: what arrives equals each process's known traffic exactly.

Each worker (``tests/apps/fleet_worker.py``) sends a known number of requests at once to a
``policy`` server on 127.0.0.1 (pool of 1: N connects, N - 1 waits on ``total``) and to a
``resources`` server on 127.0.0.2 (1 per host: M connects, M - 1 waits on ``per_host``), and
exits; the SDK's shutdown exports its last collection. What keeps the processes apart is the
resource: every process has its own ``service.instance.id`` (here set through
``OTEL_RESOURCE_ATTRIBUTES``), which the collector's Prometheus exporter turns into the
``instance`` label (``service.name`` into ``job``), with one ``target_info`` series each.

Set ``NEMO_GYM_FLEET_REPORT=path`` to write the scraped series there (a record of the
series a run scraped).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from collector_support import (
    fleet_worker_command,
    otlp_environment,
    prometheus_scraping,
    running_collector,
)

pytestmark = [pytest.mark.integration, pytest.mark.collector]

# (policy requests, resources requests) per process: all different, so a mix-up shows.
TRAFFIC = {"worker-1": (4, 3), "worker-2": (6, 5), "worker-3": (8, 7)}
CONNECTS = "gym_http_connection_pool_connect_total"
QUEUED = "gym_http_connection_pool_queue_duration_ms_milliseconds_count"
SERVER = "nemo_gym_http_destination_server_name"
CONSTRAINT = "nemo_gym_http_connection_pool_queue_constraint"


def test_collector_fleet_counts_equal_each_process_traffic(tmp_path: Path) -> None:
    """Per process and destination, connects and queued waits through the collector are exact."""
    collector = running_collector()
    # This run's series only, whatever else the shared collector holds.
    job = f"fleet-{uuid.uuid4().hex[:8]}"
    with prometheus_scraping(collector, tmp_path) as prometheus:
        workers = {
            instance: subprocess.Popen(
                fleet_worker_command(f"--policy={policy}", f"--resources={resources}"),
                env=otlp_environment(collector, job, instance),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for instance, (policy, resources) in TRAFFIC.items()
        }
        expected_connects: dict[tuple[str, ...], float] = {}
        expected_queued: dict[tuple[str, ...], float] = {}
        for instance, worker in workers.items():
            out, err = worker.communicate(timeout=120)
            assert worker.returncode == 0, err
            truth = json.loads(out.splitlines()[-1])
            assert truth["connector"] == "QueueTimedTCPConnector"
            for server, count in truth["connects"].items():
                expected_connects[(instance, server)] = count
            expected_queued[(instance, "policy", "total")] = truth["queued"]["policy"]
            expected_queued[(instance, "resources", "per_host")] = truth["queued"]["resources"]

        selector = f'{{job="{job}"}}'
        prometheus.wait_for(
            "saw every process's last export",
            lambda: prometheus.values(CONNECTS + selector, "instance", SERVER) == expected_connects,
        )
        assert prometheus.values(CONNECTS + selector, "instance", SERVER) == expected_connects
        queued = prometheus.values(QUEUED + selector, "instance", SERVER, CONSTRAINT)
        assert queued == expected_queued
        targets = prometheus.values(f"target_info{selector}", "instance")
        assert set(targets) == {(instance,) for instance in TRAFFIC}

        report = os.environ.get("NEMO_GYM_FLEET_REPORT")
        if report:
            series = prometheus.query(f'{{job="{job}", __name__=~"gym_.*|http_.*|target_info"}}')
            lines = sorted(_exposition(s["metric"], s["value"][1]) for s in series)
            Path(report).write_text("\n".join(lines) + "\n")


def _exposition(metric: dict[str, str], value: str) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{metric['__name__']}{{{labels}}} {value}"
