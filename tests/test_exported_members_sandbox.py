"""Every documented name of nemo_gym.sandbox.resource_telemetry exists in ours, with its
documented signature."""

from __future__ import annotations

import dataclasses
import inspect
import logging

from opentelemetry.instrumentation.nemo_gym.sandbox import resource_telemetry as rt

P = inspect.Parameter
EMPTY = inspect.Parameter.empty


def parameters(target: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(target).parameters.values()]  # type: ignore[arg-type]


def test_resource_telemetry_functions_have_documented_signatures() -> None:
    """The page's functions take exactly the documented parameters."""
    positional = P.POSITIONAL_OR_KEYWORD
    assert parameters(rt.allocation_attributes) == [("allocation", positional, EMPTY)]
    assert parameters(rt.amount_attributes) == [
        ("amounts", positional, EMPTY),
        ("prefix", positional, EMPTY),
    ]
    assert parameters(rt.record_request) == [
        ("spec", positional, EMPTY),
        ("attributes", positional, EMPTY),
    ]
    assert parameters(rt.requested_attributes) == [("spec", positional, EMPTY)]
    assert parameters(rt.sampling_interval) == []


def test_resource_sampler_has_documented_signature() -> None:
    """ResourceSampler(provider, handle, attributes, interval) and its five methods."""
    positional = P.POSITIONAL_OR_KEYWORD
    assert parameters(rt.ResourceSampler) == [
        ("provider", positional, EMPTY),
        ("handle", positional, EMPTY),
        ("attributes", positional, EMPTY),
        ("interval", positional, EMPTY),
    ]
    assert parameters(rt.ResourceSampler.record) == [
        ("self", positional, EMPTY),
        ("kind", positional, EMPTY),
        ("final", positional, False),
    ]
    assert parameters(rt.ResourceSampler.record_allocation) == [("self", positional, EMPTY)]
    for name in ("run", "stop", "record_allocation"):
        assert inspect.iscoroutinefunction(getattr(rt.ResourceSampler, name))
    assert inspect.iscoroutinefunction(rt.ResourceSampler.record)
    assert not inspect.iscoroutinefunction(rt.ResourceSampler.start)


def test_resource_telemetry_values_have_documented_fields() -> None:
    """The dataclasses' fields and defaults are the page's."""

    def fields(cls: type) -> list[tuple[str, object]]:
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    missing = dataclasses.MISSING
    assert fields(rt.ResourceDesignator) == [("kind", missing), ("id", missing), ("scope", None)]
    assert fields(rt.ComponentAllocation) == [
        ("name", missing),
        ("requests", missing),
        ("limits", missing),
    ]
    assert fields(rt.ResourceAllocation) == [
        ("source", missing),
        ("components", ()),
        ("designator", None),
        ("host", None),
    ]
    assert rt.ComponentAllocation("c").requests == rt.SandboxResourceAmounts()


def test_resource_telemetry_data_names() -> None:
    """PREFIX, LOGGER and Attribute are the documented values."""
    assert rt.PREFIX == "nemo.gym.sandbox."
    assert isinstance(rt.LOGGER, logging.Logger)
    assert rt.LOGGER.name == rt.__name__
    assert rt.Attribute == str | int | float | bool
    assert {"ResourceProvider", "ResourceSampler", "sampling_interval"} <= set(rt.__all__)
