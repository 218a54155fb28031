"""A proxy of the tests' own in front of one real OpenSandbox server, on loopback.

``RenamingProxy`` forwards every request to its server and every answer back, with two
changes: the first sandbox created through it is shown under ``shown_id`` (its real id is
rewritten to ``shown_id`` in answers, and back in request paths and bodies), and the server's
``host:port`` in answers (the endpoints the SDK then calls through the server) becomes the
proxy's own, so every later call comes through it too. Two proxies with the same
``shown_id`` in front of two servers make two sandboxes with one id, as two servers that hand
out colliding ids would. ``metrics``, when set, is laid over execd's ``/metrics`` answer
(the figures a test wants the metrics API to report). Streamed answers (command output)
pass through chunk by chunk.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

# Headers the proxy's own connections set (or that no longer hold once a body is rewritten).
_HOP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}
)


class RenamingProxy:
    """One server, shown on another loopback port with its first sandbox renamed."""

    def __init__(self, upstream: str, shown_id: str) -> None:
        self.upstream = upstream  # host:port of the real server
        self.shown_id = shown_id
        self.real_id: str | None = None
        self.metrics: dict[str, Any] | None = None
        self.metrics_answered = 0
        self.address = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        """Listen on a free loopback port; returns the proxy's ``host:port``."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.address = f"127.0.0.1:{port}"
        self._session = aiohttp.ClientSession(auto_decompress=True)
        return self.address

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _to_server(self, text: str) -> str:
        return text if self.real_id is None else text.replace(self.shown_id, self.real_id)

    def _to_client(self, text: str) -> str:
        if self.real_id is not None:
            text = text.replace(self.real_id, self.shown_id)
        return text.replace(self.upstream, self.address)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        if body:
            body = self._to_server(body.decode("utf-8", "surrogateescape")).encode(
                "utf-8", "surrogateescape"
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = f"http://{self.upstream}{self._to_server(request.path_qs)}"
        async with self._session.request(
            request.method, url, headers=headers, data=body or None, allow_redirects=False
        ) as answer:
            out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
            kind = answer.headers.get("Content-Type", "")
            if "json" in kind or (request.method == "POST" and request.path == "/v1/sandboxes"):
                text = await answer.text()
                text = self._rewritten(request, answer.status, text)
                return web.Response(status=answer.status, headers=out_headers, text=text)
            stream = web.StreamResponse(status=answer.status, headers=out_headers)
            await stream.prepare(request)
            async for chunk in answer.content.iter_any():
                await stream.write(
                    self._to_client(chunk.decode("utf-8", "surrogateescape")).encode(
                        "utf-8", "surrogateescape"
                    )
                )
            await stream.write_eof()
            return stream

    def _rewritten(self, request: web.Request, status: int, text: str) -> str:
        """A JSON answer as the client sees it: the created sandbox's id learned, the
        metrics overlaid, the id and the server's address renamed."""
        if request.method == "POST" and request.path == "/v1/sandboxes" and status < 300:
            created = json.loads(text)
            if self.real_id is None:
                self.real_id = str(created["id"])
        if self.metrics is not None and request.path.endswith("/metrics") and status == 200:
            answer = json.loads(text)
            answer.update(self.metrics)
            text = json.dumps(answer)
            self.metrics_answered += 1
        return self._to_client(text)
