"""Which NeMo Gym server a process is, from what ``gym env start`` hands it, in NeMo Gym's
own names.

Functions over an environment mapping and ``argv``: no I/O, no OpenTelemetry (``new_run_id``
draws a random id; setting it in the environment is the resource detector's).

The names are the ones NeMo Gym's in-app telemetry (``nemo_gym.telemetry.setup``, 0.6+, built
on nemo-lens) puts on its resource, so a server reads the same whichever of the two reports
it (``docs/names.md`` has the table):

* ``service.name`` ``<group>/<server>`` (``nemo-gym/policy_model``), and the group alone as
  ``nemo.gym.service_group``. The group is NeMo Gym's ``telemetry.service_name``: ``nemo-gym``,
  or ``OTEL_SERVICE_NAME`` where set (NeMo Gym's orchestrator exports it there). Its
  ``NEMO_GYM_OTEL_SERVICE_NAME_PER_SERVER=0`` leaves the server name off.
* NeMo Gym's command line is its ``orchestrator``: ``nemo-gym/orchestrator``, with
  ``nemo.gym.server.name`` and ``nemo.gym.server.type`` both ``orchestrator``.
* ``nemo.run.id``: one id for every process of a run. NeMo Gym's orchestrator takes
  ``NEMO_GYM_OTEL_RUN_ID``, else ``SLURM_JOB_ID``, else 12 random hex digits, and writes it
  into ``NEMO_GYM_OTEL_RUN_ID`` before it spawns a server, so every server inherits it; the
  resource detector does the same in the command line.

``gym env start`` (nemo-gym 0.4.0, ``nemo_gym/cli/env.py``) runs each server as
``NEMO_GYM_CONFIG_DICT=<yaml> NEMO_GYM_CONFIG_PATH=<name> python app.py`` in the server's
folder, where ``<yaml>`` is the whole merged configuration (``OmegaConf.to_yaml``) and
``<name>`` the server's top-level key. A server block has three levels::

    policy_model:              # the server's name (what ServerClient and our labels use)
      responses_api_models:    # its type
        openai_model:          # its implementation
          entrypoint: app.py
          num_workers: 2       # uvicorn workers (NeMo Gym sets NEMO_GYM_FASTAPI_NUM_WORKERS)

With ``num_workers > 1``, NeMo Gym sets ``IS_NEMO_GYM_FASTAPI_WORKER=1`` in its own process
just before ``uvicorn.run(workers=...)``, so every worker process uvicorn spawns has it from
its first instruction, and the process ``gym env start`` launched does not have it when the
SDK starts.

The configuration holds credentials (``policy_api_key``, ``hf_token``, model API keys inside
server blocks). Nothing here returns, logs or raises with a configuration *value* except the
one integer ``num_workers``: the YAML is scanned line by line for the keys above, never parsed
into an object, and a problem is reported by variable and key name only.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final

from opentelemetry.util.types import AttributeValue

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._once import shown_value

CONFIG_DICT_VARIABLE: Final = "NEMO_GYM_CONFIG_DICT"
CONFIG_PATH_VARIABLE: Final = "NEMO_GYM_CONFIG_PATH"
FASTAPI_WORKER_VARIABLE: Final = "IS_NEMO_GYM_FASTAPI_WORKER"
NUM_WORKERS_KEY: Final = "num_workers"

ATTR_SERVICE_NAME: Final = _names.ATTR_SERVICE_NAME
ATTR_SERVICE_GROUP: Final = "nemo.gym.service_group"
ATTR_RUN_ID: Final = _names.ATTR_RUN_ID
# NeMo Gym's own words for the three levels of a server block ("unique server name", "server
# type", "server implementation"); the name is the value NeMo Gym's ServerClient and our
# `nemo.gym.http.destination.server.name` label use, so a destination joins to its process.
ATTR_SERVER_NAME: Final = "nemo.gym.server.name"
ATTR_SERVER_TYPE: Final = "nemo.gym.server.type"
ATTR_SERVER_IMPLEMENTATION: Final = "nemo.gym.server.implementation"
ATTR_SERVER_WORKERS: Final = "nemo.gym.server.workers"
ATTR_UVICORN_WORKER: Final = "nemo.gym.server.uvicorn_worker"

# NeMo Gym 0.4.0's console scripts: `gym`, `ng`, and the legacy `ng_*` / `nemo_gym_*`.
_CLI_NAMES: Final = frozenset({"gym", "ng"})
_CLI_PREFIXES: Final = ("ng_", "nemo_gym_")

# NeMo Gym's `telemetry:` block (`nemo_gym.telemetry.config.TelemetryConfig`) and the variables
# its orchestrator translates it into for the servers (`configure_telemetry_env`).
SERVICE_GROUP: Final = "nemo-gym"  # its `service_name` default
ORCHESTRATOR: Final = "orchestrator"  # what it names its command line, as name and as type
RUN_ID_VARIABLE: Final = "NEMO_GYM_OTEL_RUN_ID"
_RUN_ID_FALLBACK_VARIABLE: Final = "NEMO_LENS_RUN_ID"  # nemo-lens reads it after NeMo Gym's
_SLURM_JOB_VARIABLE: Final = "SLURM_JOB_ID"
_PER_SERVER_VARIABLE: Final = "NEMO_GYM_OTEL_SERVICE_NAME_PER_SERVER"
_TELEMETRY_ENABLED_VARIABLES: Final = ("NEMO_GYM_OTEL_ENABLED", "NEMO_LENS_ENABLED")
_SERVICE_NAME_VARIABLE: Final = "OTEL_SERVICE_NAME"
_TRUTHY: Final = frozenset({"1", "true", "yes", "on"})

Warn = Callable[[str], None]


def server_name(environ: Mapping[str, str]) -> str | None:
    """The name of the NeMo Gym server this process is (``NEMO_GYM_CONFIG_PATH``), or
    ``None`` outside one."""
    return environ.get(CONFIG_PATH_VARIABLE, "").strip() or None


def nemo_gym_server_attributes(environ: Mapping[str, str], warn: Warn) -> dict[str, AttributeValue]:
    """The resource attributes of a NeMo Gym server process; empty elsewhere.

    ``warn`` receives a message naming the variable and key, never a value from the
    configuration. Never raises for any string input.
    """
    name = server_name(environ)
    if name is None:
        return {}
    attributes: dict[str, AttributeValue] = {
        **_service_attributes(environ, name),
        ATTR_SERVER_NAME: name,
        ATTR_UVICORN_WORKER: environ.get(FASTAPI_WORKER_VARIABLE) == "1",
    }
    config = environ.get(CONFIG_DICT_VARIABLE)
    if not config:
        warn(
            f"{CONFIG_PATH_VARIABLE} names the NeMo Gym server {shown_value(name)} but "
            f"{CONFIG_DICT_VARIABLE} is unset: its type and implementation are not known"
        )
        return attributes
    block = server_block(config, name)
    if block is None:
        warn(
            f"{CONFIG_DICT_VARIABLE} has no server block {shown_value(name)} "
            f"(from {CONFIG_PATH_VARIABLE}) of the form <name>: <type>: <implementation>: ...; "
            "its type and implementation are not known"
        )
        return attributes
    server_type, implementation, num_workers = block
    attributes[ATTR_SERVER_TYPE] = server_type
    attributes[ATTR_SERVER_IMPLEMENTATION] = implementation
    workers = _positive_int(num_workers)
    if num_workers is not None and workers is None and not num_workers.startswith("${"):
        # The value is not shown: in this configuration any field may hold a credential.
        warn(
            f"{CONFIG_DICT_VARIABLE}: {name}.{server_type}.{implementation}.{NUM_WORKERS_KEY} "
            "is not a positive integer (value not shown); the worker count is left out"
        )
    if workers is not None:
        attributes[ATTR_SERVER_WORKERS] = workers
    return attributes


def is_nemo_gym_cli(argv: Sequence[str]) -> bool:
    """True in NeMo Gym's own command line (``gym env start``, ``gym eval run``, ``ng_run``)."""
    if not argv:
        return False
    program = os.path.basename(argv[0])
    return program in _CLI_NAMES or program.startswith(_CLI_PREFIXES)


