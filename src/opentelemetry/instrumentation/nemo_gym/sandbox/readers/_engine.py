"""The container engine that NeMo Gym's CLI-driving providers use, as every reader shares it.

NeMo Gym's ``docker`` provider (and the Docker runtime of an ``opensandbox`` server on this
host) start their containers through the ``docker`` CLI; a reader asks the same engine about
them. One ``Engine`` per engine endpoint serves every reader of the process (NeMo Gym makes a
provider, so a reader, per ``AsyncSandbox``), so that a burst of sandboxes costs the engine
few requests and this host no process per sandbox:

* **over its socket** where the engine is reachable that way (``DOCKER_HOST=unix://...``, the
  socket the CLI itself talks to): the Engine API, as ``otel_docker`` speaks it, one short
  aiohttp session per batch of reads;
* **through the CLI** elsewhere (``DOCKER_HOST`` unset or not a unix socket, a
  ``podman-docker`` binary): one process per batch of reads, never one per sandbox.

Reads that arrive together are coalesced (``Coalesced``): the allocation reads of sandboxes
created in one burst wake together once the burst settles (``_burst``), and become one
``docker inspect`` of all their containers (over the socket, one inspect request each, with
no process), and the ``opensandbox`` lookups of one burst one list of the containers carrying
a label. The daemon's facts are read once per engine for the process (``_engine_facts``).

Every read is bounded (``READ_TIMEOUT_S`` per request over the socket, per process through the
CLI: a process still running then is killed) and read-only.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from opentelemetry.instrumentation.utils import suppress_instrumentation

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_resources import (
    daemon_scope,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._engine_api import (
    DockerEngineError,
    EngineClient,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._engine_facts import (
    Daemon,
    daemon_facts,
    daemon_over_api,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.readers._cli import output_of

__all__ = ["COALESCE_WINDOW_S", "Coalesced", "DockerCliError", "Engine", "engine_of"]

# How long the first read of a batch waits for others to join it. The reads of one burst
# wake in the same loop iteration (the burst settling), then take a few iterations to reach
# the engine; a few milliseconds gather them all without delaying a lone read noticeably.
COALESCE_WINDOW_S = 0.02
# One engine request over the socket (an inspect, the daemon's info, a list).
READ_TIMEOUT_S = 10.0

_K = TypeVar("_K")
_V = TypeVar("_V")


class DockerCliError(RuntimeError):
    """A CLI command (or engine request) that failed; the message is the command's name and
    exit code only (its output may name user data)."""


class Coalesced(Generic[_K, _V]):
    """Reads by key that arrive within ``COALESCE_WINDOW_S`` of each other, answered by one
    call of ``fetch`` with all their keys.

    ``fetch(keys)`` gives a value per key it found; a key it did not find raises
    ``missing(key)`` for its asker, a failed ``fetch`` raises its exception for every asker.
    A read of a key already being fetched waits for that fetch instead of asking again (a
    record that gave up on a slow batch and tries again rejoins it). Cancelling an asker
    cancels its wait only: a fetch runs to its own bound (``fetch`` must have one).
    Event-loop only; a batch belongs to the loop it was started on.
    """

    def __init__(
        self,
        fetch: Callable[[list[_K]], Awaitable[dict[_K, _V]]],
        missing: Callable[[_K], Exception],
    ) -> None:
        self._fetch = fetch
        self._missing = missing
        # The batch gathering its keys, and the keys of the batches being fetched: one
        # answer per key, shared by its askers.
        self._batch: dict[_K, asyncio.Future[_V]] = {}
        self._fetching: dict[_K, asyncio.Future[_V]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # The batches being answered (the loop keeps only weak references to tasks).
        self._answering: set[asyncio.Task[None]] = set()
        self.calls = 0  # fetches made: what the tests count

    async def get(self, key: _K) -> _V:
        """The value of ``key`` from the fetch in flight for it, else the batch it joins."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._batch, self._fetching, self._loop = {}, {}, loop
        answer = self._fetching.get(key) or self._batch.get(key)
        if answer is None:
            if not self._batch:
                loop.call_later(COALESCE_WINDOW_S, self._flush)
            answer = self._batch[key] = loop.create_future()
        # shield: an asker giving up leaves the answer to the others (and to its retry).
        return await asyncio.shield(answer)

    def _flush(self) -> None:
        batch, self._batch = self._batch, {}
        if batch:
            self.calls += 1
            self._fetching.update(batch)
            task = asyncio.ensure_future(self._answer(batch))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(self, batch: dict[_K, asyncio.Future[_V]]) -> None:
        try:
            found = await self._fetch(list(batch))
        except Exception as exc:  # noqa: BLE001 - each asker gets the failure as its own
            for answer in batch.values():
                answer.set_exception(exc)
                answer.exception()  # retrieved: a key nobody waits for any more is not logged
            return
        finally:
            for key, answer in batch.items():
                if self._fetching.get(key) is answer:
                    del self._fetching[key]
        for key, answer in batch.items():
            if key in found:
                answer.set_result(found[key])
            else:
                answer.set_exception(self._missing(key))
                answer.exception()


