"""Usage samples of a Docker provider's containers: the container's cgroup, else the engine.

Where this host can read a container's cgroup (a local engine whose cgroups we may read:
see ``_container_cgroup``), a sample reads a handful of cgroup files and asks the engine
nothing, which is what cAdvisor and the kubelet do: ``usage.source`` is ``cgroup.v1`` or
``cgroup.v2``. Elsewhere (an engine on another machine behind a forwarded socket, a rootless
engine whose cgroups we cannot read) each sample is an inspect plus the stats endpoint:
``usage.source`` is ``docker.stats``. The cgroup is looked for once per container, from the
inspect answer the provider already has at create (or, for a handle made elsewhere, at its
first sample), and is not looked for again once it has been found missing.

The two paths give the same figures for one container (the engine reads the same cgroup
files), with one difference: on cgroup v2, Podman's stats report memory as ``memory.current``
less ``inactive_file``, as ``docker stats`` shows it; ours is ``memory.current``, as the
process provider's is.

OOM kills: the cgroup path reports ``usage.oom_kills``, the kernel's cumulative count for the
container's memory cgroup, so a process ``exec``'d into a container that survives its kill
is counted too. The stats path can only report the engine's ``State.OOMKilled`` flag
(``usage.oom_killed``), which is about the container's main process.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroup_mounts import (
    Mounts,
    read_mounts,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._cgroups import (
    Cgroup,
    cgroup_usage,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._container_cgroup import (
    container_cgroup,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import Attribute

__all__ = ["ContainerUsage"]

logger = logging.getLogger(__name__)
STATS_SOURCE = "docker.stats"


@dataclass
class _Located:
    """One container's cgroup (``None``: use the engine) and its last OOM kill count."""

    cgroup: Cgroup | None
    oom_kills: int | None = None


