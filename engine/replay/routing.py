"""Is a replay's expert routing the traffic's? The check behind every MoE measurement.

    engine's routing counts (engine/core/expert_routing.py) before a replay --snapshot-->
    after it --snapshot--> difference --ExpertRouting.from_counts--> the replay's histogram
    the profile's ``expertRouting`` (observed in Prometheus) --distance--> total variation per
    layer both have, max over them --> representative when <= the threshold
    (engine/contracts/expert_routing.py REPRESENTATIVE_TV)

Kernels tuned on prompts that send tokens to other experts than the traffic does are tuned
for the wrong work: the compile evaluator (engine/compile/evaluator.py) runs this check on
every measured replay of a MoE model whose profile carries a routing histogram, records the
distance in the measurement (and so on the board), and a replay far from the profile is
reported as not representative. A fast tier with fewer layers is compared on the layers it
has. Models or passes without routing counts, and profiles without a histogram, are not
checked (None).
"""

from __future__ import annotations

from typing import Any

from shapeshift.engine.contracts.expert_routing import REPRESENTATIVE_TV, ExpertRouting
from shapeshift.engine.core.expert_routing import counts_of


def routing_snapshot(engine: Any) -> dict[int, list[int]] | None:
    """The active pass's routing counts now (one device-to-host copy), or None where it has none."""
    remote = getattr(engine, "routing_snapshot", None)  # an engine in another process asks it there
    if callable(remote):
        return remote()
    counts = counts_of(getattr(engine, "forward_pass", None))
    return None if counts is None else counts.snapshot()


def routing_between(before: dict[int, list[int]] | None, after: dict[int, list[int]] | None
                    ) -> ExpertRouting | None:
    """The histogram of what was routed between two snapshots of the same pass's counts."""
    if before is None or after is None:
        return None
    return ExpertRouting.from_counts({layer: [a - b for a, b in zip(row, before.get(layer, [0] * len(row)))]
                                      for layer, row in after.items()})


def check_routing(expected: ExpertRouting | None, replayed: ExpertRouting | None,
                  threshold: float = REPRESENTATIVE_TV) -> dict[str, Any] | None:
    """{"distance", "worst_layer", "per_layer", "threshold", "representative"} of a replay's routing
    against the profile's; None when either is missing or they share no layer."""
    if expected is None or replayed is None:
        return None
    try:
        d = expected.distance(replayed)
    except ValueError:
        return None
    return {"distance": round(d.max, 6), "worst_layer": d.worst_layer,
            "per_layer": {str(layer): round(v, 6) for layer, v in sorted(d.per_layer.items())},
            "threshold": threshold, "representative": d.representative(threshold)}


def merge_checks(checks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Repeats of one measurement as one verdict: the largest distance, representative only when
    every repeat was."""
    if not checks:
        return None
    worst = max(checks, key=lambda c: c["distance"])
    return {**worst, "repeats": [c["distance"] for c in checks],
            "representative": all(c["representative"] for c in checks)}


def describe(check: dict[str, Any]) -> str:
    """One line for a log or a report."""
    verdict = "representative" if check["representative"] else "NOT representative"
    return (f"replay routing {verdict}: total variation {check['distance']:.3f} from the profile's "
            f"(layer {check['worst_layer']}, threshold {check['threshold']:.3f})")
