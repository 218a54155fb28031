"""``nemo-gym-otel report`` and its Prometheus text reader: parsing, quantiles, the choice of
run, the tables, and the command's exit statuses against a real loopback HTTP endpoint.

``data/collector_deployment.prom`` is what the collector's Prometheus exporter served during a
run of the deployment walk-through (docs/nemo-gym-deployment.md: nemo-gym 0.4.0, 300
rollouts, 15 s export interval), captured with curl from ``$COLLECTOR_PROMETHEUS``.
"""

from __future__ import annotations

import http.server
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from opentelemetry.instrumentation.nemo_gym.pressure._pressure import LOOP_LAG
from opentelemetry.instrumentation.nemo_gym.sandbox._fleet_metrics import CREATIONS, OOM_KILLS
from opentelemetry.instrumentation.nemo_gym.sandbox._lifecycle_metrics import CPU_TIME
from opentelemetry.instrumentation.nemo_gym.telemetry._instruments import (
    CONNECT_TOTAL,
    LIMIT,
    QUEUE_DURATION,
)
from opentelemetry.instrumentation.nemo_gym.tools import _report
from opentelemetry.instrumentation.nemo_gym.tools._prometheus_text import (
    Sample,
    histogram_quantile,
    parse_samples,
)
from opentelemetry.instrumentation.nemo_gym.tools._report import (
    ReportError,
    choose_run,
    render,
    runs,
)
from opentelemetry.instrumentation.nemo_gym.tools.cli import main

CAPTURED = Path(__file__).resolve().parent / "data" / "collector_deployment.prom"

# --- the text format ---------------------------------------------------------------------------


def test_parse_samples_labels_escapes_timestamps_and_comments() -> None:
    """Labels (escaped quotes, backslashes, newlines, a trailing comma), special values, an
    optional timestamp and an OpenMetrics exemplar are read; comments and blanks are not samples."""
    text = (
        "# HELP x_total Some help.\n"
        "# TYPE x_total counter\n"
        '\nx_total{a="1",b="say \\"hi\\"\\\\ \\n",} 3 1700000000000\n'
        "y +Inf\n"
        'z_bucket{le="+Inf"} 2 # {trace_id="abc"} 0.5 1.7e9\n'
        "w NaN\n"
        "# EOF\n"
    )
    samples = parse_samples(text)
    assert [(s.name, dict(s.labels), s.value, s.timestamp_ms) for s in samples[:3]] == [
        ("x_total", {"a": "1", "b": 'say "hi"\\ \n'}, 3.0, 1.7e12),
        ("y", {}, math.inf, None),
        ("z_bucket", {"le": "+Inf"}, 2.0, None),
    ]
    assert samples[3].name == "w"
    assert math.isnan(samples[3].value)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('x{a="1" 3', "expected , or } after label 'a'"),
        ('x{a="1} 3', "unterminated label value"),
        ("x{a=1} 3", "expected =\" after label 'a'"),
        ('x{a="\\t"} 3', "bad escape \\t"),
        ("x three", "value 'three' is not a number"),
        ("x 1 2 3", "expected a value and at most a timestamp"),
        ("{} 3", "no metric name"),
    ],
)
def test_parse_samples_malformed_line_names_line_and_reason(line: str, reason: str) -> None:
    """A line that is no sample raises ValueError naming its number, the reason and the text."""
    with pytest.raises(ValueError, match="line 2: ") as raised:
        parse_samples(f"ok 1\n{line}\n")
    assert reason in str(raised.value)
    assert repr(line) in str(raised.value)


