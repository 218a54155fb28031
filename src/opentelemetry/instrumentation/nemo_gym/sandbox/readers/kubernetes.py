"""The resource reader of sandboxes that are Kubernetes pods.

OpenSandbox's Kubernetes runtime (and any runtime like it) makes each sandbox a pod that
carries the sandbox's id in a label (``opensandbox.io/id=<sandbox id>``; the label is
configurable) with its main container named ``sandbox``. ``KubernetesReader`` reads, for the
pods of one namespace:

* the allocation, from the pod: the ``sandbox`` container's requests and limits (cpu,
  memory, ephemeral-storage, GPUs by resource name, ``GPU_RESOURCES``) as one component
  named after the container, ``allocation.source`` ``kubernetes.pod``. Where the kubelet
  reports what it applied (``status.containerStatuses[].allocatedResources`` and
  ``.resources``: an in-place resize), that wins over the spec. The designator is the pod's
  UID (``k8s.pod``), the host its node (``k8s.node``), both scoped by the cluster (the API
  server's ``host:port``, or the ``cluster`` given); the placement names the pod's
  ``namespace``, ``pod`` name, ``node`` and ``qos_class``;
* usage, from the kubelet's summary API (``/stats/summary``, which the kubelet computes from
  the container's cgroup), ``usage.source`` ``kubelet.summary``: ``usage.cpu.time_s``
  (``usageCoreNanoSeconds``), ``usage.memory_mib`` (the working set, what the kubelet evicts
  and the kernel OOM-kills by), ``usage.memory_rss_mib``; and from the pod's status:
  ``usage.restarts`` and ``usage.oom_kills``, the container's terminations with reason
  ``OOMKilled`` this reader has seen (each restart is a new container ID; a kill of an
  ``exec``'d process that leaves the container running is in no status, and not counted),
  and ``usage.exit_code`` once the container has ended, with ``usage.exit_reason``: the
  pod's reason where the kubelet ended the whole pod (``Evicted``), else the container's
  (``OOMKilled``, ``Error``, ``Completed``). A pod made again for the same sandbox
  (by its controller, after a deletion or an eviction) is followed in its place: each such
  replacement adds one to ``usage.restarts`` (its container's CPU time starts from zero), and
  the OOM kills of the pods it replaced stay counted.

Least privilege: ``get``, ``list`` and ``watch`` on pods in the namespace, and ``get`` on
``nodes/stats``, which the kubelet checks when it is asked directly (the API server's node
proxy would need ``nodes/proxy``, which also reaches the kubelet's exec endpoints). So the
summary is read from the kubelet itself, at the pod's ``status.hostIP`` and ``kubelet_port``,
with the same credentials and certificate authority as the API server's; this process must
reach the nodes (as the OpenTelemetry Collector's ``kubeletstats`` receiver must). Where a
permission is missing, the record says unknown with ``kubernetes.forbidden``, and the log says
which permission, once.

Scale: one list and then one watch of the labelled pods of the namespace keeps an index of
them for every sandbox of the reader; one summary per node serves every sandbox on that node
for ``summary_max_age_s``. A sandbox whose pod the index does not hold yet (the watch lags its
create) is looked up once by its label. API calls per sampling interval therefore do not grow
with the number of sandboxes (``calls`` counts them). The watch runs while the reader follows
a sandbox, and stops when the last is released.

The client is lightkube (the ``kubernetes`` extra): its configuration (a kubeconfig, or the
in-cluster service account) and its authentication, on httpx, which the connection-pool
telemetry never counts as the application's traffic. Every call has ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.instrumentation.nemo_gym._shared._once import OnceLog
from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    Attribute,
    ComponentAllocation,
    PlacedAllocation,
    ResourceDesignator,
    ResourcesUnknown,
)
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import (
    MIB,
    SandboxHandle,
    SandboxResourceAmounts,
)

if TYPE_CHECKING:
    import httpx2
    from lightkube import AsyncClient
    from lightkube.config.kubeconfig import SingleConfig

__all__ = [
    "GPU_RESOURCES",
    "ID_LABEL",
    "POD_SOURCE",
    "SANDBOX_CONTAINER",
    "SUMMARY_SOURCE",
    "KubernetesReader",
    "amounts_of",
    "configured_namespace",
    "exit_reason",
    "quantity",
    "reason_of",
]

logger = logging.getLogger(__name__)
_ONCE = OnceLog(logger)

ID_LABEL = "opensandbox.io/id"
SANDBOX_CONTAINER = "sandbox"
POD_SOURCE = "kubernetes.pod"
SUMMARY_SOURCE = "kubelet.summary"
# Extended resources that count as GPUs (the device plugins' names).
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915", "habana.ai/gaudi")

FORBIDDEN = "kubernetes.forbidden"
UNAUTHORIZED = "kubernetes.unauthorized"
UNREACHABLE = "kubernetes.unreachable"
TIMEOUT = "kubernetes.timeout"
ERROR = "kubernetes.error"
NO_CLIENT = "kubernetes.no_client"
NO_CONFIG = "kubernetes.no_config"
POD_NOT_FOUND = "kubernetes.pod_not_found"
POD_DELETED = "kubernetes.pod_deleted"
CONTAINER_NOT_FOUND = "kubernetes.container_not_found"
NOT_SCHEDULED = "kubernetes.not_scheduled"

GIB = 1024 * MIB
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A restarted watch after a failure waits this long first, so a down API server is asked
# about once per this many seconds, not in a loop.
RELIST_DELAY_S = 5.0
FORBIDDEN_RELIST_DELAY_S = 60.0
# The API server ends a watch after this many seconds; lightkube starts the next at once.
WATCH_SERVER_TIMEOUT_S = 300

_QUANTITY = re.compile(
    r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$"
)
_MULTIPLIERS = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def quantity(text: object) -> Decimal | None:
    """A Kubernetes quantity (``500m``, ``64Mi``, ``1e3``, ``2``) as a number; ``None`` for
    anything else, a negative one included."""
    match = _QUANTITY.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    try:
        value = Decimal(number)
        if exponent:
            value *= Decimal(10) ** int(exponent[1:])
        elif suffix:
            value *= _MULTIPLIERS[suffix]
    except (InvalidOperation, ValueError):
        return None
    return value if value >= 0 else None


def amounts_of(
    resources: Mapping[str, Any] | None, gpu_resources: tuple[str, ...] = GPU_RESOURCES
) -> SandboxResourceAmounts:
    """Requests or limits as page 000's amounts: ``cpu`` in cores, ``memory_mib`` and
    ``disk_gib`` (``ephemeral-storage``) in whole MiB and GiB (rounded down, as the engine
    readers do), ``gpu`` the sum of the GPU resources. What is absent stays ``None``."""
    resources = resources or {}
    cpu = quantity(resources.get("cpu"))
    memory = quantity(resources.get("memory"))
    disk = quantity(resources.get("ephemeral-storage"))
    gpus = [quantity(resources.get(name)) for name in gpu_resources if name in resources]
    known_gpus = [g for g in gpus if g is not None]
    return SandboxResourceAmounts(
        cpu=None if cpu is None else float(cpu),
        memory_mib=None if memory is None else int(memory // MIB),
        disk_gib=None if disk is None else int(disk // GIB),
        gpu=int(sum(known_gpus)) if known_gpus else None,
    )


def status_code_of(exc: BaseException) -> int | None:
    """The HTTP status of a failed call (lightkube's ``ApiError``, httpx's status error)."""
    status = getattr(exc, "status", None)
    code = getattr(status, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def exit_reason(pod: Any, terminated: Any) -> str | None:
    """Why the sandbox's container ended: the pod's reason where the kubelet ended the whole
    pod (``Evicted``: its status says so, and its containers only that they are gone), else
    the container's own (``OOMKilled``, ``Error``, ``Completed``); ``None`` where neither says."""
    status = getattr(pod, "status", None)
    reason = getattr(status, "reason", None) or getattr(terminated, "reason", None)
    return str(reason) if reason else None


