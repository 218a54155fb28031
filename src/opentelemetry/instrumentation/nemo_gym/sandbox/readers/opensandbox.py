"""The resource reader of NeMo Gym's built-in ``opensandbox`` provider.

NeMo Gym's ``OpenSandboxProvider`` keeps the OpenSandbox SDK's ``Sandbox`` object of each
sandbox in ``handle.raw`` and its server in ``provider._connection.domain``. Where the sandbox
runs decides what can be read:

* **co-located**: the server's Docker runtime made the sandbox's container on an engine this
  process reaches (its ``docker`` CLI, ``DOCKER_HOST``). The container is found once per
  sandbox by the label OpenSandbox puts on it (``opensandbox.io/id=<sandbox id>``), in one
  list of the labelled containers for all the sandboxes looked up together; from then
  on it is read exactly as NeMo Gym's ``docker`` provider's containers are (``docker_cli``):
  the allocation is what the engine set (``allocation.source`` ``docker.inspect``: cpu,
  memory and pids limits), samples come from the container's cgroup with its OOM kill count,
  else from the engine's stats.
* **a pod**: no engine here knows the container, but a Kubernetes configuration is available
  (lightkube's: the in-cluster service account, else ``KUBECONFIG`` or ``~/.kube/config``) and a
  pod labelled ``opensandbox.io/id=<sandbox id>`` is in its namespace (the current context's):
  the server's Kubernetes runtime made it. It is read by ``KubernetesReader``
  (``readers/kubernetes.py``): the allocation is the ``sandbox`` container's requests and limits
  (``allocation.source`` ``kubernetes.pod``), placed on its node, samples come from the
  kubelet's summary with the OOM kills of the container's statuses.
* **remote**: neither an engine here nor the cluster knows the sandbox (a server on another
  machine, a cluster this process has no configuration for). The allocation is unknown, with
  the reason (``container_not_found``, or ``engine_unreachable`` when no engine answered; the
  Kubernetes reader's reason, such as ``kubernetes.forbidden``, when a cluster is configured
  but could not be asked): ``get_metrics()``'s ``cpu_count`` and
  ``memory_total_in_mib`` describe the server's host, not the sandbox (measured: 2 cores and
  24 GiB for a 0.5-CPU, 64 MiB sandbox), so they are never recorded. Samples come from
  OpenSandbox's metrics API through the provider's own SDK object, as what it reports and
  under names that say so: ``usage.opensandbox.cpu_used_percent`` (the percentage it gives,
  not CPU seconds made from it) and ``usage.opensandbox.memory_used_mib``, with
  ``usage.source`` ``opensandbox.metrics``. They are not ``usage.memory_mib``: with the Docker
  runtime, execd reads them from the ``/proc`` it sees, which is the host's (measured: the
  host's used memory, about 1.5 GiB, for a sandbox holding 40 MiB; docs/sandboxes.md). When
  the metrics call fails the sample is unknown with the reason (``opensandbox.timeout``,
  ``opensandbox.unauthorized``, ``opensandbox.not_found``, ``opensandbox.server_error``,
  ``opensandbox.unreachable``, ``opensandbox.error``), and the sandbox's status is read once
  (``get_info``): where it says OOM as NeMo Gym's provider recognises it (``oom killed``,
  ``out of memory`` in its reason or message), the sample says ``usage.oom_killed``.

Bounds: each SDK call has its own timeout (``METRICS_TIMEOUT_S``; ``get_metrics()`` itself
takes about 1 s, execd's CPU window), and there is never more than one metrics call in flight
per sandbox, so at most one per sample: each sample takes the newest answer of the call
started at the previous one (``usage.opensandbox.timestamp_ms`` says when execd measured it)
and starts the next, so no sample but the first waits for execd's window and the final sample
never races the close after it. The call in flight is cancelled when the sandbox is released. The
SDK object shares the provider's connection pool: the calls are few (one per sandbox per
sampling interval) and bounded, and run beside the provider's calls, never in front of them.

Identity: the allocation's designator is ``opensandbox.sandbox`` with the sandbox id (the
``nemo.gym.sandbox.id`` of every span of that sandbox), scoped by the server it belongs to
(``host:port`` of the provider's ``connection.domain``; never the key: ``server_scope``, from
``_server_scope``). The sandbox state keys the sandbox by that scope too, so two servers'
sandboxes with one id stay two sandboxes. Co-located, its ``host`` designator is the container
(``container`` with the engine's ID, scoped by the daemon); a pod's is the pod (``k8s.pod``
with its UID, scoped by the cluster), its node and namespace in ``allocation.placement.*``.

Which place was chosen is the allocation's ``allocation.source``: ``docker.inspect``,
``kubernetes.pod``, or none with the remote reason. The engine is asked first (today's
co-located path, one ``docker ps``), the cluster only when the engine does not know the
sandbox; the place is looked up once per sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    Attribute,
    PlacedAllocation,
    ResourceAllocation,
    ResourceDesignator,
    ResourcesUnknown,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._attributes import within_total
from opentelemetry.instrumentation.nemo_gym.sandbox._server_scope import (
    opensandbox_server_scope as server_scope,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxHandle
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.docker_cli import (
    DockerCliError,
    DockerCliReader,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.kubernetes import (
    NO_CLIENT,
    NO_CONFIG,
    POD_NOT_FOUND,
    KubernetesReader,
    configured_namespace,
)

__all__ = [
    "ID_LABEL",
    "METRICS_SOURCE",
    "OpenSandboxReader",
    "reason_of",
    "says_oom",
    "server_scope",
]

logger = logging.getLogger(__name__)

ID_LABEL = "opensandbox.io/id"
METRICS_SOURCE = "opensandbox.metrics"
DESIGNATOR_KIND = "opensandbox.sandbox"
METRICS_TIMEOUT_S = 3.0
CPU_PERCENT = "usage.opensandbox.cpu_used_percent"
MEMORY_USED = "usage.opensandbox.memory_used_mib"

CONTAINER_NOT_FOUND = "container_not_found"
ENGINE_UNREACHABLE = "engine_unreachable"
CONTAINER_REMOVED = "container_removed"
NO_SDK_SANDBOX = "opensandbox.no_sdk_sandbox"

# NeMo Gym's provider's own test for an OOM-killed sandbox in its status (reason, message).
_OOM = re.compile(r"\boom[\s_-]*killed\b|\bout of memory\b", re.IGNORECASE)


def reason_of(exc: BaseException) -> str:
    """A short, stable reason for a failed SDK call: its HTTP status class, a timeout, an
    unreachable server; never the exception's text."""
    if isinstance(exc, TimeoutError):
        return "opensandbox.timeout"
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        if status in (401, 403):
            return "opensandbox.unauthorized"
        if status == 404:
            return "opensandbox.not_found"
        if status >= 500:
            return "opensandbox.server_error"
    name = type(exc).__name__
    if "Timeout" in name:
        return "opensandbox.timeout"
    if "Connection" in name or isinstance(exc, OSError):
        return "opensandbox.unreachable"
    return "opensandbox.error"


