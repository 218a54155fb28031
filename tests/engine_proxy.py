"""A counting, fault-injecting proxy in front of the real container engine, on a unix socket.

A real aiohttp server on a socket of the test's own forwards every Engine API request to the
engine (Podman's service in CI), keeps how many requests of each kind it forwarded
(``containers.inspect``, ``libpod.info``, ``_ping``, ...), and can answer the next requests
of a kind with an engine error instead (``fail``). The ``docker`` CLI pointed at it
(``DOCKER_HOST``) works as it does against the engine, for every request that is not an
attached stream (``run -d``, ``inspect``, ``ps``, ``info``; not ``exec``).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

_VERSIONED = re.compile(r"^/v[0-9.]+")
# Response headers aiohttp sets itself for the body it sends.
_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


def request_kind(method: str, path: str) -> str:
    """A request's kind: its path without the API version, ids and query, e.g.
    ``containers.inspect`` for ``GET /v1.41/containers/<id>/json``."""
    parts = [p for p in _VERSIONED.sub("", path).split("/") if p]
    prefix = ""
    if parts[:1] == ["libpod"]:
        parts, prefix = parts[1:], "libpod."
    if parts and parts[0] in ("containers", "exec", "images") and len(parts) >= 2:
        if parts[1] in ("json", "create"):
            return f"{prefix}{parts[0]}.{'list' if parts[1] == 'json' else 'create'}"
        action = parts[2] if len(parts) > 2 else {"DELETE": "remove"}.get(method, "inspect")
        return f"{prefix}{parts[0]}.{'inspect' if action == 'json' else action}"
    return prefix + ("/".join(parts) or method)


class EngineProxy:
    """The proxy's state: ``counts`` by kind, ``failing`` (kind -> how many of the next
    requests of that kind get a 500 from the proxy instead of the engine's answer), and
    ``held`` (kind -> ``(arrived, release)``: requests of that kind set ``arrived`` and wait
    for ``release`` before they are forwarded)."""

    def __init__(self, upstream: str, path: Path) -> None:
        self.upstream = upstream
        self.path = path
        self.counts: Counter[str] = Counter()
        self.failing: Counter[str] = Counter()
        self.held: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}

    @property
    def docker_host(self) -> str:
        return f"unix://{self.path}"

    def fail(self, kind: str, times: int = 1) -> None:
        """Answer the next ``times`` requests of ``kind`` with HTTP 500."""
        self.failing[kind] += times

    def hold(self, kind: str) -> tuple[asyncio.Event, asyncio.Event]:
        """Hold requests of ``kind``: the events ``(arrived, release)``."""
        self.held[kind] = (asyncio.Event(), asyncio.Event())
        return self.held[kind]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        kind = request_kind(request.method, request.path)
        self.counts[kind] += 1
        if kind in self.held:
            arrived, release = self.held[kind]
            arrived.set()
            await release.wait()
        if self.failing[kind] > 0:
            self.failing[kind] -= 1
            return web.json_response({"message": "injected by the test's proxy"}, status=500)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP | {"host"}}
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.upstream)) as session,
            session.request(
                request.method,
                f"http://docker{request.path_qs}",
                data=await request.read(),
                headers=headers,
                allow_redirects=False,
            ) as answer,
        ):
            body = await answer.read()
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
            return web.Response(status=answer.status, body=body, headers=kept)


@asynccontextmanager
async def engine_proxy(upstream: str, folder: Path) -> AsyncIterator[EngineProxy]:
    """An ``EngineProxy`` to the engine socket ``upstream``, listening in ``folder``."""
    proxy = EngineProxy(upstream, folder / "engine-proxy.sock")
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.UnixSite(runner, str(proxy.path))
    await site.start()
    try:
        yield proxy
    finally:
        await runner.cleanup()
