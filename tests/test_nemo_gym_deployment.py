"""A real NeMo Gym deployment (nemo-gym 0.4.0, ``gym env start`` and ``gym eval run``) run by
the commands of docs/nemo-gym-deployment.md, as written: every server reports, says which
server it is, and loses nothing at shutdown.

Heavy (a Python 3.12 virtualenv with NeMo Gym's whole stack installed by the page's pip line,
a Ray cluster, a collector, three servers, 300 rollouts), so it runs in its own ``.ci/run``
section:

    .venv/bin/python -m pytest -s -m deployment tests/test_nemo_gym_deployment.py

Marked ``deployment``, which the main suite leaves out (``SECTIONS`` in ``conftest.py``);
selected, a missing Python 3.12 or any other missing piece fails it.
``NEMO_GYM_DEPLOYMENT_KEEP=1`` keeps the run's folder (logs) under /tmp.
``NEMO_GYM_DEPLOYMENT_KILL_AFTER=1`` also SIGKILLs each server process 1 s after the SIGINT,
as NeMo Gym means to (0.4.0's kill lands on the server's shell instead): the counts must
still all arrive.
"""

from __future__ import annotations

import urllib.parse
from collections import defaultdict
from typing import Any

import pytest

from nemo_gym_deployment import (
    AGENT,
    EARLIER_CONNECTS,
    EARLIER_ROLLOUTS,
    EARLIER_RUN,
    MODEL,
    REPEATS,
    RESOURCES,
    ROLLOUTS,
    SERVER_WORKERS,
    SERVERS,
    TASKS,
    Deployment,
    by_service,
    connection_rows,
    connects_to,
    report_output_on_page,
    report_shape,
    run_deployment,
    table,
)

pytestmark = [pytest.mark.integration, pytest.mark.deployment]


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    run = run_deployment()
    print("\n" + table(run))
    for server, lines in run.capacity_lines.items():
        for line in lines:
            print(f"{server}: {line}")
    print(f"servers' exit after SIGINT, seconds: {run.server_exit_seconds}")
    print(f"head port taken: {run.port_taken}")
    print(f"nemo-gym-otel report:\n{run.report}")
    return run


def test_deployment_rollouts_complete(deployment: Deployment) -> None:
    """Every rollout finished, each with two model calls the stub served."""
    assert deployment.rollouts == ROLLOUTS
    assert deployment.served == 2 * ROLLOUTS


def test_deployment_every_server_instrumented(deployment: Deployment) -> None:
    """No server hit the half-loaded state: no sitecustomize error, pool telemetry on."""
    for server in SERVERS:
        log = deployment.server_logs[server]
        assert "Error in sitecustomize" not in log, server
        assert "ModuleNotFoundError" not in log, server
        assert "connection_pool=on" in log, (server, log[-2000:])


def service(server: str) -> str:
    """The ``service.name`` (Prometheus ``job``) NeMo Gym's telemetry and ours give a server."""
    return f"nemo-gym/{server}"


def test_deployment_resource_names_each_server(deployment: Deployment) -> None:
    """Each server's processes export as that server (service.name, nemo.gym.server.name), all
    in the run gym env start began (nemo.run.id)."""
    services = by_service(deployment)
    runs: set[str | None] = set()
    # Killed 1 s after SIGINT too: the resources server makes no requests, and its event-loop
    # lag leaves first thing at exit all the same.
    for server in SERVERS:
        processes = services.get(service(server), [])
        assert processes, (server, table(deployment))
        for process in processes:
            assert process.resource.get("nemo_gym_server_name") == server
            runs.add(process.resource.get("nemo_run_id"))
    (run,) = runs
    assert run, table(deployment)
    # One process each (uvicorn runs the app in the server process), each its own instance.
    instances = [p.instance for server in SERVERS for p in services.get(service(server), [])]
    assert len(set(instances)) == len(instances), table(deployment)


def test_deployment_pool_metrics_present_per_server(deployment: Deployment) -> None:
    """Every server that made requests exported its pool's connects and created connections."""
    services = by_service(deployment)
    for server in (AGENT, MODEL):
        series = set().union(*(p.pool_series for p in services[service(server)]))
        assert "gym_http_connection_pool_connect_total" in series, (server, series)
        assert "gym_http_connection_pool_connections_created_total" in series, (server, series)