def _unix_socket(docker_host: str) -> str | None:
    """The path of a ``unix://`` ``DOCKER_HOST`` when a socket is there, else ``None``."""
    if not docker_host.startswith("unix://"):
        return None
    path = docker_host.removeprefix("unix://")
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


def _is_podman_binary(binary: str) -> bool:
    """Whether ``binary`` is Podman (as itself, or ``podman-docker``'s ``docker`` script),
    which ignores ``DOCKER_HOST``: its containers are read through it."""
    path = os.path.realpath(binary)
    if os.path.basename(path) == "podman":
        return True
    try:
        with open(path, "rb") as script:
            head = script.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and b"podman" in head


class Engine:
    """One engine as this process reaches it (see the module). ``socket`` is the Engine API's
    unix socket, or ``None`` to use ``binary``, the CLI. Shared by readers; event-loop only."""

    def __init__(self, endpoint: str, socket: str | None, binary: str | None) -> None:
        self.endpoint = endpoint
        self.socket = socket
        self.binary = binary
        self._inspects: Coalesced[str, dict[str, Any]] = Coalesced(
            self._inspect_many, lambda name: DockerCliError(f"no container {name}")
        )
        self._labelled: dict[str, Coalesced[str, list[str]]] = {}

    @property
    def inspect_calls(self) -> int:
        """How many batches of inspects this engine was asked for."""
        return self._inspects.calls

    async def inspect(self, name: str) -> dict[str, Any]:
        """The engine's inspect answer for container ``name`` (a name or an ID), read in one
        batch with the others asked for at the same time. ``DockerCliError`` when the engine
        does not know it or cannot be asked."""
        return await self._inspects.get(name)

    async def labelled(self, label: str, value: str) -> list[str]:
        """The IDs of the containers (running or not) whose ``label`` is ``value``, from one
        list of every container carrying ``label`` shared by the lookups asked at the same
        time. ``DockerCliError`` when the engine cannot be asked."""
        coalesced = self._labelled.get(label)
        if coalesced is None:
            coalesced = self._labelled[label] = Coalesced(
                lambda values: self._list_labelled(label, values),
                lambda value: DockerCliError(f"no listing of {label}={value}"),
            )
        return await coalesced.get(value)

    async def daemon(self) -> Daemon:
        """``Name`` and ``Scope`` of the engine, as ``otel_docker`` gives them for it, read once
        per engine for the process."""
        return await daemon_facts(self.endpoint, self._read_daemon)

    # --- over the socket -------------------------------------------------------------------

    async def _api(self, use: Callable[[EngineClient], Awaitable[_V]]) -> _V:
        """``use`` with a client of its own on the socket, closed after; engine failures as
        ``DockerCliError``. Our requests are not the application's: no telemetry of them."""
        assert self.socket is not None
        api = EngineClient(self.socket, READ_TIMEOUT_S)
        try:
            with suppress_instrumentation():
                return await use(api)
        except DockerEngineError as exc:
            raise DockerCliError(f"engine: {exc.message}") from exc
        finally:
            await api.close()

    # --- the batches ---------------------------------------------------------------------------

    async def _inspect_many(self, names: list[str]) -> dict[str, dict[str, Any]]:
        if self.socket is not None:
            return await self._api(lambda api: _inspect_over_api(api, names))
        answer = await self._cli_json("inspect", "--type", "container", *names)
        return _by_name(answer if isinstance(answer, list) else [], names)

    async def _list_labelled(self, label: str, values: list[str]) -> dict[str, list[str]]:
        if self.socket is not None:
            listing = await self._api(
                lambda api: api.json(
                    "GET",
                    "/containers/json",
                    params={"all": "true", "filters": json.dumps({"label": [label]})},
                )
            )
            pairs = [
                (str(c.get("Id")), str((c.get("Labels") or {}).get(label)))
                for c in listing or ()
                if isinstance(c, dict)
            ]
        else:
            text = await self._cli_text(
                "ps", "--all", "--no-trunc", "--filter", f"label={label}",
                "--format", "{{.ID}}\t{{.Label \"" + label + "\"}}",
            )  # fmt: skip
            pairs = [
                (line.split("\t")[0], line.split("\t")[1])
                for line in text.splitlines()
                if line.count("\t") == 1
            ]
        found: dict[str, list[str]] = {value: [] for value in values}
        for container_id, value in pairs:
            if value in found:
                found[value].append(container_id)
        return found

    async def _read_daemon(self) -> Daemon:
        if self.socket is not None:
            return await self._api(daemon_over_api)
        info = await self._cli_json("info", "--format", "{{json .}}")
        info = info if isinstance(info, dict) else {}
        if isinstance(info.get("host"), dict):
            # Podman's own CLI (podman-docker): libpod's info.
            return {"Name": info["host"].get("hostname"), "Scope": daemon_scope({}, info)}
        if await self._cli_is_podman():
            # Podman's compatible service: its Name is libpod's host name, its
            # DockerRootDir libpod's storage root, so the scope is otel_docker's.
            libpod = {
                "host": {"hostname": info.get("Name")},
                "store": {"graphRoot": info.get("DockerRootDir")},
            }
            return {"Name": info.get("Name"), "Scope": daemon_scope({}, libpod)}
        return {"Name": info.get("Name"), "Scope": daemon_scope(info, None)}

    async def _cli_is_podman(self) -> bool:
        server = await self._cli_json("version", "--format", "{{json .Server}}")
        components = server.get("Components") if isinstance(server, dict) else None
        return any(
            isinstance(c, dict) and str(c.get("Name", "")).startswith("Podman")
            for c in components or ()
        )

    # --- through the CLI -----------------------------------------------------------------------

    async def _cli_text(self, *args: str, partial: bool = False) -> str:
        """The standard output of ``<binary> *args``; ``DockerCliError`` when it fails (unless
        ``partial``: an inspect of several names prints the ones found and exits 1)."""
        if self.binary is None:
            raise DockerCliError("no docker binary")
        # Bounded here: a batch is not cancelled when its askers give up.
        returncode, stdout = await asyncio.wait_for(output_of(self.binary, *args), READ_TIMEOUT_S)
        if returncode != 0 and not (partial and stdout.strip()):
            raise DockerCliError(f"docker {args[0]} exited with code {returncode}")
        return stdout.decode("utf-8", "replace")

    async def _cli_json(self, *args: str) -> Any:
        try:
            return json.loads(await self._cli_text(*args, partial=args[0] == "inspect"))
        except json.JSONDecodeError as exc:
            raise DockerCliError(f"docker {args[0]} printed no JSON") from exc


