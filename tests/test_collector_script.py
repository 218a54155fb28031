"""``scripts/start-collector.sh``: idempotent start, what it prints, and ``--stop`` of its own only.

Runs the script with state folders of its own, so it starts collectors beside the shared one
(the build is cached, so this costs a start, not a build) and stops only those. They ask for
free ports (``NEMO_GYM_COLLECTOR_PORTS=0,0,0``) or for ports the test picked, never the standard
ones, which another run on the machine may hold or want.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from collector_support import (
    DEFAULT_STATE_DIR,
    ROOT,
    START_COLLECTOR,
    default_state_dir,
    http_status,
    read_ports,
)
from waiting import eventually_blocking

pytestmark = [pytest.mark.integration, pytest.mark.collector]

NOBODY = 65534
AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")


def _run(
    state: Path | str, *args: str, cwd: Path | None = None, **settings: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NEMO_GYM_COLLECTOR_DIR=str(state), NEMO_GYM_COLLECTOR_PORTS="0,0,0")
    env.update(settings)
    return subprocess.run(
        ["bash", str(START_COLLECTOR), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,  # a first build on a fresh machine takes minutes
        check=False,
    )


def _script(state: Path | str, *args: str, cwd: Path | None = None, **settings: str) -> list[str]:
    done = _run(state, *args, cwd=cwd, **settings)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _endpoints(lines: list[str]) -> tuple[str, str]:
    """The Prometheus and OTLP/HTTP endpoints of the script's last two lines."""
    assert re.fullmatch(r"COLLECTOR_PROMETHEUS=http://127\.0\.0\.1:\d+/metrics", lines[-2])
    assert re.fullmatch(r"OTEL_EXPORTER_OTLP_ENDPOINT=http://127\.0\.0\.1:\d+", lines[-1])
    return lines[-2].split("=", 1)[1], lines[-1].split("=", 1)[1]


def _build_cache() -> Path:
    """The folder the script builds into (the shared collector's start built it there)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = os.environ.get("NEMO_GYM_COLLECTOR_CACHE") or default / "nemo-gym-otel" / "collector"
    return Path(cache).resolve()


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _answers(prometheus: str, otlp: str) -> bool:
    return http_status(prometheus) == 200 and http_status(otlp + "/v1/metrics") == 405


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture
def stopped_afterwards() -> Iterator[list[Path]]:
    """State folders whose collectors are stopped (by the script, by PID) when the test ends."""
    states: list[Path] = []
    yield states
    for state in states:
        _run(state, "--stop")


def test_start_collector_is_idempotent_and_stops_by_pid(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """A second start reuses the running collector; --stop ends exactly the recorded PID."""
    state = tmp_path / "collector"
    stopped_afterwards.append(state)
    first = _script(state)
    pid = int((state / "collector.pid").read_text())
    prometheus, otlp = _endpoints(first)
    assert _answers(prometheus, otlp)
    assert read_ports(state)["COLLECTOR_PROMETHEUS"] == prometheus

    second = _script(state)
    assert second[-2:] == first[-2:]
    assert int((state / "collector.pid").read_text()) == pid

    _script(state, "--stop")
    assert not _running(pid)
    assert http_status(prometheus) == 0
    assert not (state / "collector.pid").exists()


def test_start_collector_stop_spares_a_process_naming_the_collector(tmp_path: Path) -> None:
    """--stop leaves alone a process whose command line merely names the binary and the config."""
    state = tmp_path / "collector"
    state.mkdir(mode=0o700)
    # A `pgrep -f "jaeger --config"` loop, say: it ends when its stdin closes.
    decoy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdin.read()",
            "jaeger",
            "--config",
            f"file:{state / 'config.yaml'}",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        (state / "collector.pid").write_text(f"{decoy.pid}\n")

        done = _run(state, "--stop")

        assert done.returncode == 0, done.stderr
        assert "no collector started from" in done.stderr
        assert decoy.poll() is None
    finally:
        assert decoy.stdin is not None
        decoy.stdin.close()
        decoy.wait(timeout=10)


def test_start_collector_spares_another_state_folders_collector(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """A state folder whose PID file names another's collector neither stops nor reuses it."""
    first, second = tmp_path / "first", tmp_path / "second"
    stopped_afterwards.extend([first, second])
    prometheus, otlp = _endpoints(_script(first))
    pid = int((first / "collector.pid").read_text())
    second.mkdir(mode=0o700)
    for name in ("collector.pid", "collector.identity", "ports.env"):
        (second / name).write_bytes((first / name).read_bytes())

    stop = _run(second, "--stop")

    assert stop.returncode == 0, stop.stderr
    assert "no collector started from" in stop.stderr
    assert _running(pid)
    assert _answers(prometheus, otlp)

    own_prometheus, own_otlp = _endpoints(_script(second))

    assert int((second / "collector.pid").read_text()) != pid
    assert (own_prometheus, own_otlp) != (prometheus, otlp)
    assert _answers(own_prometheus, own_otlp)
    assert _running(pid)
    assert _answers(prometheus, otlp)


