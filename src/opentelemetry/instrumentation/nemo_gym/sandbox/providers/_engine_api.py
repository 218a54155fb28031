"""A small client for the Docker Engine API on a unix socket (Docker, or Podman's service).

Only what ``DockerSandboxProvider`` needs: JSON requests, raw bodies, and the multiplexed
output stream of an exec. Every request has a timeout. The pure helpers at the bottom (socket
path, stream frames, tar archives) do no I/O and are tested on their own.
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

# The oldest API version that has everything used here (one-shot stats, exec, archive); Docker
# 20.10+ and Podman 3+ answer it.
API_VERSION = "v1.41"
DEFAULT_SOCKET = "/var/run/docker.sock"
# Host part of the URLs: a unix connector ignores it, but aiohttp needs a valid URL.
_BASE = "http://docker"


class DockerEngineError(RuntimeError):
    """The container engine refused a request or could not be reached.

    ``status`` is the HTTP status (``None`` when the engine did not answer) and ``message`` the
    engine's own words, or the connection failure's.
    """

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message if status is None else f"{message} (HTTP {status})")
        self.status = status
        self.message = message


def socket_path(docker_host: str | None) -> str:
    """Return the socket path of a ``DOCKER_HOST`` value; ``None`` or empty means the default.

    Raises ``ValueError`` for anything but ``unix://`` URLs (this client speaks only to a local
    socket).
    """
    if not docker_host:
        return DEFAULT_SOCKET
    parts = urlsplit(docker_host)
    if parts.scheme != "unix" or not parts.path:
        raise ValueError(
            f"DOCKER_HOST={docker_host!r} is not supported: only unix:///path/to/socket is"
        )
    return parts.path


class EngineClient:
    """Requests to one engine socket over this client's own aiohttp session.

    The session is created on first use, inside the running loop, and closed by ``close()``.
    Every call raises ``DockerEngineError`` for an engine refusal (status >= 400) or an
    unreachable engine, and ``TimeoutError`` when the engine does not answer in time.
    """

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.path),
                # Engine answers can be large (inspect, archives); headers such as
                # X-Docker-Container-Path-Stat stay small.
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def close(self) -> None:
        """Close the session; the next request opens a new one."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        data: bytes | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        """Send one request and return the response body; ``body`` is sent as JSON."""
        url = f"{_BASE}/{API_VERSION}{path}"
        headers = {}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif data is not None:
            headers["Content-Type"] = "application/x-tar"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._client().request(
                method, url, params=params, data=data, headers=headers, timeout=timeout
            ) as response:
                payload = await response.read()
                if response.status >= 400:
                    raise DockerEngineError(response.status, _error_message(payload))
                return payload
        except aiohttp.ClientConnectionError as exc:
            raise DockerEngineError(
                None, f"cannot reach the container engine at unix://{self.path}: {exc}"
            ) from exc

    async def ping_headers(self) -> dict[str, str]:
        """The headers of ``/_ping`` (Podman's name its API version there)."""
        try:
            async with self._client().get(f"{_BASE}/_ping") as response:
                await response.read()
                if response.status >= 400:
                    raise DockerEngineError(response.status, "the engine refused /_ping")
                return dict(response.headers)
        except aiohttp.ClientConnectionError as exc:
            raise DockerEngineError(
                None, f"cannot reach the container engine at unix://{self.path}: {exc}"
            ) from exc

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request and decode its JSON answer (``None`` for an empty body)."""
        payload = await self.request(method, path, **kwargs)
        if not payload.strip():
            return None
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise DockerEngineError(None, f"the engine answered {path} with invalid JSON") from exc

    async def exec_output(self, exec_id: str, frames: FrameDecoder) -> None:
        """Start exec ``exec_id`` attached and feed its output into ``frames`` until it ends.

        No total timeout here: the caller bounds the command's run time and keeps what
        ``frames`` holds so far when it gives up.
        """
        url = f"{_BASE}/{API_VERSION}/exec/{exec_id}/start"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)
        try:
            async with self._client().post(
                url, json={"Detach": False, "Tty": False}, timeout=timeout
            ) as response:
                if response.status >= 400:
                    raise DockerEngineError(response.status, _error_message(await response.read()))
                async for chunk in response.content.iter_any():
                    frames.feed(chunk)
        except aiohttp.ClientConnectionError as exc:
            raise DockerEngineError(
                None, f"cannot reach the container engine at unix://{self.path}: {exc}"
            ) from exc


def _error_message(payload: bytes) -> str:
    """The engine's message from an error body (``{"message": ...}``), or the body itself."""
    text = payload.decode("utf-8", "replace").strip()
    try:
        decoded = json.loads(text)
    except ValueError:
        return text or "no message"
    if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):
        return str(decoded["message"])
    return text


class FrameDecoder:
    """Split Docker's multiplexed stream (``Tty=false``) into stdout and stderr bytes.

    Each frame is an 8-byte header (stream id, three zero bytes, big-endian payload length)
    then the payload; frames may arrive split across chunks in any way. Stream 1 is stdout,
    2 stderr; stdin echoes (0) are dropped.
    """

    def __init__(self) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> None:
        self._pending += chunk
        while len(self._pending) >= 8:
            stream = self._pending[0]
            length = int.from_bytes(self._pending[4:8], "big")
            if len(self._pending) < 8 + length:
                return
            payload = bytes(self._pending[8 : 8 + length])
            del self._pending[: 8 + length]
            if stream == 1:
                self.stdout += payload
            elif stream == 2:
                self.stderr += payload


def tar_of(files: Mapping[str, bytes]) -> bytes:
    """A tar archive holding ``files`` (absolute path → content), for a PUT to ``/``.

    Only the files are archived, not their parent folders: the engine creates missing parents,
    and an archived folder entry would reset the mode of an existing one such as ``/tmp``.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path, content in files.items():
            name = posixpath.normpath(path).lstrip("/")
            if not name or name == ".":
                raise ValueError(f"sandbox file path={path!r} does not name a file")
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o644
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def single_file_of(archive_bytes: bytes, source_path: str) -> bytes:
    """The content of the one regular file in an archive from ``GET .../archive``.

    Raises ``IsADirectoryError`` when the archive holds a folder, not a file.
    """
    with tarfile.open(fileobj=io.BytesIO(archive_bytes), mode="r:") as archive:
        for member in archive:
            if member.isfile():
                extracted = archive.extractfile(member)
                if extracted is None:  # pragma: no cover - isfile() members always extract
                    break
                return extracted.read()
            if member.isdir():
                raise IsADirectoryError(f"sandbox path {source_path!r} is a directory")
    raise FileNotFoundError(f"sandbox path {source_path!r} is not a regular file")
