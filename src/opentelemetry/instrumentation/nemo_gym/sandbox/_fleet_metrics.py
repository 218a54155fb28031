"""Fleet metrics beside the sandbox spans, and the semantic-convention identity of records.

Three counters, low cardinality by construction (provider name, outcome, error type, resource,
mismatch kind; never a sandbox id), named and united as OpenTelemetry conventions ask (no
unit in the name, ``{annotation}`` units for counts):

* ``gym.sandbox.creations`` (``{sandbox}``): ``nemo.gym.sandbox.provider``,
  ``nemo.gym.sandbox.outcome`` (``created``, ``failed``), and ``error.type`` on failures;
* ``gym.sandbox.oom_kills`` (``{kill}``): ``nemo.gym.sandbox.provider``;
* ``gym.sandbox.allocation.mismatches`` (``{mismatch}``): ``nemo.gym.sandbox.provider``,
  ``nemo.gym.sandbox.resource`` (``cpu``, ``memory_mib``), ``nemo.gym.sandbox.mismatch``
  (``below_request``, ``above_request``, ``no_limit``).

The Prometheus exporter shows them as ``gym_sandbox_creations_total``,
``gym_sandbox_oom_kills_total`` and ``gym_sandbox_allocation_mismatches_total``.

``SandboxFleetMetrics.of(meter_provider)`` gives the one set of counters of a meter provider
(the SDK de-duplicates instruments by name, so a second set would only alias the first); its
methods never raise (a failure is logged once) and may be called from any thread. The tracing layer
calls ``created``/``failed`` after each create, ``allocation_recorded`` on each allocation
record (mismatch attributes, warning and counter, container identity) and ``sample_recorded``
on each usage sample (OOM kills). ``new_oom_kills``
reads OOM kills out of successive usage samples, and ``container_identity`` gives the
``container.id`` / ``container.runtime.name`` attributes of a container's allocation: both
pure. ``CappedLabels`` (the bound on distinct label values), ``guarded_record`` (an
instrument call whose failure is logged once) and ``usage_value`` serve the lifecycle
metrics (``_lifecycle_metrics``) too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from opentelemetry import metrics

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._per_provider import PerProvider
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    Attribute,
    ResourceAllocation,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._mismatch import (
    MismatchWarnings,
    compare_allocation,
    mismatch_attributes,
)

__all__ = [
    "ATTR_ERROR_TYPE",
    "ATTR_MISMATCH",
    "ATTR_OUTCOME",
    "ATTR_PROVIDER",
    "ATTR_RESOURCE",
    "CREATIONS",
    "MISMATCHES",
    "OOM_KILLS",
    "SandboxFleetMetrics",
    "container_identity",
    "error_type_of",
    "new_oom_kills",
]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

CREATIONS: Final = "gym.sandbox.creations"
CREATIONS_UNIT: Final = "{sandbox}"
OOM_KILLS: Final = "gym.sandbox.oom_kills"
OOM_KILLS_UNIT: Final = "{kill}"
MISMATCHES: Final = "gym.sandbox.allocation.mismatches"
MISMATCHES_UNIT: Final = "{mismatch}"

ATTR_PROVIDER: Final = _names.ATTR_SANDBOX_PROVIDER
ATTR_OUTCOME: Final = "nemo.gym.sandbox.outcome"
ATTR_ERROR_TYPE: Final = _names.ATTR_ERROR_TYPE
ATTR_RESOURCE: Final = "nemo.gym.sandbox.resource"
ATTR_MISMATCH: Final = "nemo.gym.sandbox.mismatch"

OUTCOME_CREATED: Final = "created"
OUTCOME_FAILED: Final = "failed"

# Provider names come from code and configs, so they are few; a bound keeps a misbehaving
# caller (a name per sandbox) from exploding the series count. Later names become "other".
MAX_PROVIDER_LABELS: Final = 100
_OTHER: Final = _names.OVERFLOW_LABEL_VALUE


def error_type_of(error: BaseException) -> str:
    """The ``error.type`` of a failure: the exception's qualified class name, as the
    connection-pool metrics use (``SandboxCreateError``, ``TimeoutError``, ...)."""
    return type(error).__qualname__


class CappedLabels:
    """At most ``MAX_PROVIDER_LABELS`` distinct values of one attribute; later ones are
    ``other`` (one warning). Thread-safe."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < MAX_PROVIDER_LABELS:
                self._seen.add(value)
                return value
        _ONCE(
            ("labels", self._what, id(self)),
            logging.WARNING,
            "nemo_gym: more than %d sandbox %s values; later ones are recorded as %r",
            MAX_PROVIDER_LABELS,
            self._what,
            _OTHER,
        )
        return _OTHER


