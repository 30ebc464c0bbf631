"""Parallel forward pass: the stock pass's ops over one rank's weight shards, plus the
collectives that make the ranks compute the same logits as one process would.

Data flow per step on each rank of a replica (all ranks see the same batch):
  token ids [T] -> embedding (the table is replicated) -> [T, H]
  per layer: RMSNorm -> column-parallel q/k/v (local heads) -> q/k norm, rotary ->
    paged KV cache holding only the local KV heads -> attention -> row-parallel o_proj
    (partial sums) -> all-reduce(tp) -> residual -> RMSNorm ->
    dense: column-parallel gate/up, row-parallel down -> all-reduce(tp)
    MoE:   replicated router (identical routing on every rank, the input being
           identical) -> the rank's experts (and its slice of their intermediate
           dimension) on the tokens routed to them, other experts' weights zeroed ->
           all-reduce(mp) sums the partial expert outputs -> residual
  last rows [B, H] -> final RMSNorm -> vocab-parallel lm_head shard -> float32 [B, Vp/tp]
  -> all-gather(tp) -> [B, Vp] -> padding columns dropped -> float32 logits [B, V].

Everything up to the lm_head shard is the stock pass's own ``forward``: this pass
overrides only ``attention`` and ``mlp`` (to add their collectives) and gathers the
vocabulary at the end, so it follows the stock pass as that evolves.

Why all-reduce rather than all-to-all for experts: every rank already holds every token
(attention is tensor-parallel, not data-parallel), so routing needs no exchange; the
only traffic is one all-reduce of [T, H] per MoE layer, the same as a dense layer's.
All-to-all pays off once attention is data-parallel across the expert ranks.

The layout and groups come from ``shapeshift.engine.parallel.process_group.current()``;
with no parallel state the pass runs single-process (tp = ep = 1) and equals the stock
pass. Weights must be sharded for the layout (``ParallelLLMEngine`` does that once).

Recipe knobs (recipe.yaml): those of the stock pass (``attention_backend``,
``moe_decode_gather_max_rows``); under tp > 1 ``fuse_layer_tail`` is turned off (its kernel
has no place for the all-reduces).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shapeshift.engine.core.attention import AttentionContext
from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.forward_passes.stock import forward as stock
from shapeshift.engine.parallel import process_group
from shapeshift.engine.parallel.layout import ParallelLayout

FORWARD_PASS_NAME = "parallel"
# Each rank's cache holds its KV heads in the stock layout; blocks are per-rank, never
# shared with a single-process engine, so the stock format version applies.
CACHE_FORMAT_VERSION = stock.CACHE_FORMAT_VERSION


# torch 2.13 renamed all_gather_into_tensor; CUDA hosts may run an older torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(x, group=group)
    return x


def moe_local(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first_expert: int, gate_up: torch.Tensor,
              down: torch.Tensor, path: str) -> torch.Tensor:
    """This rank's share [T, H] of the MoE output: its experts' contributions under the
    global routing (weights, ids: [T, k]), through the stock op of ``path``: "sparse" (eager
    prefill), "gather" or "dense" (decode). gate_up: [E_local, 2I_local, H]; down: [E_local, H, I_local].
    """
    num_local = gate_up.shape[0]
    local = ids - first_expert
    mine = (local >= 0) & (local < num_local)
    if path == "gather":
        # Gathering needs a valid index everywhere: other ranks' choices read local expert 0
        # with weight zero (no contribution).
        return stock.moe_gather(x, torch.where(mine, weights, torch.zeros_like(weights)),
                                torch.where(mine, local, torch.zeros_like(local)), gate_up, down)
    # Other ranks' choices get id E_local, which the stock sparse and dense ops skip.
    local = torch.where(mine, local, torch.full_like(local, num_local))
    if path == "sparse":
        return stock.moe_sparse(x, weights, local, gate_up, down)
    return stock.moe_dense(x, weights, local, gate_up, down)


class ParallelForwardPass(stock.StockForwardPass):
    """The stock pass, run unchanged over the rank's shards; only ``attention`` and
    ``mlp`` (adding their collectives) and the logits gather are overridden, so the
    stock pass's own optimisations and recipe knobs carry over."""

    name = FORWARD_PASS_NAME

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], recipe: dict[str, Any]) -> None:
        state = process_group.current()
        self.layout = state.layout if state is not None else ParallelLayout()
        self.layout.validate(cfg)
        coords = state.coords if state is not None else self.layout.coords(0)
        self.tp_group = state.tp_group if state is not None else None
        self.mp_group = state.mp_group if state is not None else None
        self.full_cfg = cfg
        self.num_local_experts = self.layout.local_experts(cfg) if cfg.family == "moe" else 0
        self.first_expert = coords.ep_rank * self.num_local_experts
        _check_sharded(cfg, self.layout, weights)
        # The stock pass sees the rank's view: local heads (so its views and its paged
        # attention work on the local shards); experts and vocabulary stay global.
        if self.layout.tp > 1:
            # fuse_layer_tail runs a layer's o_proj, MLP and the next qkv in one kernel: no place for
            # the all-reduces between them, so the separate GEMVs run instead (same recipe elsewhere).
            recipe = {**recipe, "fuse_layer_tail": False, "fuse_attention_into_layer": False,
                      "fuse_attention_into_tail": False}
        super().__init__(self.layout.rank_model_config(cfg), weights, recipe)
        if "lm_head.weight" in weights:  # tied embeddings under tp > 1: the head is a shard, the table is not
            self.lm_head = weights["lm_head.weight"]

    # ------------------------------------------------------------------ blocks
    def attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The stock attention over the local heads; its o_proj is row-parallel, so the
        result [T, H] is a partial sum until the all-reduce."""
        partial = super().attention(*args, **kwargs)
        return _all_reduce(partial, self.tp_group, self.layout.tp)

    def mlp(self, layer: stock.LayerWeights, x: torch.Tensor, ctx: AttentionContext, *args: Any,
            **kwargs: Any) -> torch.Tensor:
        if layer.router is None:
            partial = super().mlp(layer, x, ctx, *args, **kwargs)  # [T, H]: row-parallel down_proj
            return _all_reduce(partial, self.tp_group, self.layout.tp)
        cfg = self.full_cfg
        weights, ids = stock.route(x, layer.router, cfg.num_experts_per_tok, cfg.norm_topk_prob)  # [T, k] global
        self.count_routing(layer, ids)  # every rank routes alike: each counts all tokens
        if ctx.is_prefill:
            path = "sparse"
        elif x.shape[0] * cfg.num_experts_per_tok <= self.moe_gather_max_rows:
            path = "gather"
        else:
            path = "dense"
        partial = moe_local(x, weights, ids, self.first_expert, layer.experts_gate_up, layer.experts_down, path)
        return _all_reduce(partial, self.mp_group, self.layout.model_parallel_size)

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Logits of the rank's vocabulary shard [B, Vp/tp] -> float32 logits [B, V]."""
        tp = self.layout.tp
        if tp > 1:
            batch = local.shape[0]
            gathered = torch.empty((tp * batch, local.shape[1]), dtype=local.dtype, device=local.device)
            _all_gather_single(gathered, local.contiguous(), group=self.tp_group)  # [tp*B, Vp/tp]
            local = gathered.view(tp, batch, -1).transpose(0, 1).reshape(batch, -1)  # [B, Vp]
        return local[:, :self.full_cfg.vocab_size].float()

    # ------------------------------------------------------------------ entry
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                kv_cache: Any) -> torch.Tensor:
        """input_ids, positions: [T] -> float32 logits [B, V] of each sequence's last new token."""
        local = super().forward(input_ids, positions, ctx, kv_cache)  # [B, Vp/tp]: the head is a vocab shard
        return self.gather_vocab(local)


