"""The closed set of accelerator kinds, shared by the CRDs, the operator and the compile pod.

    ACCELERATORS --> spec.hardware.accelerator enum (CRD) and AcceleratorKind (pydantic)
                 --> operator/hardware.py placement(): resources, nodeSelector, tolerations
                 --> compile pod: accelerator_of_device(GPU name) for the ForwardPass it publishes

Each kind names the extended resource its device plugin advertises, the node
label that marks its pool, the taint that keeps other pods off it, and the
device names its chips report. The set is closed: an unknown kind is refused
by the API server and by `HardwareSpec` alike, and this table is the one both
come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

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
    # Lower-case pieces of the device name a chip of this kind reports (torch's
    # get_device_name, e.g. "NVIDIA H100 80GB HBM3"); any one of them identifies the kind.
    device_name_markers: tuple[str, ...] = ()


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
            device_name_markers=("h200",),
        ),
        Accelerator(
            kind="nvidia-h100",
            description="NVIDIA H100 SXM (80 GB HBM3)",
            resource_name="nvidia.com/gpu",
            node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            tolerations=(_NVIDIA_TAINT,),
            device="cuda",
            device_name_markers=("h100",),
        ),
        Accelerator(
            kind="trainium2",
            description="AWS Trainium2 (trn2.48xlarge)",
            resource_name="aws.amazon.com/neuron",
            node_selector={"node.kubernetes.io/instance-type": "trn2.48xlarge"},
            tolerations=(_NEURON_TAINT,),
            device="neuron",
            device_name_markers=("trainium", "neuron"),
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

# The kind of a device whose name matches no kind's markers (a GPU outside the set, the host CPU).
FALLBACK_ACCELERATOR: AcceleratorKind = "cpu"


def accelerator(kind: str) -> Accelerator:
    """The table entry for `kind`; an unknown kind raises with the known ones listed."""
    try:
        return ACCELERATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown accelerator kind {kind!r}; supported kinds are {sorted(ACCELERATORS)}"
        ) from None


def accelerator_of_device(device_name: str) -> AcceleratorKind:
    """The kind of the chip named `device_name` (a GPU name such as "nvidia-h100-80gb-hbm3",
    or a kind itself): the first kind, in table order, one of whose markers the lower-cased
    name contains; FALLBACK_ACCELERATOR when none does."""
    name = device_name.lower()
    for kind, acc in ACCELERATORS.items():
        if any(marker in name for marker in acc.device_name_markers):
            return kind  # type: ignore[return-value]  # the table's keys are the AcceleratorKind values
    return FALLBACK_ACCELERATOR
