"""Shared fixtures: real loopback aiohttp servers and real OpenTelemetry SDK providers."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.test.globals_test import reset_metrics_globals, reset_trace_globals

from opentelemetry.instrumentation.nemo_gym import NemoGymInstrumentor
from opentelemetry.instrumentation.nemo_gym._shared import _settings
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.process import ProcessSandboxProvider
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    ATTR_QUEUE_CONSTRAINT,
    ATTR_QUEUE_OUTCOME,
    ATTR_SERVER_NAME,
    CONNECT_TOTAL,
    QUEUE_DURATION,
)
from opentelemetry.instrumentation.nemo_gym.telemetry._pool_telemetry import PoolTelemetry
from opentelemetry.instrumentation.nemo_gym.telemetry.connection_pool import (
    QueueTimedTCPConnector,
    reset_server_name,
    set_server_name,
)
from waiting import eventually

IN_CI = os.environ.get("CI", "").strip().lower() == "true"
INSTRUMENT = Path(sys.executable).parent / "opentelemetry-instrument"


# --- sections: heavy tests that run once, in their own .ci/run section --------------------------


def _importable(module: str, venv_script: str, *, load: bool = True) -> Callable[[], str | None]:
    """``module`` can be imported (``load=False``: is installed, for a module that must not be
    imported before its test has set the variables it reads at import)."""

    def missing() -> str | None:
        try:
            if load:
                importlib.import_module(module)
            elif importlib.util.find_spec(module) is None:
                raise ImportError(f"no module named {module!r}")
        except ImportError as error:
            return f"{module} is not importable here ({error}); build its virtualenv: {venv_script}"
        return None

    return missing


def _python312_where_the_deployment_page_looks() -> str | None:
    # The `python=` line of docs/nemo-gym-deployment.md: pyenv's 3.12, else Debian/Ubuntu's.
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    if [*pyenv.glob("versions/3.12.*/bin/python3.12"), *Path("/usr/bin").glob("python3.12")]:
        return None
    return f"no Python 3.12 in {pyenv}/versions/3.12.* or /usr/bin (pyenv install 3.12)"


def _kubernetes_cluster() -> str | None:
    # scripts/start-kubernetes.sh's cluster, and this process inside its network namespace:
    # the reader reads the kubelet at the node's address, 192.0.2.1, which is only there.
    run = (
        'eval "$(bash scripts/start-kubernetes.sh --env)" && nsenter '
        '--net="$NEMO_GYM_KUBERNETES_NETNS" .venv/bin/python -m pytest -m kubernetes '
        "tests/test_kubernetes_reader.py"
    )
    if importlib.util.find_spec("lightkube") is None:
        return f"lightkube is not installed (the test extra has it: bash scripts/test.sh); {run}"
    kubeconfig, netns = os.environ.get("KUBECONFIG"), os.environ.get("NEMO_GYM_KUBERNETES_NETNS")
    if not kubeconfig or not Path(kubeconfig).is_file() or not netns:
        return f"KUBECONFIG and NEMO_GYM_KUBERNETES_NETNS are not set to a started cluster; {run}"
    try:
        inside = os.stat("/proc/self/ns/net").st_ino == os.stat(netns).st_ino
    except OSError as error:
        return f"the cluster's network namespace {netns} is not there ({error}); {run}"
    if not inside:
        return f"this process is not inside the cluster's network namespace {netns}; {run}"
    return None


def _kubernetes_deployment_ready() -> str | None:
    # docs/nemo-gym-kubernetes.md: its `python=` line (pyenv's 3.13, else Debian/Ubuntu's) and
    # scripts/start-kubernetes.sh's cluster started; the test itself runs on the host, as the
    # page's shells do, and enters the cluster's network namespace where the page does.
    run = (
        'eval "$(bash scripts/start-kubernetes.sh --env)" && .venv/bin/python -m pytest -s '
        "-m kubernetes_deployment tests/test_nemo_gym_kubernetes.py"
    )
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    if not [*pyenv.glob("versions/3.13.*/bin/python3.13"), *Path("/usr/bin").glob("python3.13")]:
        return f"no Python 3.13 in {pyenv}/versions/3.13.* or /usr/bin (pyenv install 3.13)"
    kubeconfig, netns = os.environ.get("KUBECONFIG"), os.environ.get("NEMO_GYM_KUBERNETES_NETNS")
    if not kubeconfig or not Path(kubeconfig).is_file() or not netns or not Path(netns).exists():
        return f"KUBECONFIG and NEMO_GYM_KUBERNETES_NETNS are not set to a started cluster; {run}"
    return None


def _nothing_beyond_services() -> str | None:
    return None  # its services are checked where they are used, by require_service


@dataclass(frozen=True)
class Section:
    """Tests that the main suite leaves out (deselected) and ``-m <marker>`` runs.

    ``missing()`` names what the section needs and does not have, or ``None``; selected, a
    section's tests fail on it, and on any ``require_service`` that is not met, CI or not.
    """

    description: str
    missing: Callable[[], str | None]


# Marker -> what its tests need. Each is selected with `-m <marker>` in .ci/run, never skipped.
SECTIONS: dict[str, Section] = {
    "collector": Section(
        "needs the collector of scripts/start-collector.sh and Prometheus; run: "
        "bash scripts/start-collector.sh && .venv/bin/python -m pytest -m collector tests/",
        _nothing_beyond_services,
    ),
    "ray_cluster": Section(
        "needs Ray (.venv-ray, from scripts/ray-env.sh) and the collector; run: "
        ".venv-ray/bin/python -m pytest -m ray_cluster tests/test_ray_cluster.py "
        "tests/test_ray_walkthrough.py",
        # Not imported here: Ray reads its variables at import, which the test sets first.
        _importable("ray", "bash scripts/ray-env.sh", load=False),
    ),
    "deployment": Section(
        "runs docs/nemo-gym-deployment.md's commands (a Python 3.12 where that page looks, "
        "Go for the collector and Jaeger, PyPI or a warm pip cache); run: "
        ".venv/bin/python -m pytest -s -m deployment tests/test_nemo_gym_deployment.py",
        _python312_where_the_deployment_page_looks,
    ),
    "nemo_gym_server": Section(
        "needs NeMo Gym's server_utils (.venv-nemo-gym-server, from "
        "scripts/nemo-gym-server-env.sh); run: .venv-nemo-gym-server/bin/python -m pytest "
        "-m nemo_gym_server tests/test_nemo_gym_server_client.py tests/test_server_venvs_config.py "
        "tests/test_nemo_gym_rollout_span.py",
        _importable("nemo_gym.server_utils", "bash scripts/nemo-gym-server-env.sh"),
    ),
    "nemo_gym_main": Section(
        "needs NeMo Gym's repository main (.venv-nemo-gym-main, from "
        "scripts/nemo-gym-main-env.sh); run: .venv-nemo-gym-main/bin/python -m pytest "
        '-m "nemo_gym or nemo_gym_main or nemo_gym_server" tests/',
        # A module main has and 0.4.0 lacks (0.4.0's built-in providers: apptainer, opensandbox).
        _importable("nemo_gym.sandbox.providers.docker", "bash scripts/nemo-gym-main-env.sh"),
    ),
    "opensandbox": Section(
        "needs NeMo Gym main with the opensandbox SDK (.venv-nemo-gym-main, from "
        "scripts/nemo-gym-main-env.sh), Podman (scripts/start-podman.sh) and Go for the "
        "server's execd (scripts/start-opensandbox.sh, which the tests run); run: "
        ".venv-nemo-gym-main/bin/python -m pytest -s -m opensandbox tests/test_opensandbox.py",
        _importable("opensandbox", "bash scripts/nemo-gym-main-env.sh"),
    ),
    "kubernetes": Section(
        "needs the single-node cluster of scripts/start-kubernetes.sh and runs inside its "
        'network namespace; run: eval "$(bash scripts/start-kubernetes.sh --env)" && '
        'nsenter --net="$NEMO_GYM_KUBERNETES_NETNS" .venv/bin/python -m pytest -m kubernetes '
        "tests/test_kubernetes_reader.py",
        _kubernetes_cluster,
    ),
    "opensandbox_kubernetes": Section(
        "needs NeMo Gym main (.venv-nemo-gym-main, from scripts/nemo-gym-main-env.sh) inside "
        "the network namespace of scripts/start-kubernetes.sh's cluster, and Go for "
        "OpenSandbox's controller and execd (scripts/start-opensandbox.sh --kubernetes, which "
        'the test runs); run: eval "$(bash scripts/start-kubernetes.sh --env)" && '
        'nsenter --net="$NEMO_GYM_KUBERNETES_NETNS" .venv-nemo-gym-main/bin/python -m pytest '
        "-s -m opensandbox_kubernetes tests/test_opensandbox_kubernetes.py",
        lambda: (
            _importable("opensandbox", "bash scripts/nemo-gym-main-env.sh")()
            or _kubernetes_cluster()
        ),
    ),
    "kubernetes_deployment": Section(
        "runs docs/nemo-gym-kubernetes.md's commands on the cluster of "
        "scripts/start-kubernetes.sh (a Python 3.13 where that page looks, Go for the "
        "collector and OpenSandbox, PyPI or a warm pip cache; NEMO_GYM_MAIN names NeMo Gym "
        'main where its git URL is out of reach); run: eval "$(bash scripts/start-kubernetes.sh '
        '--env)" && .venv/bin/python -m pytest -s -m kubernetes_deployment '
        "tests/test_nemo_gym_kubernetes.py",
        _kubernetes_deployment_ready,
    ),
}

# The section of the test being run, or None: its missing services fail rather than skip.
_running_section: str | None = None
_LEFT_OUT = pytest.StashKey[dict[str, int]]()
_MISSING: dict[str, str | None] = {}


def section_of(item: pytest.Item) -> str | None:
    """The section marker of ``item``, or ``None`` for a test of the main suite."""
    return next((m.name for m in item.iter_markers() if m.name in SECTIONS), None)


def pytest_configure(config: pytest.Config) -> None:
    for marker, section in SECTIONS.items():
        config.addinivalue_line("markers", f"{marker}: {section.description}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect every section that ``-m`` does not name: the main suite runs none of them."""
    expression = config.getoption("markexpr") or ""
    named = {marker for marker in SECTIONS if re.search(rf"\b{marker}\b", expression)}
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    counts: dict[str, int] = {}
    for item in items:
        section = section_of(item)
        if section is None or section in named:
            kept.append(item)
        else:
            left_out.append(item)
            counts[section] = counts.get(section, 0) + 1
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
    config.stash[_LEFT_OUT] = counts


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A selected section's test fails, before any fixture, when the section lacks something."""
    global _running_section
    _running_section = section_of(item)
    if _running_section is not None:
        if _running_section not in _MISSING:  # asked once per section and run
            _MISSING[_running_section] = SECTIONS[_running_section].missing()
        missing = _MISSING[_running_section]
        if missing is not None:
            pytest.fail(f"section {_running_section!r} selected (-m), but {missing}")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    counts = config.stash.get(_LEFT_OUT, {})
    if counts:
        listed = ", ".join(f"{marker} ({count})" for marker, count in sorted(counts.items()))
        terminalreporter.write_line(
            f"sections left out (each runs in .ci/run with -m <marker>): {listed}"
        )