def reason_of(exc: BaseException) -> str:
    """A short, stable reason for a failed call; never the exception's text (it may name a
    pod, a user or a token file)."""
    code = status_code_of(exc)
    if code == 403:
        return FORBIDDEN
    if code == 401:
        return UNAUTHORIZED
    if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
        return TIMEOUT
    if code is not None:
        return ERROR
    if isinstance(exc, OSError) or type(exc).__name__ in ("ConnectError", "RemoteProtocolError"):
        return UNREACHABLE
    if type(exc).__name__ in ("TransportError", "NetworkError", "ReadError", "WriteError"):
        return UNREACHABLE
    return ERROR


def server_scope(server: str) -> str | None:
    """``host:port`` of an API server URL (443 when it names none); never user-info or a
    path."""
    try:
        parts = urlsplit(server)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    return f"{host}:{port if port is not None else 443}"


def configured_namespace() -> str | None:
    """The namespace of the configuration ``KubernetesReader`` would use by default (the
    in-cluster service account's, else the current context's of ``KUBECONFIG`` or
    ``~/.kube/config``, ``default`` where the context names none); ``None``, quietly, when
    lightkube is not installed or there is no usable configuration: the caller then has no
    cluster to look in."""
    try:
        from lightkube import KubeConfig
        from lightkube.core.exceptions import ConfigError
    except ImportError:
        return None
    try:
        config = KubeConfig.from_env().get()
    except (ConfigError, OSError, ValueError):
        return None
    return None if config is None else config.namespace