def test_deployment_connects_equal_requests_served(deployment: Deployment) -> None:
    """Nothing lost at shutdown: the final exports count exactly what the stub served."""
    services = by_service(deployment)
    model = services[service(MODEL)]
    assert connects_to(model, "external") == deployment.served, table(deployment)
    agent = services[service(AGENT)]
    assert connects_to(agent, MODEL) == deployment.served, table(deployment)
    # Per rollout the agent calls the resources server three times (seed_session, the
    # get_weather tool, verify), and once at the end it forwards the CLI's one
    # /aggregate_metrics call there; the CLI makes one /run per rollout plus that call.
    assert connects_to(agent, RESOURCES) == 3 * ROLLOUTS + 1, table(deployment)
    # Its /run posts to its own /v1/responses once per rollout.
    assert connects_to(agent, AGENT) == ROLLOUTS, table(deployment)
    cli = [p for p in services["nemo-gym/orchestrator"] if p.connects]
    assert connects_to(cli, AGENT) == ROLLOUTS + 1, table(deployment)


def test_deployment_capacity_line_workers(deployment: Deployment) -> None:
    """Each server's capacity report names its real worker count (read when it is known)."""
    lines = deployment.capacity_lines
    for server in (AGENT, MODEL):
        assert lines[server], deployment.server_logs[server][-2000:]
        assert all(f"workers={SERVER_WORKERS} " in line for line in lines[server]), lines[server]
    # The CLI process has no NeMo Gym worker count: one process.
    assert lines["gym eval run"], "no capacity line from gym eval run"
    assert all("workers=1 " in line for line in lines["gym eval run"]), lines["gym eval run"]


def test_deployment_head_port_taken_ctrl_c_ends_everything(deployment: Deployment) -> None:
    """With its head port taken, gym env start waits; after Ctrl-C every process ends by itself."""
    taken = deployment.port_taken
    assert "status `timeout`" in taken.waiting_line, taken.waiting_line
    # NeMo Gym's servers may wait up to Ray's 60 s for the cluster gym env start has stopped
    # (with or without this plugin); nothing of ours may hold one open past the bound.
    assert taken.seconds_to_end is not None, taken.leftovers
    assert taken.leftovers == []
    assert taken.gym_exit not in (None, 0), taken.gym_exit


def test_deployment_every_process_ended(deployment: Deployment) -> None:
    """gym env start ended every server and Ray daemon itself; nothing was left to kill."""
    assert deployment.gym_exit is not None
    assert deployment.leftovers == [], deployment.leftovers


# --- one trace per rollout, in Jaeger ------------------------------------------------------------

LAG_COUNT = "gym_event_loop_lag_ms_milliseconds_count"
# The four process metrics as the collector's Prometheus exporter names them (unit suffixes).
PROCESS_SERIES = (
    "process_cpu_time_seconds_total",
    "process_memory_usage_bytes",
    "process_open_file_descriptor_count",
    "process_thread_count",
)


def _tag(span: dict[str, Any], key: str) -> Any:
    return next((tag["value"] for tag in span["tags"] if tag["key"] == key), None)


def _hop(trace: dict[str, Any], span: dict[str, Any]) -> tuple[str, str, str]:
    """A span as (service, kind, path): the route a server handled, the path a client called."""
    service = trace["processes"][span["processID"]]["serviceName"]
    kind = _tag(span, "span.kind") or "internal"
    if kind == "server":
        return service, kind, str(_tag(span, "http.route"))
    if kind == "client":
        url = _tag(span, "http.url") or _tag(span, "url.full") or ""
        return service, kind, urllib.parse.urlsplit(str(url)).path
    return service, kind, span["operationName"]


