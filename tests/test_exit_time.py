"""A process's exit and its SIGTERM, with this plugin, against collectors that fail or answer.

Real ``opentelemetry-instrument`` processes (``tests/apps/exit_worker.py``) exporting over
OTLP/HTTP or to the console, on whichever Python runs the suite: CI runs it on 3.11, 3.12
(where no thread starts during exit) and 3.13. Exit is timed from the line that tells the
process to return from ``main`` to its end, with a 600 s interval, so the SDK's last export
is the only one: against a collector that is down or hung it takes ``OTEL_EXPORTER_OTLP_TIMEOUT``
with or without the plugin, whose own wait at exit is at most ``EXIT_WAIT_S``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exit_support import (
    closed_port,
    exit_seconds,
    exporting_environment,
    hung_collector,
    start_worker,
)
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym._shared._exit_flush import EXIT_WAIT_S

OTLP_TIMEOUT_S = 4.0
# What a busy machine adds to one exit over another: under the OTLP timeout, so that one more
# export (one more timeout) at exit fails the test.
NOISE_S = 1.0


def _hung_exit(plugin: bool) -> tuple[float, dict[str, str]]:
    with hung_collector() as hung:
        return exit_seconds(exporting_environment(hung.port, OTLP_TIMEOUT_S, plugin=plugin))


def _down_exit(plugin: bool) -> tuple[float, dict[str, str]]:
    return exit_seconds(exporting_environment(closed_port(), OTLP_TIMEOUT_S, plugin=plugin))


@pytest.mark.parametrize("collector", [_hung_exit, _down_exit], ids=["hung", "down"])
def test_exit_failing_collector_adds_at_most_the_exit_wait(
    collector: Callable[[bool], tuple[float, dict[str, str]]],
) -> None:
    """Against a hung or down collector, the plugin adds at most EXIT_WAIT_S to exit."""
    without_s, plain = collector(False)
    with_s, timed = collector(True)
    assert (plain["connector"], timed["connector"]) == ("TCPConnector", "QueueTimedTCPConnector")
    assert with_s - without_s < EXIT_WAIT_S + NOISE_S, (without_s, with_s)


def _console_environment() -> dict[str, str]:
    env = exporting_environment(closed_port(), OTLP_TIMEOUT_S, plugin=True)
    env["OTEL_METRICS_EXPORTER"] = "console"
    return env


def _connects(console: str) -> list[int]:
    """The connect counts in the console exporter's JSON documents, in order."""
    decoder = json.JSONDecoder()
    counts, position = [], 0
    while (start := console.find("{", position)) >= 0:
        document, position = decoder.raw_decode(console, start)
        for resource in document["resource_metrics"]:
            for scope in resource["scope_metrics"]:
                for metric in scope["metrics"]:
                    if metric["name"] == "gym.http.connection_pool.connect_total":
                        counts.extend(p["value"] for p in metric["data"]["data_points"])
    return counts


def test_sigterm_exports_last_counts_and_ends_by_sigterm() -> None:
    """A process ended by SIGTERM exports what it counted and still ends by that signal."""
    worker, result = start_worker(_console_environment())
    assert result["connector"] == "QueueTimedTCPConnector"
    worker.send_signal(signal.SIGTERM)
    stdout, stderr = worker.communicate(timeout=60)
    assert worker.returncode == -signal.SIGTERM, stderr[-3000:]
    assert _connects(stdout) == [3], stdout[-3000:]


def test_sigterm_application_handler_kept() -> None:
    """A SIGTERM handler the application installs after instrument() is the one that runs."""
    worker, _ = start_worker(_console_environment(), "--own-sigterm-handler")
    worker.send_signal(signal.SIGTERM)
    stdout, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 3, stderr[-3000:]
    assert stdout.startswith("APP SIGTERM\n"), stdout[-3000:]


_HANDLER_FIRST_SCRIPT = """
import signal
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

def application(signum, frame):
    pass

signal.signal(signal.SIGTERM, application)
reader = PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=600_000)
metrics.set_meter_provider(MeterProvider([reader]))
instrumentor = NemoGymInstrumentor()
instrumentor.instrument()
kept = signal.getsignal(signal.SIGTERM) is application
print(instrumentor.is_instrumented_by_opentelemetry, kept)
instrumentor.uninstrument()
print(signal.getsignal(signal.SIGTERM) is application)
"""


def test_sigterm_application_handler_installed_first_kept(tmp_path: Path) -> None:
    """A SIGTERM handler installed before instrument() stays, through uninstrument() too."""
    script = tmp_path / "handler_first.py"
    script.write_text(_HANDLER_FIRST_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["True True", "True"], done.stdout


@pytest.fixture
def default_sigterm() -> Iterator[None]:
    """SIGTERM with its default action in this process for the test, then as it was."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.usefixtures("global_meter_provider", "default_sigterm")
def test_sigterm_handler_only_from_main_thread(instrumentor: NemoGymInstrumentor) -> None:
    """instrument() off the main thread installs no handler and raises nothing."""
    errors: list[BaseException] = []

    def instrument() -> None:
        try:
            instrumentor.instrument()
        except Exception as error:
            errors.append(error)

    thread = threading.Thread(target=instrument)
    thread.start()
    thread.join(timeout=60)
    assert errors == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.usefixtures("global_meter_provider", "default_sigterm")
def test_sigterm_handler_removed_by_uninstrument(instrumentor: NemoGymInstrumentor) -> None:
    """instrument() handles SIGTERM where nothing did; uninstrument() gives the default back."""
    instrumentor.instrument()
    try:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        instrumentor.uninstrument()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
