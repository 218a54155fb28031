"""The Kubernetes reader's pure parts: quantities, amounts, reasons, placement."""

from __future__ import annotations

from decimal import Decimal

import pytest

from opentelemetry.instrumentation.nemo_gym.sandbox._allocation import (
    ComponentAllocation,
    PlacedAllocation,
)
from opentelemetry.instrumentation.nemo_gym.sandbox._attributes import allocation_attributes
from opentelemetry.instrumentation.nemo_gym.sandbox.providers.base import SandboxResourceAmounts
from opentelemetry.instrumentation.nemo_gym.sandbox.readers.kubernetes import (
    KubernetesReader,
    amounts_of,
    exit_reason,
    quantity,
    reason_of,
    server_scope,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("0.25", Decimal("0.25")),
        ("64Mi", Decimal(64 * 2**20)),
        ("1Gi", Decimal(2**30)),
        ("100M", Decimal(10**8)),
        ("1e3", Decimal(1000)),
        ("1E", Decimal(10**18)),
        ("250000000n", Decimal("0.25")),
    ],
)
def test_quantity_reads_kubernetes_notation(text: str, value: Decimal) -> None:
    """Decimal, binary and exponent suffixes read as Kubernetes reads them."""
    assert quantity(text) == value


@pytest.mark.parametrize("text", ["", "-1", "64MB", "1.2.3", "Mi", None, 5])
def test_quantity_refuses_what_is_not_one(text: object) -> None:
    """Negative, malformed and non-string values are None, never 0."""
    assert quantity(text) is None


def test_amounts_of_reads_requests_with_gpus_by_resource_name() -> None:
    """cpu in cores, memory in whole MiB, ephemeral-storage in whole GiB, GPUs summed over the
    GPU resource names; what is absent stays None."""
    assert amounts_of(
        {
            "cpu": "500m",
            "memory": "64Mi",
            "ephemeral-storage": "2Gi",
            "nvidia.com/gpu": "2",
            "example.com/fpga": "1",
        }
    ) == SandboxResourceAmounts(cpu=0.5, memory_mib=64, disk_gib=2, gpu=2)
    assert amounts_of({"memory": "100M"}) == SandboxResourceAmounts(memory_mib=95)
    assert amounts_of(None) == SandboxResourceAmounts()
    assert amounts_of({"amd.com/gpu": "1"}, ("amd.com/gpu",)).gpu == 1


class _Status:
    def __init__(self, code: int) -> None:
        self.code = code


class _ApiError(Exception):
    def __init__(self, code: int) -> None:
        self.status = _Status(code)


class ReadTimeout(Exception):  # noqa: N818 - named as httpx names it
    pass


class ConnectError(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (_ApiError(403), "kubernetes.forbidden"),
        (_ApiError(401), "kubernetes.unauthorized"),
        (_ApiError(500), "kubernetes.error"),
        (ReadTimeout(), "kubernetes.timeout"),
        (TimeoutError(), "kubernetes.timeout"),
        (ConnectError(), "kubernetes.unreachable"),
        (ConnectionRefusedError(), "kubernetes.unreachable"),
        (ValueError("pod secret-name"), "kubernetes.error"),
    ],
)
def test_reason_of_names_the_failure_class(exc: BaseException, reason: str) -> None:
    """Forbidden, unauthorized, timeout, unreachable, else error; never the text."""
    assert reason_of(exc) == reason


def test_exit_reason_the_pods_where_the_kubelet_ended_it_else_the_containers() -> None:
    """An evicted pod's own reason wins over what its container says (the kubelet removed it:
    ``ContainerStatusUnknown``); a pod that runs on has none, so the container's is taken."""
    from lightkube.models.core_v1 import ContainerStateTerminated, PodStatus
    from lightkube.resources.core_v1 import Pod

    gone = ContainerStateTerminated(exitCode=137, reason="ContainerStatusUnknown")
    evicted = Pod(status=PodStatus(phase="Failed", reason="Evicted"))
    assert exit_reason(evicted, gone) == "Evicted"
    running = Pod(status=PodStatus(phase="Running"))
    killed = ContainerStateTerminated(exitCode=137, reason="OOMKilled")
    assert exit_reason(running, killed) == "OOMKilled"
    assert exit_reason(running, ContainerStateTerminated(exitCode=1)) is None
    assert exit_reason(Pod(), ContainerStateTerminated(exitCode=0, reason="Completed")) == (
        "Completed"
    )


def test_server_scope_is_host_and_port() -> None:
    """The API server's host:port (443 by default); never user-info or a path."""
    assert server_scope("https://127.0.0.1:6443") == "127.0.0.1:6443"
    assert server_scope("https://user:pw@k8s.example/path") == "k8s.example:443"
    assert server_scope("not a url") is None


def test_placed_allocation_placement_recorded_and_checked() -> None:
    """Placement names become allocation.placement.<name>; a bad name or a credential in a
    value raises ValueError naming it."""
    allocation = PlacedAllocation(
        "kubernetes.pod",
        (ComponentAllocation("sandbox"),),
        placement={"qos_class": "Guaranteed", "node": "n1"},
    )
    attributes = allocation_attributes(allocation)
    assert attributes["nemo.gym.sandbox.allocation.placement.qos_class"] == "Guaranteed"
    assert attributes["nemo.gym.sandbox.allocation.placement.node"] == "n1"
    with pytest.raises(ValueError, match="placement name 'QoS'"):
        PlacedAllocation("x", placement={"QoS": "Guaranteed"})
    with pytest.raises(ValueError, match="placement node carries a secret-named parameter"):
        PlacedAllocation("x", placement={"node": "n1?token=abc"})
    with pytest.raises(ValueError, match="placement node must be a string, not int"):
        PlacedAllocation("x", placement={"node": 3})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": ""}, "namespace=''"),
        ({"namespace": "ns", "label": ""}, "label=''"),
        ({"namespace": "ns", "summary_max_age_s": -1}, "summary_max_age_s=-1"),
        ({"namespace": "ns", "kubelet_port": 0}, "kubelet_port=0"),
    ],
)
def test_kubernetes_reader_refuses_bad_settings(kwargs: dict[str, object], message: str) -> None:
    """A bad setting raises ValueError naming the field and the value."""
    with pytest.raises(ValueError, match=message):
        KubernetesReader(**kwargs)  # type: ignore[arg-type]