def test_start_collector_symlinked_cache_keeps_a_healthy_collector(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """A build cache reached through a symlink does not restart a collector that answers."""
    link = tmp_path / "cache-link"
    link.symlink_to(_build_cache())
    state = tmp_path / "collector"
    stopped_afterwards.append(state)

    first = _script(state, NEMO_GYM_COLLECTOR_CACHE=str(link))
    pid = int((state / "collector.pid").read_text())
    second = _script(state, NEMO_GYM_COLLECTOR_CACHE=str(link))

    assert second[-2:] == first[-2:]
    assert int((state / "collector.pid").read_text()) == pid
    assert _answers(*_endpoints(second))


def test_start_collector_relative_state_and_cache_from_the_callers_folder(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """Relative NEMO_GYM_COLLECTOR_DIR and _CACHE are taken from the caller's working directory."""
    (tmp_path / "cache").symlink_to(_build_cache())
    stopped_afterwards.append(tmp_path / "state")

    first = _script("state", cwd=tmp_path, NEMO_GYM_COLLECTOR_CACHE="cache")
    pid = int((tmp_path / "state" / "collector.pid").read_text())
    second = _script("state", cwd=tmp_path, NEMO_GYM_COLLECTOR_CACHE="cache")

    assert _answers(*_endpoints(first))
    assert second[-2:] == first[-2:]
    assert int((tmp_path / "state" / "collector.pid").read_text()) == pid
    assert f"file:{tmp_path / 'state' / 'config.yaml'}" in Path(f"/proc/{pid}/cmdline").read_text()
    _script("state", "--stop", cwd=tmp_path)
    assert not _running(pid)


def test_start_collector_default_state_folder_is_per_user(tmp_path: Path) -> None:
    """Without NEMO_GYM_COLLECTOR_DIR each user has a state folder of their own (per checkout)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("NEMO_GYM")}
    # Another user's --stop: it looks in that user's folder, never in this one's. The script
    # goes in on stdin, as this checkout's folders need not be readable by that user.
    with START_COLLECTOR.open() as script:
        done = subprocess.run(
            [*AS_NOBODY, "bash", "-s", "--", "--stop"],
            stdin=script,
            env=dict(env, HOME="/"),
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    assert done.returncode == 0, done.stderr
    # Read from stdin, the script's checkout is its working folder's parent: "/" here.
    assert f"/tmp/nemo-gym-collector-{NOBODY}-{_checkout_key(Path('/'))}" in done.stderr
    assert DEFAULT_STATE_DIR.name == f"nemo-gym-collector-{os.getuid()}-{_checkout_key(ROOT)}"


def _checkout_key(checkout: Path) -> str:
    return hashlib.sha256(str(checkout.resolve()).encode()).hexdigest()[:12]


def _clone(destination: Path) -> Path:
    """A ``git clone`` of this checkout, with this checkout's start-collector.sh (its
    uncommitted edits too: the script under test is the one beside this test)."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(destination)], check=True, timeout=120)
    (destination / "scripts" / "start-collector.sh").write_bytes(START_COLLECTOR.read_bytes())
    return destination


def _pid_of(state: Path) -> int:
    return int((state / "collector.pid").read_text())


def test_start_collector_two_clones_each_stop_only_their_own(tmp_path: Path) -> None:
    """Two clones, each starting its script without NEMO_GYM_COLLECTOR_DIR, run two collectors
    from two state folders (the build is shared); --stop from one leaves the other's running,
    whichever folder it is called from."""
    clones = [_clone(tmp_path / "first"), _clone(tmp_path / "second")]
    states = [default_state_dir(clone) for clone in clones]
    env = {key: value for key, value in os.environ.items() if key != "NEMO_GYM_COLLECTOR_DIR"}
    env["NEMO_GYM_COLLECTOR_PORTS"] = "0,0,0"
    elsewhere = tmp_path / "working-folder"
    elsewhere.mkdir()

    def script(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(clone / "scripts" / "start-collector.sh"), *args],
            env=env,
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=900,  # a first build on a fresh machine takes minutes
            check=False,
        )

    try:
        started = [script(clone) for clone in clones]
        for done in started:
            assert done.returncode == 0, done.stderr
        assert states[0] != states[1]
        pids = [_pid_of(state) for state in states]
        assert pids[0] != pids[1]
        endpoints = [_endpoints(done.stdout.splitlines()) for done in started]
        assert all(_answers(*pair) for pair in endpoints)
        # One build, cached by the hash of its inputs: both run the same binary.
        binaries = {read_ports(state)["COLLECTOR_BINARY"] for state in states}
        assert len(binaries) == 1, binaries
        assert "building the collector" not in started[1].stderr

        stopped = script(clones[0], "--stop")

        assert stopped.returncode == 0, stopped.stderr
        assert f"stopped the collector (pid {pids[0]})" in stopped.stderr
        assert not _running(pids[0])
        assert _running(pids[1])
        assert _answers(*endpoints[1])
        assert _pid_of(states[1]) == pids[1]
    finally:
        for clone in clones:
            script(clone, "--stop")
        for state in states:
            shutil.rmtree(state, ignore_errors=True)


