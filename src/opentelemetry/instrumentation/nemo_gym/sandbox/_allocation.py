"""The values a resource provider reports: designators, component allocations, allocations.

Plain frozen values and the ``ResourceProvider`` protocol, with no I/O and no OpenTelemetry;
``resource_telemetry`` (where reference page 000 documents them) re-exports every name. A
``ResourceDesignator`` refuses values that look like an endpoint with credentials, so a secret
can never become a span attribute through one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxHandle,
    SandboxResourceAmounts,
)

Attribute = str | int | float | bool

# Parameters that carry secrets in connection strings and query strings. A designator is an
# identity, so any of these in it means a caller passed an endpoint or credential by mistake.
_SECRET_PARAMETER = re.compile(
    r"(?:^|[?&;,\s])(?:token|access_token|password|passwd|pwd|secret|api_key|apikey|auth)=",
    re.IGNORECASE,
)


def _refuse_credentials(field_name: str, value: str) -> None:
    if _SECRET_PARAMETER.search(value):
        raise ValueError(
            f"resource designator {field_name}={value!r} carries a credential parameter; "
            "a designator is an opaque identity, never an endpoint or a secret"
        )
    if "://" in value:
        try:
            parts = urlsplit(value)
        except ValueError:
            return
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                f"resource designator {field_name}={value!r} carries URL user-info; "
                "a designator is an opaque identity, never an endpoint or a secret"
            )


@dataclass(frozen=True)
class ResourceDesignator:
    """Opaque infrastructure identity interpreted by kind, within an optional scope.

    This is not a network endpoint or reconnect descriptor and contains no credentials. Scope
    identifies the deployment/cluster/daemon in which the ID is meaningful. Construction
    raises ``ValueError`` for an empty kind or id, or for a value carrying URL user-info or a
    ``token=``/``password=``/``secret=``-style parameter.
    """

    kind: str
    id: str
    scope: str | None = None

    def __post_init__(self) -> None:
        for name in ("kind", "id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"resource designator {name}={value!r} must be a non-empty string")
        if self.scope is not None and not isinstance(self.scope, str):
            raise ValueError(f"resource designator scope={self.scope!r} must be a string or None")
        for name in ("kind", "id", "scope"):
            value = getattr(self, name)
            if value is not None:
                _refuse_credentials(name, value)


@dataclass(frozen=True)
class ComponentAllocation:
    """Observed reservations and limits for one explicitly named component."""

    name: str
    requests: SandboxResourceAmounts = field(default_factory=SandboxResourceAmounts)
    limits: SandboxResourceAmounts = field(default_factory=SandboxResourceAmounts)


@dataclass(frozen=True)
class ResourceAllocation:
    """Provider-independent allocation record; placement is optional."""

    source: str
    components: tuple[ComponentAllocation, ...] = ()
    designator: ResourceDesignator | None = None
    host: ResourceDesignator | None = None


@runtime_checkable
class ResourceProvider(Protocol):
    """Optional read-only capability; values carry explicit provider/source semantics."""

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        """What the infrastructure actually allocated to the sandbox, read back from it."""
        ...

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        """One usage sample keyed ``PREFIX + "usage.<quantity>"`` (``PREFIX`` added if absent)."""
        ...
