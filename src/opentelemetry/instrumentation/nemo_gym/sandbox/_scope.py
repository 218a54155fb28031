"""Which sandbox is this? Sandbox identity, the scope of user code, and the span processor.

A sandbox created through a traced provider is remembered here under (provider name, sandbox
id) with its identity attributes (``request.id``, ``provider``, ``id``) until it is closed.
``sandbox_scope(handle)`` makes that identity current for the code inside it, and
``SandboxSpanProcessor`` copies the current identity onto every span started there. Nothing
here does I/O; everything runs on the caller's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span, SpanProcessor

from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.resource_telemetry import (
    PREFIX,
    Attribute,
    ResourceSampler,
    _log_once,
)

LOGGER = logging.getLogger(__name__)

REQUEST_ID = PREFIX + "request.id"
PROVIDER = PREFIX + "provider"
SANDBOX_ID = PREFIX + "id"


@dataclass
class _Sandbox:
    """What tracing remembers about a sandbox between its create and its close."""

    identity: dict[str, Attribute]
    provider_id: int
    sampler: ResourceSampler | None = None


# Sandboxes created through a traced provider, keyed by (provider name, sandbox id).
_SANDBOXES: dict[tuple[str, str], _Sandbox] = {}

# The identity of the sandbox whose user code is running; read by SandboxSpanProcessor.
_SCOPE_IDENTITY: ContextVar[Mapping[str, Attribute] | None] = ContextVar(
    "nemo_gym_sandbox_scope", default=None
)


def _key(handle: SandboxHandle) -> tuple[str, str]:
    return (str(getattr(handle, "provider_name", "")), str(getattr(handle, "sandbox_id", "")))


def _provider_name(provider: object) -> str:
    name = getattr(provider, "name", None)
    return name if isinstance(name, str) and name else type(provider).__name__


def sandbox_identity(handle: SandboxHandle) -> dict[str, Attribute]:
    """The identity attributes of ``handle``'s sandbox.

    ``request.id``, ``provider`` and ``id`` for a sandbox created through a traced provider in
    this process; ``provider`` and ``id`` alone for any other handle (a borrowed one, say).
    """
    entry = _SANDBOXES.get(_key(handle))
    if entry is not None:
        return dict(entry.identity)
    provider_name, sandbox_id = _key(handle)
    return {PROVIDER: provider_name, SANDBOX_ID: sandbox_id}


@contextmanager
def sandbox_scope(handle: SandboxHandle) -> Iterator[None]:
    """Mark the code inside the ``with`` block as running for ``handle``'s sandbox.

    Spans started inside the block (in this task or thread, and in tasks it creates) get the
    sandbox's identity attributes from ``SandboxSpanProcessor``. Scopes nest; the innermost
    wins.
    """
    token = _SCOPE_IDENTITY.set(sandbox_identity(handle))
    try:
        yield
    finally:
        _SCOPE_IDENTITY.reset(token)


class SandboxSpanProcessor(SpanProcessor):
    """Copies the current sandbox scope's identity attributes onto every span it starts.

    Attributes a span already has are left as they are. It exports nothing, so it does not
    count as a destination for ``sampling_interval()``. The SDK cannot remove a processor, so
    ``disable()`` turns this one into a no-op instead.
    """

    def __init__(self) -> None:
        self.enabled = True

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if not self.enabled:
            return
        identity = _SCOPE_IDENTITY.get()
        if not identity:
            return
        try:
            present = span.attributes or {}
            span.set_attributes({k: v for k, v in identity.items() if k not in present})
        except Exception as exc:  # noqa: BLE001 - a processor must never raise into the SDK
            _log_once(("processor", type(exc).__name__), "sandbox span stamping failed: %r", exc)

    def disable(self) -> None:
        """Stop stamping spans; the processor stays registered as a no-op."""
        self.enabled = False


def install_span_processor(
    tracer_provider: trace.TracerProvider | None = None,
) -> SandboxSpanProcessor | None:
    """Add a new ``SandboxSpanProcessor`` to ``tracer_provider`` (default: the global one).

    Returns the processor, to be ``disable()``-d later; returns ``None`` (logged at debug
    level) for a provider without ``add_span_processor``, such as the API's proxy.
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    add = getattr(provider, "add_span_processor", None)
    if not callable(add):
        LOGGER.debug(
            "tracer provider %s cannot take span processors; sandbox spans are not stamped",
            type(provider).__name__,
        )
        return None
    processor = SandboxSpanProcessor()
    add(processor)
    return processor
