"""Whole-attribute assertions for spans, as contrib's instrumentation tests make them.

A test compares ``attributes_of(span)`` with the complete dict it expects, so an attribute
nobody expected fails it. A value that differs from run to run (a request id, a container's
id, a usage figure) is written as a matcher below: it equals any value of its kind that
passes its check, and a failing comparison prints what it wanted. A key is never left out of
the expected dict because its value is hard to know.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import PREFIX

REQUEST_ID, PROVIDER, SANDBOX_ID = PREFIX + "request.id", PREFIX + "provider", PREFIX + "id"
ISOLATION = PREFIX + "isolation"
KIND, FINAL, ERROR = PREFIX + "resource.kind", PREFIX + "resource.final", PREFIX + "resource.error"


def attributes_of(span: ReadableSpan) -> dict[str, Any]:
    """Every attribute of ``span``, as a plain dict."""
    return dict(span.attributes or {})


class Like:
    """Equal to any value of type ``kind`` that ``accepts`` takes; ``True`` and ``False`` are
    never numbers here."""

    __hash__ = None  # type: ignore[assignment]  # compared, never a key

    def __init__(
        self, description: str, kind: type | tuple[type, ...], accepts: Callable[[Any], bool]
    ) -> None:
        self.description = description
        self.kind = kind
        self.accepts = accepts

    def __eq__(self, other: object) -> bool:
        if isinstance(other, bool) and self.kind is not bool:
            return False
        return isinstance(other, self.kind) and bool(self.accepts(other))

    def __repr__(self) -> str:
        return f"<{self.description}>"


def matching(pattern: str) -> Like:
    """A string that ``pattern`` matches in full."""
    return Like(
        f"a string matching {pattern!r}", str, lambda v: re.fullmatch(pattern, v) is not None
    )


def at_least(low: float, kind: type | tuple[type, ...] = (int, float)) -> Like:
    """A number of type ``kind`` that is ``low`` or more."""
    return Like(f"a number >= {low}", kind, lambda v: v >= low)


def between(low: float, high: float) -> Like:
    """A number from ``low`` to ``high``, both included."""
    return Like(f"a number in [{low}, {high}]", (int, float), lambda v: low <= v <= high)


# A fresh request id: a uuid4 in hex, as ``record_request`` makes it.
UUID4_HEX = matching(r"[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{15}")


def one_of(*options: str) -> Like:
    """One of the strings ``options``."""
    return Like(f"one of {options}", str, lambda v: v in options)


# --- the sandbox spans' parts -----------------------------------------------------------------

# requested.unspecified when the spec declares no resources at all.
NOTHING_REQUESTED = ("cpu", "memory_mib", "disk_gib", "gpu", "gpu_type")
UNSPECIFIED = PREFIX + "requested.unspecified"

# Usage read from /proc (a ProcessSandboxProvider without cgroups): every key, figures >= 0.
PROC_USAGE: dict[str, Any] = {
    PREFIX + "usage.source": "proc",
    PREFIX + "usage.cpu.time_s": at_least(0),
    PREFIX + "usage.memory_mib": at_least(0),
    PREFIX + "usage.memory_peak_mib": at_least(0),
    PREFIX + "usage.pids": at_least(0, int),
}


def identity(
    request_id: Any, provider: str, sandbox_id: Any, isolation: str | None = None
) -> dict[str, Any]:
    """The identity every span of one created sandbox carries; ``isolation`` for a process
    sandbox (``"bwrap"`` or ``"none"``), whose spans all say how it was isolated."""
    known = {REQUEST_ID: request_id, PROVIDER: provider, SANDBOX_ID: sandbox_id}
    return known if isolation is None else {**known, ISOLATION: isolation}


def record(identity: dict[str, Any], kind: str, final: bool = False) -> dict[str, Any]:
    """What every ``sandbox.resources`` record of ``kind`` starts with."""
    return {**identity, KIND: kind, FINAL: final}


def sandbox_cgroup_path(sandbox_id: str) -> str:
    """The cgroup path of a process sandbox made in this process, read independently of the
    code under test: ``nemo_gym/<id>`` beneath this process's own memory cgroup (v1) or its
    v2 cgroup (without the ``nemo_gym_server`` leaf the provider may have moved it into)."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path
    own = paths["memory"] if "memory" in paths else paths[""].removesuffix("/nemo_gym_server")
    return f"{own.rstrip('/')}/nemo_gym/{sandbox_id}"


