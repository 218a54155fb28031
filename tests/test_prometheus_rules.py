"""``examples/prometheus/rules.yml`` passes ``promtool`` and its unit tests cover every rule.

``promtool`` (Debian's ``prometheus`` package) checks the rules and runs
``examples/prometheus/rules_test.yml``; the other tests read both files to hold the unit
tests to the promise that every alert is seen firing and not firing, every recording rule's
value is pinned, and every alert tells the operator what to change.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import require_service
from promql_sources import dashboard_expressions

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "prometheus"
RULES = EXAMPLE / "rules.yml"
RULES_TEST = EXAMPLE / "rules_test.yml"

# The two names of the queue-wait histogram: NeMo Gym's connection-pool API's (default) and
# the semantic conventions' (OTEL_SEMCONV_STABILITY_OPT_IN=http).
QUEUE_HISTOGRAMS = (
    "gym_http_connection_pool_queue_duration_ms_milliseconds",
    "http_client_request_time_in_queue_seconds",
)
# Alerts about pool sizing end in the command that checks the new sizing.
POOL_ALERTS = {
    "NemoGymPoolSaturated",
    "NemoGymPoolPerHostSaturated",
    "NemoGymQueueWaitHigh",
    "NemoGymQueueWaitsAbandoned",
}


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _alert_tests() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES_TEST.read_text())
    return [case for test in document["tests"] for case in test.get("alert_rule_test", [])]


def _expr_tests() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES_TEST.read_text())
    return [case for test in document["tests"] for case in test.get("promql_expr_test", [])]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    require_service(
        promtool is not None, "promtool is not on PATH (apt-get install prometheus ships it)"
    )
    assert promtool is not None
    return subprocess.run(
        [promtool, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=EXAMPLE,
    )


def test_rules_file_passes_promtool_check() -> None:
    """``promtool check rules`` accepts the file and counts every rule in it."""
    result = _promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_rules_unit_tests_pass_promtool() -> None:
    """``promtool test rules`` passes every unit test in ``rules_test.yml``."""
    result = _promtool("test", "rules", RULES_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rules_every_alert_is_tested_firing_and_not_firing() -> None:
    """Each alert has a unit test where it fires and one where it does not."""
    firing: set[str] = set()
    silent: set[str] = set()
    for case in _alert_tests():
        (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert len(alerts) == 7
    assert alerts - firing == set(), "never tested firing"
    assert alerts - silent == set(), "never tested silent"


def test_rules_every_recording_rule_value_is_pinned() -> None:
    """Each recorded series has an exact expected sample in some unit test."""
    pinned = {
        sample["labels"].split("{", 1)[0]
        for case in _expr_tests()
        for sample in case.get("exp_samples") or []
    }
    records = {rule["record"] for rule in _rules() if "record" in rule}
    assert records - pinned == set()


def test_rules_every_alert_says_what_to_change() -> None:
    """Alerts carry a summary and a description; pool alerts end in the capacity command."""
    for rule in _rules():
        if "alert" not in rule:
            continue
        annotations = rule["annotations"]
        assert annotations["summary"].strip(), rule["alert"]
        assert annotations["description"].strip(), rule["alert"]
        if rule["alert"] in POOL_ALERTS:
            action = annotations["action"]
            assert "nemo-gym-otel capacity" in action, rule["alert"]
            for flag in ("--limit ", "--limit-per-host ", "--workers "):
                assert flag in action, (rule["alert"], flag)


def test_rules_queue_rules_read_both_naming_modes() -> None:
    """Every rule that reads the queue-wait histogram reads it under both names."""
    readers = [
        rule
        for rule in _rules()
        if "record" in rule and any(name in rule["expr"] for name in QUEUE_HISTOGRAMS)
    ]
    assert len(readers) == 4
    for rule in readers:
        for name in QUEUE_HISTOGRAMS:
            assert name in rule["expr"], (rule["record"], name)
        # Milliseconds on one side become seconds like the other's.
        if "queue_wait_seconds" in rule["record"]:
            assert re.search(r"\)\)\s*/\s*1000\s+or", rule["expr"]), rule["record"]


# --- the dashboard on both sources ----------------------------------------------------------

# The rules_test.yml case with NeMo Gym's own queue-duration histogram beside ours, and what each
# queue panel of the dashboard shows for it at 10 minutes (the panels sum over jobs; "policy"
# has both sources, "judge" is http/dup beside NeMo Gym's, counted once). Values as promtool
# prints them: it compares exactly.
BOTH_SOURCES_JOB = "gym_beside"
DASHBOARD_BOTH_SOURCES = {
    "'Queue wait p50 and p95 per destination' A": {
        '{nemo_gym_http_destination_server_name="policy"}': 4.5,
        '{nemo_gym_http_destination_server_name="judge"}': 0.023874999999999997,
    },
    "'Queue wait p50 and p95 per destination' B": {
        '{nemo_gym_http_destination_server_name="policy"}': 0.25 + 0.25 * 5 / 6,
        '{nemo_gym_http_destination_server_name="judge"}': 0.01375,
    },
    "'Binding constraint: queued waits per second by limit' A": {
        '{nemo_gym_http_destination_server_name="policy",'
        'nemo_gym_http_connection_pool_queue_constraint="total"}': 0.16666666666666669,
        '{nemo_gym_http_destination_server_name="judge",'
        'nemo_gym_http_connection_pool_queue_constraint="per_host"}': 6 / 60,
    },
    "'Abandoned waits per second' A": {
        '{nemo_gym_http_destination_server_name="policy"}': 1 / 60,
        '{nemo_gym_http_destination_server_name="policy",error_type="TimeoutError"}': 1 / 60,
    },
    # 10 queued waits a minute to "policy" out of 40 pool acquisitions (20 per source).
    "'Share of pool acquisitions that had to queue' A": {
        '{nemo_gym_http_destination_server_name="policy"}': 0.25,
    },
}
CONNECTS = [
    {
        "series": f'gym_http_connection_pool_connect_total{{job="{BOTH_SOURCES_JOB}",'
        f'instance="w1",otel_scope_name="{scope}",'
        'nemo_gym_http_destination_server_name="policy"}',
        "values": "0+20x20 400x20",
    }
    for scope in ("nemo.lens", "opentelemetry.instrumentation.nemo_gym")
]


def test_dashboard_queue_panels_count_both_sources_for_one_destination(tmp_path: Path) -> None:
    """Each queue panel adds NeMo Gym's own queue waits and ours in the http names up."""
    document = yaml.safe_load(RULES_TEST.read_text())
    (case,) = [
        test
        for test in document["tests"]
        if any(BOTH_SOURCES_JOB in s["series"] for s in test["input_series"])
    ]
    panels = {
        e.source.removeprefix("nemo-gym.json panel "): e.promql
        for e in dashboard_expressions()
        if all(name in e.promql for name in QUEUE_HISTOGRAMS)
    }
    assert sorted(panels) == sorted(DASHBOARD_BOTH_SOURCES)
    tests = [
        {
            "expr": panels[panel],
            "eval_time": "10m",
            "exp_samples": [{"labels": labels, "value": value} for labels, value in want.items()],
        }
        for panel, want in DASHBOARD_BOTH_SOURCES.items()
    ]
    unit = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": case["input_series"] + CONNECTS,
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "dashboard_test.yml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# The rules_test.yml case of the sandbox rules, and what each sandbox panel of the dashboard
# shows for it at 10 minutes (the panels sum over jobs; see that case's comment).
SANDBOX_CASE_SERIES = "gym_sandbox_cpu_time_seconds_total"
DASHBOARD_SANDBOXES = {
    "'Sandboxes active' A": {
        '{nemo_gym_sandbox_provider="docker"}': 5,
        '{nemo_gym_sandbox_provider="process"}': 1,
    },
    "'Sandbox start time p50 and p95' A": {'{nemo_gym_sandbox_provider="docker"}': 291},
    "'Sandbox start time p50 and p95' B": {'{nemo_gym_sandbox_provider="docker"}': 210},
    "'Sandbox command time p50 and p95' A": {'{nemo_gym_sandbox_provider="docker"}': 0.475},
    "'Sandbox command time p50 and p95' B": {'{nemo_gym_sandbox_provider="docker"}': 0.25},
    "'Sandbox CPU by environment' A": {
        '{nemo_gym_server_name="swe_env",nemo_gym_sandbox_provider="docker"}': 3,
        '{nemo_gym_server_name="math_env",nemo_gym_sandbox_provider="process"}': 0.5,
    },
    "'Sandbox memory high-water mark by environment' A": {
        '{nemo_gym_server_name="swe_env",nemo_gym_sandbox_provider="docker"}': 512 * 1024 * 1024,
    },
}


