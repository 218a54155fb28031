"""``DockerSandboxProvider``: sandboxes as containers, through the Docker Engine API.

It speaks to a unix socket (``DOCKER_HOST=unix://...``, default ``/var/run/docker.sock``) over
its own aiohttp session, with no Docker SDK, and works with Docker and with Podman's
Docker-compatible service. As a ``ResourceProvider`` it reads the allocation back from the
container's ``HostConfig`` and samples usage from the container's cgroup where this host can
read it, else from the engine's stats endpoint (``_docker_usage``).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_container import (
    EXEC_WRAPPER,
    KEEP_ALIVE,
    KILL_TREE,
    STATUS,
    Container,
    split_pid,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_resources import (
    allocation_from_inspect,
    host_config,
    sample_from_stats,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_usage import ContainerUsage
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._engine_api import (
    DockerEngineError,
    EngineClient,
    FrameDecoder,
    single_file_of,
    socket_path,
    tar_of,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._engine_facts import (
    daemon_facts,
    daemon_over_api,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    EXEC_TIMEOUT_RETURN_CODE,
    SandboxCreateError,
    SandboxExecResult,
    SandboxHandle,
    SandboxSpec,
    SandboxStatus,
    _positive_seconds,
    _resources_from,
    _spec_from,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    Attribute,
    ResourceAllocation,
)

__all__ = ["DockerEngineError", "DockerSandboxProvider"]

# Label on every container this provider creates, so operators can find them.
PROVIDER_LABEL = _names.ATTR_SANDBOX_PROVIDER
# The return code of an exec whose command did not finish in time: the shared constant, under
# the name this module has always exported.
TIMEOUT_RETURN_CODE = EXEC_TIMEOUT_RETURN_CODE


class DockerSandboxProvider:
    """Sandboxes as containers of a Docker-compatible engine on a unix socket.

    ``docker_host`` defaults to ``$DOCKER_HOST`` (``unix://`` only), then
    ``/var/run/docker.sock``. Options arrive as keyword arguments, from code or from a NeMo
    Gym config (``{"otel_docker": {...}}``); a bad value raises ``ValueError`` naming the
    option and the value. Every engine call is bounded by ``api_timeout_s``; a container
    must be running within ``spec.ready_timeout_s`` (default ``ready_timeout_s``); a command
    without ``timeout_s`` gets ``exec_timeout_s``. All methods run on the event loop and never
    block it. ``aclose()`` removes the containers this provider created and did not close,
    then closes its session.
    """

    name = "docker"
    # Samples from containers' cgroups where readable; False keeps every sample on the stats
    # endpoint, as for a remote engine (the tests compare the two paths on one container).
    _cgroup_sampling = True

    def __init__(
        self,
        docker_host: str | None = None,
        *,
        api_timeout_s: float = 30.0,
        ready_timeout_s: float = 30.0,
        exec_timeout_s: float = 3600.0,
    ) -> None:
        for field, value in (
            ("api_timeout_s", api_timeout_s),
            ("ready_timeout_s", ready_timeout_s),
            ("exec_timeout_s", exec_timeout_s),
        ):
            _positive_seconds(field, value)
        if docker_host is not None and not isinstance(docker_host, str):
            raise ValueError(
                f"docker_host={docker_host!r} must be a unix:// address string or None"
            )
        host = docker_host if docker_host is not None else os.environ.get("DOCKER_HOST")
        self._api = EngineClient(socket_path(host), api_timeout_s)
        self._ready_timeout_s = ready_timeout_s
        self._exec_timeout_s = exec_timeout_s
        self._open: dict[str, Container] = {}
        self._usage = ContainerUsage(self._inspect, self._stats, cgroups=self._cgroup_sampling)

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Create, start and wait for a container, then upload ``spec.files``.

        Raises ``SandboxCreateError`` carrying the engine's message when the engine refuses or
        cannot be reached, or the container is not running in time; a half-created container
        is removed first. Raises ``ValueError`` for a spec without an image or with unknown
        ``provider_options`` (known: ``host_config``, a mapping merged into ``HostConfig``).
        ``spec`` may also be nemo_gym's ``SandboxSpec`` or a plain mapping of its fields.
        """
        spec = _spec_from(spec)
        if not spec.image:
            raise ValueError(f"sandbox spec image={spec.image!r}: the docker provider needs one")
        unknown = sorted(repr(k) for k in spec.provider_options if k != "host_config")
        if unknown:
            # Keys only: option values may hold credentials.
            raise ValueError(
                f"unknown docker provider_options: {', '.join(unknown)}; allowed: host_config"
            )
        resources = _resources_from(spec.resources)  # already ours: typed for the reader
        if spec.ttl_s is not None:
            keep_alive = f"trap 'exit 0' TERM INT; sleep {float(spec.ttl_s):g} & wait $!"
        else:
            keep_alive = KEEP_ALIVE
        # A name of our own: if the create answer is lost, the container can still be removed.
        name = f"nemo-gym-{uuid.uuid4().hex[:16]}"
        workdir = spec.workdir or "/"
        body: dict[str, Any] = {
            "Image": spec.image,
            "Entrypoint": list(spec.entrypoint or ["/bin/sh", "-c", keep_alive]),
            "Cmd": [],
            "Env": [f"{key}={value}" for key, value in spec.env.items()],
            "Labels": {
                **{str(k): str(v) for k, v in spec.metadata.items()},
                PROVIDER_LABEL: "docker",
            },
            "Tty": False,
            "OpenStdin": False,
            "HostConfig": host_config(resources, spec.provider_options.get("host_config") or {}),
        }
        if spec.workdir:
            body["WorkingDir"] = spec.workdir
        ready_timeout = float(spec.ready_timeout_s or self._ready_timeout_s)
        try:
            created = await self._api.json(
                "POST", "/containers/create", params={"name": name}, body=body
            )
            container = Container(id=str(created["Id"]), name=name, workdir=workdir)
            self._open[container.id] = container
            await self._api.request("POST", f"/containers/{container.id}/start")
            running = await self._wait_running(container, ready_timeout)
            self._usage.locate(container.id, running)
            if spec.files:
                await self._put(
                    container,
                    {self._absolute(container, p): c.encode() for p, c in spec.files.items()},
                )
        except asyncio.CancelledError:
            await self._remove_quietly(name)
            raise
        except Exception as exc:
            await self._remove_quietly(name)
            message = exc.message if isinstance(exc, DockerEngineError) else str(exc)
            raise SandboxCreateError(
                f"docker: cannot create a sandbox from image {spec.image!r}: "
                f"{message or type(exc).__name__}"
            ) from exc
        return SandboxHandle(sandbox_id=container.id, provider_name=self.name, raw=container)

    async def _wait_running(self, container: Container, timeout_s: float) -> dict[str, Any]:
        """The container's inspect answer once it runs."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = 0.02
        while True:
            inspect = await self._inspect(container.id)
            state = inspect.get("State") or {}
            if state.get("Running"):
                return inspect
            if state.get("Status") in ("exited", "dead", "stopped"):
                raise SandboxCreateError(
                    f"container exited before it was ready (exit code {state.get('ExitCode')})"
                    + (f": {state['Error']}" if state.get("Error") else "")
                )
            if loop.time() + delay > deadline:
                raise SandboxCreateError(
                    f"container not running within ready_timeout_s={timeout_s:g} "
                    f"(status {state.get('Status')!r})"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _remove_quietly(self, name_or_id: str) -> None:
        """Force-remove a container; a failure here must not hide the error being raised."""
        try:
            await self._api.request(
                "DELETE", f"/containers/{name_or_id}", params={"force": "true", "v": "true"}
            )
        except DockerEngineError as exc:
            if exc.status != 404:
                return
        except (TimeoutError, OSError):
            return
        for key, container in list(self._open.items()):
            if name_or_id in (key, container.name):
                del self._open[key]
                self._usage.forget(key)

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        """Run ``command`` with ``/bin/sh -c`` in the container and collect its output.

        When ``timeout_s`` (default ``exec_timeout_s``) passes first, the command and its
        descendants are killed and the result has return code ``TIMEOUT_RETURN_CODE`` with
        ``error_type="timeout"`` and the output so far. Engine errors raise
        ``DockerEngineError``; a ``timeout_s`` that is not a positive number, ``ValueError``.
        """
        limit = _positive_seconds("timeout_s", timeout_s) or self._exec_timeout_s
        container = self._container(handle)
        config: dict[str, Any] = {
            "Cmd": ["/bin/sh", "-c", EXEC_WRAPPER, "sh", command],
            "AttachStdout": True,
            "AttachStderr": True,
            "AttachStdin": False,
            "Tty": False,
            "Env": [f"{key}={value}" for key, value in (env or {}).items()],
        }
        if cwd is not None:
            config["WorkingDir"] = self._absolute(container, cwd)
        if user is not None:
            config["User"] = str(user)
        exec_id = str(
            (await self._api.json("POST", f"/containers/{container.id}/exec", body=config))["Id"]
        )
        frames = FrameDecoder()
        try:
            await asyncio.wait_for(self._api.exec_output(exec_id, frames), limit)
        except TimeoutError:
            pid, stdout = split_pid(bytes(frames.stdout))
            if pid is not None:
                await self._kill_tree(container, pid)
            return SandboxExecResult(
                stdout=stdout.decode("utf-8", "replace"),
                stderr=frames.stderr.decode("utf-8", "replace"),
                return_code=TIMEOUT_RETURN_CODE,
                error_type="timeout",
            )
        _, stdout = split_pid(bytes(frames.stdout))
        return SandboxExecResult(
            stdout=stdout.decode("utf-8", "replace"),
            stderr=frames.stderr.decode("utf-8", "replace"),
            return_code=await self._exit_code(exec_id),
        )

    async def _exit_code(self, exec_id: str) -> int:
        # The stream can end a moment before the engine records the exit code.
        for _ in range(50):
            info = await self._api.json("GET", f"/exec/{exec_id}/json")
            if not info.get("Running") and isinstance(info.get("ExitCode"), int):
                return int(info["ExitCode"])
            await asyncio.sleep(0.02)
        raise DockerEngineError(None, f"exec {exec_id} ended without an exit code")

    async def _kill_tree(self, container: Container, pid: int) -> None:
        config = {"Cmd": ["/bin/sh", "-c", KILL_TREE, "sh", str(pid)], "Tty": False}
        try:
            killer = await self._api.json("POST", f"/containers/{container.id}/exec", body=config)
            await self._api.request(
                "POST", f"/exec/{killer['Id']}/start", body={"Detach": True, "Tty": False}
            )
        except (DockerEngineError, TimeoutError):
            # The container may be gone already; the timeout result is returned regardless.
            return

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        """Copy a local file to ``target_path`` (relative paths from the workdir); parent
        folders are created. Engine errors raise ``DockerEngineError``."""
        container = self._container(handle)
        content = await asyncio.to_thread(Path(source_path).read_bytes)
        await self._put(container, {self._absolute(container, target_path): content})

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path
    ) -> None:
        """Copy one file from the sandbox; a missing one raises ``FileNotFoundError``, a
        folder ``IsADirectoryError``, other engine errors ``DockerEngineError``."""
        container = self._container(handle)
        path = self._absolute(container, source_path)
        try:
            archive = await self._api.request(
                "GET", f"/containers/{container.id}/archive", params={"path": path}
            )
        except DockerEngineError as exc:
            if exc.status == 404:
                raise FileNotFoundError(f"sandbox path {path!r}: {exc.message}") from exc
            raise
        content = single_file_of(archive, path)
        await asyncio.to_thread(Path(target_path).write_bytes, content)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        """The container's state; a removed container is ``STOPPED``."""
        try:
            state = (await self._inspect(self._container(handle).id)).get("State") or {}
        except DockerEngineError as exc:
            if exc.status == 404:
                return SandboxStatus.STOPPED
            raise
        return STATUS.get(str(state.get("Status", "")).lower(), SandboxStatus.UNKNOWN)

    async def close(self, handle: SandboxHandle) -> None:
        """Force-remove the container and its anonymous volumes; idempotent."""
        container = self._container(handle)
        try:
            await self._api.request(
                "DELETE", f"/containers/{container.id}", params={"force": "true", "v": "true"}
            )
        except DockerEngineError as exc:
            if exc.status != 404:
                raise
        self._open.pop(container.id, None)
        self._usage.forget(container.id)

    async def aclose(self) -> None:
        """Remove the containers this provider created and did not close; close the session."""
        for container_id in list(self._open):
            await self._remove_quietly(container_id)
        await self._api.close()

    async def resource_allocation(self, handle: SandboxHandle) -> ResourceAllocation:
        """The allocation read back from the container's ``HostConfig``, placed by the daemon's
        ID and name."""
        inspect, daemon = await asyncio.gather(
            self._inspect(self._container(handle).id), self._daemon_info()
        )
        return allocation_from_inspect(inspect, daemon)

    async def resource_sample(self, handle: SandboxHandle) -> dict[str, Attribute]:
        """One usage sample: cpu time and throttling, memory and its peak, OOM kills, pids.

        From the container's cgroup (``usage.source`` ``cgroup.v1``/``cgroup.v2``, with
        ``usage.oom_kills``), or from the engine's stats endpoint (``docker.stats``, with the
        engine's ``usage.oom_killed``); once the container has ended, ``usage.exit_code``.
        """
        return await self._usage.sample(self._container(handle).id)

    def resource_sample_nowait(self, handle: SandboxHandle) -> dict[str, Attribute] | None:
        """The sample ``resource_sample`` would give, when the container's cgroup gives it
        without asking the engine (read synchronously: small kernel files); else ``None``.
        ``ResourceSampler`` takes it first, sparing the bounded wait an engine call needs."""
        return self._usage.sample_nowait(self._container(handle).id)

    async def _inspect(self, container_id: str) -> dict[str, Any]:
        answer = await self._api.json("GET", f"/containers/{container_id}/json")
        if not isinstance(answer, dict):
            raise DockerEngineError(None, f"the engine sent no inspect answer for {container_id}")
        return answer

    async def _stats(self, container_id: str) -> dict[str, Attribute]:
        """The engine's one-shot stats of a running container, as usage attributes."""
        stats = await self._api.json(
            "GET",
            f"/containers/{container_id}/stats",
            params={"stream": "false", "one-shot": "true"},
        )
        return sample_from_stats(stats)

    async def _daemon_info(self) -> dict[str, Any]:
        """``Name`` and ``Scope`` of the daemon, read once per engine for the process
        (``_engine_facts``: every provider and reader on this socket shares the read)."""
        return await daemon_facts(f"unix://{self._api.path}", lambda: daemon_over_api(self._api))

    async def _put(self, container: Container, files: Mapping[str, bytes]) -> None:
        archive = await asyncio.to_thread(tar_of, files)
        await self._api.request(
            "PUT", f"/containers/{container.id}/archive", params={"path": "/"}, data=archive
        )

    @staticmethod
    def _absolute(container: Container, path: str) -> str:
        return posixpath.normpath(posixpath.join(container.workdir, path))

    def _container(self, handle: SandboxHandle) -> Container:
        raw = handle.raw
        if isinstance(raw, Container):
            return raw
        # A handle rebuilt elsewhere (only the id survived): the workdir is unknown, so "/".
        return Container(id=str(handle.sandbox_id), name=str(handle.sandbox_id), workdir="/")
