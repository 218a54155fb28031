"""``examples/grafana/nemo-gym.json`` is a well-formed dashboard, checked without Grafana.

Grafana cannot be installed here (examples/grafana/README.md says why); what its import needs
is checked directly, and ``tests/test_prometheus_e2e.py`` runs every query in it against a
real Prometheus.
"""

from __future__ import annotations

import json
from typing import Any

from promql_sources import DASHBOARD, MODES, QUEUE_HISTOGRAM, dashboard_expressions

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_has_a_prometheus_datasource_variable_used_everywhere() -> None:
    """A ``datasource`` variable of type prometheus; every panel and query goes through it."""
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, (panel["title"], target["refId"])
    for name in ("job", "instance", "destination"):
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"] is True
        assert variables[name]["allValue"] == ".*"


def test_dashboard_panels_have_unique_ids_and_do_not_overlap() -> None:
    """Panel ids are unique and no two panels share a grid cell on the 24-column grid."""
    panels = _dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, (panel["title"], taken.get((x, y)))
                taken[(x, y)] = panel["title"]


def test_dashboard_queries_have_ref_ids_and_expressions() -> None:
    """Every query has a ``refId`` unique in its panel and a non-empty expression."""
    for panel in _panels():
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), (panel["title"], target["refId"])


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    """Heatmaps, percentiles, binding constraint, abandoned waits, connections, waiting vs
    limits: each read from the series that carries it."""
    text = "\n".join(t["expr"] for p in _panels() for t in p["targets"])
    heatmaps = [p for p in _panels() if p["type"] == "heatmap"]
    assert {h["targets"][0]["format"] for h in heatmaps} == {"heatmap"}
    assert len(heatmaps) == len(MODES)
    for name in QUEUE_HISTOGRAM.values():
        assert f"{name}_bucket" in text
    for needle in (
        "histogram_quantile(0.95",
        "histogram_quantile(0.5",
        "nemo_gym_http_connection_pool_queue_constraint",
        'nemo_gym_http_connection_pool_queue_outcome="abandoned"',
        'error_type!=""',
        "http_connection_state",
        "gym_http_connection_pool_waiting_requests",
        "gym_http_connection_pool_limit",
    ):
        assert needle in text, needle


def test_dashboard_every_expression_is_runnable_promql_text() -> None:
    """Grafana's variables all have a stand-in, so each query can be sent to Prometheus."""
    expressions = dashboard_expressions()
    assert len(expressions) == sum(len(p["targets"]) for p in _panels()) + 3
    for expression in expressions:
        assert "$" not in expression.promql, expression.source
