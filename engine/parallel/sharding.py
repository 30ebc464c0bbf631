"""Cutting the flat weights dict into one rank's share (pure: no process groups).

Data flow: the engine's flat ``dict[str, Tensor]`` (HF names, full shapes, loaded
once) + ``ModelConfig`` + ``ParallelLayout`` + the rank's ``RankCoords`` ->
``shard_weights`` -> a dict with the same names holding only this rank's slices
(fresh compact tensors, so the full dict can be dropped and its memory freed).

Rules (T = tp, tr = tp_rank; D = head_dim):
  q_proj  weight/bias   column-parallel: rows of the rank's q heads [tr*Hq/T, +Hq/T) * D
  k/v_proj weight/bias  column-parallel: rows of the rank's KV heads; when T > Hkv each
                        rank keeps the one head its q heads use (replication)
  o_proj                row-parallel: the columns matching the rank's q heads
  gate_proj, up_proj    column-parallel: rows [tr*I/T, +I/T)
  down_proj             row-parallel: the matching columns
  lm_head               vocab-parallel: rows [tr*Vp/T, +Vp/T) of the vocabulary padded to
                        Vp (a multiple of T) with zero rows; with tied embeddings the shard is
                        cut from embed_tokens and stored as lm_head.weight
  embed_tokens          replicated: a lookup reads only T rows, so a full table costs memory
                        (V x H per rank) but saves the all-reduce a vocab-parallel lookup
                        needs every step, and lets the parallel pass reuse the stock
                        forward unchanged
  mlp.gate (router)     replicated: every rank routes every token identically
  experts.gate_up_proj  experts [ep_rank*E/ep, +E/ep); inside each, the gate rows and
                        the up rows of slice etp_rank of the intermediate dimension
  experts.down_proj     same experts; the matching columns of the intermediate dimension
  norms                 replicated
The KV cache of a rank holds only its KV heads: allocate it from
``layout.rank_model_config(cfg)``.
"""

from __future__ import annotations

import re

import torch

from shapeshift.engine.core.config import ModelConfig

from shapeshift.engine.parallel.layout import ParallelLayout, RankCoords

_REPLICATED = re.compile(r"(norm\.weight|mlp\.gate\.weight)$")


def _take(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    # A fresh compact copy: a view would keep the whole unsharded tensor alive.
    return t.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


def _vocab_shard(t: torch.Tensor, cfg: ModelConfig, layout: ParallelLayout, tp_rank: int) -> torch.Tensor:
    """[V, H] -> [Vp/T, H]; rows past V (padding) are zero."""
    per_rank = layout.padded_vocab(cfg) // layout.tp
    start = tp_rank * per_rank
    shard = torch.zeros((per_rank, t.shape[1]), dtype=t.dtype, device=t.device)
    valid = max(0, min(per_rank, cfg.vocab_size - start))
    if valid:
        shard[:valid] = t[start:start + valid]
    return shard


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, layout: ParallelLayout,
                  coords: RankCoords) -> dict[str, torch.Tensor]:
    """This rank's share of ``weights`` (same names, sharded shapes)."""
    layout.validate(cfg)
    if layout.model_parallel_size == 1:
        return dict(weights)
    d = cfg.head_dim
    tr = coords.tp_rank
    q_rows = (tr * layout.local_heads(cfg) * d, layout.local_heads(cfg) * d)
    kv_rows = (layout.first_kv_head(cfg, tr) * d, layout.local_kv_heads(cfg) * d)
    inter = cfg.intermediate_size // layout.tp
    local_e = layout.local_experts(cfg)
    first_e = coords.ep_rank * local_e
    e_inter = cfg.moe_intermediate_size // layout.expert_tp if cfg.family == "moe" else 0
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name == "lm_head.weight":
            out[name] = _vocab_shard(t, cfg, layout, tr) if layout.tp > 1 else t
        elif name == "model.embed_tokens.weight":
            out[name] = t
            if cfg.tie_word_embeddings and layout.tp > 1:
                out["lm_head.weight"] = _vocab_shard(t, cfg, layout, tr)
        elif _REPLICATED.search(name):
            out[name] = t
        elif ".self_attn.q_proj." in name:
            out[name] = _take(t, 0, *q_rows)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            out[name] = _take(t, 0, *kv_rows)
        elif name.endswith(".self_attn.o_proj.weight"):
            out[name] = _take(t, 1, *q_rows)
        elif name.endswith(".mlp.gate_proj.weight") or name.endswith(".mlp.up_proj.weight"):
            out[name] = _take(t, 0, tr * inter, inter)
        elif name.endswith(".mlp.down_proj.weight"):
            out[name] = _take(t, 1, tr * inter, inter)
        elif name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            experts = t.narrow(0, first_e, local_e)
            full_i = cfg.moe_intermediate_size
            start = coords.etp_rank * e_inter
            out[name] = torch.cat([experts.narrow(1, start, e_inter), experts.narrow(1, full_i + start, e_inter)],
                                  dim=1).contiguous()  # [E/ep, 2I/etp, H]
        elif name.endswith(".mlp.experts.down_proj"):  # [E, H, I]
            out[name] = _take(t.narrow(0, first_e, local_e), 2, coords.etp_rank * e_inter, e_inter)
        else:
            raise ValueError(
                f"weight {name} has no sharding rule for layout {layout.name}; the parallel engine knows the "
                "Llama/Qwen/Mixtral names of loader.expected_weight_shapes; extend sharding.shard_weights")
    return out