def test_histogram_quantile_interpolates_as_promql() -> None:
    """Linear within the bucket the rank falls in; the lowest bucket from 0; the +Inf bucket
    answers the highest finite bound; no observations answer None."""
    buckets = [(1.0, 10.0), (2.0, 30.0), (4.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, buckets) == 1.5  # rank 20: halfway through (1, 2]
    assert histogram_quantile(0.25, buckets) == 1.0  # rank 10: the top of (0, 1]
    assert histogram_quantile(0.1, buckets) == 0.4  # rank 4 of 10 in (0, 1]
    assert histogram_quantile(0.99, [(1.0, 1.0), (math.inf, 2.0)]) == 1.0
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None
    with pytest.raises(ValueError, match=r"quantile 1\.5 is not between 0 and 1"):
        histogram_quantile(1.5, buckets)


# --- the names the report reads ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prometheus", "otel", "suffix"),
    [
        (_report.CONNECT_TOTAL, CONNECT_TOTAL, ""),
        (_report.QUEUE_DURATION_BUCKET, QUEUE_DURATION, "_milliseconds_bucket"),
        (_report.POOL_LIMIT, LIMIT, ""),
        (_report.LOOP_LAG_BUCKET, LOOP_LAG, "_milliseconds_bucket"),
        (_report.SANDBOX_CREATIONS, CREATIONS, "_total"),
        (_report.SANDBOX_OOM_KILLS, OOM_KILLS, "_total"),
        (_report.SANDBOX_CPU_TIME, CPU_TIME, "_seconds_total"),
    ],
)
def test_report_names_are_the_instruments_as_the_collector_writes_them(
    prometheus: str, otel: str, suffix: str
) -> None:
    """Each series the report reads is one of our instruments, dots to underscores, with the
    unit and counter suffixes the collector's Prometheus exporter appends."""
    assert prometheus == otel.replace(".", "_") + suffix


# --- runs and tables on hand-made samples --------------------------------------------------------


def _info(job: str, instance: str, run: str, server: str | None = None) -> Sample:
    labels = {"job": job, "instance": instance, "nemo_run_id": run}
    if server:
        labels["nemo_gym_server_name"] = server
    return Sample("target_info", labels, 1.0)


def _point(name: str, job: str, instance: str, value: float, **labels: str) -> Sample:
    return Sample(name, {"job": job, "instance": instance, **labels}, value)


def _queue(job: str, instance: str, destination: str, constraint: str, counts: list[float]):
    bounds = [1.0, 10.0, math.inf]
    return [
        _point(
            _report.QUEUE_DURATION_BUCKET,
            job,
            instance,
            count,
            le="+Inf" if math.isinf(bound) else str(bound),
            nemo_gym_http_destination_server_name=destination,
            nemo_gym_http_connection_pool_queue_constraint=constraint,
        )
        for bound, count in zip(bounds, counts, strict=True)
    ]


DEST = "nemo_gym_http_destination_server_name"
FULL = "█" * 24  # the bar of a table's largest value


def _two_runs() -> list[Sample]:
    return [
        _info("nemo-gym/agent", "a1", "new", server="agent"),
        _info("nemo-gym/model", "m1", "new", server="model"),
        _info("nemo-gym/orchestrator", "o1", "new", server="orchestrator"),
        _info("nemo-gym/orchestrator", "o2", "new", server="orchestrator"),
        _info("ray.worker", "r1", "new"),
        _info("nemo-gym/agent", "old1", "old", server="agent"),
        _point(_report.CONNECT_TOTAL, "nemo-gym/agent", "a1", 600, **{DEST: "model"}),
        _point(_report.CONNECT_TOTAL, "nemo-gym/agent", "a1", 300, **{DEST: "resources"}),
        _point(_report.CONNECT_TOTAL, "nemo-gym/orchestrator", "o2", 150, **{DEST: "agent"}),
        _point(_report.CONNECT_TOTAL, "nemo-gym/agent", "old1", 999, **{DEST: "model"}),
        *_queue("nemo-gym/agent", "a1", "model", "per_host", [20, 36, 40]),
        *_queue("nemo-gym/agent", "a1", "model", "total", [0, 0, 2]),
        *_queue("nemo-gym/agent", "old1", "model", "total", [0, 0, 500]),
        _point(
            _report.POOL_LIMIT,
            "nemo-gym/agent",
            "a1",
            8,
            nemo_gym_http_connection_pool_limit_kind="per_host",
        ),
        _point(_report.LOOP_LAG_BUCKET, "nemo-gym/model", "m1", 50, le="1.0"),
        _point(_report.LOOP_LAG_BUCKET, "nemo-gym/model", "m1", 100, le="10.0"),
        _point(_report.LOOP_LAG_BUCKET, "nemo-gym/model", "m1", 100, le="+Inf"),
        _point(
            _report.SANDBOX_CREATIONS,
            "nemo-gym/agent",
            "a1",
            4,
            nemo_gym_sandbox_provider="otel_process",
            nemo_gym_sandbox_outcome="created",
        ),
        _point(
            _report.SANDBOX_CREATIONS,
            "nemo-gym/agent",
            "a1",
            1,
            nemo_gym_sandbox_provider="otel_process",
            nemo_gym_sandbox_outcome="failed",
        ),
        _point(
            _report.SANDBOX_OOM_KILLS,
            "nemo-gym/agent",
            "a1",
            1,
            nemo_gym_sandbox_provider="otel_process",
        ),
        _point(
            _report.SANDBOX_CPU_TIME,
            "nemo-gym/agent",
            "a1",
            2.25,
            nemo_gym_sandbox_provider="otel_process",
        ),
        _point(
            _report.SANDBOX_MEMORY_PEAK,
            "nemo-gym/agent",
            "a1",
            48 * 1024 * 1024,
            nemo_gym_sandbox_provider="otel_process",
        ),
        # The same provider in another server: a row of its own, its peak its own.
        _point(
            _report.SANDBOX_CREATIONS,
            "nemo-gym/model",
            "m1",
            2,
            nemo_gym_sandbox_provider="otel_process",
            nemo_gym_sandbox_outcome="created",
        ),
        _point(
            _report.SANDBOX_CPU_TIME,
            "nemo-gym/model",
            "m1",
            1.1,
            nemo_gym_sandbox_provider="otel_process",
        ),
    ]