def guarded_record(
    record: Callable[[float, Mapping[str, str]], None], value: float, attributes: Any
) -> None:
    """``record(value, attributes)`` (an instrument's ``add``, ``record`` or ``set``), a
    failure logged once per instrument: telemetry never fails the sandbox."""
    try:
        record(value, attributes)
    except Exception as exc:  # noqa: BLE001 - telemetry never fails the sandbox
        name = getattr(getattr(record, "__self__", None), "name", "sandbox metric")
        _ONCE(("record", name), logging.WARNING, "nemo_gym: %s not recorded: %r", name, exc)


class SandboxFleetMetrics:
    """The sandbox fleet counters of one meter provider, created once, here.

    ``meter_provider`` defaults to the global one as it is now; ``version`` is the meter
    scope's version. Prefer ``of``, which keeps one object per meter provider. Methods add 1
    (or ``count``) to a counter with the attributes above. They never raise: a failure is
    logged once per kind and dropped. Thread-safe.
    """

    def __init__(
        self, meter_provider: metrics.MeterProvider | None = None, *, version: str | None = None
    ) -> None:
        provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
        meter = provider.get_meter(_names.METER_NAME, version)
        self._creations = meter.create_counter(
            CREATIONS,
            unit=CREATIONS_UNIT,
            description="Sandbox creations by provider and outcome (created or failed).",
        )
        self._oom_kills = meter.create_counter(
            OOM_KILLS,
            unit=OOM_KILLS_UNIT,
            description="Processes the kernel OOM-killed inside sandboxes, by provider.",
        )
        self._mismatches = meter.create_counter(
            MISMATCHES,
            unit=MISMATCHES_UNIT,
            description=(
                "Sandboxes whose allocated limit differs from the requested resource, by "
                "provider, resource and kind (below_request, above_request, no_limit)."
            ),
        )
        self._provider_label = CappedLabels("provider")
        self._warnings = MismatchWarnings()

    @classmethod
    def of(
        cls, meter_provider: metrics.MeterProvider, *, version: str | None = None
    ) -> SandboxFleetMetrics:
        """The counters of ``meter_provider``, made on first use; later calls return the same
        object whatever ``version`` they pass. Raises whatever the provider raises when it
        cannot create instruments."""
        return _BY_PROVIDER.get(meter_provider, lambda: cls(meter_provider, version=version))

    def created(self, provider: str) -> None:
        """One sandbox created by ``provider``."""
        guarded_record(
            self._creations.add,
            1,
            {ATTR_PROVIDER: self._provider_label(provider), ATTR_OUTCOME: OUTCOME_CREATED},
        )

    def failed(self, provider: str, error_type: str) -> None:
        """One failed creation by ``provider``; ``error_type`` as ``error_type_of`` gives it."""
        guarded_record(
            self._creations.add,
            1,
            {
                ATTR_PROVIDER: self._provider_label(provider),
                ATTR_OUTCOME: OUTCOME_FAILED,
                ATTR_ERROR_TYPE: error_type,
            },
        )

    def oom_killed(self, provider: str, count: int = 1) -> None:
        """``count`` OOM kills seen in a sandbox of ``provider`` (nothing for ``count < 1``)."""
        if count >= 1:
            guarded_record(
                self._oom_kills.add, count, {ATTR_PROVIDER: self._provider_label(provider)}
            )

    def mismatched(self, provider: str, resource: str, kind: str) -> None:
        """One sandbox of ``provider`` whose ``resource`` limit differs from the request by
        ``kind`` (see ``_mismatch``)."""
        guarded_record(
            self._mismatches.add,
            1,
            {
                ATTR_PROVIDER: self._provider_label(provider),
                ATTR_RESOURCE: resource,
                ATTR_MISMATCH: kind,
            },
        )

    # --- the calls the tracing layer makes, one per record --------------------------------

    def allocation_recorded(
        self, provider: str, requested: object, allocation: ResourceAllocation
    ) -> dict[str, Attribute]:
        """Compare an allocation record with the request, count and warn (once per provider
        and resource) about each mismatch, and return the attributes to add to the record:
        the mismatch attributes and the container identity. Never raises (a request that
        cannot be compared is logged once and yields the identity alone)."""
        attributes = container_identity(allocation)
        try:
            mismatches = compare_allocation(requested, allocation)
        except Exception as exc:  # noqa: BLE001 - the record is still written without them
            _ONCE(("compare", type(exc).__name__), logging.WARNING, "nemo_gym: %r", exc)
            return attributes
        self._warnings.warn(provider, mismatches)
        for mismatch in mismatches:
            self.mismatched(provider, mismatch.resource, mismatch.kind)
        attributes.update(mismatch_attributes(mismatches))
        return attributes

    def sample_recorded(
        self, provider: str, previous: Mapping[str, Any] | None, sample: Mapping[str, Any]
    ) -> None:
        """Count the OOM kills between a sandbox's previous usage sample and this one."""
        self.oom_killed(provider, new_oom_kills(previous, sample))