@dataclass
class _Pod:
    """What the index holds of one sandbox's pod."""

    pod: Any
    # The IDs of the sandbox container's terminations with reason OOMKilled seen so far, in
    # this pod and in the pods it replaced.
    oom_kills: set[str] = field(default_factory=set)
    deleted: bool = False
    # Pods of the sandbox this one replaced (its controller made it again after a deletion or
    # an eviction): each a start of the sandbox's container afresh, counted as a restart.
    replacements: int = 0


@dataclass
class _Summary:
    """One node's summary: when it was asked for, and the call (shared by its sandboxes)."""

    asked_at: float
    call: asyncio.Task[dict[str, dict[str, Any]] | ResourcesUnknown]


class KubernetesReader:
    """Allocation and usage of sandboxes that are pods in ``namespace`` (see the module).

    ``label`` names the label whose value is the sandbox id (``handle.sandbox_id``);
    ``container`` the pod's main container (else its only one). ``kubeconfig`` (a path) and
    ``context`` choose the configuration; by default lightkube's: the in-cluster service
    account, else ``KUBECONFIG``, else ``~/.kube/config``. ``cluster`` scopes the designators
    (default: the API server's ``host:port``). Reads only; runs on one event loop at a time.
    """

    periodic = True

    def __init__(
        self,
        namespace: str,
        *,
        label: str = ID_LABEL,
        container: str = SANDBOX_CONTAINER,
        kubeconfig: str | None = None,
        context: str | None = None,
        cluster: str | None = None,
        kubelet_port: int = 10250,
        summary_max_age_s: float = 10.0,
        request_timeout_s: float = 5.0,
        gpu_resources: tuple[str, ...] = GPU_RESOURCES,
    ) -> None:
        for name, value in (("namespace", namespace), ("label", label), ("container", container)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"KubernetesReader {name}={value!r} must be a non-empty string")
        for name, number in (
            ("summary_max_age_s", summary_max_age_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if isinstance(number, bool) or not isinstance(number, int | float) or number < 0:
                raise ValueError(f"KubernetesReader {name}={number!r} must be a number >= 0")
        if isinstance(kubelet_port, bool) or not isinstance(kubelet_port, int) or kubelet_port < 1:
            raise ValueError(f"KubernetesReader kubelet_port={kubelet_port!r} must be a port")
        self.namespace = namespace
        self.label = label
        self.container = container
        self._kubeconfig = kubeconfig
        self._context = context
        self._cluster = cluster
        self._kubelet_port = kubelet_port
        self._summary_max_age_s = float(summary_max_age_s)
        self._timeout_s = float(request_timeout_s)
        self._gpu_resources = tuple(gpu_resources)
        # API calls made, by kind ("list", "watch", "lookup", "summary"): what the benchmark
        # and the tests count.
        self.calls: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reset()

    def _reset(self) -> None:
        """Forget everything bound to an event loop (clients, tasks) and every pod."""
        self._config: SingleConfig | ResourcesUnknown | None = None
        self._client: AsyncClient | None = None
        self._kubelets: dict[str, httpx2.AsyncClient] = {}
        self._pods: dict[str, _Pod] = {}
        self._looked_up: set[str] = set()
        self._followed: set[str] = set()
        self._summaries: dict[str, _Summary] = {}
        self._watch: asyncio.Task[None] | None = None
        self._synced: asyncio.Event | None = None
        # Why the last list of the index failed (None: it answered).
        self._index_error: str | None = None

    # --- the reads ------------------------------------------------------------------------

    async def resource_allocation(
        self, handle: SandboxHandle
    ) -> PlacedAllocation | ResourcesUnknown:
        """The pod's requests and limits, placed on its node; unknown with the reason when the
        pod cannot be read."""
        found = await self._pod(str(handle.sandbox_id))
        if isinstance(found, ResourcesUnknown):
            return found
        pod = found.pod
        container = self._container_of(pod)
        if container is None:
            return ResourcesUnknown(CONTAINER_NOT_FOUND)
        status = self._status_of(pod, container.name)
        # What the kubelet applied (in-place resize) wins over the spec, resource by resource,
        # where it reports it (it may report cpu and memory only).
        applied = getattr(status, "resources", None)
        spec = container.resources
        requests = {
            **(getattr(spec, "requests", None) or {}),
            **(getattr(applied, "requests", None) or {}),
            **(getattr(status, "allocatedResources", None) or {}),
        }
        limits = {
            **(getattr(spec, "limits", None) or {}),
            **(getattr(applied, "limits", None) or {}),
        }
        scope = self._scope()
        node = pod.spec.nodeName
        placement = {"namespace": pod.metadata.namespace, "pod": pod.metadata.name}
        if node:
            placement["node"] = node
        if pod.status is not None and pod.status.qosClass:
            placement["qos_class"] = pod.status.qosClass
        return PlacedAllocation(
            source=POD_SOURCE,
            components=(
                ComponentAllocation(
                    container.name,
                    requests=amounts_of(requests, self._gpu_resources),
                    limits=amounts_of(limits, self._gpu_resources),
                ),
            ),
            designator=ResourceDesignator("k8s.pod", pod.metadata.uid, scope=scope),
            host=ResourceDesignator("k8s.node", node, scope=scope) if node else None,
            placement=placement,
        )

    async def resource_sample(
        self, handle: SandboxHandle
    ) -> dict[str, Attribute] | ResourcesUnknown:
        """The container's figures in its node's summary, with its restarts and OOM kills."""
        found = await self._pod(str(handle.sandbox_id))
        if isinstance(found, ResourcesUnknown):
            return found
        if found.deleted:
            return ResourcesUnknown(POD_DELETED)
        pod = found.pod
        container = self._container_of(pod)
        if container is None:
            return ResourcesUnknown(CONTAINER_NOT_FOUND)
        status = self._status_of(pod, container.name)
        sample: dict[str, Attribute] = {
            "usage.source": SUMMARY_SOURCE,
            "usage.oom_kills": len(found.oom_kills),
        }
        if status is not None:
            sample["usage.restarts"] = int(status.restartCount or 0) + found.replacements
            terminated = getattr(status.state, "terminated", None)
            if terminated is not None:
                sample["usage.exit_code"] = int(terminated.exitCode)
                reason = exit_reason(pod, terminated)
                if reason is not None:
                    sample["usage.exit_reason"] = reason
        elif found.replacements:
            sample["usage.restarts"] = found.replacements
        host_ip = pod.status.hostIP if pod.status is not None else None
        if not host_ip:
            return ResourcesUnknown(NOT_SCHEDULED)
        summary = await self._summary(host_ip)
        if isinstance(summary, ResourcesUnknown):
            return summary
        stats = summary.get(pod.metadata.uid, {}).get(container.name)
        if stats is not None:
            sample.update(_figures(stats))
        return sample

    @property
    def following(self) -> int:
        """How many sandboxes the reader follows (looked up and not released)."""
        return len(self._followed)

    async def lookup(self, handle: SandboxHandle) -> ResourcesUnknown | None:
        """``None`` when the sandbox's pod is known (from the index, or one lookup by its
        label), else why not (``kubernetes.pod_not_found``, ``kubernetes.forbidden``, ...).
        A sandbox whose pod is not found is not followed: nothing is kept of it."""
        found = await self._pod(str(handle.sandbox_id))
        if isinstance(found, ResourcesUnknown):
            self.release(handle)
            return found
        return None

    def release(self, handle: SandboxHandle) -> None:
        """Forget the sandbox (called after its final sample); the watch stops with the last."""
        key = str(handle.sandbox_id)
        self._followed.discard(key)
        self._looked_up.discard(key)
        self._pods.pop(key, None)
        if not self._followed and self._watch is not None:
            self._watch.cancel()
            self._watch = None
            self._synced = None
            self._pods.clear()

    async def aclose(self) -> None:
        """Stop the watch and the summary calls in flight, and close the HTTP clients."""
        tasks: list[asyncio.Task[Any]] = [
            s.call for s in self._summaries.values() if not s.call.done()
        ]
        if self._watch is not None:
            tasks.append(self._watch)
        for task in tasks:
            task.cancel()
        if tasks:
            # wait(), not gather(): their cancellation is theirs, never this caller's.
            await asyncio.wait(tasks)
        for client in self._kubelets.values():
            await client.aclose()
        if self._client is not None:
            await self._client.close()
        self._reset()

    # --- the pod index ----------------------------------------------------------------------

    def _container_of(self, pod: Any) -> Any:
        containers = list(pod.spec.containers or ())
        for container in containers:
            if container.name == self.container:
                return container
        return containers[0] if len(containers) == 1 else None

    @staticmethod
    def _status_of(pod: Any, name: str) -> Any:
        for status in (pod.status.containerStatuses or ()) if pod.status is not None else ():
            if status.name == name:
                return status
        return None

    def _on_loop(self) -> None:
        """Start afresh on another event loop: clients and tasks belong to the one they were
        made on."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._reset()

    def _load_config(self) -> SingleConfig | ResourcesUnknown:
        if self._config is None:
            try:
                from lightkube import AsyncClient, KubeConfig
                from lightkube.core.exceptions import ConfigError
            except ImportError:
                _ONCE(
                    "no-client",
                    logging.WARNING,
                    "Kubernetes sandbox reader: lightkube is not installed "
                    "(pip install 'opentelemetry-instrumentation-nemo-gym[kubernetes]')",
                )
                self._config = ResourcesUnknown(NO_CLIENT)
                return self._config
            import httpx2

            try:
                loaded = (
                    KubeConfig.from_file(self._kubeconfig)
                    if self._kubeconfig is not None
                    else KubeConfig.from_env()
                )
                config = loaded.get(context_name=self._context)
            except (ConfigError, OSError, ValueError) as exc:
                _ONCE(
                    ("no-config", self._kubeconfig),
                    logging.WARNING,
                    "Kubernetes sandbox reader: no usable configuration (%s)",
                    type(exc).__name__,
                )
                self._config = ResourcesUnknown(NO_CONFIG)
                return self._config
            if config is None:
                self._config = ResourcesUnknown(NO_CONFIG)
                return self._config
            self._config = config
            self._client = AsyncClient(
                config, namespace=self.namespace, timeout=httpx2.Timeout(self._timeout_s)
            )
        return self._config

    def _scope(self) -> str | None:
        if self._cluster is not None:
            return self._cluster
        config = self._config
        if config is None or isinstance(config, ResourcesUnknown):
            return None
        return server_scope(config.cluster.server)

    async def _pod(self, sandbox_id: str) -> _Pod | ResourcesUnknown:
        """The sandbox's pod from the index; looked up by its label once when the index does
        not hold it (yet)."""
        self._on_loop()
        config = self._load_config()
        if isinstance(config, ResourcesUnknown):
            return config
        self._followed.add(sandbox_id)
        self._follow()
        known = self._pods.get(sandbox_id)
        if known is None and self._synced is not None and not self._synced.is_set():
            # The first list is under way: it brings every labelled pod at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._synced.wait()), self._timeout_s)
            known = self._pods.get(sandbox_id)
        if known is not None:
            return known
        if sandbox_id in self._looked_up:
            # Looked up once already: from now on only the index tells (and why it cannot).
            return ResourcesUnknown(self._index_error or POD_NOT_FOUND)
        self._looked_up.add(sandbox_id)
        try:
            pods = await self._list({self.label: sandbox_id}, "lookup")
        except asyncio.CancelledError:
            self._looked_up.discard(sandbox_id)
            raise
        except Exception as exc:  # noqa: BLE001 - a failed read is an unknown record
            return ResourcesUnknown(self._failed("list pods", exc))
        known = self._pods.get(sandbox_id)  # the watch may have brought it meanwhile
        if known is None and pods:
            known = self._pods[sandbox_id] = _Pod(_newest(pods))
            self._count_oom_kills(known)
        return known if known is not None else ResourcesUnknown(POD_NOT_FOUND)

    async def _list(self, labels: dict[str, Any], kind: str) -> list[Any]:
        from lightkube.resources.core_v1 import Pod

        assert self._client is not None
        self.calls[kind] += 1
        listing = self._client.list(Pod, namespace=self.namespace, labels=labels)
        return [pod async for pod in listing]

    def _follow(self) -> None:
        if self._watch is None or self._watch.done():
            self._synced = asyncio.Event()
            self._watch = asyncio.ensure_future(self._watch_pods(self._synced))

    async def _watch_pods(self, synced: asyncio.Event) -> None:
        """List the labelled pods, then watch them; after a failure, again a moment later.
        ``synced`` is set once the first list has answered or failed."""
        from lightkube import operators
        from lightkube.resources.core_v1 import Pod

        assert self._client is not None
        labels: dict[str, Any] = {self.label: operators.exists()}
        while True:
            try:
                self.calls["list"] += 1
                listing = self._client.list(Pod, namespace=self.namespace, labels=labels)
                pods = [pod async for pod in listing]
                seen = set()
                for pod in pods:
                    seen.add(self._apply("ADDED", pod))
                for key, known in self._pods.items():
                    if key not in seen:
                        known.deleted = True
                self._index_error = None
                synced.set()
                self.calls["watch"] += 1
                async for kind, pod in self._client.watch(
                    Pod,
                    namespace=self.namespace,
                    labels=labels,
                    resource_version=listing.resourceVersion,
                    server_timeout=WATCH_SERVER_TIMEOUT_S,
                ):
                    self._apply(kind, pod)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the index keeps what it knew
                self._index_error = self._failed("list and watch pods", exc)
            synced.set()
            # A permission is not given back soon: ask about once a minute, not every moment.
            forbidden = self._index_error in (FORBIDDEN, UNAUTHORIZED)
            await asyncio.sleep(FORBIDDEN_RELIST_DELAY_S if forbidden else RELIST_DELAY_S)

    def _apply(self, kind: str, pod: Any) -> str:
        """One pod from the list or the watch into the index; its label's value."""
        key = str((pod.metadata.labels or {}).get(self.label, ""))
        known = self._pods.get(key)
        if kind == "DELETED":
            if known is not None and known.pod.metadata.uid == pod.metadata.uid:
                known.pod = pod
                known.deleted = True
            return key
        if known is None or known.pod.metadata.uid != pod.metadata.uid:
            if known is not None and _created(known.pod) > _created(pod) and not known.deleted:
                return key  # an older pod with the same label: the newer one stays
            replaced, known = known, _Pod(pod)
            if replaced is not None:
                # The sandbox's pod made again: its container starts from nothing (CPU time
                # from zero), which the samples' restarts say; earlier OOM kills stay counted.
                known.oom_kills |= replaced.oom_kills
                known.replacements = replaced.replacements + 1
            self._pods[key] = known
        known.pod = pod
        known.deleted = False
        self._count_oom_kills(known)
        return key

    def _count_oom_kills(self, known: _Pod) -> None:
        status = self._status_of(known.pod, getattr(self._container_of(known.pod), "name", ""))
        if status is None:
            return
        for state in (status.state, status.lastState):
            terminated = getattr(state, "terminated", None)
            if terminated is not None and terminated.reason == "OOMKilled":
                # Each run of the container has its own ID; a run not yet given one is
                # told apart by when it finished.
                known.oom_kills.add(
                    str(terminated.containerID or terminated.finishedAt or terminated.startedAt)
                )

    # --- the kubelet's summary -----------------------------------------------------------------

    async def _summary(self, host_ip: str) -> dict[str, dict[str, Any]] | ResourcesUnknown:
        """The node's summary by pod UID and container name: one call per node at most every
        ``summary_max_age_s``, shared by the node's sandboxes."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        known = self._summaries.get(host_ip)
        if known is None or (known.call.done() and now - known.asked_at >= self._summary_max_age_s):
            known = self._summaries[host_ip] = _Summary(
                now, asyncio.ensure_future(self._ask_summary(host_ip))
            )
        # shield: a record that gives up at its deadline leaves the call to the others.
        return await asyncio.shield(known.call)

    async def _ask_summary(self, host_ip: str) -> dict[str, dict[str, Any]] | ResourcesUnknown:
        client = self._kubelets.get(host_ip)
        if client is None:
            client = self._kubelets[host_ip] = self._kubelet_client(host_ip)
        self.calls["summary"] += 1
        try:
            response = await client.get("/stats/summary", params={"only_cpu_and_memory": "true"})
            response.raise_for_status()
            summary = response.json()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed read is an unknown sample
            return ResourcesUnknown(self._failed("get nodes/stats", exc))
        by_pod: dict[str, dict[str, Any]] = {}
        for pod in summary.get("pods") or () if isinstance(summary, dict) else ():
            uid = (pod.get("podRef") or {}).get("uid")
            if uid:
                by_pod[uid] = {c.get("name"): c for c in pod.get("containers") or ()}
        return by_pod

    def _kubelet_client(self, host_ip: str) -> httpx2.AsyncClient:
        """An HTTP client of the kubelet at ``host_ip``, with the API server's credentials and
        certificate authority (lightkube's own adapter, pointed at the kubelet)."""
        import httpx2
        import msgspec
        from lightkube.config import client_adapter

        config = self._config
        assert isinstance(config, tuple)  # a SingleConfig: loaded before any pod was read
        host = f"[{host_ip}]" if ":" in host_ip else host_ip
        kubelet = config._replace(
            cluster=msgspec.structs.replace(
                config.cluster, server=f"https://{host}:{self._kubelet_port}"
            )
        )
        return client_adapter.AsyncClient(
            kubelet, client_adapter.ConnectionParams(timeout=httpx2.Timeout(self._timeout_s))
        )

    def _failed(self, action: str, exc: BaseException) -> str:
        """The reason of a failed call, logged once per action and reason; a refusal once per
        resource (``action``'s last word): the index's list and watch and a lookup's list are
        refused by one missing permission, which the operator reads about once."""
        reason = reason_of(exc)
        if reason == FORBIDDEN:
            _ONCE(
                (action.rsplit(" ", 1)[-1], reason, self.namespace),
                logging.WARNING,
                "Kubernetes sandbox reader: forbidden to %s (namespace %s); records say %s",
                action,
                self.namespace,
                reason,
            )
        else:
            _ONCE(
                (action, reason, self.namespace),
                logging.WARNING,
                "Kubernetes sandbox reader: could not %s (namespace %s): %s (%s)",
                action,
                self.namespace,
                reason,
                type(exc).__name__,
            )
        return reason


def _figures(stats: Mapping[str, Any]) -> dict[str, Attribute]:
    """The usage figures of one container's summary entry; absent ones left out, never 0."""
    figures: dict[str, Attribute] = {}
    cpu = (stats.get("cpu") or {}).get("usageCoreNanoSeconds")
    memory = stats.get("memory") or {}
    if isinstance(cpu, int) and cpu >= 0:
        figures["usage.cpu.time_s"] = round(cpu / 1e9, 6)
    working_set = memory.get("workingSetBytes")
    if isinstance(working_set, int) and working_set >= 0:
        figures["usage.memory_mib"] = round(working_set / MIB, 3)
    rss = memory.get("rssBytes")
    if isinstance(rss, int) and rss >= 0:
        figures["usage.memory_rss_mib"] = round(rss / MIB, 3)
    return figures


def _created(pod: Any) -> datetime:
    created = pod.metadata.creationTimestamp
    return created if isinstance(created, datetime) else _EPOCH


def _newest(pods: list[Any]) -> Any:
    """The newest of the pods sharing a sandbox's label (a replaced pod may linger)."""
    return max(pods, key=lambda pod: (_created(pod), pod.metadata.name or ""))