def test_choose_run_flag_then_variable_then_the_only_one() -> None:
    """--run-id wins, then $NEMO_GYM_OTEL_RUN_ID; one run is the default; several without a
    choice, or an unknown one, are refused naming what the collector holds."""
    found = runs(_two_runs())
    assert sorted(found) == ["new", "old"]
    assert choose_run(found, "old", {"NEMO_GYM_OTEL_RUN_ID": "new"}).run_id == "old"
    assert choose_run(found, None, {"NEMO_GYM_OTEL_RUN_ID": "new"}).run_id == "new"
    assert choose_run({"new": found["new"]}, None, {}).run_id == "new"
    with pytest.raises(ReportError, match=r"holds 2 runs .* new \(nemo-gym/agent, .*old \("):
        choose_run(found, None, {})
    with pytest.raises(ReportError, match=r"\$NEMO_GYM_OTEL_RUN_ID 'gone': no such run"):
        choose_run(found, None, {"NEMO_GYM_OTEL_RUN_ID": "gone"})
    with pytest.raises(ReportError, match="holds no process with a nemo_run_id"):
        choose_run({}, None, {})


def test_render_one_run_every_table() -> None:
    """The chosen run's connections, queue waits (p50, p99, binding limit), loop lag and
    sandboxes, as aligned rows with bars; the other run's series are left out."""
    samples = _two_runs()
    found = runs(samples)
    assert render(samples, found["new"], ["old"]).splitlines() == [
        "run new: 4 processes, 3 services (and 1 process with nothing to report: ray.worker)",
        "(the collector also holds runs old: --run-id picks one)",
        "",
        "Connections per server (pool acquisitions per destination)",
        "  server                               destination    connects",
        "  nemo-gym/agent                       model               600  " + FULL,
        "  nemo-gym/agent                       resources           300  " + "█" * 12,
        "  nemo-gym/model                       (no requests)",
        "  nemo-gym/orchestrator (2 processes)  agent               150  " + "█" * 6,
        "",
        "Queue waits per destination (requests that waited for a pool slot)",
        "  destination  waits  p50 ms  p99 ms  binding limit",
        # p50: rank 21 of 42, 1 of 16 into (1, 10]; p99: rank 41.58, in +Inf: the top bound.
        "  model           42    1.56   10.00  per_host 8     " + FULL,
        "",
        "Event-loop lag per server (how late the loop ran a timed callback)",
        "  server          samples  p99 ms",
        "  nemo-gym/model      100    9.82  " + FULL,  # 1 + 9 * 49/50
        "",
        "Sandboxes per provider and server",
        "  provider      server          created  failed  OOM kills  CPU s  peak MiB",
        "  otel_process  nemo-gym/agent        4       1          1    2.2      48.0  " + FULL,
        # No memory sample from the model's sandboxes: no peak, rather than 0.
        "  otel_process  nemo-gym/model        2       0          0    1.1         -  " + "█" * 12,
    ]


