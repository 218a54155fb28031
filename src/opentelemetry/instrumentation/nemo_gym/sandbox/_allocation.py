"""The values a resource provider reports: designators, component allocations, allocations.

Plain frozen values and the ``ResourceProvider`` protocol, with no I/O and no OpenTelemetry;
``resource_telemetry`` (the documented API, ``nemo_gym.sandbox.resource_telemetry``) re-exports
every name. Each value validates itself on construction, so a NaN, an infinity, a negative amount or
a credential never becomes a span attribute through one. ``PREFIX`` and ``Attribute`` live here, at
the bottom of the sandbox modules, so every other module can import them without a cycle.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    SandboxHandle,
    SandboxResourceAmounts,
)

Attribute = str | int | float | bool

PREFIX = _names.SANDBOX_PREFIX

# A parameter (``name=value``) in a connection string or query. Its name is split into words
# and refused when a word (or the whole name) says it holds a secret, so ``client_secret``,
# ``AWS_SECRET_ACCESS_KEY``, ``api-key``, ``X-Amz-Signature`` and ``sig`` are all caught, not
# just a fixed list of spellings.
_PARAMETER = re.compile(r"(?:^|(?<=[^A-Za-z0-9_.\-]))([A-Za-z][A-Za-z0-9_.\-]*)\s*=")
_SECRET_WORDS = frozenset(
    {
        "auth",
        "authorization",
        "bearer",
        "credential",
        "credentials",
        "pass",
        "passwd",
        "password",
        "pw",
        "pwd",
        "sas",
        "secret",
        "secrets",
        "sig",
        "signature",
        "token",
    }
)
_SECRET_ENDINGS = ("apikey", "accesskey", "privatekey", "secretkey", "sessionkey", "token")
# ``user:password@host``, with or without a scheme in front.
_USER_INFO = re.compile(r"(?:^|[\s/;,])[^\s/@:;,]+:[^\s/@]*@")
_BEARER = re.compile(r"\bbearer\s+\S", re.IGNORECASE)


def _secret_name(name: str) -> bool:
    words = re.split(r"[_.\-]+", name.lower())
    joined = "".join(words)
    return any(w in _SECRET_WORDS for w in words) or joined.endswith(_SECRET_ENDINGS)


def _credential_kind(value: str) -> str | None:
    """What in ``value`` looks like a credential, described without repeating it; or None."""
    for match in _PARAMETER.finditer(value):
        name = match.group(1)
        if _secret_name(name):
            return f"a secret-named parameter ({name}=)"
    if _BEARER.search(value):
        return "a bearer token"
    if _USER_INFO.search(value):
        return "user-info (user:password@)"
    if "://" in value:
        try:
            parts = urlsplit(value)
        except ValueError:
            return None
        if parts.username is not None or parts.password is not None:
            return "URL user-info"
    return None


def _refuse_credentials(field_name: str, value: str, owner: str = "resource designator") -> None:
    """Raise ``ValueError`` when ``value`` looks like it carries a credential.

    The message names the field and the kind of thing found, never the value itself: it may be
    logged or shown, and the value may be a secret.
    """
    kind = _credential_kind(value)
    if kind is not None:
        raise ValueError(
            f"{owner} {field_name} carries {kind}; a designator or placement is an opaque "
            "identity, never an endpoint or a secret (value not shown)"
        )


@dataclass(frozen=True)
class ResourceDesignator:
    """Opaque infrastructure identity interpreted by kind, within an optional scope.

    This is not a network endpoint or reconnect descriptor and contains no credentials. Scope
    identifies the deployment/cluster/daemon in which the ID is meaningful. Construction
    raises ``ValueError`` for an empty kind or id, or for a value carrying user-info
    (``user:pw@host``, with or without a scheme), a bearer token, or a parameter whose name
    says it holds a secret (``password=``, ``client_secret=``, ``api-key=``, ``sig=``, ...).
    """

    kind: str
    id: str
    scope: str | None = None

    def __post_init__(self) -> None:
        for name in ("kind", "id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                kind = type(value).__name__
                raise ValueError(
                    f"resource designator {name} must be a non-empty string, not {kind}"
                    + (" ''" if value == "" else "")
                )
        if self.scope is not None and not isinstance(self.scope, str):
            kind = type(self.scope).__name__
            raise ValueError(f"resource designator scope must be a string or None, not {kind}")
        for name in ("kind", "id", "scope"):
            value = getattr(self, name)
            if value is not None:
                _refuse_credentials(name, value)


def _amounts(field_name: str, value: object) -> SandboxResourceAmounts:
    """``value`` as our validated amounts: ours as is; a mapping or an object with the four
    quantity attributes (nemo_gym's, duck-typed) converted, so its values are checked."""
    if isinstance(value, SandboxResourceAmounts):
        return value
    names = ("cpu", "memory_mib", "disk_gib", "gpu")
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise ValueError(
                f"component {field_name} has unknown quantities {unknown}; allowed: {list(names)}"
            )
        raw: dict[str, Any] = {name: value.get(name) for name in names}
    else:
        raw = {name: getattr(value, name, None) for name in names}
    try:
        return SandboxResourceAmounts(**raw)
    except ValueError as exc:
        raise ValueError(f"component {field_name}: {exc}") from None


@dataclass(frozen=True)
class ComponentAllocation:
    """Observed reservations and limits for one explicitly named component."""

    name: str
    requests: SandboxResourceAmounts = field(default_factory=SandboxResourceAmounts)
    limits: SandboxResourceAmounts = field(default_factory=SandboxResourceAmounts)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(
                f"component allocation name must be a non-empty string, not {self.name!r}"
            )
        object.__setattr__(self, "requests", _amounts("requests", self.requests))
        object.__setattr__(self, "limits", _amounts("limits", self.limits))


# A placement name: lower-case words joined by "_" (it becomes an attribute key's last part).
_PLACEMENT_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class ResourceAllocation:
    """Provider-independent allocation record; placement is optional."""

    source: str
    components: tuple[ComponentAllocation, ...] = ()
    designator: ResourceDesignator | None = None
    host: ResourceDesignator | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(
                f"resource allocation source must be a non-empty string, not {self.source!r}"
            )
        components = tuple(self.components)
        for component in components:
            if not isinstance(component, ComponentAllocation):
                kind = type(component).__name__
                raise ValueError(  # noqa: TRY004 - one exception type for a wrong value
                    f"resource allocation components must be ComponentAllocation, not {kind}"
                )
        object.__setattr__(self, "components", components)
        for name in ("designator", "host"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, ResourceDesignator):
                kind = type(value).__name__
                raise ValueError(
                    f"resource allocation {name} must be a ResourceDesignator or None, not {kind}"
                )


@dataclass(frozen=True)
class PlacedAllocation(ResourceAllocation):
    """A ``ResourceAllocation`` that also names how the sandbox was placed, as the
    infrastructure names it (a Kubernetes pod's ``namespace``, ``pod``, ``node`` and
    ``qos_class``), recorded as ``allocation.placement.<name>``. Not part of page 000's API: a
    reader's answer, read by the record like any allocation. Names are lower-case words joined
    by ``_``, values strings; a value carrying a credential raises ``ValueError``, as a
    designator's does."""

    placement: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        placement = dict(self.placement)
        for name, value in placement.items():
            if not isinstance(name, str) or not _PLACEMENT_NAME.match(name):
                raise ValueError(
                    f"resource allocation placement name {name!r} must be lower-case words "
                    "joined by '_'"
                )
            if not isinstance(value, str):
                kind = type(value).__name__
                raise ValueError(  # noqa: TRY004 - one exception type for a wrong value
                    f"resource allocation placement {name} must be a string, not {kind}"
                )
            _refuse_credentials(name, value, "resource allocation placement")
        object.__setattr__(self, "placement", placement)


@runtime_checkable
class ResourceProvider(Protocol):
    """Optional read-only capability; values carry explicit provider/source semantics."""

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        """What the infrastructure actually allocated to the sandbox, read back from it."""
        ...

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        """One usage sample keyed ``PREFIX + "usage.<quantity>"`` (``PREFIX`` added if absent)."""
        ...


@dataclass(frozen=True)
class ResourcesUnknown:
    """A resource reader's answer when it cannot know a sandbox's allocation or usage.

    The record then carries ``allocation.unknown_reason`` or ``usage.unknown_reason`` with
    ``reason`` (a short, stable code such as ``remote``), and no figure: unknown is never 0.
    """

    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError(f"resources unknown reason={self.reason!r} must be a non-empty string")
