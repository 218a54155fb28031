"""Pure translations between sandbox resources and Docker Engine JSON (no I/O, no OTel).

``host_config`` turns a requested shape into ``HostConfig``; ``allocation_from_inspect`` and
``sample_from_stats`` read an engine's inspect and stats answers back into the typed
allocation and usage attributes. Engine fields that are missing, 0 or -1 mean "not set" and
become absent values, never 0.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox._attributes import within_total
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    MIB,
    ContainerResourceAmounts,
    SandboxResourceAmounts,
    SandboxResources,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    Attribute,
    ComponentAllocation,
    ResourceAllocation,
    ResourceDesignator,
)


def _positive(mapping: Mapping[str, Any], key: str) -> int | None:
    """An engine number that means something only when positive (0 and -1 mean unset)."""
    value = mapping.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    return None


def _nested(mapping: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return mapping


def host_config(resources: SandboxResources, extra: Mapping[str, Any]) -> dict[str, Any]:
    """``HostConfig`` for the requested resources: cpu as ``NanoCpus``, memory as ``Memory``
    with an equal ``MemorySwap`` (no swap beyond the limit), GPUs as a device request; then
    ``extra`` (``provider_options["host_config"]``) on top."""
    config: dict[str, Any] = {}
    if resources.cpu is not None:
        config["NanoCpus"] = round(resources.cpu * 1e9)
    if resources.memory_mib is not None:
        config["Memory"] = config["MemorySwap"] = resources.memory_mib * MIB
    if resources.gpu:
        config["DeviceRequests"] = [{"Count": resources.gpu, "Capabilities": [["gpu"]]}]
    config.update(extra)
    return config


def daemon_scope(info: Mapping[str, Any], libpod_info: Mapping[str, Any] | None) -> str | None:
    """The identity of the daemon that container IDs are meaningful in.

    Docker's ``/info`` ``ID`` is stable. Podman's compatible ``/info`` invents a new ``ID`` on
    every call, so for Podman (``libpod_info`` given) the scope is a digest of what does
    identify its container namespace: the host name and the storage root.
    """
    if libpod_info is None:
        return str(info.get("ID") or "") or None
    host = _nested(libpod_info, "host", "hostname")
    root = _nested(libpod_info, "store", "graphRoot")
    if not host or not root:
        return None
    digest = hashlib.sha256(f"{host}\0{root}".encode()).hexdigest()[:16]
    return f"podman-{digest}"


def allocation_from_inspect(
    inspect: Mapping[str, Any], daemon: Mapping[str, Any]
) -> ResourceAllocation:
    """The allocation a container's inspect answer shows; 0 or a missing field stays unknown.

    The limits are ``ContainerResourceAmounts``: cpu, memory and the pids limit.
    """
    config = inspect.get("HostConfig") or {}
    cpu_limit: float | None = None
    nano = _positive(config, "NanoCpus")
    quota, period = _positive(config, "CpuQuota"), _positive(config, "CpuPeriod")
    if nano is not None:
        cpu_limit = nano / 1e9
    elif quota is not None and period is not None:
        cpu_limit = quota / period
    memory = _positive(config, "Memory")
    reservation = _positive(config, "MemoryReservation")
    shares = _positive(config, "CpuShares")
    # The pids limit as the engine reports it, not the cgroup's ``pids.max``: both hold what
    # the engine set (measured equal on Podman 4.3: 32 and 32, 2048 and 2048, 0 and ``max``),
    # but the inspect answer is what every other quantity here comes from, and it is there
    # wherever the engine is, also where this host cannot read the container's cgroup.
    # Null, 0 and -1 mean no limit. An engine's own default is what it set: Podman gives a
    # container whose create asks nothing (``otel_docker``'s, or its own CLI's) 2048.
    pids = _positive(config, "PidsLimit")
    component = ComponentAllocation(
        name="container",
        # CpuShares are relative weights; 1024 is the engines' weight of one full core.
        requests=SandboxResourceAmounts(
            cpu=None if shares is None else shares / 1024,
            memory_mib=None if reservation is None else reservation // MIB,
        ),
        limits=ContainerResourceAmounts(
            cpu=cpu_limit, memory_mib=None if memory is None else memory // MIB, pids=pids
        ),
    )
    daemon_id = daemon.get("Scope") or None
    daemon_name = daemon.get("Name") or None
    return ResourceAllocation(
        source="docker.inspect",
        components=(component,),
        designator=ResourceDesignator("container", str(inspect["Id"]), scope=daemon_id),
        host=None if daemon_name is None else ResourceDesignator("host", str(daemon_name)),
    )


def sample_from_stats(stats: Mapping[str, Any] | None) -> dict[str, Attribute]:
    """Usage attributes from a stats answer (cgroup v1 or v2 shape); absent fields are omitted.
    Memory above the answer's own ``memory_stats.limit`` (the container's limit, else the
    host's memory) is impossible and dropped (``within_total``: logged once)."""
    sample: dict[str, Attribute] = {}
    if not stats:
        return sample
    throttling = _nested(stats, "cpu_stats", "throttling_data")
    # Throttled time means something only once quota periods were counted: Podman 4 on
    # cgroup v1 sends this block as zeros whatever the cgroup says, and a 0 would be a lie.
    throttled = (
        _nested(throttling, "throttled_time") if _positive(throttling or {}, "periods") else None
    )
    readings = {
        "usage.cpu.time_s": (_nested(stats, "cpu_stats", "cpu_usage", "total_usage"), 1e9),
        "usage.cpu.throttled_s": (throttled, 1e9),
        "usage.memory_mib": (_nested(stats, "memory_stats", "usage"), MIB),
        "usage.memory_peak_mib": (_nested(stats, "memory_stats", "max_usage"), MIB),
        "usage.pids": (_nested(stats, "pids_stats", "current"), 1),
    }
    limit = _nested(stats, "memory_stats", "limit")
    for key, (value, scale) in readings.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            if key in _MEMORY and within_total(key, value, limit, "memory limit") is None:
                continue
            sample[key] = int(value) if scale == 1 else value / scale
    return sample


# The stats figures bounded by the answer's memory limit.
_MEMORY = ("usage.memory_mib", "usage.memory_peak_mib")
