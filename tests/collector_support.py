"""The collector that ``scripts/start-collector.sh`` runs, and a Prometheus that scrapes it.

Collector tests are heavy (a Go-built collector, several instrumented processes, a Prometheus
server), so they run once, in their own ``.ci/run`` section, not in each of the four runs of
``scripts/test.sh``: they are marked ``collector``, which the main suite leaves out
(``SECTIONS`` in ``conftest.py``) and ``-m collector`` selects. Selected, a collector or a
Prometheus that is missing fails them (``require_service``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import INSTRUMENT, require_service
from waiting import eventually_blocking

ROOT = Path(__file__).resolve().parent.parent
START_COLLECTOR = ROOT / "scripts" / "start-collector.sh"
FLEET_WORKER = ROOT / "tests" / "apps" / "fleet_worker.py"
EXAMPLE_APP = ROOT / "examples" / "prometheus" / "app.py"


def default_state_dir(checkout: Path = ROOT) -> Path:
    """The script's state folder without NEMO_GYM_COLLECTOR_DIR: one per user and checkout
    (the first 12 hex digits of the SHA-256 of the checkout's absolute path)."""
    key = hashlib.sha256(str(checkout.resolve()).encode()).hexdigest()[:12]
    return Path(f"/tmp/nemo-gym-collector-{os.getuid()}-{key}")


# The state folder the script uses: NEMO_GYM_COLLECTOR_DIR (from the working directory when
# relative), else this checkout's default.
DEFAULT_STATE_DIR = default_state_dir()
STATE_DIR = Path(os.environ.get("NEMO_GYM_COLLECTOR_DIR") or DEFAULT_STATE_DIR).resolve()


@dataclass(frozen=True)
class Collector:
    """The endpoints of a running collector, as ``ports.env`` records them."""

    prometheus: str  # the collector's Prometheus exporter, .../metrics
    otlp_endpoint: str  # OTLP over HTTP, http://127.0.0.1:<port>
    self_metrics: str  # the collector's own metrics (CPU, memory, accepted points)


def read_ports(state_dir: Path = STATE_DIR) -> dict[str, str]:
    """``KEY=value`` lines of ``ports.env``; empty when there is none."""
    path = state_dir / "ports.env"
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {pair[0]: pair[1] for pair in pairs}


def http_status(url: str, timeout: float = 2.0) -> int:
    """The status a GET of ``url`` answers with; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def running_collector() -> Collector:
    """The collector ``scripts/start-collector.sh`` started; skips (fails in CI) without one."""
    ports = read_ports()
    collector = Collector(
        prometheus=ports.get("COLLECTOR_PROMETHEUS", ""),
        otlp_endpoint=ports.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        self_metrics=ports.get("COLLECTOR_SELF_METRICS", ""),
    )
    up = bool(ports) and http_status(collector.prometheus) == 200
    # The OTLP/HTTP receiver answers a GET of its path with 405 Method Not Allowed.
    up = up and http_status(collector.otlp_endpoint + "/v1/metrics") == 405
    require_service(up, f"no collector answers (see {STATE_DIR}); run: bash {START_COLLECTOR}")
    return collector


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Prometheus:
    """A Prometheus server's query API."""

    url: str
    log: Path

    def api(self, path: str, **params: str) -> Any:
        """GET an API path; return its ``data`` (fails on an error status)."""
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, promql: str, *labels: str) -> dict[tuple[str, ...], float]:
        """``promql``'s samples keyed by the given labels."""
        return {
            tuple(s["metric"].get(label, "") for label in labels): float(s["value"][1])
            for s in self.query(promql)
        }

    def wait_for(self, what: str, done: Callable[[], bool], bound_s: float = 90.0) -> None:
        """``eventually_blocking(done)``; its failure carries the end of Prometheus's log."""
        try:
            eventually_blocking(lambda: _true(done), what, timeout=bound_s, interval=0.25)
        except AssertionError as never:
            pytest.fail(f"{never}; Prometheus log:\n{self.log.read_text()[-3000:]}")


def _true(done: Callable[[], bool]) -> bool:
    try:
        return done()
    except (OSError, AssertionError, KeyError, ValueError):
        return False


def _example_prometheus_config() -> Callable[..., str]:
    """``prometheus_config`` of ``examples/prometheus/app.py``, the configuration users get."""
    spec = importlib.util.spec_from_file_location("nemo_gym_prometheus_example", EXAMPLE_APP)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config: Callable[..., str] = module.prometheus_config
    return config


