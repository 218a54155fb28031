"""Connection-pool instrument names, units, buckets and attribute keys.

The names and attribute keys are a contract: dashboards and the shipped Prometheus rules
(``examples/prometheus/rules.yml``) depend on them. Nothing here creates instruments; that is
``_pool_telemetry.PoolTelemetry``'s job, once per meter provider.
"""

from __future__ import annotations

from typing import Final

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._buckets import ladder

# --- nemo_gym.telemetry.connection_pool's names (the default, what NeMo Gym's dashboards use) -

QUEUE_DURATION: Final = "gym.http.connection_pool.queue_duration_ms"
QUEUE_DURATION_UNIT: Final = "ms"
QUEUE_DURATION_DESCRIPTION: Final = (
    "Time an aiohttp request waited for a free connection-pool slot, one sample per queued wait."
)
# Sub-millisecond buckets show a pool that is only just saturated; 30 s covers the longest
# connect timeouts rollout servers use.
QUEUE_DURATION_BUCKETS: Final[tuple[float, ...]] = (
    0.01,
    0.05,
    *ladder(0.1, 1000.0),
    5000.0,
    30000.0,
)

CONNECT_TOTAL: Final = "gym.http.connection_pool.connect_total"
CONNECT_TOTAL_UNIT: Final = "{connection}"
CONNECT_TOTAL_DESCRIPTION: Final = (
    "Pool acquisitions: connect() calls per destination, one per request attempt (a request "
    "served over a kept-alive connection counts too), failed and abandoned ones included. "
    "New TCP connections are gym.http.connection_pool.connections_created."
)

ATTR_QUEUE_CONSTRAINT: Final = "nemo.gym.http.connection_pool.queue_constraint"
ATTR_QUEUE_OUTCOME: Final = "nemo.gym.http.connection_pool.queue_outcome"
ATTR_SERVER_NAME: Final = "nemo.gym.http.destination.server.name"

OUTCOME_OK: Final = "ok"
OUTCOME_ABANDONED: Final = "abandoned"

# --- the HTTP semantic conventions' name (OTEL_SEMCONV_STABILITY_OPT_IN=http or http/dup) ---

TIME_IN_QUEUE: Final = "http.client.request.time_in_queue"
TIME_IN_QUEUE_UNIT: Final = "s"
TIME_IN_QUEUE_DESCRIPTION: Final = (
    "Time an HTTP request spent waiting for a free connection-pool slot, one sample per "
    "queued wait."
)
# The bucket boundaries .NET's HttpClient metrics use for the same measurement.
TIME_IN_QUEUE_BUCKETS: Final[tuple[float, ...]] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)

ATTR_SERVER_ADDRESS: Final = "server.address"
ATTR_SERVER_PORT: Final = "server.port"
ATTR_URL_SCHEME: Final = "url.scheme"
ATTR_ERROR_TYPE: Final = _names.ATTR_ERROR_TYPE

# --- pool state, read from the live connectors at collection time (every naming mode) -------

OPEN_CONNECTIONS: Final = "http.client.open_connections"
OPEN_CONNECTIONS_UNIT: Final = "{connection}"
OPEN_CONNECTIONS_DESCRIPTION: Final = (
    "Connections the aiohttp pools hold: active (handed to a request) or idle (kept alive). "
    "Connections still being established are not counted."
)
ATTR_CONNECTION_STATE: Final = "http.connection.state"
STATE_ACTIVE: Final = "active"
STATE_IDLE: Final = "idle"

WAITING_REQUESTS: Final = "gym.http.connection_pool.waiting_requests"
WAITING_REQUESTS_UNIT: Final = "{request}"
WAITING_REQUESTS_DESCRIPTION: Final = "Requests waiting for a free connection-pool slot now."

LIMIT: Final = "gym.http.connection_pool.limit"
LIMIT_UNIT: Final = "{connection}"
LIMIT_DESCRIPTION: Final = (
    "Configured connection limits summed over the live timed connectors; connectors with "
    "that limit unlimited (0) add nothing."
)
ATTR_LIMIT_KIND: Final = "nemo.gym.http.connection_pool.limit.kind"
LIMIT_TOTAL: Final = "total"
LIMIT_PER_HOST: Final = "per_host"

CONNECTIONS_CREATED: Final = "gym.http.connection_pool.connections_created"
CONNECTIONS_CREATED_UNIT: Final = "{connection}"
CONNECTIONS_CREATED_DESCRIPTION: Final = (
    "TCP connections the aiohttp pools actually established, per destination."
)

# Each observable instrument's unit and description, by name (the pool telemetry registers them
# from this table).
UNITS_AND_DESCRIPTIONS: Final[dict[str, tuple[str, str]]] = {
    CONNECT_TOTAL: (CONNECT_TOTAL_UNIT, CONNECT_TOTAL_DESCRIPTION),
    CONNECTIONS_CREATED: (CONNECTIONS_CREATED_UNIT, CONNECTIONS_CREATED_DESCRIPTION),
    OPEN_CONNECTIONS: (OPEN_CONNECTIONS_UNIT, OPEN_CONNECTIONS_DESCRIPTION),
    WAITING_REQUESTS: (WAITING_REQUESTS_UNIT, WAITING_REQUESTS_DESCRIPTION),
    LIMIT: (LIMIT_UNIT, LIMIT_DESCRIPTION),
}
