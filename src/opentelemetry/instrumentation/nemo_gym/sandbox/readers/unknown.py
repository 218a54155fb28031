"""The reader of a provider whose sandboxes' resources this plugin cannot read.

Its records say so, and why, instead of saying nothing or 0: one allocation record with
``allocation.unknown_reason`` and one final sample with ``usage.unknown_reason``. The reasons:

* ``remote``: NeMo Gym's providers whose sandboxes run on another service and that read
  nothing back. Checked in NeMo Gym main (0.5.1) source: ``daytona`` passes cpu, memory and
  disk to Daytona's create and reads back only the state; ``ecs_fargate`` sets the task's cpu
  and memory and reads only the task's status (``describe_tasks``), with no usage;
  ``openshell`` sets cpu and memory in its gRPC sandbox spec and reads back only the phase.
  None keeps a client call for limits or usage that a reader could make beside it.
  (``opensandbox`` has one, ``get_metrics()``: it has its own reader, ``opensandbox``.)
* ``unknown_provider``: any other provider that does not implement ``ResourceProvider``.
"""

from __future__ import annotations

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import ResourcesUnknown
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxHandle

__all__ = ["REMOTE", "UNKNOWN_PROVIDER", "UnknownResourcesReader"]

REMOTE = "remote"
UNKNOWN_PROVIDER = "unknown_provider"


class UnknownResourcesReader:
    """Answers every read with ``ResourcesUnknown(reason)``. Samples once, at close: there
    is nothing to sample periodically."""

    periodic = False

    def __init__(self, reason: str) -> None:
        self._answer = ResourcesUnknown(reason)

    async def resource_allocation(self, handle: SandboxHandle) -> ResourcesUnknown:
        return self._answer

    async def resource_sample(self, handle: SandboxHandle) -> ResourcesUnknown:
        return self._answer