def says_oom(info: object) -> bool:
    """Whether a ``get_info()`` answer's status says the sandbox was OOM-killed, as NeMo
    Gym's provider reads it (its reason or message)."""
    status = getattr(info, "status", None)
    text = f"{getattr(status, 'reason', '')} {getattr(status, 'message', '')}"
    return _OOM.search(text) is not None


# The Kubernetes reader's reasons that mean "no cluster to look in" or "not there": the
# engine's reason says more.
_NOT_IN_CLUSTER = (NO_CLIENT, NO_CONFIG, POD_NOT_FOUND)


@dataclass
class _Sandbox:
    """What the reader knows of one sandbox: its container (``None``: a pod or remote),
    whether its pod is read, why it is remote, its last metrics answer and its metrics call in
    flight."""

    container: str | None
    remote_reason: str | None = None
    pod: bool = False
    last: dict[str, Attribute] | ResourcesUnknown | None = None
    in_flight: asyncio.Task[dict[str, Attribute] | ResourcesUnknown] | None = None


class OpenSandboxReader:
    """Allocation and usage of one NeMo Gym ``OpenSandboxProvider``'s sandboxes (see the
    module). Runs on the event loop; reads only."""

    periodic = True

    def __init__(self, provider: object) -> None:
        self._scope = server_scope(provider)
        # The server its sandboxes' ids are unique within: its samplers key them by it.
        self.server_scope = self._scope
        # The engine path is docker_cli's own reader, given the container's engine ID.
        self._docker = DockerCliReader(provider)
        self._located: dict[str, asyncio.Task[_Sandbox]] = {}
        # The reader of the cluster's pods, made at the first sandbox no engine knows: False
        # until then, None when there is no cluster to look in.
        self._kubernetes: KubernetesReader | bool | None = False
        # Its HTTP clients are closed whenever it follows no sandbox (this reader has no close
        # of its own); a lookup waits for that close first.
        self._kubernetes_closing: asyncio.Task[None] | None = None

    def _designator(self, handle: SandboxHandle) -> ResourceDesignator:
        return ResourceDesignator(DESIGNATOR_KIND, str(handle.sandbox_id), scope=self._scope)

    async def resource_allocation(
        self, handle: SandboxHandle
    ) -> ResourceAllocation | ResourcesUnknown:
        """What the engine set for the sandbox's container; unknown with the reason when no
        engine here knows it."""
        sandbox = await self._sandbox(handle)
        if sandbox.pod:
            return await self._pod_allocation(handle)
        if sandbox.container is None:
            return ResourcesUnknown(sandbox.remote_reason or CONTAINER_NOT_FOUND)
        engine = await self._docker.resource_allocation(_container_handle(sandbox.container))
        return ResourceAllocation(
            source=engine.source,
            components=engine.components,
            designator=self._designator(handle),
            host=engine.designator,
        )

    async def resource_sample(
        self, handle: SandboxHandle
    ) -> dict[str, Attribute] | ResourcesUnknown:
        """One usage sample: the container's (cgroup, else engine stats) when co-located,
        else OpenSandbox's metrics API."""
        sandbox = await self._sandbox(handle)
        if sandbox.pod and isinstance(self._kubernetes, KubernetesReader):
            return await self._kubernetes.resource_sample(handle)
        if sandbox.container is not None:
            return await self._container_sample(handle, sandbox.container)
        return await self._metrics_sample(handle, sandbox)

    def resource_sample_nowait(self, handle: SandboxHandle) -> dict[str, Attribute] | None:
        """The co-located sample from the container's cgroup without running anything."""
        located = self._located.get(str(handle.sandbox_id))
        if located is None or not located.done() or located.cancelled():
            return None
        if located.exception() is not None:
            return None
        container = located.result().container
        if container is None:
            return None
        return self._docker.resource_sample_nowait(_container_handle(container))

    def release(self, handle: SandboxHandle) -> None:
        """Forget the sandbox (called after its final sample)."""
        located = self._located.pop(str(handle.sandbox_id), None)
        if located is not None and located.done() and not located.cancelled():
            sandbox = None if located.exception() else located.result()
            if sandbox is not None and sandbox.container is not None:
                self._docker.release(_container_handle(sandbox.container))
            if sandbox is not None and sandbox.pod and self._kubernetes:
                assert isinstance(self._kubernetes, KubernetesReader)  # a pod: found by it
                self._kubernetes.release(handle)
                self._close_kubernetes_when_idle()
            if sandbox is not None and sandbox.in_flight is not None:
                sandbox.in_flight.cancel()

    # --- where the sandbox is ------------------------------------------------------------

    async def _sandbox(self, handle: SandboxHandle) -> _Sandbox:
        """The sandbox's place, looked up once (the allocation read and the first sample
        share one lookup)."""
        key = str(handle.sandbox_id)
        located = self._located.get(key)
        if located is None or (located.done() and located.cancelled()):
            located = asyncio.ensure_future(self._locate(key))
            self._located[key] = located
        # shield: a timed-out record abandons its wait, not the lookup others share.
        return await asyncio.shield(located)

    async def _locate(self, sandbox_id: str) -> _Sandbox:
        """The container labelled with the sandbox id on the engine this process reaches, else
        its pod in the cluster this process is configured for, else remote."""
        engine = await self._locate_container(sandbox_id)
        if engine.container is not None:
            return engine
        kubernetes = self._kubernetes_reader()
        if kubernetes is None:
            return engine
        handle = SandboxHandle(sandbox_id=sandbox_id, provider_name="opensandbox", raw=None)
        closing = self._kubernetes_closing
        if closing is not None and not closing.done():
            await asyncio.shield(closing)
        missing = await kubernetes.lookup(handle)
        if missing is None:
            return _Sandbox(None, pod=True)
        self._close_kubernetes_when_idle()
        if missing.reason in _NOT_IN_CLUSTER:
            return engine
        return _Sandbox(None, missing.reason)

    def _kubernetes_reader(self) -> KubernetesReader | None:
        """The reader of the configured cluster's pods, in its configuration's namespace; made
        once, ``None`` when lightkube or a configuration is missing."""
        if self._kubernetes is False:
            namespace = configured_namespace()
            self._kubernetes = None if namespace is None else KubernetesReader(namespace)
        return self._kubernetes if isinstance(self._kubernetes, KubernetesReader) else None

    def _close_kubernetes_when_idle(self) -> None:
        """Close the Kubernetes reader's clients (its watch has stopped) when it follows no
        sandbox: they belong to this event loop, and nothing else would close them."""
        kubernetes = self._kubernetes
        if not isinstance(kubernetes, KubernetesReader) or kubernetes.following:
            return
        closing = self._kubernetes_closing
        if closing is None or closing.done():
            self._kubernetes_closing = asyncio.ensure_future(kubernetes.aclose())

    async def _pod_allocation(self, handle: SandboxHandle) -> ResourceAllocation | ResourcesUnknown:
        """The pod's requests and limits, designated as the sandbox (the pod as its host)."""
        assert isinstance(self._kubernetes, KubernetesReader)  # a pod was found through it
        pod = await self._kubernetes.resource_allocation(handle)
        if isinstance(pod, ResourcesUnknown):
            return pod
        return PlacedAllocation(
            source=pod.source,
            components=pod.components,
            designator=self._designator(handle),
            host=pod.designator,
            placement=pod.placement,
        )

    async def _locate_container(self, sandbox_id: str) -> _Sandbox:
        """The container labelled with the sandbox id on the engine this process reaches,
        from one list of the labelled containers shared by the lookups of a burst."""
        engine = self._docker.engine
        if engine.socket is None and engine.binary is None:
            return _Sandbox(None, ENGINE_UNREACHABLE)
        try:
            ids = await engine.labelled(ID_LABEL, sandbox_id)
        except DockerCliError:
            return _Sandbox(None, ENGINE_UNREACHABLE)
        if not ids:
            return _Sandbox(None, CONTAINER_NOT_FOUND)
        if len(ids) > 1:
            logger.debug("opensandbox %s: %d containers carry its label", sandbox_id, len(ids))
        return _Sandbox(ids[0])

    # --- co-located: the container ---------------------------------------------------------

    async def _container_sample(
        self, handle: SandboxHandle, container: str
    ) -> dict[str, Attribute] | ResourcesUnknown:
        try:
            return await self._docker.resource_sample(_container_handle(container))
        except DockerCliError:
            # Removed from outside (or the engine went away): say which, once known.
            gone = await self._locate_container(str(handle.sandbox_id))
            if gone.container is None and gone.remote_reason == CONTAINER_NOT_FOUND:
                return ResourcesUnknown(CONTAINER_REMOVED)
            raise

    # --- remote: OpenSandbox's metrics API ------------------------------------------------

    async def _metrics_sample(
        self, handle: SandboxHandle, sandbox: _Sandbox
    ) -> dict[str, Attribute] | ResourcesUnknown:
        """The newest answer of this sandbox's metrics calls, and the next call started for
        the next sample. A call takes about a second (execd's CPU window): each sample takes
        the answer of the call started at the previous one instead of waiting for it; a sample
        that comes while that call still runs (a final sample right after a periodic one)
        repeats the previous answer, whose ``usage.opensandbox.timestamp_ms`` says when it was
        measured, so it never races the close that follows. Only the first sample waits. One
        call at a time, so at most one per sample."""
        call = sandbox.in_flight
        if call is None:
            call = sandbox.in_flight = asyncio.ensure_future(self._ask_metrics(handle))
        if not call.done() and sandbox.last is not None:
            return sandbox.last
        # shield: a record that gives up at its deadline leaves the call to its own bound.
        answer = await asyncio.shield(call)
        if sandbox.in_flight is call:
            sandbox.last = answer
            sandbox.in_flight = asyncio.ensure_future(self._ask_metrics(handle))
        return answer

    async def _ask_metrics(self, handle: SandboxHandle) -> dict[str, Attribute] | ResourcesUnknown:
        """One bounded ``get_metrics()`` call; on failure, one bounded ``get_info()`` for the
        OOM the status may tell."""
        sdk = getattr(handle, "raw", None)
        get_metrics = getattr(sdk, "get_metrics", None)
        if not callable(get_metrics):
            return ResourcesUnknown(NO_SDK_SANDBOX)
        try:
            metrics = await asyncio.wait_for(get_metrics(), METRICS_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed read is an unknown sample
            reason = reason_of(exc)
            if reason in ("opensandbox.unauthorized", "opensandbox.unreachable"):
                return ResourcesUnknown(reason)
            return await self._status_after_failure(sdk, reason)
        return _sample_from_metrics(metrics)

    async def _status_after_failure(
        self, sdk: Any, reason: str
    ) -> dict[str, Attribute] | ResourcesUnknown:
        get_info = getattr(sdk, "get_info", None)
        if not callable(get_info):
            return ResourcesUnknown(reason)
        try:
            info = await asyncio.wait_for(get_info(), METRICS_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the metrics failure is the answer
            return ResourcesUnknown(reason)
        if says_oom(info):
            return {"usage.source": "opensandbox.status", "usage.oom_killed": True}
        return ResourcesUnknown(reason)


def _sample_from_metrics(metrics: object) -> dict[str, Attribute]:
    """The figures of a ``get_metrics()`` answer, under names that say they are OpenSandbox's
    report: ``usage.opensandbox.cpu_used_percent`` and ``usage.opensandbox.memory_used_mib``.
    Not ``usage.memory_mib``: with the Docker runtime execd reads them from the ``/proc`` it
    sees, the host's (measured: the host's used memory and CPU busy percentage, for a 64 MiB,
    0.5-CPU sandbox), so they must not feed the sandbox's memory figures. ``cpu_count`` and
    ``memory_total_in_mib`` are left out: the host's cores and memory, never an allocation.

    They bound the figures all the same: a CPU percentage above ``100 * cpu_count`` (100 when
    the answer gives no CPU count of at least one) or memory above ``memory_total_in_mib`` is
    impossible and dropped (``within_total``: logged once, as a NaN or negative is)."""
    sample: dict[str, Attribute] = {"usage.source": METRICS_SOURCE}
    cpu = _number(getattr(metrics, "cpu_used_percentage", None))
    memory = _number(getattr(metrics, "memory_used_in_mib", None))
    if cpu is not None:
        cpu = within_total(CPU_PERCENT, cpu, _percent_bound(metrics), "100 x cpu_count")
    if cpu is not None:
        sample[CPU_PERCENT] = cpu
    if memory is not None:
        total = _number(getattr(metrics, "memory_total_in_mib", None))
        memory = within_total(MEMORY_USED, memory, total, "memory_total_in_mib")
    if memory is not None:
        sample[MEMORY_USED] = memory
    # When execd measured them (a sample may carry the answer of a call made since the
    # previous sample).
    timestamp = getattr(metrics, "timestamp", None)
    if isinstance(timestamp, int) and not isinstance(timestamp, bool):
        sample["usage.opensandbox.timestamp_ms"] = timestamp
    return sample


def _number(value: object) -> float | None:
    """``value`` as a float when it is a number (not a bool), else ``None``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _percent_bound(metrics: object) -> float:
    """The most ``cpu_used_percentage`` can be: 100 per CPU of the answer's ``cpu_count``, or
    100 (the percentage's own range, as the SDK documents it) without a count of at least 1."""
    count = _number(getattr(metrics, "cpu_count", None))
    return 100.0 * count if count is not None and 1 <= count < math.inf else 100.0


def _container_handle(container: str) -> SandboxHandle:
    """A handle naming the container by its engine ID, for ``DockerCliReader``."""
    return SandboxHandle(sandbox_id=container, provider_name="docker", raw=None)
