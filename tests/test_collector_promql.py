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

import urllib.parse
from collections.abc import Iterator

import pytest

from collector_support import private_collector
from promql_sources import MODES, Expression, all_expressions
from test_prometheus_e2e import Run, app_scraped
from test_prometheus_e2e import (
    test_prometheus_sandbox_lifecycle_matches_the_app as check_sandbox_lifecycle,
)
from test_prometheus_e2e import (
    test_prometheus_sandbox_usage_is_per_nemo_gym_server as check_sandbox_usage,
)

pytestmark = [pytest.mark.integration, pytest.mark.collector]
EXPRESSIONS = all_expressions()


@pytest.fixture(scope="module", params=MODES)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The app in one naming mode, through a collector, after two rounds and a hold."""
    mode: str = request.param
    workdir = tmp_path_factory.mktemp(f"collector-promql-{mode}")
    with private_collector(workdir) as collector:
        app_args = (
            f"--otlp-endpoint={collector.otlp_endpoint}",
            f"--scrape-target={urllib.parse.urlsplit(collector.prometheus).netloc}",
        )
        with app_scraped(mode, workdir, app_args, metrics_url=collector.prometheus) as result:
            yield result


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
    assert {job for job, _ in found} == {"nemo-gym/sandbox_example"}
    assert all(instance.count("-") >= 1 for _, instance in found)


def test_collector_sandbox_lifecycle_and_usage_match_the_app(run: Run) -> None:
    """Through the collector too, the sandbox lifecycle counts equal the app's own, none is
    held at the end, and the CPU time and memory peak name the NeMo Gym server."""
    check_sandbox_lifecycle(run)
    check_sandbox_usage(run)
