"""Which Ray process this is, from its command line: no ``import ray``, no I/O.

Ray starts its Python processes as scripts inside the ``ray`` package, and passes each worker
its node and worker ids as arguments (Ray 2.55-2.60, ``default_worker.py --node-id=<hex>
--worker-id=<hex> --session-name=...``; the dashboard and runtime-env agents get
``--node-id`` too). Those arguments are read before Ray has connected, which is when an SDK
configured by ``opentelemetry-instrument`` builds its resource. Only the few arguments named
here are read: a worker's command line also carries ``--redis-password``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from opentelemetry.util.types import AttributeValue

from opentelemetry.instrumentation.nemo_gym._shared import _names

ATTR_COMPONENT: Final = "ray.component"
ATTR_NODE_ID: Final = "ray.node.id"
ATTR_WORKER_ID: Final = "ray.worker.id"
ATTR_SESSION_NAME: Final = "ray.session.name"

WORKER: Final = "worker"
# The script (as a path suffix inside the `ray` package) that each Python process of Ray runs.
_SCRIPTS: Final = (
    ("ray/_private/workers/default_worker.py", WORKER),
    ("ray/dashboard/dashboard.py", "dashboard"),
    ("ray/dashboard/agent.py", "dashboard_agent"),
    ("ray/_private/runtime_env/agent/main.py", "runtime_env_agent"),
    ("ray/_private/log_monitor.py", "log_monitor"),
    ("ray/autoscaler/_private/monitor.py", "monitor"),
    ("ray/util/client/server/__main__.py", "client_server"),
    ("ray/util/client/server/server.py", "client_server"),
)
_ARGUMENTS: Final = (
    ("--node-id", ATTR_NODE_ID),
    ("--worker-id", ATTR_WORKER_ID),
    ("--session-name", ATTR_SESSION_NAME),
)


def ray_component(argv: Sequence[str], parent_argv: Sequence[str] = ()) -> str | None:
    """Ray's name for the process running ``argv`` (``worker``, ``dashboard``, ...), or None.

    ``parent_argv`` covers the dashboard's module processes: they come from a
    ``multiprocessing`` forkserver (``python -c ...``, so ``argv == ['-c']``) that the
    dashboard starts.
    """
    component = _component_of(argv)
    if component is None and argv[:1] == ["-c"]:
        parent = _component_of(parent_argv)
        if parent == "dashboard":
            return parent
    return component


def is_ray_system_process(argv: Sequence[str], parent_argv: Sequence[str] = ()) -> bool:
    """True in Ray's own daemons (dashboard, agents, monitors): not in workers, not elsewhere."""
    component = ray_component(argv, parent_argv)
    return component is not None and component != WORKER


def ray_process_attributes(
    argv: Sequence[str], parent_argv: Sequence[str] = ()
) -> dict[str, AttributeValue]:
    """``service.name``, ``ray.component`` and the ids Ray passed on the command line."""
    component = ray_component(argv, parent_argv)
    if component is None:
        return {}
    attributes: dict[str, AttributeValue] = {
        _names.ATTR_SERVICE_NAME: f"ray.{component}",
        ATTR_COMPONENT: component,
    }
    if component == _component_of(argv):  # a forked module child has none of its own
        for flag, key in _ARGUMENTS:
            value = _argument(argv, flag)
            if value:
                attributes[key] = value
    return attributes


def _component_of(argv: Sequence[str]) -> str | None:
    if not argv:
        return None
    script = argv[0].replace("\\", "/")
    for suffix, component in _SCRIPTS:
        if script.endswith(suffix):
            return component
    return None


def _argument(argv: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` given as ``--flag=value`` or ``--flag value``; the last wins.

    ``--flag`` followed by another flag has no value: the next token is never taken when it
    starts with ``-`` (Ray's ids and session names never do), so ``--node-id
    --redis-password=X`` cannot put the password into ``ray.node.id``.
    """
    found: str | None = None
    prefix = flag + "="
    for index, argument in enumerate(argv):
        if argument.startswith(prefix):
            found = argument[len(prefix) :]
        elif argument == flag and index + 1 < len(argv) and not argv[index + 1].startswith("-"):
            found = argv[index + 1]
    return found
