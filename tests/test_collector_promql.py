"""Every PromQL expression of the rules and the dashboard returns data through a collector.

``examples/prometheus/app.py`` runs its rounds and hold as in ``test_prometheus_e2e.py``, but
exports over OTLP/HTTP to a collector of this test's own (the binary
``scripts/start-collector.sh`` built; the shared one would hold other runs' series), and
Prometheus scrapes the collector's Prometheus exporter, with the shipped rules, in both naming
modes. The collector's names are the Python exporter's (dots to underscores, unit suffixes
such as ``_milliseconds``, ``_total`` on counters); what differs is that ``job`` and
``instance`` come from ``service.name`` and ``service.instance.id`` (``honor_labels``), that
every series carries ``otel_scope_name``/``otel_scope_version``/``otel_scope_schema_url``,
and that resource attributes are on ``target_info``. The rules and the dashboard aggregate
by ``job``/``instance`` and the domain labels only, so they work on both unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator

import pytest

from collector_support import private_collector, skip_unless_required

skip_unless_required()

from conftest import require_service  # noqa: E402
from promql_sources import MODES, RULES, Expression, all_expressions  # noqa: E402
from test_prometheus_e2e import (  # noqa: E402
    APP,
    ROUNDS,
    Run,
    _command,
    _free_port,
    _report,
    _settle,
    _stop,
)

pytestmark = [pytest.mark.integration, pytest.mark.collector]
EXPRESSIONS = all_expressions()


@pytest.fixture(scope="module", params=MODES)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The app in one naming mode, through a collector, after two rounds and a hold."""
    mode: str = request.param
    prometheus = shutil.which("prometheus")
    require_service(prometheus is not None, "the prometheus binary is not on PATH")
    assert prometheus is not None
    workdir = tmp_path_factory.mktemp(f"collector-promql-{mode}")
    with private_collector(workdir) as collector:
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
                f"--otlp-endpoint={collector.otlp_endpoint}",
                f"--scrape-target={urllib.parse.urlsplit(collector.prometheus).netloc}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        server: subprocess.Popen[str] | None = None
        log_path = workdir / "prometheus.log"
        log = log_path.open("w")
        try:
            _report(app, "ready")
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
            result = Run(
                mode=mode,
                prometheus_url=f"http://127.0.0.1:{port}",
                metrics_url=collector.prometheus,
            )
            _settle(result, time.time(), log_path)
            for _ in range(ROUNDS):
                result.reports["round"] = _command(app, "round")
                _settle(result, result.reports["round"]["time"], log_path)
            result.reports["hold"] = _command(app, "hold")
            _settle(result, result.reports["hold"]["time"], log_path)
            yield result
        finally:
            if server is not None:
                _stop(server)
            log.close()
            if app.stdin is not None and app.poll() is None:
                try:
                    app.stdin.write("release\nquit\n")
                    app.stdin.close()
                except BrokenPipeError:
                    pass
            try:
                app.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _stop(app)
            for stream in (app.stdout, app.stderr):
                if stream is not None:
                    stream.close()


@pytest.mark.parametrize("expression", EXPRESSIONS, ids=[e.source for e in EXPRESSIONS])
def test_collector_expression_returns_data(run: Run, expression: Expression) -> None:
    """Through the collector, the expression returns data in the modes whose series it reads,
    and nothing in the other."""
    if expression.label is not None:
        found = run.api(f"label/{expression.label}/values", **{"match[]": expression.promql})
    else:
        found = run.query(expression.promql)
    if run.mode in expression.modes:
        assert found, f"returned no data in mode {run.mode}: {expression.promql}"
    else:
        assert not found, f"returned data in mode {run.mode}, which has no such series"


def test_collector_series_carry_service_identity(run: Run) -> None:
    """The collector's series name the process: ``job`` is service.name, ``instance`` its id."""
    found = run.values("gym_http_connection_pool_connect_total", "job", "instance")
    assert found
    assert {job for job, _ in found} == {"nemo-gym-prometheus-example"}
    assert all(instance.count("-") >= 1 for _, instance in found)