def process_allocation(
    extra: dict[str, Any] | None = None, *, cgroup: str | None = None
) -> dict[str, Any]:
    """The allocation of a ProcessSandboxProvider sandbox on this boot and host: without
    cgroups this process and no limits; in the cgroup at path ``cgroup``, the limits that
    ``extra`` names. ``extra`` adds the limits and the request comparison."""
    base = PREFIX + "allocation."
    unbounded = ("cpu", "memory_mib", "disk_gib", "gpu")
    designator = {
        base + "source": "process" if cgroup is None else matching(r"cgroup\.v[12]"),
        base + "designator.kind": "process" if cgroup is None else "cgroup",
        base + "designator.id": str(os.getpid()) if cgroup is None else cgroup,
    }
    return {
        **designator,
        base + "designator.scope": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        base + "host.kind": "host",
        base + "host.id": socket.gethostname(),
        base + "components": ("sandbox",),
        base + "component.sandbox.requests.unspecified": unbounded,
        base + "component.sandbox.limits.unspecified": unbounded,
        **(extra or {}),
    }


def sample_outcome(got: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A sample record's outcome: ``answer``, or for a sample the provider did not answer in
    time (a loaded machine, or cut short by a close) only the error naming why.

    Which of the two a sample is depends on timing; either way every key is compared.
    """
    if ERROR in got:
        return {ERROR: one_of("TimeoutError", "CancelledError")}
    return answer


async def settled(bound_s: float = 30.0) -> None:
    """Wait until every other task on the loop has ended (failing after ``bound_s``): after
    it, no sampler, record or provider call is left that could still export a span."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        _, pending = await asyncio.wait(others, timeout=bound_s)
        assert not pending, f"still running after {bound_s} s: {pending}"


# The usage figures a sample may carry, each only where its source offers it (a cgroup v1
# kernel without an OOM count, an engine whose stats leave a field out).
USAGE_FIGURES = frozenset(
    PREFIX + "usage." + name
    for name in (
        "cpu.time_s",
        "cpu.throttled_s",
        "cpu.throttled_periods",
        "memory_mib",
        "memory_peak_mib",
        "oom_kills",
        "pids",
    )
)


def usage_figures(got: dict[str, Any]) -> dict[str, Any]:
    """The usage figures ``got`` has, each expected to be a number >= 0.

    Which figures a source offers varies; any other key in ``got`` is not filled in here,
    so a whole-dict comparison still fails on it.
    """
    return {key: at_least(0) for key in got if key in USAGE_FIGURES}


PARTIAL = PREFIX + "resource.partial"


def carried_forward(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records as a reader rebuilds them: a partial sample (``resource.partial``) takes each
    figure it leaves out from its sandbox's previous sample with figures, and the marker goes;
    any other record is as it was. A partial sample with no earlier one fails (KeyError)."""
    rebuilt: list[dict[str, Any]] = []
    previous: dict[Any, dict[str, Any]] = {}
    for attributes in records:
        whole = dict(attributes)
        if whole.pop(PARTIAL, False) is True:
            whole = {**previous[whole.get(SANDBOX_ID)], **whole}
        has_figures = ERROR not in whole and PREFIX + "usage.unknown_reason" not in whole
        if whole.get(KIND) == "sample" and has_figures:
            previous[whole.get(SANDBOX_ID)] = whole
        rebuilt.append(whole)
    return rebuilt
