"""``runtime_env()`` on a real two-node Ray cluster: a worker on the second node reports.

A head node and a second node (``ray.cluster_utils.Cluster``, the same node start-up as
``ray start``) run on loopback, started from a process with no ``OTEL_*`` variables and no
``opentelemetry-instrument``, so nothing reaches a worker except through the ``runtime_env``.
A task pinned to the second node sends known requests to a loopback aiohttp server, and the
OpenTelemetry Collector from ``scripts/start-collector.sh`` must show exactly that many
connects, from a process whose ``target_info`` names the second node. A sandbox created in a
task is traced: the worker exports its spans over OTLP/HTTP to a small receiver in this test,
which decodes them with opentelemetry-proto (the collector keeps no traces). A task without the
``runtime_env`` stays plain. A task, an actor method and an ``async`` one started inside a
span of this process, while the plugin is instrumented, export spans in that span's trace,
with it as their parent; uninstrumented, the same calls start traces of their own. Every Ray
process is ended (``Cluster.shutdown()``) and checked
gone by the test's own ``RAY_TMPDIR`` in its environment.

Heavy (a Ray cluster, about a minute on 2 cores): marked ``ray_cluster``, which the main suite
leaves out (``SECTIONS`` in ``conftest.py``); it runs once, in its own ``.ci/run`` section and
virtualenv (``scripts/ray-env.sh``), with ``-m ray_cluster``, where a missing Ray, collector or
Prometheus fails it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web

# `ray` itself is imported by the fixture, after it has set Ray's variables: Ray reads some at
# import (imported earlier, a driver looks for the cluster on the host's outward address).
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from prometheus_client.parser import text_string_to_metric_families

from collector_support import free_port, http_status, running_collector
from conftest import GatedServer, processes_with, serve_on_loopback
from opentelemetry.instrumentation.nemo_gym.ray import runtime_env
from waiting import eventually, eventually_blocking

pytestmark = [
    pytest.mark.integration,
    pytest.mark.ray_cluster,
    # Ray's own modules warn on import and at shutdown; they are not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

REQUESTS = 7
CONNECTS = "gym_http_connection_pool_connect_total"
DESTINATION = "nemo_gym_http_destination_server_name"
BOUND_S = 90.0


def any_value(value: AnyValue) -> Any:
    """A decoded OTLP attribute value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {pair.key: any_value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


class TraceReceiver:
    """An OTLP/HTTP trace endpoint on loopback keeping ``(resource, span name, attributes)``."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], str, dict[str, Any]]] = []
        # span name -> (trace id, span id, parent span id), in hex ("" for no parent).
        self.ids: dict[str, tuple[str, str, str]] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append((resource, span.name, attributes_of(span.attributes)))
                    self.ids[span.name] = (
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                    )
        return web.Response(content_type="application/x-protobuf", body=b"")

    async def start(self) -> None:
        self._runner, port = await serve_on_loopback("127.0.0.1", self._traces)
        self.url = f"http://127.0.0.1:{port}/v1/traces"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


_RAY_IMPORTED_HERE: list[bool] = []  # non-empty once the ray_cluster fixture imported ray


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, str, str]]:
    """The ``ray`` module connected to a head node and a second node on loopback, the second
    node's id and the cluster's address. Every Ray process is ended after, and checked gone."""
    for key in [key for key in os.environ if key.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # no opentelemetry-instrument sitecustomize
    # Short: Ray's unix socket paths under it must stay below 108 characters.
    tmpdir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", tmpdir)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no report to the internet
    # Imported here first (the same variables each time, but the folder, which Ray reads when a
    # node starts); imported by anything else before, it would have read the host's values.
    assert "ray" not in sys.modules or _RAY_IMPORTED_HERE, (
        "ray was imported before its variables were set"
    )
    _RAY_IMPORTED_HERE.append(True)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            # Ray's fixed defaults (8265, 52365) may be held by another cluster on this machine;
            # Ray still binds them for its minimal dashboard and the head's agent.
            "dashboard_port": free_port(),
            "dashboard_agent_listen_port": free_port(),
        },
    )
    try:
        second = cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield ray, second.node_id, cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()
        with contextlib.suppress(AssertionError):  # those left are killed, then reported
            eventually_blocking(
                lambda: not processes_with("RAY_TMPDIR", tmpdir),
                "Ray's processes ending",
                interval=0.5,
            )
        left = processes_with("RAY_TMPDIR", tmpdir)
        for pid in left:  # ours by the environment we gave them; the test fails below
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)
        assert left == [], f"Ray processes left after Cluster.shutdown(): {left}"


@pytest.fixture
async def servers() -> AsyncIterator[tuple[GatedServer, TraceReceiver]]:
    """The requests' destination (it answers at once: nothing is sent to ``/hold``) and the
    trace receiver."""
    target, receiver = GatedServer("127.0.0.1"), TraceReceiver()
    await target.start()
    await receiver.start()
    yield target, receiver
    await receiver.stop()
    await target.stop()


def connect_series(exposition: str, destination: str) -> list[tuple[dict[str, str], float]]:
    """The collector's ``connect_total`` samples for ``destination``: labels and value."""
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == CONNECTS and sample.labels.get(DESTINATION) == destination
    ]


