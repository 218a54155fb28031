"""The scope of user code running for a sandbox, and the span processor that stamps it.

``stamped(identity)`` makes a sandbox's identity attributes (``request.id``, ``provider``,
``id``) current for the code inside it, and ``SandboxSpanProcessor`` copies the current
identity onto every span started there. Which identity belongs to a handle is the sandbox
state's business (``tracing.sandbox_scope``); this module knows only the current one. Nothing
here does I/O; everything runs on the caller's thread.

NeMo Gym's own sandbox spans (``gym.sandbox.start``, ``gym.sandbox.exec``, off by default) sit
one level above ours: ``AsyncSandbox`` opens them and then calls the provider, so our provider
spans are their children. ``stamp_nemo_gym_span`` gives such an enclosing span the identity
our child span carries, so both carry one identity.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Span, SpanProcessor

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import PREFIX, Attribute
from opentelemetry.instrumentation.nemo_gym.sandbox._log import log_failure

logger = logging.getLogger(__name__)

REQUEST_ID = PREFIX + "request.id"
PROVIDER = PREFIX + "provider"
SANDBOX_ID = PREFIX + "id"

# The identity of the sandbox whose user code is running; read by SandboxSpanProcessor.
_SCOPE_IDENTITY: ContextVar[Mapping[str, Attribute] | None] = ContextVar(
    "nemo_gym_sandbox_scope", default=None
)


@contextmanager
def stamped(identity: Mapping[str, Attribute]) -> Iterator[None]:
    """Make ``identity`` the current sandbox identity inside the ``with`` block (this task or
    thread, and tasks it creates). Scopes nest; the innermost wins."""
    token = _SCOPE_IDENTITY.set(dict(identity))
    try:
        yield
    finally:
        _SCOPE_IDENTITY.reset(token)


IDENTITY_KEYS = (REQUEST_ID, PROVIDER, SANDBOX_ID)
# The names of NeMo Gym's own sandbox spans start with this.
NEMO_GYM_SPAN_PREFIX = "gym.sandbox."


def enclosing_nemo_gym_span() -> trace.Span | None:
    """The current span when it is one of NeMo Gym's own sandbox spans, still recording."""
    span = trace.get_current_span()
    name = getattr(span, "name", None)
    if isinstance(name, str) and name.startswith(NEMO_GYM_SPAN_PREFIX) and span.is_recording():
        return span
    return None


def stamp_nemo_gym_span(enclosing: trace.Span | None, child: trace.Span) -> None:
    """Copy ``child``'s identity attributes onto ``enclosing`` (a NeMo Gym sandbox span),
    leaving any it already has. Never raises."""
    if enclosing is None:
        return
    try:
        attributes = getattr(child, "attributes", None) or {}
        present = getattr(enclosing, "attributes", None) or {}
        enclosing.set_attributes(
            {k: attributes[k] for k in IDENTITY_KEYS if k in attributes and k not in present}
        )
    except Exception as exc:  # noqa: BLE001 - another library's span is not worth a failure
        log_failure("stamping NeMo Gym's sandbox span", exc)


class SandboxSpanProcessor(SpanProcessor):
    """Copies the current sandbox scope's identity attributes onto every span it starts.

    Attributes a span already has are left as they are. It exports nothing, so it does not
    count as a destination for ``sampling_interval()``. The SDK cannot remove a processor, so
    ``disable()`` turns this one into a no-op instead (and ``enable()`` turns it back on).
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
            log_failure("sandbox span stamping", exc)

    def enable(self) -> None:
        """Stamp spans again."""
        self.enabled = True

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
        logger.debug(
            "tracer provider %s cannot take span processors; sandbox spans are not stamped",
            type(provider).__name__,
        )
        return None
    processor = SandboxSpanProcessor()
    add(processor)
    return processor
