"""How a pod lands on an accelerator pool: the operator's side of the closed set of kinds.

    spec.hardware (HardwareSpec) --placement()--> resources, nodeSelector, tolerations
                                                    (merged into engine and compile pods)

The kinds themselves (their extended resource, pool label, taint and device) are
the table `ACCELERATORS` in `shapeshift.operator.api.hardware`, which the CRD
schema, the pydantic models and the compile pod read too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shapeshift.operator.api.hardware import accelerator


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