def test_render_empty_sections_say_why() -> None:
    """A run without waits, lag or sandboxes says so in each section instead of an empty table."""
    samples = [_info("nemo-gym/resources", "r1", "only", server="resources")]
    text = render(samples, runs(samples)["only"])
    assert "  nemo-gym/resources  (no requests)" in text
    assert "  (none: no request waited for a pool slot)" in text
    assert "  (none: no process of this run measured its event loop)" in text
    assert "  (none: no process of this run created a sandbox)" in text


# --- the captured collector text ------------------------------------------------------------------


def test_report_of_the_captured_deployment_text() -> None:
    """The collector's real text parses whole, and each run's report shows the connects the
    deployment test reads from the same text with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = CAPTURED.read_text()
    samples = parse_samples(text)
    runs_of: dict[tuple[str, str], str] = {}
    expected: dict[tuple[str, str, str], float] = {}  # (run, job, destination) -> connects
    count = 0
    families = list(text_string_to_metric_families(text))
    for family in families:
        for sample in family.samples:
            count += 1
            if sample.name == "target_info":
                runs_of[(sample.labels["job"], sample.labels["instance"])] = sample.labels[
                    "nemo_run_id"
                ]
    for family in families:
        for sample in family.samples:
            if sample.name == _report.CONNECT_TOTAL:
                run = runs_of[(sample.labels["job"], sample.labels["instance"])]
                key = (run, sample.labels["job"], sample.labels[DEST])
                expected[key] = expected.get(key, 0.0) + sample.value
    assert len(samples) == count
    found = runs(samples)
    # The page's shells before one run id: gym env start's run and gym eval run's.
    assert len(found) == 2
    assert expected
    for (run_id, job, destination), connects in expected.items():
        rows = [line.split() for line in render(samples, found[run_id]).splitlines()]
        assert [job, destination, str(round(connects))] in [row[:3] for row in rows], (
            run_id,
            job,
            destination,
            connects,
        )


# --- the command -------------------------------------------------------------------------------


@pytest.fixture
def served_text() -> Iterator[list[str]]:
    """A loopback HTTP endpoint serving the text in the list's first item (its URL appended)."""
    holder: list[str] = [""]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = holder[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    holder.append(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    yield holder
    server.shutdown()
    server.server_close()
    thread.join()


def _text(samples: list[Sample]) -> str:
    def labels(sample: Sample) -> str:
        return ",".join(f'{key}="{value}"' for key, value in sample.labels.items())

    return "".join(f"{s.name}{{{labels(s)}}} {s.value}\n" for s in samples)


def test_main_report_reads_the_url_from_the_environment(
    served_text: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """$COLLECTOR_PROMETHEUS and $NEMO_GYM_OTEL_RUN_ID choose the endpoint and run: exit 0."""
    served_text[0] = _text(_two_runs())
    monkeypatch.setenv("COLLECTOR_PROMETHEUS", served_text[1])
    monkeypatch.setenv("NEMO_GYM_OTEL_RUN_ID", "old")
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run old: 1 process, 1 service\n")
    rows = [line.split() for line in out.split("Connections per server", 1)[1].splitlines()]
    assert ["nemo-gym/agent", "model", "999", FULL] in rows


def test_main_report_bad_input_exits_2(
    served_text: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No URL, or several runs and none chosen: exit 2 with the reason on stderr."""
    monkeypatch.delenv("COLLECTOR_PROMETHEUS", raising=False)
    monkeypatch.delenv("NEMO_GYM_OTEL_RUN_ID", raising=False)
    assert main(["report"]) == 2
    assert "no collector: set $COLLECTOR_PROMETHEUS" in capsys.readouterr().err
    served_text[0] = _text(_two_runs())
    assert main(["report", "--url", served_text[1]]) == 2
    assert "holds 2 runs" in capsys.readouterr().err


def test_main_report_unreadable_collector_exits_1(
    served_text: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A collector that does not answer, or answers with something else, exits 1 naming it."""
    served_text[0] = "<html>not metrics</html>\n"
    assert main(["report", "--url", served_text[1]]) == 1
    assert f"{served_text[1]} is not Prometheus text: line 1" in capsys.readouterr().err
    closed = "http://127.0.0.1:1/metrics"
    assert main(["report", "--url", closed]) == 1
    assert f"cannot read {closed}" in capsys.readouterr().err
