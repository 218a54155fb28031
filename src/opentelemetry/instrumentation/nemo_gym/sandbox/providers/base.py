"""The provider-facing sandbox protocol and its values.

Shapes follow nemo_gym's ``sandbox.providers.base`` so that nemo_gym's own specs, handles and
providers work here duck-typed, and ours work there. The additions are
``SandboxResourceAmounts``: the quantities that requests, limits and usage share, validated on
construction so a NaN, an infinity or a negative amount never reaches a span; and
``ContainerResourceAmounts``, a container's limits, which add the process count an engine caps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "EXEC_TIMEOUT_RETURN_CODE",
    "MIB",
    "ContainerResourceAmounts",
    "ExecResult",
    "SandboxCreateError",
    "SandboxExecResult",
    "SandboxHandle",
    "SandboxProvider",
    "SandboxResourceAmounts",
    "SandboxResources",
    "SandboxSpec",
    "SandboxStatus",
]


# Bytes in a mebibyte: every ``*_mib`` quantity, for both bundled providers.
MIB = 1 << 20

# The return code of a command a provider ended at its timeout (with ``error_type="timeout"``),
# as coreutils' ``timeout`` reports it; the same for every bundled provider.
EXEC_TIMEOUT_RETURN_CODE = 124

# The largest integer an OpenTelemetry attribute can carry (a signed 64-bit value).
_MAX_INT = (1 << 63) - 1


class SandboxStatus(str, Enum):  # noqa: UP042 - nemo_gym's shape: str(status) as theirs
    """Provider-neutral sandbox lifecycle status."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"
    ERROR = "error"
    UNKNOWN = "unknown"


def _checked_quantity(name: str, value: object, kind: type[int] | type[float]) -> Any:
    """Return ``value`` as ``kind``, or raise ``ValueError`` naming the field and the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"sandbox resource {name}={value!r} is not a number")  # noqa: TRY004
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"sandbox resource {name}={value!r} must be finite")
    if value < 0:
        raise ValueError(f"sandbox resource {name}={value!r} must not be negative")
    # Integers have no upper bound in Python, but a span attribute is 64-bit: refuse here,
    # naming the field, rather than fail later with an OverflowError nobody can place.
    if value > _MAX_INT:
        raise ValueError(f"sandbox resource {name}={value!r} is too large (at most 2**63 - 1)")
    if kind is int:
        if value != int(value):
            raise ValueError(f"sandbox resource {name}={value!r} must be a whole number")
        return int(value)
    return float(value)


def _positive_seconds(name: str, value: object) -> float | None:
    """``value`` as seconds: ``None`` stays ``None``; anything but a finite positive number
    raises ``ValueError`` naming ``name``. Shared by the providers' timeouts."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name}={value!r} must be a positive number of seconds or None")
    return float(value)


@dataclass(frozen=True)
class SandboxResourceAmounts:
    """Resource quantities shared by requests, limits and allocations; ``None`` is unknown.

    ``cpu`` is in cores (0.5 is half a core), ``memory_mib`` in MiB, ``disk_gib`` in GiB,
    ``gpu`` a device count. Construction raises ``ValueError`` naming the field for a value
    that is NaN, infinite, negative or not a number; an absent value stays ``None`` and is
    never read as 0.
    """

    cpu: float | None = None
    memory_mib: int | None = None
    disk_gib: int | None = None
    gpu: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu", _checked_quantity("cpu", self.cpu, float))
        object.__setattr__(
            self, "memory_mib", _checked_quantity("memory_mib", self.memory_mib, int)
        )
        object.__setattr__(self, "disk_gib", _checked_quantity("disk_gib", self.disk_gib, int))
        object.__setattr__(self, "gpu", _checked_quantity("gpu", self.gpu, int))


@dataclass(frozen=True)
class ContainerResourceAmounts(SandboxResourceAmounts):
    """A container's limits: the shared quantities plus ``pids``, the most processes (and
    threads) the engine lets it hold at once.

    Only limits have it: NeMo Gym's ``SandboxResources`` cannot ask for a process count, so it
    is no shared quantity and never appears in requests. ``None`` is no known limit (what the
    docker readers make of an engine's null, 0 or -1), never 0; a value is validated like the
    others.
    """

    pids: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "pids", _checked_quantity("pids", self.pids, int))