def nemo_gym_cli_attributes(
    environ: Mapping[str, str], argv: Sequence[str]
) -> dict[str, AttributeValue]:
    """NeMo Gym's command line as NeMo Gym names it: its orchestrator. Empty elsewhere."""
    if not is_nemo_gym_cli(argv):
        return {}
    return {
        **_service_attributes(environ, ORCHESTRATOR),
        ATTR_SERVER_NAME: ORCHESTRATOR,
        ATTR_SERVER_TYPE: ORCHESTRATOR,
    }


def run_id(environ: Mapping[str, str]) -> str | None:
    """The run this process belongs to, as NeMo Gym's telemetry reads it, or ``None``.

    ``NEMO_GYM_OTEL_RUN_ID`` (which NeMo Gym's orchestrator, or our detector in the command
    line, hands every server), then nemo-lens's ``NEMO_LENS_RUN_ID``, then ``SLURM_JOB_ID``.
    Where none is set a process has no run id: nemo-lens would make one up per process, which
    would group nothing.
    """
    for variable in (RUN_ID_VARIABLE, _RUN_ID_FALLBACK_VARIABLE, _SLURM_JOB_VARIABLE):
        value = environ.get(variable, "").strip()
        if value:
            return value
    return None


def new_run_id(environ: Mapping[str, str]) -> str:
    """The run id NeMo Gym's orchestrator mints where ``NEMO_GYM_OTEL_RUN_ID`` is unset:
    ``SLURM_JOB_ID``, else 12 random hex digits."""
    return environ.get(_SLURM_JOB_VARIABLE, "").strip() or uuid.uuid4().hex[:12]


