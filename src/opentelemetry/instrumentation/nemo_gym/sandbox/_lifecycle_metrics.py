"""Sandbox lifecycle metrics in NeMo Gym's own names, and usage totals per environment.

**Lifecycle**, as NeMo Gym 0.6+ defines them in ``nemo_gym.telemetry.gym_metrics`` (read in
its source, ``SANDBOX_*_INSTRUMENT`` and ``SANDBOX_DURATION_BOUNDARIES_MS``, and on its docs
page https://docs.nvidia.com/nemo/gym/nemo-gym/nemo_gym/telemetry/gym_metrics): same names,
units and bucket boundaries, and every one carries ``nemo.gym.sandbox.provider``, so a
dashboard reads NeMo Gym's series and ours alike:

* ``gym.sandbox.active`` (up-down counter, ``{sandbox}``): +1 when a traced ``create`` or
  ``connect`` hands back a handle, -1 when the sandbox is closed (or its provider is
  ``aclose``d with it still open);
* ``gym.sandbox.startup_duration_ms`` (histogram, ``ms``): the wall-clock of one ``create``;
* ``gym.sandbox.exec_duration_ms`` (histogram, ``ms``): the wall-clock of one ``exec``;
* ``gym.sandbox.transfer_duration_ms`` (histogram, ``ms``): one ``upload_file`` or
  ``download_file`` (NeMo Gym's docs page names it, "wall-clock of one file transfer into or
  out of a sandbox"; the source we could read predates it, so its unit and buckets are taken
  to be its siblings');
* ``gym.sandbox.create_retry_total`` (counter, unit ``1``): a ``create`` of the same spec
  object through the same provider object after that spec's previous create failed (the
  retry NeMo Gym's providers count inside their own loops, seen from outside).

The histograms' buckets end at 30 minutes (250 ms ... 1,800,000 ms). A create, command or
transfer that raised also carries ``error.type`` (the exception's class name; for a command,
also a result's ``error_type``); attributes are never a sandbox id.

While the application records these itself (``HOST.records_lifecycle()``, in
``sandbox/_host.py``: for NeMo Gym, its own ``gym_metrics`` module loaded and recording), we
record none of them, as the connection pool leaves NeMo Gym's own timed connectors alone. A
sandbox counted +1 here is always counted -1 here, whatever happens meanwhile.

**Usage totals**, fed by the usage samples of the resource records, per provider and per NeMo
Gym server (``HOST.server_attributes()``: for NeMo Gym, ``nemo.gym.server.name``, the server
this process is, from ``NEMO_GYM_CONFIG_PATH``, absent outside one), after the semantic
conventions' ``container.cpu.time`` (counter, ``s``, no ``cpu.mode``: the samples give the
total only):

* ``gym.sandbox.cpu.time`` (counter, ``s``): the CPU time the sandboxes used, the increase of
  each sandbox's ``usage.cpu.time_s`` from one sample to the next (a first sample counts
  whole; a counter that went back, as after a container restart, counts from zero);
* ``gym.sandbox.memory.peak`` (gauge, ``By``): the highest memory any sandbox reached
  (``usage.memory_peak_mib``, else ``usage.memory_mib``), a high-water mark since the
  process started.

``SandboxLifecycleMetrics.of(meter_provider)`` gives the one set of a meter provider; its
methods never raise (a failure is logged once) and are thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import metrics

from opentelemetry.instrumentation.nemo_gym._shared import _names
from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym._shared._per_provider import PerProvider
from opentelemetry.instrumentation.nemo_gym.sandbox._fleet_metrics import (
    ATTR_ERROR_TYPE,
    ATTR_PROVIDER,
    CappedLabels,
    guarded_record,
    usage_value,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._host import HOST

__all__ = [
    "ACTIVE",
    "CPU_TIME",
    "CREATE_RETRIES",
    "DURATION_BUCKETS_MS",
    "EXEC_DURATION",
    "MEMORY_PEAK",
    "STARTUP_DURATION",
    "TRANSFER_DURATION",
    "SandboxLifecycleMetrics",
]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

# NeMo Gym's names and units (nemo_gym/telemetry/gym_metrics.py, NeMo Gym 0.6+).
ACTIVE: Final = "gym.sandbox.active"
ACTIVE_UNIT: Final = "{sandbox}"
STARTUP_DURATION: Final = "gym.sandbox.startup_duration_ms"
EXEC_DURATION: Final = "gym.sandbox.exec_duration_ms"
TRANSFER_DURATION: Final = "gym.sandbox.transfer_duration_ms"
DURATION_UNIT: Final = "ms"
CREATE_RETRIES: Final = "gym.sandbox.create_retry_total"
CREATE_RETRIES_UNIT: Final = "1"
# NeMo Gym's SANDBOX_DURATION_BOUNDARIES_MS: a remote sandbox takes tens of seconds to start
# and a command may run for minutes; the SDK's default buckets end at 10 s.
DURATION_BUCKETS_MS: Final = (
    250.0,
    500.0,
    1_000.0,
    2_000.0,
    5_000.0,
    10_000.0,
    30_000.0,
    60_000.0,
    120_000.0,
    300_000.0,
    600_000.0,
    1_800_000.0,
)

# After the semantic conventions' container.cpu.time (counter, s) and container.memory.* (By).
CPU_TIME: Final = "gym.sandbox.cpu.time"
CPU_TIME_UNIT: Final = "s"
MEMORY_PEAK: Final = "gym.sandbox.memory.peak"
MEMORY_PEAK_UNIT: Final = "By"

_MIB: Final = 1024 * 1024
# Failed creates remembered for retry counting; the oldest are dropped beyond this.
_MAX_FAILED_CREATES: Final = 1024

# (provider name, server scope, sandbox id), as the sandbox state keys a sandbox (_state).
SandboxKey = tuple[str, str | None, str]


def _number(sample: Mapping[str, Any], quantity: str) -> float | None:
    """A usage figure of a sample, with or without the ``nemo.gym.sandbox.`` prefix."""
    value = usage_value(sample, quantity)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return None
    return float(value)


class SandboxLifecycleMetrics:
    """The lifecycle and usage instruments of one meter provider, created once, here.

    Prefer ``of``, which keeps one object per meter provider. Durations are given in seconds
    and recorded in milliseconds. Never raises: a failure is logged once per instrument.
    """

    def __init__(
        self, meter_provider: metrics.MeterProvider | None = None, *, version: str | None = None
    ) -> None:
        provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
        meter = provider.get_meter(_names.METER_NAME, version)
        self._active = meter.create_up_down_counter(
            ACTIVE, unit=ACTIVE_UNIT, description="Sandboxes this process holds, by provider."
        )
        self._startup = meter.create_histogram(
            STARTUP_DURATION,
            unit=DURATION_UNIT,
            description="Wall-clock time of one sandbox create, by provider.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self._exec = meter.create_histogram(
            EXEC_DURATION,
            unit=DURATION_UNIT,
            description="Wall-clock time of one command run in a sandbox, by provider.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self._transfer = meter.create_histogram(
            TRANSFER_DURATION,
            unit=DURATION_UNIT,
            description="Wall-clock time of one file upload or download, by provider.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_MS,
        )
        self._retries = meter.create_counter(
            CREATE_RETRIES,
            unit=CREATE_RETRIES_UNIT,
            description="Sandbox creates that retried a failed create of the same spec.",
        )
        self._cpu_time = meter.create_counter(
            CPU_TIME,
            unit=CPU_TIME_UNIT,
            description="CPU time used by sandboxes, by provider and NeMo Gym server.",
        )
        self._memory_peak = meter.create_gauge(
            MEMORY_PEAK,
            unit=MEMORY_PEAK_UNIT,
            description="Highest memory use any sandbox reached, by provider and NeMo Gym server.",
        )
        self._providers = CappedLabels("provider")
        self._error_types = CappedLabels(ATTR_ERROR_TYPE)
        self._lock = threading.Lock()
        # Sandboxes counted +1 on gym.sandbox.active -> the provider label they were counted
        # under: only those are counted -1, under the same label.
        self._held: dict[SandboxKey, str] = {}
        # (provider object id, spec object id) of failed creates -> the spec, kept so its id
        # is not reused while remembered.
        self._failed: OrderedDict[tuple[int, int], object] = OrderedDict()
        # (provider label, server attributes) -> the highest memory peak recorded, in bytes.
        self._peaks: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}

    @classmethod
    def of(
        cls, meter_provider: metrics.MeterProvider, *, version: str | None = None
    ) -> SandboxLifecycleMetrics:
        """The instruments of ``meter_provider``, made on first use; later calls return the
        same object. Raises whatever the provider raises when it cannot create them."""
        return _BY_PROVIDER.get(meter_provider, lambda: cls(meter_provider, version=version))

    def _attributes(self, provider: str, error_type: str | None) -> dict[str, str]:
        attributes = {ATTR_PROVIDER: self._providers(provider)}
        if error_type:
            attributes[ATTR_ERROR_TYPE] = self._error_types(error_type)
        return attributes

    # --- lifecycle: what the traced calls report ------------------------------------------

    def created(
        self,
        provider: str,
        key: SandboxKey | None,
        duration_s: float,
        error_type: str | None = None,
        *,
        retry_of: tuple[object, object] | None = None,
    ) -> None:
        """One create by ``provider`` that took ``duration_s``: the sandbox ``key`` it made,
        or the ``error_type`` it failed with. ``retry_of`` is ``(provider object, spec)``:
        a create of a spec whose previous create through that provider failed is a retry."""
        retried = self._retry_seen(retry_of, failed=error_type is not None)
        if HOST.records_lifecycle():
            return
        if retried:
            guarded_record(self._retries.add, 1, self._attributes(provider, None))
        guarded_record(
            self._startup.record, duration_s * 1000.0, self._attributes(provider, error_type)
        )
        if error_type is None and key is not None:
            self._hold(provider, key)

    def connected(self, provider: str, key: SandboxKey) -> None:
        """``provider`` handed back a handle to an existing sandbox: it is held now."""
        if not HOST.records_lifecycle():
            self._hold(provider, key)

    def released(self, *keys: SandboxKey) -> None:
        """These sandboxes were closed: -1 for each that was counted +1."""
        for key in keys:
            with self._lock:
                label = self._held.pop(key, None)
            if label is not None:
                guarded_record(self._active.add, -1, {ATTR_PROVIDER: label})

    def executed(self, provider: str, duration_s: float, error_type: str | None = None) -> None:
        """One command in a sandbox of ``provider`` took ``duration_s``."""
        if not HOST.records_lifecycle():
            guarded_record(
                self._exec.record, duration_s * 1000.0, self._attributes(provider, error_type)
            )

    def transferred(self, provider: str, duration_s: float, error_type: str | None = None) -> None:
        """One file upload or download with a sandbox of ``provider`` took ``duration_s``."""
        if not HOST.records_lifecycle():
            guarded_record(
                self._transfer.record, duration_s * 1000.0, self._attributes(provider, error_type)
            )

    def _hold(self, provider: str, key: SandboxKey) -> None:
        label = self._providers(provider)
        with self._lock:
            if key in self._held:
                return  # one sandbox is held once, however often it is connected to
            self._held[key] = label
        guarded_record(self._active.add, 1, {ATTR_PROVIDER: label})

    def _retry_seen(self, retry_of: tuple[object, object] | None, *, failed: bool) -> bool:
        """Whether this create retries a failed one; remembers it if it failed too."""
        if retry_of is None:
            return False
        provider, spec = retry_of
        slot = (id(provider), id(spec))
        with self._lock:
            retried = self._failed.pop(slot, None) is spec and spec is not None
            if failed and spec is not None:
                self._failed[slot] = spec
                while len(self._failed) > _MAX_FAILED_CREATES:
                    self._failed.popitem(last=False)
        return retried

    # --- usage: what each usage sample reports --------------------------------------------

    def sampled(
        self, provider: str, previous: Mapping[str, Any] | None, sample: Mapping[str, Any]
    ) -> None:
        """Add the CPU time used since the sandbox's ``previous`` sample and raise the memory
        high-water mark of ``provider`` and this process's NeMo Gym server."""
        server = dict(HOST.server_attributes())
        attributes = {**server, ATTR_PROVIDER: self._providers(provider)}
        cpu = _number(sample, "cpu.time_s")
        if cpu is not None:
            before = _number(previous or {}, "cpu.time_s")
            used = cpu - before if before is not None and cpu >= before else cpu
            if used > 0:
                guarded_record(self._cpu_time.add, used, attributes)
        peak_mib = _number(sample, "memory_peak_mib")
        if peak_mib is None:
            peak_mib = _number(sample, "memory_mib")
        if peak_mib is None:
            return
        peak = round(peak_mib * _MIB)
        slot = (attributes[ATTR_PROVIDER], tuple(sorted(server.items())))
        with self._lock:
            if peak <= self._peaks.get(slot, -1):
                return
            self._peaks[slot] = peak
            # Under the lock: a lower mark set after a higher one would be the gauge's value.
            guarded_record(self._memory_peak.set, peak, attributes)


_BY_PROVIDER: PerProvider[SandboxLifecycleMetrics] = PerProvider()