def test_start_collector_refuses_a_state_folder_of_another_user(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """A state folder that belongs to another user is refused, naming it, before anything runs."""
    state = tmp_path / "theirs"
    stopped_afterwards.append(state)
    state.mkdir()
    os.chown(state, NOBODY, NOBODY)

    done = _run(state)

    assert done.returncode == 1
    assert done.stdout == ""
    assert f"the state folder {state} belongs to uid {NOBODY}" in done.stderr
    assert not (state / "collector.pid").exists()


def test_start_collector_preferred_ports_when_free_else_free_ones(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """It listens on the ports asked for when free, says so, and takes free ones for those taken."""
    http, grpc, prom = _free_ports(3)
    preferred = f"{http},{grpc},{prom}"
    first, second = tmp_path / "first", tmp_path / "second"
    stopped_afterwards.extend([first, second])

    started = _run(first, NEMO_GYM_COLLECTOR_PORTS=preferred)

    assert started.returncode == 0, started.stderr
    assert _endpoints(started.stdout.splitlines()) == (
        f"http://127.0.0.1:{prom}/metrics",
        f"http://127.0.0.1:{http}",
    )
    assert f"OTLP/HTTP on its standard port {http}" in started.stderr
    assert f"OTLP/gRPC on its standard port {grpc}" in started.stderr
    assert f"Prometheus exporter on its standard port {prom}" in started.stderr
    with socket.create_connection(("127.0.0.1", grpc), timeout=5):
        pass  # the gRPC receiver listens there too

    # The first collector holds all three now: the second takes free ones, and says so.
    fallback = _run(second, NEMO_GYM_COLLECTOR_PORTS=preferred)

    assert fallback.returncode == 0, fallback.stderr
    prometheus, otlp = _endpoints(fallback.stdout.splitlines())
    assert _answers(prometheus, otlp)
    assert f":{http}" not in otlp
    assert f":{prom}/" not in prometheus
    assert f"OTLP/HTTP: port {http} is taken; on free port " in fallback.stderr
    assert f"Prometheus exporter: port {prom} is taken; on free port " in fallback.stderr


def test_start_collector_env_prints_only_export_lines(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """--env prints export lines a shell takes as they are; the logs stay on stderr."""
    state = tmp_path / "collector"
    stopped_afterwards.append(state)
    prometheus, otlp = _endpoints(_script(state))

    done = _run(state, "--env")
    take = 'eval "$1" && echo "$OTEL_EXPORTER_OTLP_ENDPOINT $COLLECTOR_PROMETHEUS"'
    shell = subprocess.run(
        ["bash", "-c", take, "-", done.stdout],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"export OTEL_EXPORTER_OTLP_ENDPOINT={otlp}",
        "export OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
        f"export COLLECTOR_PROMETHEUS={prometheus}",
    ]
    assert "start-collector: " in done.stderr
    assert shell.stdout == f"{otlp} {prometheus}\n"


def test_start_collector_former_jaeger_cache_variable_is_said_unread(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """NEMO_GYM_JAEGER_CACHE, from when Jaeger was a build of its own, is named as unread and
    nothing is built or written there."""
    state = tmp_path / "collector"
    stopped_afterwards.append(state)
    former = tmp_path / "jaeger-cache"

    done = _run(state, NEMO_GYM_JAEGER_CACHE=str(former))

    assert done.returncode == 0, done.stderr
    assert "NEMO_GYM_JAEGER_CACHE is no longer read" in done.stderr
    assert _answers(*_endpoints(done.stdout.splitlines()))
    assert not former.exists()


@pytest.mark.parametrize("ports", ["4318", "4318,4317,nope", "4318,4317,70000"])
def test_start_collector_malformed_ports_exit_2(
    tmp_path: Path, stopped_afterwards: list[Path], ports: str
) -> None:
    """A malformed NEMO_GYM_COLLECTOR_PORTS is refused with its value, and nothing starts."""
    state = tmp_path / "collector"
    stopped_afterwards.append(state)

    done = _run(state, NEMO_GYM_COLLECTOR_PORTS=ports)

    assert done.returncode == 2
    assert done.stdout == ""
    assert f"NEMO_GYM_COLLECTOR_PORTS={ports}: " in done.stderr
    assert not (state / "collector.pid").exists()


def test_start_collector_build_only_builds(tmp_path: Path) -> None:
    """``--build`` leaves the binary built (here: found in the shared cache) and starts
    nothing; beside ``--jaeger`` or ``--stop`` it is refused."""
    state = tmp_path / "collector"

    done = _run(state, "--build")

    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    (built,) = re.findall(r"start-collector: built: (\S+)", done.stderr)
    assert Path(built).parent.parent == _build_cache()
    assert os.access(built, os.X_OK)
    assert not (state / "collector.pid").exists()
    assert not (state / "ports.env").exists()
    for other in ("--jaeger", "--stop"):
        refused = _run(state, "--build", other)
        assert refused.returncode == 2, other
        assert "usage: start-collector.sh" in refused.stderr


def test_start_collector_jaeger_receives_the_collectors_traces(
    tmp_path: Path, stopped_afterwards: list[Path]
) -> None:
    """--jaeger starts Jaeger on loopback before the collector, from the collector's binary, and
    the collector sends it every trace it receives; the query URL is printed (and exported by
    --env); --stop ends both by PID."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    state = tmp_path / "collector"
    stopped_afterwards.append(state)
    lines = _script(state, "--jaeger", NEMO_GYM_JAEGER_PORT="0")
    assert re.fullmatch(r"JAEGER_QUERY=http://127\.0\.0\.1:\d+", lines[-3])
    query = lines[-3].split("=", 1)[1]
    _, otlp = _endpoints(lines)
    jaeger_pid = int((state / "jaeger.pid").read_text())
    collector_pid = int((state / "collector.pid").read_text())
    # One build runs both: the binary the script recorded for the collector.
    binary = read_ports(state)["COLLECTOR_BINARY"]
    assert os.readlink(f"/proc/{collector_pid}/exe") == binary
    assert os.readlink(f"/proc/{jaeger_pid}/exe") == binary
    env_lines = _script(state, "--env")
    assert env_lines[-1] == f"export JAEGER_QUERY={query}"
    assert int((state / "collector.pid").read_text()) == collector_pid  # kept, not replaced

    provider = TracerProvider(resource=Resource.create({"service.name": "jaeger-probe"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(f"{otlp}/v1/traces")))
    tracer = provider.get_tracer("probe")
    with tracer.start_as_current_span("root") as root, tracer.start_as_current_span("child"):
        pass
    provider.shutdown()
    trace_id = f"{root.get_span_context().trace_id:032x}"

    # The collector's batch processor forwards within a second or so (bounded: 30 s).
    def stored_trace() -> dict[str, object] | None:
        try:
            found: dict[str, object] = json.loads(
                urllib.request.urlopen(f"{query}/api/traces/{trace_id}").read()
            )
        except urllib.error.HTTPError as not_yet:  # 404 until the trace is stored
            if not_yet.code != 404:
                raise
            return None
        return found

    found = eventually_blocking(stored_trace, f"Jaeger storing trace {trace_id}", interval=0.2)
    (stored,) = found["data"]  # type: ignore[misc]
    assert sorted(span["operationName"] for span in stored["spans"]) == ["child", "root"]

    _script(state, "--stop")
    assert not _running(jaeger_pid)
    assert not _running(collector_pid)
    assert http_status(f"{query}/api/services") == 0
    assert not (state / "jaeger.pid").exists()
