"""Which server a provider's sandbox ids are unique within: part of every sandbox's key.

A sandbox id is unique only where it was given out: two OpenSandbox servers may both hand out
the same id, and then "provider name and id" names two sandboxes. So the sandbox state keys a
sandbox by (provider name, server scope, id), as the allocation's designator is scoped.
``server_scope_of(provider)`` is that scope: ``host:port`` of an OpenSandbox server (the
provider's ``connection.domain``, never its key), a provider's or reader's own
``server_scope`` string where it has one, else ``None`` (ids unique on their own: a
container's engine ID, a process sandbox's uuid). Pure: no I/O, never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["SCOPES", "opensandbox_server_scope", "server_scope_of"]

_NEMO_GYM = "nemo_gym.sandbox.providers."


def opensandbox_server_scope(provider: object) -> str | None:
    """``host:port`` of the provider's OpenSandbox server (``connection.domain``, with or
    without a scheme), or ``None``. Never user-info, a path or a query."""
    domain = getattr(getattr(provider, "_connection", None), "domain", None)
    if not isinstance(domain, str) or not domain.strip():
        return None
    domain = domain.strip()
    try:
        parts = urlsplit(domain if "://" in domain else f"http://{domain}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    return f"{host}:{port}" if port is not None else host


# (module, class name) -> the server scope of one provider object of that class, for the
# NeMo Gym providers whose sandbox ids are unique only within their server.
SCOPES: dict[tuple[str, str], Callable[[object], str | None]] = {
    (_NEMO_GYM + "opensandbox.provider", "OpenSandboxProvider"): opensandbox_server_scope,
}


def server_scope_of(provider: object) -> str | None:
    """The server whose sandbox ids ``provider``'s are (see the module); never raises."""
    kind = type(provider)
    scope_of = SCOPES.get((kind.__module__, kind.__qualname__))
    try:
        found = (
            scope_of(provider) if scope_of is not None else getattr(provider, "server_scope", None)
        )
    except Exception:  # noqa: BLE001 - an odd provider's sandboxes are keyed without a scope
        return None
    return found if isinstance(found, str) else None
