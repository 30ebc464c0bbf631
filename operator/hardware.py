"""Accelerator kinds and how a pod lands on their node pool.

    spec.hardware (HardwareSpec) --placement()--> resources, nodeSelector, tolerations
                                                    (merged into engine and compile pods)

Each kind names the extended resource its device plugin advertises, the node
label that marks its pool, and the taint that keeps other pods off it. The set
of kinds is closed: the CRD schema carries it as an enum and the pydantic
model as a Literal, so an unknown kind is refused by the API server and by
`HardwareSpec` alike, and `ACCELERATORS` is the one table both come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

AcceleratorKind = Literal["nvidia-h200", "nvidia-h100", "trainium2", "cpu"]


@dataclass(frozen=True)
class Accelerator:
    kind: str
    description: str
    # Extended resource advertised by the device plugin; None for plain CPU pods.
    resource_name: str | None
    # Labels that select the pool (NVIDIA GPU feature discovery, EKS instance type).
    node_selector: dict[str, str] = field(default_factory=dict)
    # Taints the pool carries; pods for it tolerate exactly these.
    tolerations: tuple[dict[str, str], ...] = ()
    # What the engine passes to torch / the runtime as its device.
    device: str = "cpu"


_NVIDIA_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
_NEURON_TAINT = {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}

ACCELERATORS: dict[str, Accelerator] = {
    a.kind: a
    for a in (
        Accelerator(
            kind="nvidia-h200",
            description="NVIDIA H200 (141 GB HBM3e)",
            resource_name="nvidia.com/gpu",
            node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
            tolerations=(_NVIDIA_TAINT,),
            device="cuda",
        ),
        Accelerator(
            kind="nvidia-h100",
            description="NVIDIA H100 SXM (80 GB HBM3)",
            resource_name="nvidia.com/gpu",
            node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            tolerations=(_NVIDIA_TAINT,),
            device="cuda",
        ),
        Accelerator(
            kind="trainium2",
            description="AWS Trainium2 (trn2.48xlarge)",
            resource_name="aws.amazon.com/neuron",
            node_selector={"node.kubernetes.io/instance-type": "trn2.48xlarge"},
            tolerations=(_NEURON_TAINT,),
            device="neuron",
        ),
        Accelerator(
            kind="cpu",
            description="CPU only",
            resource_name=None,
            device="cpu",
        ),
    )
}

assert set(ACCELERATORS) == set(get_args(AcceleratorKind)), "AcceleratorKind and ACCELERATORS disagree"


def accelerator(kind: str) -> Accelerator:
    """The table entry for `kind`; an unknown kind raises with the known ones listed."""
    try:
        return ACCELERATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown accelerator kind {kind!r}; supported kinds are {sorted(ACCELERATORS)}"
        ) from None


@dataclass(frozen=True)
class Placement:
    """What a pod spec needs to land on, and use, one pool."""

    resources: dict[str, dict[str, str]]  # {"requests": {...}, "limits": {...}}
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]


def placement(
    kind: str,
    count: int = 1,
    *,
    extra_node_selector: dict[str, str] | None = None,
    extra_tolerations: list[dict[str, Any]] | None = None,
    cpu: str | None = None,
    memory: str | None = None,
) -> Placement:
    """Resources, node selector and tolerations for `count` accelerators of `kind`.

    The user's node selector is merged over the pool's (the user wins on a
    shared key); the user's tolerations are appended to the pool's, without
    duplicates. Extended resources are set in both requests and limits, as
    device plugins require.
    """
    acc = accelerator(kind)
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if acc.resource_name is not None:
        requests[acc.resource_name] = str(count)
        limits[acc.resource_name] = str(count)
    if cpu:
        requests["cpu"] = cpu
    if memory:
        requests["memory"] = memory
        limits["memory"] = memory
    resources: dict[str, dict[str, str]] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    selector = {**acc.node_selector, **(extra_node_selector or {})}
    tolerations: list[dict[str, Any]] = [dict(t) for t in acc.tolerations]
    for t in extra_tolerations or []:
        if t not in tolerations:
            tolerations.append(dict(t))
    return Placement(resources=resources, node_selector=selector, tolerations=tolerations)
