"""Part of ``sampler_cost.py``: the OpenTelemetry Collector's ``dockerstats`` receiver on the
same containers, and what it and the engine spend per container sample.

The collector is built for the benchmark only (``dockerstats/build.sh``: the OpenTelemetry
Collector Builder, the contrib receiver at v0.149.0) and runs with the debug exporter at basic
verbosity, which logs one line per export with its count of resource metrics: one resource
metrics per container per scrape, so the lines count the container samples the receiver
actually exported. Its ``excluded_images`` keeps it to the benchmark's containers, which
run a tag of their own (``BENCHMARK_TAG``) of the test image.

Nothing here is imported by the package.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from _sampler_parts import tree_cpu_s

BUILD_SCRIPT = Path(__file__).parent / "dockerstats" / "build.sh"
BENCHMARK_TAG = "sampler-cost"
# Long enough for the collector to start and list the containers before the window opens.
_FIRST_EXPORT_S = 60.0
_POLL_S = 0.02

CONFIG = """\
receivers:
  docker_stats:
    endpoint: unix://{socket}
    collection_interval: {interval}s
    timeout: 10s
    api_version: "1.41"
    excluded_images: ["!{image}"]
exporters:
  debug:
    verbosity: basic
service:
  telemetry:
    logs:
      level: info
      encoding: json
    metrics:
      level: none
  pipelines:
    metrics:
      receivers: [docker_stats]
      exporters: [debug]
"""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self._path)


def _engine(socket_path: str, method: str, path: str) -> int:
    connection = _UnixConnection(socket_path)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def tagged_image(socket_path: str, image: str) -> str:
    """``image`` tagged ``BENCHMARK_TAG`` in the engine (the same image, a name of its own
    for ``excluded_images``); raises ``RuntimeError`` when the engine refuses."""
    repository = image.rpartition(":")[0] if ":" in image.rpartition("/")[2] else image
    query = urllib.parse.urlencode({"repo": repository, "tag": BENCHMARK_TAG})
    status = _engine(socket_path, "POST", f"/images/{urllib.parse.quote(image)}/tag?{query}")
    if status >= 300:
        raise RuntimeError(f"the engine answered {status} to tagging {image}")
    return f"{repository}:{BENCHMARK_TAG}"


def untag(socket_path: str, image: str) -> None:
    """Remove the benchmark's tag (the image stays under its other names)."""
    with contextlib.suppress(OSError):
        _engine(socket_path, "DELETE", f"/images/{urllib.parse.quote(image)}")


def build() -> str:
    """The collector binary, built (or found in the cache) by ``dockerstats/build.sh``."""
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE, text=True
    )
    return done.stdout.strip().splitlines()[-1]


def _process_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _ExportLog:
    """The debug exporter's lines, read as they are written: each export's container count."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = ""

    def new_exports(self) -> list[int]:
        with self._path.open() as log:
            log.seek(self._offset)
            text = self._partial + log.read()
            self._offset = log.tell()
        lines = text.split("\n")
        self._partial = lines.pop()
        counts = []
        for line in lines:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("msg") == "Metrics" and "resource metrics" in entry:
                    counts.append(int(entry["resource metrics"]))
        return counts

    def next_export(self, bound_s: float) -> list[int]:
        """Exports up to and including the next one; ``TimeoutError`` after ``bound_s``."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            counts = self.new_exports()
            if counts:
                return counts
            time.sleep(_POLL_S)
        raise TimeoutError(f"the collector exported nothing in {bound_s:g} s")


def measure(
    binary: str,
    socket_path: str,
    image: str,
    engine_pid: int | None,
    interval_s: float,
    window_s: float,
) -> dict[str, Any]:
    """Run the collector's ``dockerstats`` receiver on the containers of ``image`` for about
    ``window_s`` seconds and return its CPU and the engine's per container sample.

    The window runs from just after one export to just after the last one within it, so the
    exports counted are the scrapes whose work was measured. The engine's CPU over an equal
    window without the collector, just before, is its baseline (other clients of a shared
    engine): ``engine_us`` is net of it, ``engine_baseline_us`` says how much it was.
    """
    baseline_s = 0.0
    if engine_pid is not None:
        before = tree_cpu_s(engine_pid) or 0.0
        time.sleep(window_s)
        baseline_s = (tree_cpu_s(engine_pid) or 0.0) - before
    with tempfile.TemporaryDirectory(prefix="sampler-cost-dockerstats-") as folder:
        config = Path(folder, "config.yaml")
        config.write_text(CONFIG.format(socket=socket_path, interval=interval_s, image=image))
        log_path = Path(folder, "collector.log")
        with log_path.open("w") as log:
            collector = subprocess.Popen(
                [binary, "--config", f"file:{config}"], stdout=log, stderr=log
            )
        try:
            exports = _ExportLog(log_path)
            exports.next_export(_FIRST_EXPORT_S)  # started, containers listed, first scrape
            collector_start = _process_cpu_s(collector.pid)
            engine_start = tree_cpu_s(engine_pid) if engine_pid else None
            opened = time.monotonic()
            counts: list[int] = []
            while time.monotonic() - opened < window_s:
                counts += exports.next_export(interval_s * 10 + 10)
            collector_end = _process_cpu_s(collector.pid)
            engine_end = tree_cpu_s(engine_pid) if engine_pid else None
            elapsed = time.monotonic() - opened
        finally:
            collector.send_signal(signal.SIGTERM)
            try:
                collector.wait(timeout=20)
            except subprocess.TimeoutExpired:
                collector.kill()
                collector.wait()
    samples = sum(counts)
    if samples == 0:
        raise RuntimeError("the collector exported no container sample in the window")
    collector_us = (collector_end - collector_start) / samples * 1e6
    engine_us = None
    baseline_us = None
    if engine_start is not None and engine_end is not None:
        baseline_us = baseline_s * (elapsed / window_s) / samples * 1e6
        engine_us = max(0.0, (engine_end - engine_start) / samples * 1e6 - baseline_us)
    return {
        "collection_interval_s": interval_s,
        "window_s": elapsed,
        "exports": len(counts),
        "container_samples": samples,
        "collector_us": collector_us,
        "engine_us": engine_us,
        "engine_baseline_us": baseline_us,
        "total_us": collector_us + (engine_us or 0.0),
    }