def span_tree(trace: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The trace's roots as (service, kind, path, children...) trees, children sorted; the
    ASGI middleware's own ``http send``/``http receive`` spans (a count per response body
    chunk) left out."""
    spans = {
        span["spanID"]: span
        for span in trace["spans"]
        if not span["operationName"].endswith((" http send", " http receive"))
    }
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in spans.values():
        parents = [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]
        children[parents[0] if parents and parents[0] in spans else None].append(span)

    def tree(span: dict[str, Any]) -> tuple[Any, ...]:
        below = sorted((tree(child) for child in children[span["spanID"]]), key=repr)
        return (*_hop(trace, span), *below)

    return sorted((tree(root) for root in children[None]), key=repr)


def expected_rollout(cli: str) -> tuple[Any, ...]:
    """One rollout of example_single_tool_call with simple_agent, hop by hop: the CLI's
    rollout span and POST /run; the agent's /run, which seeds the session, runs its own
    /v1/responses (two model calls, each answered by the model server, which calls the model
    endpoint, and the get_weather tool between them) and verifies."""

    def called(caller: str, path: str, server: str, *below: tuple[Any, ...]) -> tuple[Any, ...]:
        return (caller, "client", path, (server, "server", path, *below))

    agent, model, resources = service(AGENT), service(MODEL), service(RESOURCES)
    model_call = called(agent, "/v1/responses", model, (model, "client", "/v1/responses"))
    responses = sorted([model_call, model_call, called(agent, "/get_weather", resources)], key=repr)
    run = sorted(
        [
            called(agent, "/seed_session", resources),
            called(agent, "/v1/responses", agent, *responses),
            called(agent, "/verify", resources),
        ],
        key=repr,
    )
    return (cli, "internal", "rollout", called(cli, "/run", agent, *run))


def test_deployment_one_trace_per_rollout(deployment: Deployment) -> None:
    """300 rollouts are exactly 300 traces in Jaeger, each named by its task and repeat (every
    pair once) and each complete: one root, the rollout span, with every hop below it."""
    traces = deployment.traces
    assert len(traces) == ROLLOUTS, (len(traces), deployment.jaeger_services)
    named = set()
    for trace in traces:
        (root,) = [s for s in trace["spans"] if not s["references"]]
        assert root["operationName"] == "rollout"
        assert _tag(root, "nemo.gym.rollout.agent") == AGENT
        named.add(
            (
                _tag(root, "nemo.gym.rollout.task_index"),
                _tag(root, "nemo.gym.rollout.rollout_index"),
            )
        )
        cli = trace["processes"][root["processID"]]["serviceName"]
        assert cli == "nemo-gym/orchestrator", cli
        assert span_tree(trace) == [expected_rollout(cli)], trace["traceID"]
    assert named == {(task, repeat) for task in range(TASKS) for repeat in range(REPEATS)}


def test_deployment_every_server_lag_and_process_metrics(deployment: Deployment) -> None:
    """Each server's event-loop lag histogram and its four process metrics reach the collector."""
    services = by_service(deployment)
    for server in SERVERS:
        series = set().union(*(p.series for p in services.get(service(server), [])))
        assert LAG_COUNT in series, (server, sorted(series)[:40])
        missing = [name for name in PROCESS_SERIES if name not in series]
        assert not missing, (server, missing)


def test_deployment_tracing_page_lists_the_slowest_rollouts(deployment: Deployment) -> None:
    """docs/tracing.md's command, run against this run's Jaeger, prints the ten slowest
    rollouts, slowest first, each with its task, repeat and the id of its trace."""
    roots = {}
    for trace in deployment.traces:
        (root,) = [s for s in trace["spans"] if not s["references"]]
        task = _tag(root, "nemo.gym.rollout.task_index")
        repeat = _tag(root, "nemo.gym.rollout.rollout_index")
        roots[trace["traceID"]] = (root["duration"] / 1e6, task, repeat)
    expected = [
        f"{seconds:6.2f} s  task {task} repeat {repeat}  {trace_id}"
        for seconds, task, repeat, trace_id in sorted(
            ((*row, trace_id) for trace_id, row in roots.items()), reverse=True
        )[:10]
    ]
    assert deployment.slowest_rollouts == expected


# --- the page's `nemo-gym-otel report` ------------------------------------------------------------


def test_deployment_report_matches_the_page(deployment: Deployment) -> None:
    """The page's `nemo-gym-otel report`, run after Ctrl-C, prints this run's table as the page
    shows it: the same rows, the same connects per server and destination, numbers aside."""
    report, page = deployment.report, report_output_on_page()
    assert report.startswith(f"run {deployment.run_id}: "), report
    assert connection_rows(report) == connection_rows(page), report
    assert report_shape(report) == report_shape(page), report


def test_deployment_report_leaves_out_the_earlier_run(deployment: Deployment) -> None:
    """The report names the earlier run the collector also holds and counts none of its
    connects: its rows are this run's, the model endpoint's requests exactly."""
    assert f"(the collector also holds runs {EARLIER_RUN}: --run-id picks one)" in deployment.report
    rows = {
        (server, destination): n for server, destination, n in connection_rows(deployment.report)
    }
    assert rows[(service(MODEL), "external")] == deployment.served
    # The CLI's 301 of this run, not 301 + the earlier run's EARLIER_CONNECTS.
    orchestrators = [n for (server, dest), n in rows.items() if server.startswith("nemo-gym/orch")]
    assert orchestrators == [ROLLOUTS + 1], (orchestrators, EARLIER_CONNECTS, deployment.report)


def test_deployment_jaeger_holds_the_earlier_run_apart(deployment: Deployment) -> None:
    """Jaeger holds the earlier run's rollouts beside this run's, told apart by nemo.run.id:
    the tracing page's command had them to leave out."""
    assert deployment.earlier_traces == EARLIER_ROLLOUTS
    assert len(deployment.traces) == ROLLOUTS
