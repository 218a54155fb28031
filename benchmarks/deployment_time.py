"""Clone to the report's table: how long the NeMo Gym deployment walk-through takes.

Clones this checkout's committed HEAD into a fresh folder under /tmp, then runs the shells of
docs/nemo-gym-deployment.md through ``tests/nemo_gym_deployment.run_deployment`` with its own
15 s export interval, and prints the seconds from the start of the clone to the servers being
ready, to the first ``gym_http_connection_pool_connect_total`` the collector's Prometheus
exporter shows (polled every second), to the end of ``gym eval run``, and to the table of
``nemo-gym-otel report`` (after Ctrl-C). ``--cold`` points pip's, uv's and Go's caches
(``PIP_CACHE_DIR``, ``UV_CACHE_DIR``, ``GOMODCACHE``, ``GOCACHE``, ``GOPATH``) and the build
cache of the collector's and Jaeger's one binary (``NEMO_GYM_COLLECTOR_CACHE``) at empty
folders beside the clone, so the real caches are neither used nor touched. Run from the
repository root (about 10 minutes cold on 2 busy cores, 5 warm):

    .venv/bin/python benchmarks/deployment_time.py --cold
    .venv/bin/python benchmarks/deployment_time.py

``--kubernetes`` times docs/nemo-gym-kubernetes.md instead, through
``tests/test_nemo_gym_kubernetes.run_walk``: the clone's own cluster and OpenSandbox server
start from its scripts (stop any other cluster on the machine first: two would share the
kubelet's cgroups), and are stopped again at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import nemo_gym_deployment as deployment  # noqa: E402
import test_nemo_gym_kubernetes as kubernetes_walk  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="empty pip, uv, Go, collector caches")
    parser.add_argument(
        "--kubernetes", action="store_true", help="docs/nemo-gym-kubernetes.md's walk instead"
    )
    args = parser.parse_args()
    cold = args.cold
    base = Path(tempfile.mkdtemp(prefix="deployment-time-", dir="/tmp"))
    uv_cache = deployment.UV_CACHE
    if cold:
        for variable, folder in (
            ("PIP_CACHE_DIR", "pip"),
            ("GOMODCACHE", "go-mod"),
            ("GOCACHE", "go-build"),
            ("GOPATH", "go-path"),
            ("NEMO_GYM_COLLECTOR_CACHE", "collector"),
        ):
            os.environ[variable] = str(base / folder)
        uv_cache = base / "uv"
    start = time.monotonic()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(base / "clone")], check=True)
    cloned = time.monotonic() - start
    if args.kubernetes:
        _kubernetes_walk(base / "clone", cloned, cold)
        print(f"(left in {base}: the clone and the cold caches; remove it when done)")
        return
    timeline = deployment.Timeline()
    run = deployment.run_deployment(
        clone=base / "clone", uv_cache=uv_cache, measure=True, timeline=timeline
    )
    ready = cloned + (timeline.servers_ready or float("nan"))
    first = cloned + (timeline.first_metrics or float("nan"))
    evaluated = cloned + (timeline.eval_done or float("nan"))
    reported = cloned + (timeline.report_done or float("nan"))
    print(
        f"{'cold' if cold else 'warm'} caches: clone {cloned:.1f} s, servers ready {ready:.0f} s, "
        f"first pool metrics in the collector {first:.0f} s, gym eval run done {evaluated:.0f} s, "
        f"the report's table {reported:.0f} s after the clone began "
        f"({run.rollouts} rollouts, {run.served} model calls served)"
    )
    print(f"(left in {base}: the clone and the cold caches; remove it when done)")


def _kubernetes_walk(clone: Path, cloned: float, cold: bool) -> None:
    scripts = clone / "scripts"
    # OpenSandbox's sources, as a user names them for a clone without ../shared beside it.
    shared = ROOT.parent / "shared" / "opensandbox"
    for variable, archive in (
        ("NEMO_GYM_OPENSANDBOX_SOURCE", "opensandbox-execd-4db3a993.tgz"),
        ("NEMO_GYM_OPENSANDBOX_K8S_SOURCE", "opensandbox-k8s-4db3a993.tgz"),
    ):
        if (shared / archive).exists():
            os.environ.setdefault(variable, str(shared / archive))
    try:
        walk = kubernetes_walk.run_walk(clone)
    finally:
        subprocess.run(["bash", str(scripts / "start-opensandbox.sh"), "--kubernetes", "--stop"])
        subprocess.run(["bash", str(scripts / "start-kubernetes.sh"), "--stop"])
    cluster = walk.seconds["cluster running"]
    moments = ", ".join(f"{name} {cloned + s:.0f} s" for name, s in walk.seconds.items())
    print(
        f"{'cold' if cold else 'warm'} caches: clone {cloned:.1f} s, cluster started "
        f"{cloned + cluster:.0f} s, then the page's shells: {moments} after the clone began "
        f"({len(walk.rollouts)} rollouts)"
    )


if __name__ == "__main__":
    main()
