"""What the pool instruments report: attribute sets and observations, from counts and states.

Plain computation between aiohttp's state (read by ``_aiohttp_compat``) and the instruments
(owned by ``_pool_telemetry``): no I/O, no locks, no OpenTelemetry calls beyond building
``Observation`` values.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry.metrics import Observation

from opentelemetry.instrumentation.nemo_gym.telemetry import _instruments as names
from opentelemetry.instrumentation.nemo_gym.telemetry._aiohttp_compat import Destination, PoolState
from opentelemetry.instrumentation.nemo_gym.telemetry._destination_budget import (
    OVERFLOW_ATTRIBUTE,
    DestinationBudget,
)


def add_into(total: dict[Any, int], counts: dict[Any, int]) -> None:
    """Add ``counts`` into ``total``, key by key."""
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


def destination_attributes(where: Destination) -> dict[str, str | int]:
    """``server.address``, ``server.port`` and ``url.scheme`` of a destination."""
    return {
        names.ATTR_SERVER_ADDRESS: where[0],
        names.ATTR_SERVER_PORT: where[1],
        names.ATTR_URL_SCHEME: where[2],
    }


def error_type_name(error_type: type[BaseException]) -> str:
    """``error.type`` as the conventions ask: the qualified class name, builtins left bare."""
    module = error_type.__module__
    qualname = error_type.__qualname__
    return qualname if module == "builtins" else f"{module}.{qualname}"


def semconv_wait_attributes(
    where: Destination | None,
    constraint: str,
    error_type: type[BaseException] | None,
    label: str,
    overflow: bool = False,
) -> dict[str, str | int | bool]:
    """The attributes of one ``http.client.request.time_in_queue`` sample.

    ``overflow``: the destination is over the budget, so it is named by
    ``otel.metric.overflow=true`` instead of its address and port.
    """
    attributes: dict[str, str | int | bool] = {
        names.ATTR_QUEUE_CONSTRAINT: constraint,
        names.ATTR_SERVER_NAME: label,
    }
    if overflow:
        attributes[OVERFLOW_ATTRIBUTE] = True
    elif where is not None:
        attributes.update(destination_attributes(where))
    if error_type is not None:
        attributes[names.ATTR_ERROR_TYPE] = error_type_name(error_type)
    return attributes


def open_connection_observations(
    states: Iterable[PoolState], budget: DestinationBudget
) -> Iterator[Observation]:
    """``http.client.open_connections``: active and idle connections per destination.

    Every destination seen gets both states, so a pool that went quiet reports active 0
    rather than a series that just stops. Destinations over ``budget`` are summed into one
    ``otel.metric.overflow=true`` series per state.
    """
    active: dict[Destination, int] = {}
    idle: dict[Destination, int] = {}
    for state in states:
        add_into(active, state.active)
        add_into(idle, state.idle)
    both = {where: active.get(where, 0) + idle.get(where, 0) for where in active.keys() | idle}
    own = sorted(budget.split(both)[0])
    rest = both.keys() - set(own)
    for state_name, counts in ((names.STATE_ACTIVE, active), (names.STATE_IDLE, idle)):
        for where in own:
            attributes: dict[str, str | int | bool] = dict(destination_attributes(where))
            attributes[names.ATTR_CONNECTION_STATE] = state_name
            yield Observation(counts.get(where, 0), attributes)
        if rest:
            yield Observation(
                sum(counts.get(where, 0) for where in rest),
                {OVERFLOW_ATTRIBUTE: True, names.ATTR_CONNECTION_STATE: state_name},
            )


def waiting_observations(
    states: Iterable[PoolState], budget: DestinationBudget
) -> Iterator[Observation]:
    """``gym.http.connection_pool.waiting_requests`` per destination, over-budget ones summed."""
    waiting: dict[Destination, int] = {}
    for state in states:
        add_into(waiting, state.waiting)
    own, rest = budget.split(waiting)
    for where, count in sorted(own.items()):
        yield Observation(count, destination_attributes(where))
    if rest is not None:
        yield Observation(rest, {OVERFLOW_ATTRIBUTE: True})


def limit_observations(connectors: list[Any]) -> Iterator[Observation]:
    """``gym.http.connection_pool.limit``: the finite limits of ``connectors``, summed.

    Reads aiohttp's public ``limit``/``limit_per_host``; 0 means unlimited and adds nothing.
    Nothing is observed when there is no connector.
    """
    if not connectors:
        return
    total = per_host = 0
    for connector in connectors:
        total += max(int(connector.limit), 0)
        per_host += max(int(connector.limit_per_host), 0)
    yield Observation(total, {names.ATTR_LIMIT_KIND: names.LIMIT_TOTAL})
    yield Observation(per_host, {names.ATTR_LIMIT_KIND: names.LIMIT_PER_HOST})