@dataclass(frozen=True)
class SandboxResources(SandboxResourceAmounts):
    """A sandbox's requested shape: the shared quantities plus the kind of GPU."""

    gpu_type: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gpu_type is not None and (not isinstance(self.gpu_type, str) or not self.gpu_type):
            raise ValueError(
                f"sandbox resource gpu_type={self.gpu_type!r} must be a non-empty string or None"
            )

    @classmethod
    def from_mapping(cls, resources: Mapping[str, Any] | None) -> SandboxResources:
        """Build from a configuration mapping; unknown keys raise ``ValueError`` listing the
        allowed ones, and each value is validated as on construction."""
        if resources is None:
            return cls()
        if not isinstance(resources, Mapping):
            kind = type(resources).__name__
            raise ValueError(f"sandbox resources must be a mapping, not {kind}")  # noqa: TRY004
        allowed = [f.name for f in fields(cls)]
        for key in resources:
            if not isinstance(key, str):
                raise ValueError(  # noqa: TRY004 - one exception type for bad resources
                    f"sandbox resource key {key!r} is not a string; "
                    f"allowed keys: {', '.join(sorted(allowed))}"
                )
        unknown = sorted(set(resources) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown sandbox resource keys: {', '.join(unknown)}; "
                f"allowed keys: {', '.join(sorted(allowed))}"
            )
        values: dict[str, Any] = {}
        for name in ("cpu", "memory_mib", "disk_gib", "gpu"):
            raw = resources.get(name)
            values[name] = _coerce_number(name, raw, float if name == "cpu" else int)
        # Validated by the constructor: a string or None, never a number turned into "nan".
        values["gpu_type"] = resources.get("gpu_type")
        return cls(**values)


def _coerce_number(name: str, raw: object, kind: type[int] | type[float]) -> Any:
    """Accept numbers and numeric strings from configuration files."""
    if raw is None:
        return None
    if isinstance(raw, str):
        text = raw.strip()
        try:
            # Whole numbers stay integers, so a huge one is refused as too large, not rounded.
            raw = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise ValueError(f"sandbox resource {name}={raw!r} is not a number") from None
    return _checked_quantity(name, raw, kind)


@dataclass(frozen=True)
class SandboxSpec:
    """A sandbox creation request."""

    image: str | None = None
    ttl_s: int | float | None = None
    ready_timeout_s: int | float | None = None
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    resources: SandboxResources | Mapping[str, Any] = field(default_factory=SandboxResources)
    entrypoint: list[str] | None = None
    provider_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.resources, SandboxResources):
            object.__setattr__(self, "resources", SandboxResources.from_mapping(self.resources))


def _resources_from(value: object) -> SandboxResources:
    """Any requested shape as ours: our ``SandboxResources`` as is, ``None`` as no request, a
    mapping through ``from_mapping``, another object of the same shape (nemo_gym's
    ``SandboxResources``) by its attributes; each value validated as on construction."""
    if value is None:
        return SandboxResources()
    if isinstance(value, SandboxResources):
        return value
    if isinstance(value, Mapping):
        return SandboxResources.from_mapping(value)
    return SandboxResources.from_mapping(
        {name: getattr(value, name, None) for name in _RESOURCE_FIELDS}
    )


_RESOURCE_FIELDS = ("cpu", "memory_mib", "disk_gib", "gpu", "gpu_type")


def _spec_from(spec: object) -> SandboxSpec:
    """Any creation request as our ``SandboxSpec``, so providers read one type.

    Ours is returned as is; a mapping's keys are the fields (unknown keys raise ``ValueError``
    listing the allowed ones); another object of the same shape (nemo_gym's ``SandboxSpec``)
    is read field by field, missing fields taking their defaults. Values keep their types
    (providers validate them); ``resources`` goes through ``_resources_from``.
    """
    if isinstance(spec, SandboxSpec):
        return spec
    allowed = [f.name for f in fields(SandboxSpec)]
    if isinstance(spec, Mapping):
        unknown = sorted(str(key) for key in set(spec) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown sandbox spec keys: {', '.join(unknown)}; "
                f"allowed keys: {', '.join(sorted(allowed))}"
            )
        values = {name: spec[name] for name in allowed if spec.get(name) is not None}
    else:
        values = {
            name: getattr(spec, name) for name in allowed if getattr(spec, name, None) is not None
        }
    values["resources"] = _resources_from(values.get("resources"))
    return SandboxSpec(**values)


@dataclass
class SandboxHandle:
    """A provider-neutral handle to a created sandbox.

    ``raw`` is provider-owned state; code other than the provider passes it back through the
    handle without reading it.
    """

    sandbox_id: str
    provider_name: str
    raw: Any


@dataclass(frozen=True)
class SandboxExecResult:
    """The outcome of one command run in a sandbox.

    ``return_code`` is the process exit code when the command ran. When the runtime ended it
    without one (a timeout, say), providers return a sentinel code with ``error_type`` set.
    """

    stdout: str | None
    stderr: str | None
    return_code: int
    error_type: str | None = None


ExecResult = SandboxExecResult


class SandboxCreateError(RuntimeError):
    """A provider could not create a sandbox; the message carries the provider's reason."""


@runtime_checkable
class SandboxProvider(Protocol):
    """What a sandbox runtime provides; nemo_gym's providers have the same shape."""

    name: str

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Create a sandbox ready to run commands, or raise ``SandboxCreateError``."""
        ...

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        """Run ``command`` with ``sh -c`` semantics inside the sandbox."""
        ...

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        """Copy one local file into the sandbox."""
        ...

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path
    ) -> None:
        """Copy one sandbox file to the local filesystem."""
        ...

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        """Return the sandbox's lifecycle status."""
        ...

    async def close(self, handle: SandboxHandle) -> None:
        """End the sandbox and release everything it holds."""
        ...

    async def aclose(self) -> None:
        """Release provider-wide resources such as clients and sessions."""
        ...