def require_service(available: bool, reason: str) -> None:
    """Skip a test whose external service is missing; fail instead under ``CI=true`` or in a
    section selected with ``-m`` (see ``SECTIONS``)."""
    if available:
        return
    if _running_section is not None:
        pytest.fail(f"required service missing in section {_running_section!r}: {reason}")
    if IN_CI:
        pytest.fail(f"required service missing under CI=true: {reason}")
    pytest.skip(reason)


def run_under_instrument(script: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``opentelemetry-instrument``, none of this shell's ``OTEL_*`` or
    ``NEMO_GYM*`` variables, console metrics read at exit, no traces or logs, then ``settings``."""
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "NEMO_GYM"))
    }
    env.update(
        OTEL_METRICS_EXPORTER="console",
        OTEL_TRACES_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        # A long interval: the one export we read happens at shutdown.
        OTEL_METRIC_EXPORT_INTERVAL="60000",
    )
    env.update(settings)
    return subprocess.run(
        [str(INSTRUMENT), sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def serve_on_loopback(
    host: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> tuple[web.AppRunner, int]:
    """Serve ``handler`` for every method and path on ``host`` at a free port; the runner and
    port."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    server = site._server
    assert server is not None
    sockets = getattr(server, "sockets", None)
    assert sockets
    port: int = sockets[0].getsockname()[1]
    return runner, port


@pytest.fixture
async def process() -> AsyncIterator[ProcessSandboxProvider]:
    """A process sandbox provider without cgroups (isolated by bubblewrap, the default),
    closed after the test."""
    require_service(shutil.which("bwrap") is not None, "bwrap not on PATH (bubblewrap)")
    made = ProcessSandboxProvider(cgroups=False)
    yield made
    await made.aclose()


@pytest.fixture
def sandbox_base_dir() -> Iterator[Path]:
    """A ``base_dir`` for process sandboxes that any uid may pass, removed after the test: a
    root server's sandboxes run as ``sandbox_uid``, which cannot reach pytest's ``tmp_path``
    (under a directory only root may enter)."""
    made = Path(tempfile.mkdtemp(prefix="nemo-gym-base-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made)


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def meter_provider(metric_reader: InMemoryMetricReader) -> Iterator[MeterProvider]:
    provider = MeterProvider(metric_readers=[metric_reader])
    yield provider
    provider.shutdown()


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(span_exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    yield provider
    provider.shutdown()


@pytest.fixture
def global_meter_provider(meter_provider: MeterProvider) -> Iterator[MeterProvider]:
    """Install ``meter_provider`` as the global one for the test, then restore the proxy."""
    reset_metrics_globals()
    metrics.set_meter_provider(meter_provider)
    yield meter_provider
    reset_metrics_globals()


@pytest.fixture
def global_tracer_provider(tracer_provider: TracerProvider) -> Iterator[TracerProvider]:
    """Install ``tracer_provider`` as the global one for the test, then restore the proxy."""
    reset_trace_globals()
    trace.set_tracer_provider(tracer_provider)
    yield tracer_provider
    reset_trace_globals()


@pytest.fixture
def clean_metrics_globals() -> Iterator[None]:
    """Start and end with the API's proxy meter provider as the global one."""
    reset_metrics_globals()
    yield
    reset_metrics_globals()


@pytest.fixture
def instrumentor() -> Iterator[NemoGymInstrumentor]:
    """The singleton instrumentor, uninstrumented before and after the test."""
    instance = NemoGymInstrumentor()
    instance.uninstrument()
    yield instance
    instance.uninstrument()


@pytest.fixture
def fresh_settings_warnings() -> Iterator[None]:
    """No settings warning remembered, as in a fresh process."""
    _settings._ONCE.reset()
    yield
    _settings._ONCE.reset()


# --- held requests: deterministic pool saturation ---------------------------------------------


class GatedServer:
    """A real loopback aiohttp server whose ``/hold`` requests wait until the test opens a gate.

    ``/`` answers ``ok`` at once; ``/hold`` answers ``ok`` once ``open()`` has been called;
    ``/redirect?to=URL`` answers 302 to ``URL``. ``held`` is the number of requests waiting at
    the gate right now, ``requests`` the number received. Connections are kept alive.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.held = 0
        self.requests = 0
        self._gate = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if request.path == "/redirect":
            raise web.HTTPFound(request.query["to"])
        if request.path == "/hold":
            self.held += 1
            try:
                await self._gate.wait()
            finally:
                self.held -= 1
        return web.Response(text="ok")

    def open(self) -> None:
        """Let every held request, and every later one, answer."""
        self._gate.set()

    async def until_held(self, count: int) -> None:
        """Wait until exactly ``count`` requests are held at the gate."""
        await eventually(lambda: self.held == count, f"{count} requests held on {self.url}")

    async def start(self) -> None:
        self._runner, self.port = await serve_on_loopback(self.host, self._answer)

    async def stop(self) -> None:
        self.open()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


GatedServerFactory = Callable[..., Awaitable[GatedServer]]


@pytest.fixture
async def gated_server() -> AsyncIterator[GatedServerFactory]:
    """Start gated loopback servers: ``server = await gated_server("127.0.0.2")``."""
    servers: list[GatedServer] = []

    async def start(host: str = "127.0.0.1") -> GatedServer:
        server = GatedServer(host)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def server(gated_server: GatedServerFactory) -> GatedServer:
    """One gated loopback server on 127.0.0.1, the pool tests' usual destination."""
    return await gated_server("127.0.0.1")


@pytest.fixture
async def two_hosts(gated_server: GatedServerFactory) -> tuple[GatedServer, GatedServer]:
    """Two gated loopback servers, on 127.0.0.1 and 127.0.0.2: two destinations."""
    return await gated_server("127.0.0.1"), await gated_server("127.0.0.2")


def queued(connector: object) -> int:
    """Requests waiting for a slot in ``connector`` (aiohttp's ``_waiters``), read directly."""
    waiters = getattr(connector, "_waiters", {})
    return sum(len(per_key) for per_key in waiters.values())


def metric_points(data: Any, name: str) -> list[Any]:
    """Every data point of metric ``name`` in one collection (``reader.get_metrics_data()``)."""
    return [
        point
        for resource_metrics in (data.resource_metrics if data is not None else ())
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def metric_names(data: Any) -> set[str]:
    """The names of every metric with at least one data point in one collection."""
    return {
        metric.name
        for resource_metrics in (data.resource_metrics if data is not None else ())
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if metric.data.data_points
    }


@pytest.fixture
def pool_telemetry(meter_provider: MeterProvider) -> PoolTelemetry:
    """The ``PoolTelemetry`` of the test's own SDK meter provider (cap of 100 labels)."""
    return PoolTelemetry.of(meter_provider, version="test", max_server_names=100)


def timed_connector(telemetry: PoolTelemetry, **kwargs: Any) -> QueueTimedTCPConnector:
    """A ``QueueTimedTCPConnector`` built with ``kwargs`` that records into ``telemetry``."""
    connector = QueueTimedTCPConnector(**kwargs)
    connector._nemo_gym_attach(telemetry)
    return connector


# --- pool metrics and requests, shared by the pool tests ---------------------------------------


def queue_waits(reader: InMemoryMetricReader) -> dict[tuple[str, str, str], int]:
    """Queue-wait sample counts per (constraint, outcome, destination label)."""
    return {
        (
            str(point.attributes[ATTR_QUEUE_CONSTRAINT]),
            str(point.attributes[ATTR_QUEUE_OUTCOME]),
            str(point.attributes[ATTR_SERVER_NAME]),
        ): point.count
        for point in metric_points(reader.get_metrics_data(), QUEUE_DURATION)
        if point.count
    }


def connect_counts(reader: InMemoryMetricReader) -> dict[str, int]:
    """connect_total per destination label."""
    return {
        str(point.attributes[ATTR_SERVER_NAME]): point.value
        for point in metric_points(reader.get_metrics_data(), CONNECT_TOTAL)
    }


async def fetch(
    session: aiohttp.ClientSession,
    url: str,
    *,
    label: str | None = None,
    timeout: aiohttp.ClientTimeout | None = None,  # noqa: ASYNC109 - aiohttp's own timeout
) -> str:
    """GET ``url`` (under destination label ``label`` when given) and return the body."""
    token = set_server_name(label) if label is not None else None
    try:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        async with session.get(url, **kwargs) as response:
            return await response.text()
    finally:
        if token is not None:
            reset_server_name(token)


async def outcome(awaitable: Any) -> BaseException | str:
    """What awaiting ``awaitable`` gave: its result or the exception it raised."""
    try:
        return str(await awaitable)
    except BaseException as error:  # the test compares exactly what was raised
        return error


async def timeout_while_queued(
    connector: aiohttp.TCPConnector, server: GatedServer
) -> tuple[BaseException | str, aiohttp.ClientSession, asyncio.Task[str]]:
    """Hold the connector's only slot, then let a second request's connect timeout expire.

    Returns what the queued request raised, the session and the still-held request.
    """
    session = aiohttp.ClientSession(connector=connector)
    held_before = server.held
    holder = asyncio.create_task(fetch(session, f"{server.url}/hold"))
    await server.until_held(held_before + 1)
    caught = await outcome(
        fetch(session, f"{server.url}/", timeout=aiohttp.ClientTimeout(connect=0.05))
    )
    return caught, session, holder


async def cancel_while_queued(
    connector: aiohttp.TCPConnector, server: GatedServer
) -> tuple[BaseException | str, aiohttp.ClientSession, asyncio.Task[str]]:
    """Hold the connector's only slot, queue a second request and cancel it while it waits."""
    session = aiohttp.ClientSession(connector=connector)
    held_before = server.held
    holder = asyncio.create_task(fetch(session, f"{server.url}/hold"))
    await server.until_held(held_before + 1)
    waiting = asyncio.create_task(fetch(session, f"{server.url}/"))
    await eventually(lambda: queued(connector) == 1, "the second request queued")
    waiting.cancel()
    return await outcome(waiting), session, holder


async def through_pool(
    connector: aiohttp.TCPConnector, server: GatedServer, requests: int, slots: int
) -> None:
    """``requests`` at once through a pool of ``slots``: that many held at the server, the
    rest queued, then all answered."""
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(fetch(session, f"{server.url}/hold")) for _ in range(requests)]
        await server.until_held(slots)
        await eventually(lambda: queued(connector) == requests - slots, "the rest queued")
        server.open()
        assert await asyncio.gather(*tasks) == ["ok"] * requests


def same_failure(plain: BaseException | str, timed: BaseException | str) -> None:
    """Both raised, the same exception type with the same message."""
    assert isinstance(plain, BaseException), plain
    assert isinstance(timed, BaseException), timed
    assert type(timed) is type(plain)
    assert str(timed) == str(plain)


def processes_with(variable: str, value: str) -> list[int]:
    """PIDs whose environment has ``variable=value``: how the Ray tests find the processes
    they started (by a variable only they set), to end those alone, by PID."""
    wanted = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environment:
            found.append(int(entry.name))
    return found