@contextmanager
def prometheus_server(config: Path, workdir: Path) -> Iterator[Prometheus]:
    """A real Prometheus (Debian's binary) with ``config``, its data and log in ``workdir``,
    on a free loopback port; ended afterwards."""
    binary = shutil.which("prometheus")
    require_service(
        binary is not None, "the prometheus binary is not on PATH (apt-get install prometheus)"
    )
    assert binary is not None
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("w") as log_file:
        server = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            yield Prometheus(url=f"http://127.0.0.1:{port}", log=log)
        finally:
            stop(server)


@contextmanager
def prometheus_scraping(
    collector: Collector, workdir: Path, rule_files: tuple[Path, ...] = ()
) -> Iterator[Prometheus]:
    """A real Prometheus scraping ``collector`` every second, configured as the example app
    configures it for a collector (``--scrape-target``: ``honor_labels``, so ``job`` and
    ``instance`` are the ones the collector derives from each process's resource)."""
    target = urllib.parse.urlsplit(collector.prometheus).netloc
    config = workdir / "prometheus.yml"
    config.write_text(_example_prometheus_config()(0, 1.0, rule_files, target))
    with prometheus_server(config, workdir) as prometheus:
        prometheus.wait_for("scraped the collector", lambda: bool(prometheus.query("up == 1")))
        yield prometheus


def stop(process: subprocess.Popen[Any]) -> None:
    """End a process this test started: terminate, and kill what ignores that for 10 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def fleet_worker_command(*args: str) -> list[str]:
    """``tests/apps/fleet_worker.py`` with ``args`` under ``opentelemetry-instrument``."""
    return [str(INSTRUMENT), sys.executable, str(FLEET_WORKER), *args]


def otlp_environment(collector: Collector, service: str, instance: str) -> dict[str, str]:
    """The environment of a process exporting metrics over OTLP/HTTP to ``collector``."""
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("OTEL_")]:
        del env[key]
    env.update(
        OTEL_SERVICE_NAME=service,
        OTEL_RESOURCE_ATTRIBUTES=f"service.instance.id={instance}",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.otlp_endpoint,
        OTEL_METRIC_EXPORT_INTERVAL="1000",
    )
    return env


def collector_config(otlp_port: int, prometheus_port: int) -> str:
    """``scripts/collector/config.yaml.in`` with these ports (and free ones for the rest), as
    start-collector.sh writes it without ``--jaeger``: no Jaeger exporter, traces to debug."""
    text = (ROOT / "scripts" / "collector" / "config.yaml.in").read_text()
    text = re.sub(r"\n[^\n]*@JAEGER_BEGIN@.*?@JAEGER_END@[^\n]*", "", text, flags=re.DOTALL)
    for key, value in {
        "@OTLP_HTTP_PORT@": otlp_port,
        "@OTLP_GRPC_PORT@": free_port(),
        "@PROMETHEUS_PORT@": prometheus_port,
        "@SELF_METRICS_PORT@": free_port(),
        "@TRACES_EXPORTER@": "debug",
    }.items():
        text = text.replace(key, str(value))
    return text


@contextmanager
def private_collector(workdir: Path) -> Iterator[Collector]:
    """A collector of the test's own (the binary start-collector.sh built), ended afterwards.

    For tests whose assertions would be disturbed by other processes' series in the shared one.
    """
    running_collector()  # the build exists and works
    binary = read_ports().get("COLLECTOR_BINARY", "")
    require_service(Path(binary).is_file(), f"no collector binary recorded in {STATE_DIR}")
    otlp_port, prometheus_port = free_port(), free_port()
    config = workdir / "collector.yaml"
    config.write_text(collector_config(otlp_port, prometheus_port))
    collector = Collector(
        prometheus=f"http://127.0.0.1:{prometheus_port}/metrics",
        otlp_endpoint=f"http://127.0.0.1:{otlp_port}",
        self_metrics="",
    )
    with (workdir / "collector.log").open("wb") as log:
        process = subprocess.Popen([binary, f"--config=file:{config}"], stdout=log, stderr=log)
        try:

            def answering() -> bool:
                assert process.poll() is None, (workdir / "collector.log").read_text()[-2000:]
                return http_status(collector.prometheus) == 200

            eventually_blocking(answering, "the private collector answering", timeout=30)
            yield collector
        finally:
            process.terminate()
            process.wait(timeout=10)