def service_group(environ: Mapping[str, str]) -> str:
    """NeMo Gym's service group: ``OTEL_SERVICE_NAME`` where set, else ``nemo-gym``."""
    return environ.get(_SERVICE_NAME_VARIABLE, "").strip() or SERVICE_GROUP


def service_name_is_group(environ: Mapping[str, str]) -> bool:
    """True where ``OTEL_SERVICE_NAME`` is NeMo Gym's service group rather than a whole name:
    NeMo Gym's own telemetry is switched on (its orchestrator exported the variable as the
    group, and its servers append their names to it)."""
    for variable in _TELEMETRY_ENABLED_VARIABLES:
        raw = environ.get(variable, "").strip().lower()
        if raw:  # NeMo Gym's own variable decides before nemo-lens's, as in NeMo Gym
            return raw in _TRUTHY
    return False


def _service_attributes(environ: Mapping[str, str], name: str) -> dict[str, AttributeValue]:
    """``service.name`` ``<group>/<name>`` and ``nemo.gym.service_group``, as NeMo Gym's
    ``init_telemetry`` sets them."""
    group = service_group(environ)
    per_server = environ.get(_PER_SERVER_VARIABLE, "").strip().lower()
    service = group if per_server and per_server not in _TRUTHY else f"{group}/{name}"
    return {ATTR_SERVICE_NAME: service, ATTR_SERVICE_GROUP: group}


def server_block(config_yaml: str, name: str) -> tuple[str, str, str | None] | None:
    """``(type, implementation, raw num_workers or None)`` of server ``name``, or ``None``.

    Reads the block layout ``OmegaConf.to_yaml`` writes (block style, two-space indents).
    Only keys are compared; the one value returned is ``num_workers``'s, as written.
    """
    lines = _keyed_lines(config_yaml)
    for indent, key, value in lines:
        if indent == 0 and key == name and not value:
            break
    else:
        return None
    levels: list[tuple[int, str]] = []  # (indent, key) of the type, then the implementation
    fields_indent: int | None = None
    num_workers: str | None = None
    for indent, key, value in lines:
        if indent == 0:
            break  # the next top-level key: the block has ended
        if len(levels) < 2:
            if levels and indent <= levels[-1][0]:
                return None  # a sibling where the next level should begin: not a server block
            if value:
                return None  # a scalar where a level should be: not a server block
            levels.append((indent, key))
            continue
        if indent <= levels[1][0]:
            break  # the implementation's mapping has ended
        if fields_indent is None:
            fields_indent = indent
        if indent == fields_indent and key == NUM_WORKERS_KEY:
            num_workers = value
    if len(levels) < 2:
        return None
    return levels[0][1], levels[1][1], num_workers


def _keyed_lines(text: str) -> Iterator[tuple[int, str, str]]:
    """``(indent, key, value text)`` of each ``key: value`` or ``key:`` line, lazily."""
    for line in text.splitlines():
        content = line.lstrip(" ")
        if not content or content[0] in "#-":
            continue
        parsed = _split_key(content)
        if parsed is not None:
            yield len(line) - len(content), parsed[0], parsed[1]


def _split_key(content: str) -> tuple[str, str] | None:
    """Split ``key: value`` where the key may be plain, 'single' or "double" quoted."""
    if content[0] == "'":
        end = 1
        while True:
            end = content.find("'", end)
            if end < 0:
                return None
            if content.startswith("''", end):
                end += 2
                continue
            break
        key, rest = content[1:end].replace("''", "'"), content[end + 1 :]
    elif content[0] == '"':
        end = 1
        while True:
            end = content.find('"', end)
            if end < 0:
                return None
            if content[end - 1] == "\\":
                end += 1
                continue
            break
        try:
            key = json.loads(content[: end + 1])
        except ValueError:
            return None
        rest = content[end + 1 :]
    else:
        colon = content.find(": ")
        if colon < 0:
            if not content.endswith(":"):
                return None
            colon = len(content) - 1
        key, rest = content[:colon], content[colon:]
    if not isinstance(key, str) or not rest.startswith(":"):
        return None
    return key, rest[1:].strip()


def _positive_int(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 1 else None
