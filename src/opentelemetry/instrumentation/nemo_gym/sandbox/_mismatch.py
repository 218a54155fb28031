"""Requested against allocated: which resources a sandbox did not get as declared.

Providers that silently drop or cap the requested CPU and memory are a real failure: the
sandbox runs, slower or closer to an OOM kill than its author planned. ``compare_allocation``
holds the declared shape against the limits a ``ResourceAllocation`` reports and returns one
``ResourceMismatch`` per resource that differs; ``mismatch_attributes`` turns them into the
allocation record's attributes; ``MismatchWarnings`` logs each (provider, resource) once.

Pure: no I/O, no OpenTelemetry. The tracing layer calls these when it records an allocation,
and counts each mismatch on ``gym.sandbox.allocation.mismatches``.

What counts, per compared resource (``cpu`` in cores, ``memory_mib`` in MiB):

* the request is absent: nothing to compare, never a mismatch;
* the sandbox's limit is the sum of its components' limits when every component has one;
  a component without one leaves the sandbox unbounded, so: ``no_limit``;
* limit below the request: ``below_request``; above it: ``above_request``; CPU within one
  millicore counts as equal (the finest unit of Kubernetes quantities; cgroup quotas and
  Docker's ``NanoCpus`` round within it); memory compares exactly;
* an allocation with no components reports nothing about limits: nothing to compare.

Record attributes (``PREFIX = "nemo.gym.sandbox."``), present only when something differs:

* ``nemo.gym.sandbox.allocation.mismatch.resources``: the differing resources, e.g. ``["cpu"]``
* ``nemo.gym.sandbox.allocation.mismatch.<resource>.kind``: ``below_request``,
  ``above_request`` or ``no_limit``
* ``nemo.gym.sandbox.allocation.mismatch.<resource>.requested``: the declared amount
* ``nemo.gym.sandbox.allocation.mismatch.<resource>.allocated``: the limit (absent for
  ``no_limit``)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, cast

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    Attribute,
    ResourceAllocation,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import _resources_from

__all__ = [
    "ABOVE_REQUEST",
    "BELOW_REQUEST",
    "COMPARED_RESOURCES",
    "MISMATCH_PREFIX",
    "NO_LIMIT",
    "MismatchWarnings",
    "ResourceMismatch",
    "compare_allocation",
    "mismatch_attributes",
]

logger = logging.getLogger(__name__)

MISMATCH_PREFIX = "nemo.gym.sandbox.allocation.mismatch."
BELOW_REQUEST: Final = "below_request"
ABOVE_REQUEST: Final = "above_request"
NO_LIMIT: Final = "no_limit"
MismatchKind = Literal["below_request", "above_request", "no_limit"]
COMPARED_RESOURCES = ("cpu", "memory_mib")

# One millicore: Kubernetes' finest CPU unit, coarser than cgroup-quota and NanoCpus rounding.
_CPU_TOLERANCE = 1e-3


@dataclass(frozen=True)
class ResourceMismatch:
    """One resource whose allocated limit differs from the request.

    ``allocated`` is ``None`` for ``no_limit`` (nothing bounds the sandbox).
    """

    resource: str
    kind: MismatchKind
    requested: float | int
    allocated: float | int | None


def _sandbox_limit(allocation: ResourceAllocation, resource: str) -> float | int | None:
    """The sandbox's limit: the components' limits summed, ``None`` if any is unbounded."""
    total: float | int = 0
    for component in allocation.components:
        limit = getattr(component.limits, resource)
        if limit is None:
            return None
        total += limit
    return total


def _differs(resource: str, requested: float | int, limit: float | int) -> bool:
    if resource == "cpu":
        return not math.isclose(requested, limit, rel_tol=0.0, abs_tol=_CPU_TOLERANCE)
    return requested != limit


def compare_allocation(requested: object, allocation: ResourceAllocation) -> list[ResourceMismatch]:
    """The mismatches between ``requested`` and ``allocation``'s limits, in
    ``COMPARED_RESOURCES`` order; empty when the allocation honours the request.

    ``requested`` is a spec's resources in any shape providers accept: our
    ``SandboxResources``, nemo_gym's, a mapping, or ``None``. Raises ``ValueError`` naming the
    field for a requested value that is not a finite, non-negative number.
    """
    resources = _resources_from(requested)
    if not allocation.components:
        return []
    mismatches: list[ResourceMismatch] = []
    for resource in COMPARED_RESOURCES:
        wanted: float | int | None = getattr(resources, resource)
        if wanted is None:
            continue
        limit = _sandbox_limit(allocation, resource)
        if limit is None:
            mismatches.append(ResourceMismatch(resource, NO_LIMIT, wanted, None))
        elif _differs(resource, wanted, limit):
            kind: MismatchKind = BELOW_REQUEST if limit < wanted else ABOVE_REQUEST
            mismatches.append(ResourceMismatch(resource, kind, wanted, limit))
    return mismatches


def mismatch_attributes(mismatches: Sequence[ResourceMismatch]) -> dict[str, Attribute]:
    """The allocation record's attributes for ``mismatches`` (empty for none)."""
    if not mismatches:
        return {}
    # A string array is an OpenTelemetry attribute value; ``Attribute`` names only scalars.
    resources = cast(Attribute, tuple(m.resource for m in mismatches))
    attributes: dict[str, Attribute] = {MISMATCH_PREFIX + "resources": resources}
    for mismatch in mismatches:
        prefix = f"{MISMATCH_PREFIX}{mismatch.resource}."
        attributes[prefix + "kind"] = mismatch.kind
        attributes[prefix + "requested"] = mismatch.requested
        if mismatch.allocated is not None:
            attributes[prefix + "allocated"] = mismatch.allocated
    return attributes


_EXPLANATION = {
    BELOW_REQUEST: "capped below the request",
    ABOVE_REQUEST: "set above the request",
    NO_LIMIT: "not limited at all",
}


class MismatchWarnings:
    """Log one warning per (provider, resource) that ever mismatched; later ones are dropped
    (the counter still counts them). Thread-safe; never raises."""

    def __init__(self, to: logging.Logger = logger) -> None:
        self._once = OnceLog(to)

    def warn(self, provider: str, mismatches: Sequence[ResourceMismatch]) -> None:
        for mismatch in mismatches:
            allocated = "no limit" if mismatch.allocated is None else f"{mismatch.allocated:g}"
            self._once(
                (provider, mismatch.resource),
                logging.WARNING,
                "sandbox provider %r: %s %s (requested %g, allocated %s); later %s mismatches "
                "of this provider are counted on gym.sandbox.allocation.mismatches, not logged",
                provider,
                mismatch.resource,
                _EXPLANATION[mismatch.kind],
                mismatch.requested,
                allocated,
                mismatch.resource,
            )

    def reset(self) -> None:
        """Forget what was logged (for tests)."""
        self._once.reset()