def _check_sharded(cfg: ModelConfig, layout: ParallelLayout, weights: dict[str, torch.Tensor]) -> None:
    expected = {
        "model.embed_tokens.weight": cfg.vocab_size,  # replicated
        "model.layers.0.self_attn.q_proj.weight": layout.local_heads(cfg) * cfg.head_dim,
        "model.layers.0.self_attn.k_proj.weight": layout.local_kv_heads(cfg) * cfg.head_dim,
    }
    if layout.tp > 1:
        expected["lm_head.weight"] = layout.padded_vocab(cfg) // layout.tp
    if cfg.family == "moe":
        expected["model.layers.0.mlp.experts.gate_up_proj"] = layout.local_experts(cfg)
    for name, rows in expected.items():
        got = weights[name].shape[0] if name in weights else None
        if got != rows:
            raise ValueError(
                f"weight {name} has {got} rows, layout {layout.name} expects {rows} on each rank: the weights are "
                "not sharded for this layout; serve through shapeshift.engine.parallel.engine.ParallelLLMEngine, "
                "which shards them with sharding.shard_weights")


def build(model_config: ModelConfig, weights: dict[str, torch.Tensor], recipe: dict[str, Any]) -> ParallelForwardPass:
    return ParallelForwardPass(model_config, weights, recipe)
