"""Expert routing of mixture-of-experts traffic: per layer, the share of routed tokens per expert.

    engine counters shapeshift_expert_routed_tokens_total{layer, expert}
      --operator (rate over the window, operator/prometheus.py)--> ExpertRouting in the
        observed TrafficProfile (``expertRouting``)
      --a replay's own counts (engine/replay/routing.py)--> ExpertRouting of the replay
      --ExpertRouting.distance--> RoutingDistance: total variation per layer, max over layers

A layer's shares are its experts' routed tokens (each of a token's top-k choices counts
once) over all of that layer's choices: each share >= 0, the shares of a layer sum to 1.
The distance between two histograms is, per layer they share, the total variation
0.5 * sum_e |p_e - q_e| (0: the same routing; 1: no expert in common), and its maximum over
those layers: the one number a replay's routing is judged by (``REPRESENTATIVE_TV``).

Torch-free (pydantic), shared by the engine and the operator; camelCase on the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# A replay whose routing is further than this from the profile's (max over layers of the total
# variation) does not exercise the experts the traffic does: the measurement is marked not
# representative. Measured with hack/bench_routing.py on tiny-moe (random weights, 32 requests
# a replay; docs/expert-routing.md): two draws of real-text prompts 0.04-0.11 apart, random token
# ids 0.14-0.29 from real text. Small replays draw more noise (16 requests: up to 0.18 seen).
REPRESENTATIVE_TV = 0.15
SHARE_TOLERANCE = 1e-3  # |sum of a layer's shares - 1| allowed (rounding on the wire)
MAX_LAYERS = 512
MAX_EXPERTS = 1024

__all__ = ["ExpertRouting", "LayerRouting", "REPRESENTATIVE_TV", "RoutingDistance"]


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class LayerRouting(_Wire):
    """One MoE layer: the share of its routed tokens that went to each expert (index = expert)."""

    layer: int = Field(ge=0, description="Index of the decoder layer.")
    shares: list[Annotated[float, Field(ge=0.0, le=1.0)]] = Field(
        min_length=1, max_length=MAX_EXPERTS,
        description="Share of the layer's routed tokens per expert (each >= 0, summing to 1).")

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": f"self.shares.sum() >= {1 - SHARE_TOLERANCE} && self.shares.sum() <= {1 + SHARE_TOLERANCE}",
         "message": "a layer's expert shares must sum to 1"},
    ]})

    @model_validator(mode="after")
    def _sums_to_one(self) -> "LayerRouting":
        total = math.fsum(self.shares)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise ValueError(f"a layer's expert shares must sum to 1, layer {self.layer}'s sum to {total:.6f}")
        return self


class ExpertRouting(_Wire):
    """Per MoE layer, how the traffic's tokens were routed over the experts."""

    layers: list[LayerRouting] = Field(min_length=1, max_length=MAX_LAYERS,
                                       description="One entry per MoE layer, by increasing layer index.")
    routed_tokens: float | None = Field(
        default=None, ge=0, description="Top-k choices per layer the shares were taken from (a token counts k times).")

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self.layers.map(l, l.layer).isSorted() && "
                 "self.layers.all(l, size(l.shares) == size(self.layers[0].shares))",
         "message": "expertRouting layers must come by increasing layer index, each with as many shares as experts"},
    ]})

    @model_validator(mode="after")
    def _consistent(self) -> "ExpertRouting":
        indices = [entry.layer for entry in self.layers]
        if any(b <= a for a, b in zip(indices, indices[1:])):
            raise ValueError(f"expertRouting layers must come by strictly increasing layer index, got {indices}")
        experts = {len(entry.shares) for entry in self.layers}
        if len(experts) > 1:
            raise ValueError(f"every layer must have as many shares as experts, got {sorted(experts)}")
        return self

    @property
    def num_experts(self) -> int:
        return len(self.layers[0].shares)

    def shares(self) -> dict[int, list[float]]:
        return {entry.layer: list(entry.shares) for entry in self.layers}

    @classmethod
    def from_counts(cls, counts: Mapping[int, Sequence[float]]) -> "ExpertRouting | None":
        """Shares from routed-token counts {layer: [per expert]}; layers that routed nothing are
        left out; None when no layer routed anything."""
        layers, total = [], 0.0
        for layer in sorted(counts):
            row = [max(0.0, float(v)) for v in counts[layer]]
            s = math.fsum(row)
            if s <= 0 or not math.isfinite(s):
                continue
            layers.append(LayerRouting(layer=int(layer), shares=[v / s for v in row]))
            total += s
        if not layers:
            return None
        return cls(layers=layers, routed_tokens=total / len(layers))

    def distance(self, other: "ExpertRouting") -> "RoutingDistance":
        """Total variation per layer both have, and its maximum; raises when they share no layer
        or count experts differently (another model)."""
        if other.num_experts != self.num_experts:
            raise ValueError(f"routing histograms of {self.num_experts} and {other.num_experts} experts are of "
                             "different models")
        mine, theirs = self.shares(), other.shares()
        common = sorted(set(mine) & set(theirs))
        if not common:
            raise ValueError(f"routing histograms share no layer ({sorted(mine)} against {sorted(theirs)})")
        per_layer = {layer: 0.5 * math.fsum(abs(p - q) for p, q in zip(mine[layer], theirs[layer]))
                     for layer in common}
        return RoutingDistance(per_layer=per_layer)


@dataclass(frozen=True)
class RoutingDistance:
    """Total variation per layer (0..1) between two routing histograms."""

    per_layer: dict[int, float]

    @property
    def max(self) -> float:
        return max(self.per_layer.values())

    @property
    def worst_layer(self) -> int:
        return max(self.per_layer, key=lambda layer: self.per_layer[layer])

    def representative(self, threshold: float = REPRESENTATIVE_TV) -> bool:
        return self.max <= threshold
