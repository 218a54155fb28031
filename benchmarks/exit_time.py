"""How long an instrumented process takes to exit against a collector that is hung or down.

Runs ``tests/apps/exit_worker.py`` under ``opentelemetry-instrument`` (3 requests through a
timed pool, OTLP/HTTP metrics, a 600 s interval: the SDK's last export at exit is the only
one), with this plugin switched off (``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=nemo_gym``) and
on, against a loopback port that accepts and never answers (hung) and a closed one (down), at
the exporter's default timeout (10 s) and at ``OTEL_EXPORTER_OTLP_TIMEOUT=2``. Exit is timed
alone: from the line that tells the process to return from ``main`` to the process's end.
The interpreter is the one running this script. Run from the repository root:

    .venv/bin/python benchmarks/exit_time.py
    .venv-py312/bin/python benchmarks/exit_time.py  # PYTHON=python3.12 VENV=.venv-py312
                                                    # bash scripts/test.sh made it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# The tests' helpers, found through the path above.
from exit_support import (
    closed_port,
    exit_seconds,
    exporting_environment,
    hung_collector,
)


def measure(collector: str, otlp_timeout_s: float | None, plugin: bool, interval_ms: int) -> float:
    """Seconds of exit for one process."""
    with hung_collector() as hung:
        port = hung.port if collector == "hung" else closed_port()
        env = exporting_environment(port, otlp_timeout_s or 10, plugin=plugin)
        env["OTEL_METRIC_EXPORT_INTERVAL"] = str(interval_ms)
        if otlp_timeout_s is None:
            del env["OTEL_EXPORTER_OTLP_TIMEOUT"]  # the exporter's own default
        seconds, _ = exit_seconds(env)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--interval-ms",
        type=int,
        default=600_000,
        help="OTEL_METRIC_EXPORT_INTERVAL (1000: an export is often in flight at exit)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    python = sys.version.split()[0]
    rows = []
    for otlp_timeout_s in (None, 2.0):
        for collector in ("hung", "down"):
            without = measure(collector, otlp_timeout_s, False, args.interval_ms)
            with_plugin = measure(collector, otlp_timeout_s, True, args.interval_ms)
            rows.append(
                {
                    "timeout": "default" if otlp_timeout_s is None else f"{otlp_timeout_s:g} s",
                    "collector": collector,
                    "without_plugin_s": round(without, 2),
                    "with_plugin_s": round(with_plugin, 2),
                }
            )
    if args.json:
        print(json.dumps({"python": python, "interval_ms": args.interval_ms, "rows": rows}))
        return
    print(f"Python {python}, {args.interval_ms} ms interval: exit seconds, plugin off / on")
    for row in rows:
        print(
            f"  OTEL_EXPORTER_OTLP_TIMEOUT {row['timeout']:>7}, {row['collector']} collector: "
            f"{row['without_plugin_s']:.2f} / {row['with_plugin_s']:.2f}"
        )


if __name__ == "__main__":
    main()
