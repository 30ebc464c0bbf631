"""Measurement tiers: a fast tier (the first few layers) and the full model, from one weights dict.

Data flow: EngineConfig -> full LLMEngine (loads the weights once) -> fast tier: the same
config with ``num_layers_override = N`` and a weights dict that holds the full engine's
tensors for layers < N plus embeddings, final norm and head (no copy, no second load)
-> a second LLMEngine with its own small KV cache. Candidates are screened on the fast
tier (quick, low-noise timings) and confirmed on the full one.

The engine core loads weights through its ``_load_model`` hook; the fast tier overrides
that hook to hand in the subset.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from shapeshift.engine.core.config import EngineConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
DEFAULT_FAST_LAYERS = 2


def layer_subset(weights: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The tensors of layers < num_layers plus every non-layer tensor (same objects)."""
    out = {}
    for name, tensor in weights.items():
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            out[name] = tensor
    return out


def fast_tier_config(base: EngineConfig, num_layers: int) -> EngineConfig:
    return dataclasses.replace(base, num_layers_override=num_layers)


def build_fast_tier(full_engine: Any, num_layers: int = DEFAULT_FAST_LAYERS, **overrides: Any) -> Any:
    """An LLMEngine over the first ``num_layers`` layers of ``full_engine``'s weights."""
    from shapeshift.engine.core.llm_engine import LLMEngine
    from shapeshift.engine.models.loader import LoadedModel

    base = full_engine.config
    total = full_engine.model_config.num_hidden_layers
    num_layers = min(num_layers, total)
    config = dataclasses.replace(fast_tier_config(base, num_layers), **overrides)
    loaded = LoadedModel(name=f"{full_engine.model_name}[:{num_layers}]",
                         model_config=full_engine.model_config.with_num_layers(num_layers),
                         weights=layer_subset(full_engine.weights, num_layers),
                         tokenizer=full_engine.tokenizer, source=f"tier of {full_engine.model_name}")

    class FastTierEngine(LLMEngine):
        def _load_model(self, _config: EngineConfig) -> LoadedModel:
            return loaded  # the full engine's tensors: no second load, no copy

    return FastTierEngine(config)


@dataclass
class Tiers:
    full: Any
    fast: Any

    @classmethod
    def load(cls, config: EngineConfig, fast_layers: int = DEFAULT_FAST_LAYERS, **fast_overrides: Any) -> Tiers:
        from shapeshift.engine.core.llm_engine import LLMEngine

        full = LLMEngine(config)
        return cls(full=full, fast=build_fast_tier(full, fast_layers, **fast_overrides))

    def engine(self, tier: str) -> Any:
        if tier not in ("fast", "full"):
            raise ValueError(f"tier must be 'fast' or 'full', got {tier!r}")
        return self.fast if tier == "fast" else self.full
