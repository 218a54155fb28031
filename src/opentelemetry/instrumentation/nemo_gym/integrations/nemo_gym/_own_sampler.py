"""One owner per sandbox beside NeMo Gym's own sandbox resource telemetry.

Newer NeMo Gym samples its sandboxes itself (``nemo_gym.sandbox.resource_telemetry``,
``ResourceSampler``: the API this package implements under its own name). Where a NeMo Gym
sampler samples a sandbox, ours must not sample it too: two series of records for one sandbox,
and twice the provider calls. While the patch is installed, a post-import hook wraps NeMo
Gym's ``ResourceSampler.start`` and ``stop`` (nothing here imports the module); the
instrumentor makes the patch with its sandbox state (``own_sampler_patch``) and keeps it:

* a NeMo Gym sampler that starts sampling (its ``task`` set: it owns the sandbox in NeMo Gym's
  registry and has a positive interval) claims the sandbox, keyed as ours are by
  ``(nemo.gym.sandbox.provider, nemo.gym.sandbox.id)`` from its ``attributes``, in the
  registry of the instrumentor's sandbox state (scoped by the server as ours are: the
  sandbox its handle stands for, else the one known sandbox with that provider and id, else
  its provider's server scope); our sampler for it then starts no task and
  records no sample. If ours was sampling already, it is stopped (its final sample is its
  last record) and NeMo Gym's takes over;
* its ``stop`` releases the claim.

Allocation records and spans stay ours: NeMo Gym's own sampler is about samples. NeMo Gym's
samplers' calls, results and exceptions pass through unchanged; a failure here is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._patching import Patch, methods_of
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import PREFIX
from opentelemetry.instrumentation.nemo_gym.sandbox._server_scope import server_scope_of
from opentelemetry.instrumentation.nemo_gym.sandbox._state import SandboxKey, SandboxState

__all__ = ["MODULE", "own_sampler_patch"]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

MODULE = "nemo_gym.sandbox.resource_telemetry"
_CLASS = "ResourceSampler"


class NemoGymOwner:
    """NeMo Gym's sampler as the owner of a sandbox in our registry. Stopping it is NeMo
    Gym's business: our ``stop`` does nothing."""

    def __init__(self, sampler: object) -> None:
        self.sampler = sampler

    async def stop(self) -> None:
        return None


def _key(state: SandboxState, sampler: object) -> SandboxKey | None:
    """The key in ``state``'s registry of the sandbox NeMo Gym's ``sampler`` samples."""
    attributes = getattr(sampler, "attributes", None)
    if not isinstance(attributes, dict):
        return None
    provider, given_id = attributes.get(PREFIX + "provider"), attributes.get(PREFIX + "id")
    if provider is None or given_id is None:
        return None
    name, sandbox_id = str(provider), str(given_id)
    # NeMo Gym's sampler mirrors ours: its handle and provider are where ours keep them.
    handle = getattr(sampler, "_handle", None)
    known = state.registry.key_of(handle) if handle is not None else None
    if known is None or (known[0], known[2]) != (name, sandbox_id):
        known = state.registry.find(name, sandbox_id)
    if known is not None:
        return known
    return (name, server_scope_of(getattr(sampler, "_provider", None)), sandbox_id)


def _claim(state: SandboxState, sampler: object) -> None:
    """Make NeMo Gym's sampling ``sampler`` the sandbox's owner, stopping ours."""
    key = _key(state, sampler)
    if key is None or getattr(sampler, "task", None) is None:
        return
    owner = NemoGymOwner(sampler)
    entry = state.registry.claim_for(key, owner)
    if entry is not None:
        # Ours was sampling: it stops (its final sample is its last record).
        state.spawn(entry.stop(), f"nemo-gym sandbox sampler yields {key[2]}")


def _release(state: SandboxState, sampler: object) -> None:
    key = _key(state, sampler)
    if key is not None:
        state.registry.release_where(key, lambda owner: getattr(owner, "sampler", None) is sampler)


def own_sampler_patch(state: SandboxState) -> Patch:
    """A new ``Patch`` on NeMo Gym's ``ResourceSampler.start`` and ``stop`` that claims and
    releases sandboxes in ``state``'s registry (the instrumentor makes one per
    ``instrument()`` and keeps it). ``install()`` never raises, whether or not NeMo Gym's
    module exists or is imported yet; ``uninstall()`` restores both methods."""

    def wrapper(
        wrapped: Callable[..., Any],
        instance: object,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        result = wrapped(*args, **kwargs)
        action = _claim if wrapped.__name__ == "start" else _release
        try:
            action(state, instance)
        except Exception as exc:  # noqa: BLE001 - NeMo Gym's sampler goes on regardless
            _ONCE(("own-sampler", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)
        return result

    return Patch((MODULE,), methods_of(_CLASS, ("start", "stop"), wrapper, _ONCE), _ONCE)