_BY_PROVIDER: PerProvider[SandboxFleetMetrics] = PerProvider()


def usage_value(sample: Mapping[str, Any], quantity: str) -> Any:
    """A usage value, whether the sample's keys carry the ``nemo.gym.sandbox.`` prefix or not."""
    key = "usage." + quantity
    return sample.get(_names.SANDBOX_PREFIX + key, sample.get(key))


def new_oom_kills(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> int:
    """OOM kills that happened between two usage samples of one sandbox (``previous`` is
    ``None`` for its first sample).

    Reads ``usage.oom_kills`` (a cumulative count: the ``oom_kill`` of a process sandbox's or
    a container's memory cgroup, which also counts a process ``exec``'d into a container that
    survives) as the difference, else ``usage.oom_killed`` (a sticky flag: the Docker
    engine's ``OOMKilled``, about the container's main process only, all a remote engine
    tells) as 1 when it turns true. Absent or odd values count 0. Pure.
    """
    count = usage_value(current, "oom_kills")
    if _is_count(count):
        before = usage_value(previous or {}, "oom_kills")
        return max(0, int(count) - (int(before) if _is_count(before) else 0))
    if usage_value(current, "oom_killed") is True:
        return 0 if usage_value(previous or {}, "oom_killed") is True else 1
    return 0


def _is_count(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


# Container runtimes we can name from what the Docker provider's allocation says: Podman's
# daemon scope is "podman-<digest>" (see providers/_docker_resources.daemon_scope); any other
# "docker.*" source came from a Docker engine.
def _runtime_name(allocation: ResourceAllocation) -> str | None:
    designator = allocation.designator
    if designator is not None and (designator.scope or "").startswith("podman-"):
        return "podman"
    if allocation.source.startswith("docker."):
        return "docker"
    return None


def container_identity(allocation: ResourceAllocation) -> dict[str, Attribute]:
    """The semantic-convention identity of a container's allocation record:
    ``container.id`` (the designator's id) and, where the source tells it,
    ``container.runtime.name`` (``docker`` or ``podman``). Empty unless the designator's kind
    is ``container``. Pure."""
    designator = allocation.designator
    if designator is None or designator.kind != "container":
        return {}
    identity: dict[str, Attribute] = {"container.id": designator.id}
    runtime = _runtime_name(allocation)
    if runtime is not None:
        identity["container.runtime.name"] = runtime
    return identity
