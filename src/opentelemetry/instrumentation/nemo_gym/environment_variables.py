"""Environment variables read by the nemo_gym instrumentation.

``opentelemetry-instrument`` offers each as a flag through the
``opentelemetry_environment_variables`` entry point: ``OTEL_PYTHON_`` dropped, the rest lower
case (``OTEL_PYTHON_NEMO_GYM_WORKERS`` is ``--nemo_gym_workers``). It builds those flags from
the names alone, so its ``--help`` shows no description for them (nor for any other
instrumentation's); the descriptions are here and in the README. Every variable is checked
when ``instrument()`` runs: a value that cannot be parsed is reported once, with the variable
and the value (its first 64 characters and its length, when longer), and the default is used
instead; configuration never stops an application.
"""

OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL = "OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_CONNECTION_POOL

Whether ``instrument()`` patches ``aiohttp.TCPConnector`` construction so pools report queue
waits and connects. ``true`` (default) or ``false``.
Flag: ``--nemo_gym_connection_pool``.
"""

OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCES

Whether ``instrument()`` registers the sandbox span processor and traces the bundled sandbox
providers. ``true`` (default) or ``false``.
Flag: ``--nemo_gym_sandbox_resources``.
"""

OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL = "OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_SANDBOX_RESOURCE_INTERVAL

Seconds between resource usage samples of a running sandbox. Default 10; ``0`` turns periodic
sampling off (the allocation and the final sample are still recorded). The shortest interval
is 0.1: a positive value below it is raised to 0.1, with one warning. Each sample is a
provider call and a span per sandbox; at ``1e-9`` one idle sandbox spent a whole CPU core on
them, while 0.1 still sees the peak of a sandbox that lives for a second.
Flag: ``--nemo_gym_sandbox_resource_interval``.
"""

OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT = "OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_SANDBOX_CGROUP_PARENT

The cgroup under which the ``otel_process`` provider (``ProcessSandboxProvider``) makes its
sandboxes' cgroups, as ``/proc/self/cgroup`` spells cgroup paths: absolute, such as
``/gym.slice/sandboxes``, in every hierarchy (cgroup v1) or the one (v2). It must exist and be
writable; on cgroup v2 it must hold no process other than this server (which is then moved into
its child ``nemo_gym_server``). Unset by default: sandbox cgroups go under the server's own
cgroup, so that whatever bounds the server (Kubernetes, Slurm, systemd) bounds its sandboxes
too. ``/`` makes them at the root of the hierarchy, outside the server's limits. A value that is
not an absolute path is one warning and treated as unset; a cgroup that is missing, not
writable or shared (v2) is one warning naming the value, and the server's own cgroup is used.
Flag: ``--nemo_gym_sandbox_cgroup_parent``.
"""

OTEL_PYTHON_NEMO_GYM_WORKERS = "OTEL_PYTHON_NEMO_GYM_WORKERS"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_WORKERS

Number of worker processes that share one server's configured connector limits. The capacity
report divides limits across them. Default 1.
Flag: ``--nemo_gym_workers``.
"""

OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY = "OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY

Expected concurrent outbound requests of one server's process group. When set, the capacity
report warns if a connector's total limit cannot serve it. Unset by default (no check).
Flag: ``--nemo_gym_intended_concurrency``.
"""

OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST = (
    "OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST"
)
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_INTENDED_CONCURRENCY_PER_HOST

Expected concurrent outbound requests to one destination from one server's process group.
When set, the capacity report checks it against the per-host limit and the ephemeral-port
budget. Unset by default (no check).
Flag: ``--nemo_gym_intended_concurrency_per_host``.
"""

OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES = "OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_MAX_SERVER_NAMES

Most distinct destination labels (``set_server_name``) recorded per process; later names are
recorded as ``other``, with one warning. Default 100.
Flag: ``--nemo_gym_max_server_names``.
"""

OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS = "OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_MAX_DESTINATIONS

Most destinations (``server.address``/``server.port``) with series of their own per meter
provider, in each pool instrument keyed by them; the rest share one series marked
``otel.metric.overflow=true``. Default 100.
Flag: ``--nemo_gym_max_destinations``.
"""

OTEL_PYTHON_NEMO_GYM_LOG_LEVEL = "OTEL_PYTHON_NEMO_GYM_LOG_LEVEL"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_LOG_LEVEL

A level name as Python's logging spells it, in any case: ``debug``, ``info``, ``warning``
(``warn``), ``error``, ``critical`` (``fatal``). Print this instrumentation's own log lines (the
status line, the capacity report, its warnings) at that level and above to stderr, in
processes whose logging nobody configured, such as NeMo Gym's servers (Python then shows
warnings only). The lines then go to that stderr handler only, not on to the root logger.
Unset by default (the application's logging configuration decides); any other value is one
warning naming the accepted levels, and is treated as unset.
Flag: ``--nemo_gym_log_level``.
"""

OTEL_PYTHON_NEMO_GYM_PRESSURE = "OTEL_PYTHON_NEMO_GYM_PRESSURE"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_PRESSURE

Whether ``instrument()`` records the pressure on each process with NeMo Gym's names: the
event-loop lag (``gym.event_loop.lag_ms``), garbage-collection pauses (``gym.gc.*``) and
requests in flight (``gym.server.requests.in_flight``), plus the process CPU, memory, thread
and file-descriptor metrics of ``opentelemetry-instrumentation-system-metrics`` where that is
installed (the ``pressure`` extra). They start with each uvicorn server (every NeMo Gym
server) and in each loop that builds an aiohttp connector, and not where NeMo Gym's own
observer records them. ``true`` (default) or ``false``.
Flag: ``--nemo_gym_pressure``.
"""

OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS = "OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_LOOP_LAG_INTERVAL_MS

Milliseconds between two event-loop lag measurements: the probe asks the loop to run a
callback this long from now and records how late it ran. Default 100; at least 10 (a smaller
value, or one that is not a number, is one warning and the default). The probe costs one timer
per interval, nothing per request.
Flag: ``--nemo_gym_loop_lag_interval_ms``.
"""

OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN = "OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_ROLLOUT_SPAN

Whether ``instrument()`` wraps NeMo Gym's ``ServerClient.request`` so that each rollout
(a ``POST /run`` whose row carries NeMo Gym's task and rollout indices) runs inside a
``rollout`` span, the root of the rollout's trace. ``true`` (default) or ``false``. Off, the
method is not wrapped at all.
Flag: ``--nemo_gym_rollout_span``.
"""

OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT = "OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_FRESH_REQUEST_CONTEXT

Whether ``instrument()`` makes each request a uvicorn server handles start from an empty
OpenTelemetry context, so that a request never joins the trace of an earlier request on the
same connection (uvicorn can hand one request's context to the next: a CPython bug, gh-140947).
``true`` (default) or ``false``. Off, ``uvicorn.Server.startup`` is not wrapped and the app is
served as uvicorn serves it.
Flag: ``--nemo_gym_fresh_request_context``.
"""

OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION = "OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION"
"""
.. envvar:: OTEL_PYTHON_NEMO_GYM_RAY_PROPAGATION

Whether ``instrument()`` carries the current trace context into Ray tasks and actor methods
started inside a span: the caller adds one keyword argument (``__nemo_gym_otel_context__``)
for workers whose ``runtime_env`` runs ``setup_worker``, and such a worker's instrumentation
takes it off before the task runs. ``true`` (default) or ``false``. Off, nothing of Ray's is
patched and a task's arguments are exactly the caller's; a caller sends nothing to a task
whose ``runtime_env`` sets this variable to ``false``.
Flag: ``--nemo_gym_ray_propagation``.
"""
