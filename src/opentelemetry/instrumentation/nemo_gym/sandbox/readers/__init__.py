"""Resource readers: the records of providers that do not implement ``ResourceProvider``.

A reader reads a sandbox's allocation and usage beside a provider that cannot say them
itself: NeMo Gym's built-in providers. ``READERS`` names each provider class we know by its
module and class name (so a user's provider that happens to be called ``docker`` is never
mistaken for NeMo Gym's), with the reader made for it; one module per reader:
``docker_cli`` (``docker``), ``host_instance`` (``apptainer``, ``enroot``), ``opensandbox``
(its container through the engine where co-located, else OpenSandbox's metrics API) and
``unknown`` (the providers whose sandboxes run elsewhere and that read nothing back:
``daytona``, ``ecs_fargate``, ``openshell``). Every other provider without ``ResourceProvider`` gets
``UnknownResourcesReader`` too, whose records say that allocation and usage are unknown and
why.

``resource_source(provider)`` is what the traced create reads records from: the provider
itself when it implements ``ResourceProvider``, else its reader (one per provider object).
Readers run beside the provider's calls, never in front: they never take a provider's locks
or semaphores, and their reads are bounded like any provider's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.instrumentation.nemo_gym._shared._per_provider import PerProvider
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import ResourceProvider
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.docker_cli import DockerCliReader
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.host_instance import (
    apptainer_reader,
    enroot_reader,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.opensandbox import OpenSandboxReader
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.unknown import (
    REMOTE,
    UNKNOWN_PROVIDER,
    UnknownResourcesReader,
)

__all__ = ["READERS", "Reader", "resource_source"]

_NEMO_GYM = "nemo_gym.sandbox.providers."


# A reader has ``ResourceProvider``'s two reads (an unknown reader answers them with
# ``ResourcesUnknown``), and may have ``periodic`` (False: no samples but the final one) and
# ``release(handle)`` (called after the final sample).
Reader = Any


def _unknown(reason: str) -> Callable[[object], Reader]:
    return lambda provider: UnknownResourcesReader(reason)


# (module, class name) -> the reader made for one provider object of that class.
READERS: dict[tuple[str, str], Callable[[object], Reader]] = {
    (_NEMO_GYM + "docker.provider", "DockerProvider"): DockerCliReader,
    (_NEMO_GYM + "apptainer.provider", "ApptainerProvider"): apptainer_reader,
    (_NEMO_GYM + "enroot.provider", "EnrootProvider"): enroot_reader,
    (_NEMO_GYM + "opensandbox.provider", "OpenSandboxProvider"): OpenSandboxReader,
    (_NEMO_GYM + "daytona.provider", "DaytonaProvider"): _unknown(REMOTE),
    (_NEMO_GYM + "ecs_fargate.provider", "EcsFargateProvider"): _unknown(REMOTE),
    (_NEMO_GYM + "openshell.provider", "OpenShellProvider"): _unknown(REMOTE),
}

# One reader per provider object (a reader keeps per-provider state: the cgroups it found),
# dropped with the provider; what belongs to the engine (its facts, its batches of reads) is
# shared by the readers of every provider on it (``_engine``).
_MADE: PerProvider[Reader] = PerProvider()


def resource_source(provider: object) -> Reader:
    """Where ``provider``'s sandboxes' records come from: the provider itself, its reader
    from ``READERS``, or ``UnknownResourcesReader("unknown_provider")``."""
    if isinstance(provider, ResourceProvider):
        return provider
    # A provider that cannot be weakly referenced gets a reader of its own each time.
    return _MADE.get(provider, lambda: _new_reader(provider))


def _new_reader(provider: object) -> Reader:
    kind = type(provider)
    factory = READERS.get((kind.__module__, kind.__qualname__), _unknown(UNKNOWN_PROVIDER))
    return factory(provider)