def test_dashboard_sandbox_panels_show_the_sandbox_case(tmp_path: Path) -> None:
    """Each lifecycle and usage panel shows exactly what the sandbox rules' unit test implies:
    held sandboxes, start and command percentiles, CPU and memory per environment."""
    document = yaml.safe_load(RULES_TEST.read_text())
    (case,) = [
        test
        for test in document["tests"]
        if any(SANDBOX_CASE_SERIES in s["series"] for s in test["input_series"])
    ]
    panels = {
        e.source.removeprefix("nemo-gym.json panel "): e.promql
        for e in dashboard_expressions()
        if any(
            name in e.promql
            for name in (
                "gym_sandbox_active",
                "gym_sandbox_startup_duration",
                "gym_sandbox_exec_duration",
                "gym_sandbox_cpu_time",
                "gym_sandbox_memory_peak",
            )
        )
    }
    assert sorted(panels) == sorted(DASHBOARD_SANDBOXES)
    tests = [
        {
            "expr": panels[panel],
            "eval_time": "10m",
            "exp_samples": [{"labels": labels, "value": value} for labels, value in want.items()],
        }
        for panel, want in DASHBOARD_SANDBOXES.items()
    ]
    unit = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": case["input_series"], "promql_expr_test": tests}
        ],
    }
    path = tmp_path / "dashboard_sandboxes_test.yml"
    path.write_text(yaml.safe_dump(unit, sort_keys=False))
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
