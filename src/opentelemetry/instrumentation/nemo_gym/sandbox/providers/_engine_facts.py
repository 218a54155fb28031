"""A container engine's facts that do not change, read once per engine for the process.

The daemon's name and scope (the identity container IDs are meaningful in: Docker's
``/info`` ``ID``, Podman's host name and storage root) are the same for every container of an
engine, so they are read once per engine endpoint (``unix:///run/podman/podman.sock``, or a
CLI's binary and environment) and shared by every provider and reader in the process:
``otel_docker``'s providers and the readers of NeMo Gym's ``docker`` and ``opensandbox``
providers alike, however many of them a run makes (NeMo Gym makes one provider per
``AsyncSandbox``). A read that fails is not kept: the next asker reads again. Readers that ask
while a read is in flight on the same event loop share it.

``daemon_over_api`` is the read over the Engine API (one ``/_ping``, then Podman's
``/libpod/info`` or Docker's ``/info``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox.providers._docker_resources import (
    _nested,
    daemon_scope,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers._engine_api import EngineClient

__all__ = ["daemon_facts", "daemon_over_api"]

Daemon = dict[str, Any]

# Endpoint -> the daemon's ``Name`` and ``Scope``, once read. One entry per engine the
# process has asked, so a handful at most.
_KNOWN: dict[str, Daemon] = {}
# (endpoint, event loop) -> the read in flight there, shared by its askers.
_READING: dict[tuple[str, asyncio.AbstractEventLoop], asyncio.Future[Daemon]] = {}


async def daemon_facts(endpoint: str, read: Callable[[], Awaitable[Daemon]]) -> Daemon:
    """The daemon facts of ``endpoint``: kept from an earlier read, else ``read()`` (one at a
    time per endpoint and loop). Raises what ``read`` raises; a cancelled asker cancels only
    its own wait."""
    known = _KNOWN.get(endpoint)
    if known is not None:
        return known
    key = (endpoint, asyncio.get_running_loop())
    reading = _READING.get(key)
    if reading is None:
        reading = _READING[key] = asyncio.ensure_future(_read_and_keep(endpoint, read))
        reading.add_done_callback(lambda _: _READING.pop(key, None))
    # shield: one asker giving up (its record timed out) leaves the read to the others.
    return await asyncio.shield(reading)


async def _read_and_keep(endpoint: str, read: Callable[[], Awaitable[Daemon]]) -> Daemon:
    daemon = await read()
    _KNOWN[endpoint] = daemon
    return daemon


async def daemon_over_api(api: EngineClient) -> Daemon:
    """``Name`` and ``Scope`` of the engine behind ``api``: one ``/_ping`` (Podman names its
    libpod API version there), then ``/libpod/info`` or ``/info`` (slow: ~0.2 s on Podman)."""
    if "Libpod-Api-Version" in await api.ping_headers():
        libpod = await api.json("GET", "/libpod/info") or {}
        name = _nested(libpod, "host", "hostname")
        return {"Name": name, "Scope": daemon_scope({}, libpod)}
    info = await api.json("GET", "/info") or {}
    return {"Name": info.get("Name"), "Scope": daemon_scope(info, None)}
