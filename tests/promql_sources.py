"""Every PromQL expression the examples ship: the rules in ``examples/prometheus/rules.yml``
and the queries in ``examples/grafana/nemo-gym.json``, ready to run against Prometheus.

Grafana's variables are replaced by values that select everything (``$job`` and friends by
``.*``, ``$__rate_interval`` by ``5m``); a variable's ``label_values(SELECTOR, LABEL)`` query
becomes a label-values lookup. Pure reading and text substitution: no I/O beyond the two files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RULES = EXAMPLES / "prometheus" / "rules.yml"
DASHBOARD = EXAMPLES / "grafana" / "nemo-gym.json"

# The queue-wait histogram's name in each naming mode (OTEL_SEMCONV_STABILITY_OPT_IN unset,
# or ``http``); an expression that reads only one of them has data only in that mode.
QUEUE_HISTOGRAM = {
    "default": "gym_http_connection_pool_queue_duration_ms_milliseconds",
    "http": "http_client_request_time_in_queue_seconds",
}
MODES = tuple(QUEUE_HISTOGRAM)

# What the dashboard's variables become: everything, over a window that covers a test run.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "5m",
    "$job": ".*",
    "$instance": ".*",
    "$destination": ".*",
}
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\)$", re.DOTALL)
# The instruments that only exist once other branches land (see the test module's docstring).
SANDBOX_METRICS = (
    "gym_sandbox_creations_total",
    "gym_sandbox_oom_kills_total",
    "gym_sandbox_allocation_mismatches_total",
)


# Alerts the example app's traffic cannot set off (starts slower than two minutes): their
# expressions return nothing in every mode, which the live tests check; promtool's unit tests
# (rules_test.yml) show them firing.
QUIET_ALERTS = frozenset({"NemoGymSandboxStartSlow"})


@dataclass(frozen=True)
class Expression:
    """One query to run: where it comes from, the PromQL, and in which modes it has data.

    ``label`` is set for a Grafana variable's ``label_values``: then ``promql`` is the series
    selector and the query is for that label's values.
    """

    source: str
    promql: str
    modes: tuple[str, ...]
    label: str | None = None


def modes_with_data(promql: str) -> tuple[str, ...]:
    """The naming modes in which ``promql`` reads series that exist."""
    reads = [mode for mode, name in QUEUE_HISTOGRAM.items() if name in promql]
    return tuple(reads) if len(reads) == 1 else MODES


def grafana_to_promql(text: str) -> str:
    """``text`` with Grafana's variables replaced; fails on a variable it does not know."""
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        text = text.replace(variable, GRAFANA_VARIABLES[variable])
        text = text.replace("${" + variable[1:] + "}", GRAFANA_VARIABLES[variable])
    if "$" in text:
        raise ValueError(f"unknown Grafana variable in {text!r}")
    return text


def rule_expressions() -> list[Expression]:
    """Each rule's ``expr`` in rules.yml, and each recording rule's recorded series."""
    document = yaml.safe_load(RULES.read_text())
    found = []
    for group in document["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            kind = "record" if "record" in rule else "alert"
            expr = rule["expr"].strip()
            modes = () if name in QUIET_ALERTS else modes_with_data(expr)
            found.append(Expression(f"rules.yml {kind} {name}", expr, modes))
            if kind == "record":
                found.append(Expression(f"rules.yml series {name}", name, MODES))
    return found


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_expressions() -> list[Expression]:
    """Each panel query and each ``label_values`` variable query in the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = grafana_to_promql(target["expr"])
            source = f"nemo-gym.json panel {panel['title']!r} {target['refId']}"
            found.append(Expression(source, expr, modes_with_data(expr)))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(grafana_to_promql(text))
        if match is None:
            raise ValueError(f"variable {variable['name']}: not label_values(...): {text!r}")
        found.append(
            Expression(
                f"nemo-gym.json variable {variable['name']}",
                match["selector"],
                MODES,
                label=match["label"],
            )
        )
    return found


def all_expressions() -> list[Expression]:
    return rule_expressions() + dashboard_expressions()


def needs_sandbox_metrics(expression: Expression) -> bool:
    """Whether ``expression`` reads the sandbox fleet counters (the fleet's instruments)."""
    return any(name in expression.promql for name in SANDBOX_METRICS)
