"""Parts of ``sampler_cost.py``: the container engine's CPU from ``/proc``, and exporters.

Nothing here is imported by the package.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _common import DiscardingSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX

PODMAN_SOCKET = "/run/nemo-gym-podman/podman.sock"

try:  # the real wire format's cost, where the OTLP encoder is installed
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
except ImportError:  # pragma: no cover - depends on the environment
    encode_spans = None


class EncodingSpanExporter(DiscardingSpanExporter):
    """Encodes each batch as OTLP protobuf (what an OTLP exporter sends) and drops the bytes;
    counts the resource samples. Without ``opentelemetry-exporter-otlp-proto-common`` it only
    counts (``encoding`` says which)."""

    encoding = "otlp-protobuf" if encode_spans is not None else "none (encoder not installed)"

    def __init__(self) -> None:
        self.samples = 0
        self.bytes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        batch = list(spans)
        if encode_spans is not None:
            self.bytes += len(encode_spans(batch).SerializeToString())
        self.samples += sum(
            1 for s in batch if (s.attributes or {}).get(PREFIX + "resource.kind") == "sample"
        )
        return SpanExportResult.SUCCESS


def engine_socket(explicit: str | None) -> str | None:
    """The unix socket of a Docker-compatible engine that accepts connections, if any:
    ``explicit``, else ``DOCKER_HOST``, ``/var/run/docker.sock``, ``scripts/start-podman.sh``'s."""
    host = os.environ.get("DOCKER_HOST", "")
    candidates = [explicit] if explicit else []
    candidates += [host.removeprefix("unix://")] if host.startswith("unix://") else []
    candidates += ["/var/run/docker.sock", PODMAN_SOCKET]
    for path in candidates:
        if not path or not Path(path).exists():
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)
            try:
                probe.connect(path)
            except OSError:
                continue
        return path
    return None


def serving_pid(socket_path: str) -> int | None:
    """The PID of the process serving ``socket_path`` (Linux peer credentials)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(socket_path)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid = struct.unpack("3i", creds)[0]
    return pid if pid > 0 else None


def _stat_fields() -> Mapping[int, list[str]]:
    """Every process's ``/proc/<pid>/stat`` fields after the command name."""
    fields: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields[int(entry.name)] = text.rpartition(")")[2].split()
    return fields


def tree_cpu_s(root: int) -> float | None:
    """CPU seconds of ``root`` and its live descendants, their reaped children included
    (utime + stime + cutime + cstime of each); ``None`` when ``root`` is gone.

    A descendant that exits is reaped by its parent, so its time moves into the parent's
    cutime/cstime and stays counted.
    """
    table = _stat_fields()
    if root not in table:
        return None
    children: dict[int, list[int]] = {}
    for pid, rest in table.items():
        try:
            children.setdefault(int(rest[1]), []).append(pid)
        except (IndexError, ValueError):
            continue
    ticks = 0
    pending = [root]
    while pending:
        pid = pending.pop()
        rest = table.get(pid)
        if rest is None:
            continue
        with contextlib.suppress(IndexError, ValueError):
            ticks += sum(int(value) for value in rest[11:15])
        pending.extend(children.get(pid, ()))
    return ticks / os.sysconf("SC_CLK_TCK")


def sample_keys(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A provider's sample with every key under ``PREFIX`` (providers differ)."""
    return {k if k.startswith(PREFIX) else PREFIX + k: v for k, v in sample.items()}