class ContainerUsage:
    """The usage samples of one provider's containers (see the module).

    ``inspect`` is the provider's inspect call and ``stats`` its reading of the engine's
    stats for a running container, as ``usage.*`` attributes (``usage.source`` is
    ``stats_source``): the Engine API's stats endpoint for ``otel_docker``, the CLI's
    ``stats`` for NeMo Gym's docker provider. ``cgroups=False`` keeps every sample on
    ``stats``. Runs on the event loop; cgroup files are small kernel files read
    synchronously. Engine failures raise as ``inspect`` and ``stats`` raise them.
    """

    def __init__(
        self,
        inspect: Callable[[str], Awaitable[dict[str, Any]]],
        stats: Callable[[str], Awaitable[dict[str, Attribute]]],
        *,
        stats_source: str = STATS_SOURCE,
        cgroups: bool = True,
    ) -> None:
        self._inspect = inspect
        self._stats = stats
        self._stats_source = stats_source
        self._cgroups = cgroups
        self._located: dict[str, _Located] = {}
        self._mounts: Mounts | None = None  # read at the first locate (see _container_cgroup)

    def locate(self, container_id: str, inspect: dict[str, Any]) -> None:
        """Find the container's cgroup from an inspect answer taken while it runs. Never
        raises: this runs inside ``create``, which telemetry must not fail. ``container_id``
        is how the provider names the container (its ID, or the name NeMo Gym's provider
        gave it); the cgroup is matched against the engine's ID in ``inspect``."""
        cgroup = None
        if self._cgroups:
            try:
                pid = (inspect.get("State") or {}).get("Pid")
                engine_id = str(inspect.get("Id") or container_id)
                cgroup = self._container_cgroup(pid, engine_id)
            except Exception as exc:  # noqa: BLE001 - the stats endpoint still answers
                logger.debug("container %s: cgroup not located: %r", container_id, exc)
        self._located[container_id] = _Located(cgroup)

    def _container_cgroup(self, pid: object, container_id: str) -> Cgroup | None:
        """``container_cgroup`` under this host's cgroup mounts, read once rather than per
        container. A cgroup found under the kept mounts is checked against its own files
        (the PID in ``cgroup.procs``, the memory usage readable), so it is live whatever
        has been mounted since. When none is found, the mounts are read again and, if they
        have changed (a hierarchy mounted after the first look), the search is repeated:
        the answer is the one a fresh read alone would give."""
        if self._mounts is not None:
            cgroup = container_cgroup(pid, container_id, self._mounts)
            if cgroup is not None:
                return cgroup
        mounts = read_mounts()
        if mounts == self._mounts:
            return None
        self._mounts = mounts
        return container_cgroup(pid, container_id, mounts)

    def forget(self, container_id: str) -> None:
        """Drop what is known about a container (it was removed)."""
        self._located.pop(container_id, None)

    def sample_nowait(self, container_id: str) -> dict[str, Attribute] | None:
        """The sample ``sample`` would give when the container's cgroup answers it alone (a
        located cgroup, readable, with processes in it), read synchronously; else ``None``
        (the engine is needed: ``sample`` asks it). Never raises for a missing cgroup."""
        located = self._located.get(container_id)
        sample = None if located is None else _cgroup_sample(located)
        if sample is None or sample.get("usage.pids") == 0:
            return None  # not located, gone or ended: ``sample`` asks the engine
        return sample

    async def sample(self, container_id: str) -> dict[str, Attribute]:
        """One usage sample (keys ``usage.*``), from the cgroup where possible.

        The cgroup answers while the container has processes; once it has none, the engine's
        ``usage.exit_code`` and ``usage.oom_killed`` are added; once the cgroup is gone, the
        engine answers alone, keeping the last OOM kill count the cgroup gave.
        """
        inspect: dict[str, Any] | None = None
        located = self._located.get(container_id)
        if located is None:
            inspect = await self._inspect(container_id)
            state = inspect.get("State") or {}
            if state.get("Running"):
                self.locate(container_id, inspect)
                located = self._located[container_id]
            else:
                located = _Located(None)
        sample = _cgroup_sample(located)
        if sample is not None:
            if sample.get("usage.pids") == 0:
                # No process left: the container has ended; the engine says how.
                sample.update(_ending(await self._state(container_id, inspect)))
            return sample
        state = await self._state(container_id, inspect)
        sample = {"usage.source": self._stats_source}
        sample.update(_ending(state))
        if state.get("Running"):
            sample.update(await self._stats(container_id))
        if located.oom_kills is not None:
            # The cgroup counted kills before it went: keep the count (never lower), and the
            # engine's flag is at least one kill the cgroup may not have shown in time.
            flagged = 1 if sample.get("usage.oom_killed") is True else 0
            sample["usage.oom_kills"] = max(located.oom_kills, flagged)
        return sample

    async def _state(self, container_id: str, inspect: dict[str, Any] | None) -> dict[str, Any]:
        """The engine's ``State`` of the container, from ``inspect`` when already asked."""
        return (inspect or await self._inspect(container_id)).get("State") or {}


def _cgroup_sample(located: _Located) -> dict[str, Attribute] | None:
    """The container's sample from its cgroup, keeping its OOM kill count; ``None`` when it
    has no readable cgroup (once gone, the container ended or its cgroup moved, it is not
    read again). Reads small kernel files synchronously."""
    if located.cgroup is None:
        return None
    usage = cgroup_usage(located.cgroup)
    if usage is None:
        located.cgroup = None
        return None
    kills = usage.get("oom_kills")
    if isinstance(kills, int):
        located.oom_kills = kills
    sample: dict[str, Attribute] = {"usage.source": located.cgroup.source}
    for quantity, value in usage.items():
        sample["usage." + quantity] = value
    return sample


def _ending(state: dict[str, Any]) -> dict[str, Attribute]:
    """The engine's word on how a container ended: OOM-killed, and (once it is no longer
    running) its exit code."""
    ending: dict[str, Attribute] = {}
    if isinstance(state.get("OOMKilled"), bool):
        ending["usage.oom_killed"] = state["OOMKilled"]
    if not state.get("Running") and isinstance(state.get("ExitCode"), int):
        ending["usage.exit_code"] = state["ExitCode"]
    return ending
