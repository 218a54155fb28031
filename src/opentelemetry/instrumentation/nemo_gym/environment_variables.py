"""Environment variables read by the nemo_gym instrumentation.

``opentelemetry-instrument`` lists these through the ``opentelemetry_environment_variables``
entry point. A value that cannot be parsed is reported once, with the variable and the value,
and the default is used instead: configuration never stops an application from starting.
"""

OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL = "OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL

Whether ``instrument()`` patches ``aiohttp.TCPConnector`` construction so pools report queue
waits and connects. ``true`` (default) or ``false``.
"""

OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES

Whether ``instrument()`` registers the sandbox span processor and traces the bundled sandbox
providers. ``true`` (default) or ``false``.
"""

OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL

Seconds between resource usage samples of a running sandbox. Default 10; ``0`` turns periodic
sampling off (the allocation and the final sample are still recorded).
"""

OTEL_PYTHON_NEMO_GYM_WORKERS = "OTEL_PYTHON_NEMO_GYM_WORKERS"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_WORKERS

Number of worker processes that share one server's configured connector limits. The capacity
report divides limits across them. Default 1.
"""

OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY = "OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY

Expected concurrent outbound requests of one server's process group. When set, the capacity
report warns if a connector's total limit cannot serve it. Unset by default (no check).
"""

OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST = (
    "OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST"
)
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST

Expected concurrent outbound requests to one destination from one server's process group.
When set, the capacity report checks it against the per-host limit and the ephemeral-port
budget. Unset by default (no check).
"""

OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES = "OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES

Most distinct destination labels (``set_server_name``) recorded per process; later names are
recorded as ``other``, with one warning. Default 100.
"""