def target_info(exposition: str, instance: str) -> dict[str, str]:
    """The ``target_info`` labels of the process whose ``service.instance.id`` is ``instance``."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "target_info" and sample.labels.get("instance") == instance:
                return dict(sample.labels)
    return {}


def scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
        return text


async def until(what: str, check: Any) -> Any:
    """``eventually(check)``, each call of ``check`` (a blocking scrape) in a thread."""
    return await eventually(lambda: asyncio.to_thread(check), what, BOUND_S, interval=0.5)


async def test_ray_runtime_env_second_node_reports_exact_connects_and_sandbox_spans(
    ray_cluster: tuple[Any, str, str], servers: tuple[GatedServer, TraceReceiver]
) -> None:
    """A task on the second node: exact connects in the collector, its node id, sandbox spans."""
    ray, second_node, address = ray_cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    target, receiver = servers
    collector = running_collector()
    assert http_status(collector.prometheus) == 200
    destination = f"ray-test-{uuid.uuid4().hex[:12]}"
    env = runtime_env(
        env_vars={
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": collector.otlp_endpoint + "/v1/metrics",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
            "OTEL_METRIC_EXPORT_INTERVAL": "500",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL": "0",
        }
    )
    on_second_node = NodeAffinitySchedulingStrategy(node_id=second_node, soft=False)

    # Defined here, not at module level, so Ray ships them by value (the tests folder is not
    # importable in a worker).
    def requests_from_worker(
        url: str, count: int, label: str, flush_at_end: bool = False
    ) -> dict[str, Any]:
        import asyncio
        import os

        import aiohttp
        import ray

        from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
            set_server_name,
        )

        async def send() -> str:
            set_server_name(label)
            async with aiohttp.ClientSession() as session:
                for _ in range(count):
                    async with session.get(url) as response:
                        await response.read()
                return type(session.connector).__name__

        from opentelemetry import metrics

        connector = asyncio.run(send())
        if flush_at_end:
            from opentelemetry.instrumentation.nemo_gym.ray import flush

            assert flush()
        node = ray.get_runtime_context().get_node_id()
        provider = type(metrics.get_meter_provider()).__name__
        return {"connector": connector, "node": node, "pid": os.getpid(), "provider": provider}

    def sandbox_in_worker() -> dict[str, Any]:
        import asyncio

        import ray

        from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxSpec
        from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import (
            ProcessSandboxProvider,
        )

        async def run() -> tuple[str, int]:
            provider = ProcessSandboxProvider(cgroups=False)
            try:
                handle = await provider.create(SandboxSpec(resources={"cpu": 0.5}))
                result = await provider.exec(handle, "echo hello", timeout_s=30)
                await provider.close(handle)
                return handle.sandbox_id, result.return_code
            finally:
                await provider.aclose()

        sandbox_id, return_code = asyncio.run(run())
        node = ray.get_runtime_context().get_node_id()
        return {"sandbox": sandbox_id, "return_code": return_code, "node": node}

    pinned = ray.remote(requests_from_worker).options(
        runtime_env=env, scheduling_strategy=on_second_node
    )
    sandboxed = ray.remote(sandbox_in_worker).options(
        runtime_env=env, scheduling_strategy=on_second_node
    )
    plain = ray.remote(requests_from_worker).options(scheduling_strategy=on_second_node)

    task = await asyncio.to_thread(
        ray.get, pinned.remote(target.url, REQUESTS, destination), timeout=BOUND_S
    )
    assert task["connector"] == "QueueTimedTCPConnector", task
    assert task["node"] == second_node
    assert target.requests == REQUESTS

    def arrived() -> tuple[dict[str, str], float] | None:
        series = connect_series(scrape(collector.prometheus), destination)
        return series[0] if len(series) == 1 and series[0][1] == REQUESTS else None

    labels, connects = await until(f"saw {REQUESTS} connects to {destination}", arrived)
    info = target_info(scrape(collector.prometheus), labels["instance"])
    print(f"\ncollector: {CONNECTS}{{{DESTINATION}={destination!r}}} = {connects:g}")
    print(f"  job={labels['job']!r} instance={labels['instance']!r}")
    print(
        f"  target_info: { {k: v for k, v in info.items() if k.startswith(('ray_', 'process_'))} }"
    )
    assert connects == REQUESTS
    assert labels["job"] == "ray.worker"
    assert info["ray_node_id"] == second_node
    assert info["ray_component"] == "worker"
    assert info["process_pid"] == str(task["pid"])

    sandbox = await asyncio.to_thread(ray.get, sandboxed.remote(), timeout=BOUND_S)
    assert sandbox["return_code"] == 0
    assert sandbox["node"] == second_node

    def sandbox_spans() -> list[tuple[dict[str, Any], str, dict[str, Any]]]:
        spans = [
            span
            for span in receiver.spans
            if span[2].get("nemo.gym.sandbox.id") == sandbox["sandbox"]
        ]
        names = sorted(name for _, name, _ in spans)
        return spans if {"sandbox.create", "sandbox.exec", "sandbox.close"} <= set(names) else []

    spans = await until(f"received the spans of sandbox {sandbox['sandbox']}", sandbox_spans)
    print(f"trace receiver: sandbox {sandbox['sandbox']}: {sorted(name for _, name, _ in spans)}")
    for resource, _, _ in spans:
        assert resource["ray.node.id"] == second_node
        assert resource["service.name"] == "ray.worker"

    control = await asyncio.to_thread(
        ray.get, plain.remote(target.url, 1, destination + "-plain"), timeout=BOUND_S
    )
    assert control["connector"] == "TCPConnector"  # no runtime_env: nothing reaches the worker

    # The same runtime_env for a whole job (ray.init): every task of it reports.
    await asyncio.to_thread(ray.shutdown)
    await asyncio.to_thread(ray.init, address=address, log_to_driver=False, runtime_env=env)
    job_destination = destination + "-job"
    job_task = ray.remote(requests_from_worker).options(scheduling_strategy=on_second_node)
    served_before = target.requests
    from_job = await asyncio.to_thread(
        ray.get, job_task.remote(target.url, REQUESTS, job_destination), timeout=BOUND_S
    )
    assert from_job["connector"] == "QueueTimedTCPConnector", from_job
    assert target.requests - served_before == REQUESTS

    def job_arrived() -> tuple[dict[str, str], float] | None:
        series = connect_series(scrape(collector.prometheus), job_destination)
        return series[0] if len(series) == 1 and series[0][1] == REQUESTS else None

    job_labels, _ = await until(f"saw {REQUESTS} connects to {job_destination}", job_arrived)
    assert target_info(scrape(collector.prometheus), job_labels["instance"])["ray_node_id"] == (
        second_node
    )
    print(f"job-level runtime_env: {REQUESTS} connects from node {second_node[:12]}...")

    # A worker whose periodic export never comes (600 s) reports through flush() at the end of
    # its task: Ray ends a job's workers without running their atexit handlers.
    flushed_destination = destination + "-flushed"
    slow_env = runtime_env(
        env_vars={**env["env_vars"], "OTEL_METRIC_EXPORT_INTERVAL": "600000"},
        inherit_environment=False,
    )
    flushing = ray.remote(requests_from_worker).options(
        runtime_env=slow_env, scheduling_strategy=on_second_node
    )
    await asyncio.to_thread(
        ray.get,
        flushing.remote(target.url, REQUESTS, flushed_destination, True),
        timeout=BOUND_S,
    )

    def flushed_arrived() -> tuple[dict[str, str], float] | None:
        found = connect_series(scrape(collector.prometheus), flushed_destination)
        return found[0] if len(found) == 1 and found[0][1] == REQUESTS else None

    await until(f"saw {REQUESTS} flushed connects to {flushed_destination}", flushed_arrived)
    print(f"flush() at the end of a task (600 s export interval): {REQUESTS} connects arrived")


async def test_ray_task_and_actor_method_join_the_callers_trace(
    ray_cluster: tuple[Any, str, str], servers: tuple[GatedServer, TraceReceiver]
) -> None:
    """Inside a driver span, a task and actor methods run in its trace; uninstrumented, not."""
    from opentelemetry.sdk.trace import TracerProvider

    from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor

    ray, _, _ = ray_cluster
    _, receiver = servers
    env = runtime_env(
        env_vars={
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
    )

    # Defined here so that Ray ships them by value. `**extra` would receive a stray keyword:
    # each returns the names it got, which must be none.
    def span_in_worker(name: str, **extra: Any) -> list[str]:
        from opentelemetry import trace

        from opentelemetry.instrumentation.nemo_gym.ray import flush

        with trace.get_tracer("ray-test").start_as_current_span(name):
            pass
        assert flush()
        return sorted(extra)

    class Spans:
        def record(self, name: str, **extra: Any) -> list[str]:
            return span_in_worker(name, **extra)

    class AsyncSpans:
        async def record(self, name: str, **extra: Any) -> list[str]:
            return span_in_worker(name, **extra)

    def strict(value: int) -> int:
        return value

    def raises(message: str) -> None:
        raise ValueError(message)

    class Undoes:
        def undo(self) -> tuple[bool, bool, bool]:
            """In its worker: the worker side in place, then its instrumentor's
            uninstrument() takes it off, leaving Ray's own method."""
            from ray._private.function_manager import FunctionActorManager

            from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
            from opentelemetry.instrumentation.nemo_gym.ray._propagation import (
                worker_side_in_place,
            )

            before = worker_side_in_place()
            NemoGymInstrumentor().uninstrument()
            method = vars(FunctionActorManager)["get_execution_info"]
            return before, worker_side_in_place(), not hasattr(method, "__wrapped__")

    # A worker where nemo_gym is switched off: setup_worker still takes the context off.
    disabled_env = runtime_env(
        env_vars={**env["env_vars"], "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "nemo_gym"},
        inherit_environment=False,
    )
    remote_before = ray.remote_function.RemoteFunction.__dict__["_remote"]

    # Instrumented first, as opentelemetry-instrument does: an actor is known to run
    # setup_worker when it is created while instrumented.
    instrumentor = NemoGymInstrumentor()
    instrumentor.instrument(connection_pool=False, sandbox_resources=False, pressure=False)
    try:
        assert ray.remote_function.RemoteFunction.__dict__["_remote"] is not remote_before
        task = ray.remote(span_in_worker).options(runtime_env=env)
        actor = ray.remote(Spans).options(runtime_env=env).remote()
        async_actor = ray.remote(AsyncSpans).options(runtime_env=env).remote()
        tracer = TracerProvider().get_tracer("driver")
        run = uuid.uuid4().hex[:8]

        async def calls(label: str) -> tuple[str, str]:
            """The three calls inside a driver span: its trace id and span id."""
            with tracer.start_as_current_span(f"driver-{label}") as driver:
                refs = [
                    task.remote(f"task-{label}-{run}"),
                    actor.record.remote(f"actor-{label}-{run}"),
                    async_actor.record.remote(f"async-actor-{label}-{run}"),
                    # No runtime_env: its worker has no setup_worker, so nothing is sent to it.
                    ray.remote(strict).remote(5),
                ]
            results = await asyncio.to_thread(ray.get, refs, timeout=BOUND_S)
            assert results == [[], [], [], 5]  # arguments and results as without the plugin
            context = driver.get_span_context()
            return f"{context.trace_id:032x}", f"{context.span_id:016x}"

        def spans_of(label: str) -> dict[str, tuple[str, str, str]]:
            names = [f"{kind}-{label}-{run}" for kind in ("task", "actor", "async-actor")]
            return {name: receiver.ids[name] for name in names if name in receiver.ids}

        trace_id, span_id = await calls("joined")
        with tracer.start_as_current_span("driver-disabled") as disabled_driver:
            disabled = ray.remote(span_in_worker).options(runtime_env=disabled_env)
            disabled_ref = disabled.remote(f"task-disabled-{run}")
        # Exactly its own arguments, though its caller sent the context along.
        assert await asyncio.to_thread(ray.get, disabled_ref, timeout=BOUND_S) == []
        undoes = ray.remote(Undoes).options(runtime_env=env).remote()
        undone = await asyncio.to_thread(ray.get, undoes.undo.remote(), timeout=BOUND_S)
        assert undone == (True, False, True)
        ray.kill(undoes)
        with tracer.start_as_current_span("driver-error"):
            failing = ray.remote(raises).options(runtime_env=env).remote("boom")
        with pytest.raises(ValueError, match="boom"):  # the task's own exception, unchanged
            await asyncio.to_thread(ray.get, failing, timeout=BOUND_S)
    finally:
        instrumentor.uninstrument()
    assert ray.remote_function.RemoteFunction.__dict__["_remote"] is remote_before
    await until("received the joined spans", lambda: len(spans_of("joined")) == 3)
    disabled_name = f"task-disabled-{run}"
    await until("received the disabled worker's span", lambda: disabled_name in receiver.ids)
    disabled_context = disabled_driver.get_span_context()
    assert receiver.ids[disabled_name][::2] == (
        f"{disabled_context.trace_id:032x}",
        f"{disabled_context.span_id:016x}",
    )
    joined = spans_of("joined")
    for name, (span_trace, _, parent) in joined.items():
        print(f"{name}: trace {span_trace} parent {parent} (driver {trace_id} {span_id})")
        assert (span_trace, parent) == (trace_id, span_id), name

    # Not instrumented, or instrumented with ray_propagation=False: the same calls start their
    # own traces, exactly as before, and Ray's _remote is its own.
    for label in ("plain", "switched-off"):
        switched_off = label == "switched-off"
        if switched_off:
            instrumentor.instrument(
                connection_pool=False,
                sandbox_resources=False,
                pressure=False,
                ray_propagation=False,
            )
        try:
            assert ray.remote_function.RemoteFunction.__dict__["_remote"] is remote_before
            plain_trace, _ = await calls(label)
        finally:
            if switched_off:
                instrumentor.uninstrument()
        await until(f"received the {label} spans", lambda: len(spans_of(label)) == 3)  # noqa: B023
        for name, (span_trace, _, parent) in spans_of(label).items():
            assert span_trace != plain_trace, name
            assert parent == "", name
