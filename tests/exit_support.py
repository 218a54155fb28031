"""Collectors that fail, and the time an instrumented process takes to exit against them.

A *hung* collector is a loopback port that accepts connections and never answers; a *down*
one is a closed loopback port. ``exit_seconds`` runs ``tests/apps/exit_worker.py`` under
``opentelemetry-instrument`` exporting over OTLP/HTTP, and times its exit alone: from the line
the test sends it, after its traffic, to the end of the process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conftest import INSTRUMENT

EXIT_WORKER = Path(__file__).resolve().parent / "apps" / "exit_worker.py"


@dataclass
class HungCollector:
    """A loopback port that accepts and never answers; ``accepted`` is set at each accept."""

    port: int
    accepted: threading.Event = field(default_factory=threading.Event)
    connections: list[socket.socket] = field(default_factory=list)


@contextmanager
def hung_collector() -> Iterator[HungCollector]:
    """A collector that accepts OTLP connections and never answers, until the block ends."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    hung = HungCollector(port=listener.getsockname()[1])
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                hung.connections.append(listener.accept()[0])
            except OSError:
                continue
            hung.accepted.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield hung
    finally:
        stop.set()
        thread.join(timeout=5)
        for connection in hung.connections:
            connection.close()
        listener.close()


def closed_port() -> int:
    """A loopback port nothing listens on (free a moment ago): a collector that is down."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def exporting_environment(port: int, otlp_timeout_s: float, *, plugin: bool) -> dict[str, str]:
    """Metrics over OTLP/HTTP to ``127.0.0.1:port``, a 600 s interval (the last export is
    the only one), this plugin on or off (``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update(
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_TIMEOUT=f"{otlp_timeout_s:g}",
        OTEL_METRIC_EXPORT_INTERVAL="600000",
    )
    if not plugin:
        env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "nemo_gym"
    return env


def start_worker(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """``exit_worker.py`` under ``opentelemetry-instrument``, once its traffic is done: the
    process and its JSON line."""
    worker = subprocess.Popen(
        [str(INSTRUMENT), sys.executable, str(EXIT_WORKER), "--requests=3", *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line:
        worker.kill()
        _, stderr = worker.communicate(timeout=30)
        raise AssertionError(f"exit_worker.py printed nothing:\n{stderr[-3000:]}")
    result: dict[str, str] = json.loads(line)
    return worker, result


def exit_seconds(env: dict[str, str]) -> tuple[float, dict[str, str]]:
    """How long ``exit_worker.py`` takes from the end of its work to the end of the process,
    and its JSON line."""
    worker, result = start_worker(env)
    assert worker.stdin is not None
    started = time.monotonic()
    worker.stdin.write("exit\n")
    worker.stdin.flush()
    _, stderr = worker.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert worker.returncode == 0, stderr[-3000:]
    return elapsed, result
