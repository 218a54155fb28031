"""The resource records' attributes: pure functions, no I/O, no OpenTelemetry (a dropped
sample value is logged once).

``resource_telemetry`` documents and re-exports the public ones (``amount_attributes``,
``requested_attributes``, ``record_request``, ``allocation_attributes``): they turn a
``SandboxSpec``, a ``ResourceAllocation`` and a provider's usage sample into span attributes
under ``PREFIX = "nemo.gym.sandbox."``, with identical keys for every provider.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from typing import TypeVar, cast

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    PREFIX,
    Attribute,
    PlacedAllocation,
    ResourceAllocation,
    ResourceDesignator,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._log import log_once
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    ContainerResourceAmounts,
    SandboxResourceAmounts,
    SandboxResources,
    SandboxSpec,
)

__all__ = [
    "allocation_attributes",
    "amount_attributes",
    "changed_attributes",
    "record_request",
    "requested_attributes",
    "sample_attributes",
    "within_total",
]

_QUANTITIES = ("cpu", "memory_mib", "disk_gib", "gpu")
_CONTAINER_QUANTITIES = (*_QUANTITIES, "pids")

# The largest integer a span attribute can carry (signed 64-bit).
_MAX_INT = (1 << 63) - 1


def _string_array(values: Sequence[str]) -> Attribute:
    # OpenTelemetry attribute values include homogeneous sequences; the API's ``Attribute``
    # alias names only the scalars, so a string array is cast to it here, in one place.
    return cast(Attribute, tuple(values))


def amount_attributes(amounts: SandboxResourceAmounts, prefix: str) -> dict[str, Attribute]:
    """Serialize shared resource quantities without losing unspecified values.

    Each known quantity becomes ``prefix + name``; an absent one (``None``) is omitted, never
    written as 0, and its name is listed in ``prefix + "unspecified"`` (a string array, left
    out when everything is specified). ``amounts`` may be any object with the four quantity
    attributes (nemo_gym's work duck-typed). A ``ContainerResourceAmounts`` adds ``pids``
    under the same rules; other amounts have no such quantity, so their keys never mention it.
    """
    attributes: dict[str, Attribute] = {}
    unspecified: list[str] = []
    names = _CONTAINER_QUANTITIES if isinstance(amounts, ContainerResourceAmounts) else _QUANTITIES
    for name in names:
        value = getattr(amounts, name, None)
        if value is None:
            unspecified.append(name)
        else:
            attributes[prefix + name] = value
    if unspecified:
        attributes[prefix + "unspecified"] = _string_array(unspecified)
    return attributes


def _resources_of(spec: SandboxSpec) -> SandboxResources:
    """The spec's resources as our validated type, whatever shape the caller used."""
    resources: object = getattr(spec, "resources", None)
    if resources is None:
        return SandboxResources()
    if isinstance(resources, SandboxResources):
        return resources
    if isinstance(resources, Mapping):
        return SandboxResources.from_mapping(resources)
    return SandboxResources(
        cpu=getattr(resources, "cpu", None),
        memory_mib=getattr(resources, "memory_mib", None),
        disk_gib=getattr(resources, "disk_gib", None),
        gpu=getattr(resources, "gpu", None),
        gpu_type=getattr(resources, "gpu_type", None),
    )


def requested_attributes(spec: SandboxSpec) -> dict[str, Attribute]:
    """Declared shape only. Absent values are unknown, never zero or effective allocation.

    Keys are ``PREFIX + "requested.<quantity>"`` plus ``requested.gpu_type``; absent ones are
    listed in ``requested.unspecified``. Raises ``ValueError`` naming the field for a value
    that is NaN, infinite, negative or not a number.
    """
    resources = _resources_of(spec)
    prefix = PREFIX + "requested."
    attributes = amount_attributes(resources, prefix)
    unspecified = list(cast(Sequence[str], attributes.pop(prefix + "unspecified", ())))
    if resources.gpu_type is None:
        unspecified.append("gpu_type")
    else:
        attributes[prefix + "gpu_type"] = resources.gpu_type
    if unspecified:
        attributes[prefix + "unspecified"] = _string_array(unspecified)
    return attributes


def record_request(spec: SandboxSpec, attributes: Mapping[str, Attribute]) -> dict[str, Attribute]:
    """Give one logical sandbox request an identity, even if provisioning never succeeds.

    Returns ``attributes`` plus ``PREFIX + "request.id"`` (a fresh uuid4 hex, unless
    ``attributes`` already carries one: a retry of the same logical request keeps it) and the
    requested shape. Call it before provisioning so a failed create can still be told apart.
    Pure: it neither emits nor stores anything. Raises ``ValueError`` like
    ``requested_attributes``.
    """
    recorded = dict(attributes)
    recorded.setdefault(PREFIX + "request.id", uuid.uuid4().hex)
    recorded.update(requested_attributes(spec))
    return recorded


def _designator_attributes(
    designator: ResourceDesignator | None, prefix: str
) -> dict[str, Attribute]:
    if designator is None:
        return {}
    attributes: dict[str, Attribute] = {
        prefix + "kind": designator.kind,
        prefix + "id": designator.id,
    }
    if designator.scope is not None:
        attributes[prefix + "scope"] = designator.scope
    return attributes


def allocation_attributes(allocation: ResourceAllocation) -> dict[str, Attribute]:
    """Use identical OTEL keys for every provider's typed allocation.

    ``allocation.source``, ``allocation.designator.{kind,id,scope}``,
    ``allocation.host.{kind,id,scope}`` (absent parts omitted), ``allocation.components``
    (names, in order), per component, ``allocation.component.<name>.requests.<quantity>``
    and ``.limits.<quantity>`` under the rules of ``amount_attributes``, and
    ``allocation.placement.<name>`` for each placement a ``PlacedAllocation`` names.
    """
    prefix = PREFIX + "allocation."
    attributes: dict[str, Attribute] = {prefix + "source": allocation.source}
    attributes.update(_designator_attributes(allocation.designator, prefix + "designator."))
    attributes.update(_designator_attributes(allocation.host, prefix + "host."))
    attributes[prefix + "components"] = _string_array([c.name for c in allocation.components])
    for component in allocation.components:
        base = f"{prefix}component.{component.name}."
        attributes.update(amount_attributes(component.requests, base + "requests."))
        attributes.update(amount_attributes(component.limits, base + "limits."))
    if isinstance(allocation, PlacedAllocation):
        for name, value in allocation.placement.items():
            attributes[f"{prefix}placement.{name}"] = value
    return attributes


def _clean_number(value: int | float) -> bool:
    """Whether a sample's number can be a usage figure: finite, not negative, 64-bit."""
    if isinstance(value, bool):
        return True
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return 0 <= value <= _MAX_INT


_Number = TypeVar("_Number", int, float)


def within_total(name: str, value: _Number, total: object, total_name: str) -> _Number | None:
    """``value``, unless it is more than ``total``, the answer's own bound on it (a memory
    figure above the memory total the same answer gives, a CPU percentage above 100 times its
    CPU count): such a figure cannot be a reading, so it is dropped (``None``) and logged
    once per ``name``, as a NaN or negative figure is. A ``total`` that is not a finite
    positive number bounds nothing."""
    if isinstance(total, bool) or not isinstance(total, int | float):
        return value
    if not (0 < total < math.inf) or not value > total:
        return value
    log_once(
        ("sample-impossible", name),
        "dropping sample value %s: %r is more than the answer's own %s (%r)",
        name,
        value,
        total_name,
        total,
    )
    return None


def sample_attributes(sample: Mapping[str, object]) -> dict[str, Attribute]:
    """A provider's sample with every key under ``PREFIX``.

    Values no span can carry, and numbers that cannot be usage (NaN, infinite, negative, or
    beyond 64 bits), are dropped and logged once per key: a broken reading is absent, never
    exported.
    """
    attributes: dict[str, Attribute] = {}
    for key, value in sample.items():
        if not isinstance(key, str):
            log_once(("sample-key", type(key).__name__), "dropping a sample key that is no string")
            continue
        name = key if key.startswith(PREFIX) else PREFIX + key
        # Every sample of every sandbox passes here: the exact types a provider gives come
        # first (a NaN fails both comparisons, an infinity the upper one); subclasses and
        # sequences take the general path below.
        kind = type(value)
        if kind is str or kind is bool:
            attributes[name] = value  # type: ignore[assignment]  # str or bool, as checked
            continue
        if (kind is float or kind is int) and 0 <= value <= _MAX_INT:  # type: ignore[operator]
            attributes[name] = value  # type: ignore[assignment]  # a clean number, as checked
            continue
        if isinstance(value, int | float) and not _clean_number(value):
            log_once(
                ("sample-number", name), "dropping sample value %s: %r is not usage", name, value
            )
        elif isinstance(value, str | int | float | bool):
            attributes[name] = value
        elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
            attributes[name] = _string_array(cast(Sequence[str], value))
        else:
            log_once(
                ("sample-value", name),
                "dropping sample value %s of type %s",
                name,
                type(value).__name__,
            )
    return attributes


def changed_attributes(
    previous: Mapping[str, Attribute], sample: Mapping[str, Attribute]
) -> dict[str, Attribute] | None:
    """``sample`` without the values ``previous`` already had (equal, and of the same type);
    ``None`` when ``previous`` has a key that ``sample`` lacks, since a record leaving it out
    would read as unchanged rather than gone (such a sample goes whole). Pure."""
    if not previous.keys() <= sample.keys():
        return None
    changed: dict[str, Attribute] = {}
    for key, value in sample.items():
        before = previous.get(key, _ABSENT)
        if before != value or type(before) is not type(value):
            changed[key] = value
    return changed


_ABSENT = object()