async def _inspect_over_api(api: EngineClient, names: list[str]) -> dict[str, dict[str, Any]]:
    """One inspect request per container, on one session; a container the engine does not
    know is left out (its asker gets ``DockerCliError``), any other failure fails the batch."""

    async def one(name: str) -> dict[str, Any] | None:
        try:
            answer = await api.json("GET", f"/containers/{name}/json")
        except DockerEngineError as exc:
            if exc.status == 404:
                return None
            raise
        return answer if isinstance(answer, dict) else None

    answers = await asyncio.gather(*(one(name) for name in names))
    return {name: answer for name, answer in zip(names, answers, strict=True) if answer}


def _by_name(answers: Iterable[Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """``docker inspect``'s answers by the name or ID each was asked by (an ID may be asked
    by a prefix, a name with or without its leading ``/``)."""
    found: dict[str, dict[str, Any]] = {}
    for answer in answers:
        if not isinstance(answer, dict):
            continue
        container_id = str(answer.get("Id") or "")
        name = str(answer.get("Name") or "").lstrip("/")
        for asked in names:
            if asked == name or (container_id and container_id.startswith(asked)):
                found.setdefault(asked, answer)
    return found


# Endpoint -> its engine, for the process: one per engine endpoint ever asked, a handful.
_ENGINES: dict[str, Engine] = {}


def engine_of(binary: str | None) -> Engine:
    """The engine ``binary`` (the provider's ``docker`` CLI) talks to, as the environment
    says now: the Engine API on ``DOCKER_HOST``'s unix socket where there is one (and the
    binary is not Podman, which ignores ``DOCKER_HOST``), else the CLI itself, keyed by the
    binary and the variables that choose its engine."""
    docker_host = os.environ.get("DOCKER_HOST", "")
    socket = _unix_socket(docker_host)
    if socket is not None and binary is not None and _is_podman_binary(binary):
        socket = None
    if socket is not None:
        endpoint = f"unix://{socket}"
    else:
        context = os.environ.get("DOCKER_CONTEXT", "")
        endpoint = f"cli:{binary}|{docker_host}|{context}"
    engine = _ENGINES.get(endpoint)
    if engine is None:
        engine = _ENGINES[endpoint] = Engine(endpoint, socket, binary)
    return engine
