"""Weight sharding, checked in one process: the ranks' shards, combined the way the
collectives combine them (sum for row-parallel / expert outputs, concatenation for
vocabulary shards), reproduce the unsharded computation. Covers layouts wider than
the 2-process tests (tp=4 with KV-head replication, tp=4 x ep=2 with split experts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.forward_pass.importer import load_bundle
from shapeshift.engine.forward_passes.stock import forward as stock
from shapeshift.engine.models.loader import random_weights
from shapeshift.engine.parallel.engine import PARALLEL_BUNDLE_DIR
from shapeshift.engine.parallel.layout import ParallelLayout
from shapeshift.engine.parallel.sharding import shard_weights
from shapeshift.engine.models.presets import PRESETS


def model(name: str, **overrides) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf({**PRESETS[name].hf_config, **overrides})
    return cfg, random_weights(cfg, seed=7, dtype=torch.float32, device="cpu")


def shards(cfg, weights, layout):
    return [shard_weights(weights, cfg, layout, layout.coords(r)) for r in range(layout.world_size)]


@pytest.fixture(scope="module")
def parallel_module():
    return load_bundle(PARALLEL_BUNDLE_DIR, allow_unmanifested=True).module


def test_attention_shards_pair_each_q_head_with_its_kv_head():
    cfg, w = model("tiny-llama")  # 4 q heads, 2 KV heads, head_dim 16
    layout = ParallelLayout(tp=4)  # 1 q head per rank, KV heads replicated on 2 ranks each
    d, group = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    name_q, name_k, name_o = (f"model.layers.1.self_attn.{n}_proj.weight" for n in "qko")
    parts = shards(cfg, w, layout)
    torch.testing.assert_close(torch.cat([p[name_q] for p in parts]), w[name_q], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p[name_o] for p in parts], dim=1), w[name_o], rtol=0, atol=0)
    for r, p in enumerate(parts):
        global_q_head = r  # one head per rank
        kv_head = global_q_head // group
        torch.testing.assert_close(p[name_k], w[name_k][kv_head * d:(kv_head + 1) * d], rtol=0, atol=0)


def test_dense_mlp_partial_sums_equal_full():
    cfg, w = model("tiny-llama")
    x = torch.randn(5, cfg.hidden_size)
    p = "model.layers.0.mlp."
    full = stock.dense_mlp(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
    partial = sum(stock.dense_mlp(x, s[p + "gate_proj.weight"], s[p + "up_proj.weight"], s[p + "down_proj.weight"])
                  for s in shards(cfg, w, ParallelLayout(tp=4)))
    torch.testing.assert_close(partial, full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", [ParallelLayout(tp=4, ep=2), ParallelLayout(ep=4), ParallelLayout(tp=2)],
                         ids=lambda x: x.name)
def test_expert_shards_sum_to_the_full_moe(parallel_module, layout):
    cfg, w = model("tiny-moe")  # 4 experts top-2, intermediate 96
    m = parallel_module
    p = "model.layers.0.mlp."
    x = torch.randn(7, cfg.hidden_size)
    weights, ids = stock.route(x, w[p + "gate.weight"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    full = stock.moe_sparse(x, weights, ids, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"])
    sums = {"sparse": torch.zeros_like(x), "dense": torch.zeros_like(x), "gather": torch.zeros_like(x)}
    for r, s in enumerate(shards(cfg, w, layout)):
        first = layout.coords(r).ep_rank * layout.local_experts(cfg)
        gate_up, down = s[p + "experts.gate_up_proj"], s[p + "experts.down_proj"]
        assert gate_up.shape == (cfg.num_experts // layout.ep, 2 * cfg.moe_intermediate_size // layout.expert_tp,
                                 cfg.hidden_size)
        for path in sums:
            sums[path] += m.moe_local(x, weights, ids, first, gate_up, down, path)
    for path, got in sums.items():
        torch.testing.assert_close(got, full, atol=1e-6, rtol=1e-5, msg=lambda msg, path=path: f"{path}: {msg}")


def test_lm_head_vocab_shards_with_padding():
    cfg, w = model("tiny-llama", vocab_size=509)  # 509 -> padded to 512 over tp=4
    parts = shards(cfg, w, ParallelLayout(tp=4))
    assert [p["lm_head.weight"].shape[0] for p in parts] == [128] * 4
    assert torch.count_nonzero(parts[3]["lm_head.weight"][-3:]) == 0  # padding rows
    assert all(p["model.embed_tokens.weight"] is w["model.embed_tokens.weight"] for p in parts)  # replicated
    h = torch.randn(3, cfg.hidden_size)
    gathered = torch.cat([F.linear(h, p["lm_head.weight"]) for p in parts], dim=1)[:, :cfg.vocab_size]
    torch.testing.assert_close(gathered, F.linear(h, w["lm_head.weight"]), atol=1e-6, rtol=1e-5)


def test_tied_head_is_cut_from_the_embedding():
    cfg, w = model("tiny-qwen3")  # tie_word_embeddings
    assert "lm_head.weight" not in w
    parts = shards(cfg, w, ParallelLayout(tp=2))
    torch.testing.assert_close(torch.cat([p["lm_head.weight"] for p in parts]), w["model.embed_tokens.weight"],
                               rtol=0, atol=0)
    assert "lm_head.weight" not in shard_weights(w, cfg, ParallelLayout(ep=1, dp=2), ParallelLayout(dp=2).coords(1))


def test_shards_are_compact_copies_and_replicas_are_shared():
    cfg, w = model("tiny-moe")
    part = shard_weights(w, cfg, ParallelLayout(tp=2, ep=2), ParallelLayout(tp=2, ep=2).coords(1))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert part[q].is_contiguous()
    assert part[q].untyped_storage().data_ptr() != w[q].untyped_storage().data_ptr()  # full tensor can be freed
    router = "model.layers.0.mlp.gate.weight"
    assert part[router] is w[router]


def test_unknown_weight_has_no_rule():
    cfg, w = model("tiny-llama")
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    with pytest.raises(ValueError, match="rotary_emb.inv_freq has no sharding rule"):
        shard_weights(w, cfg, ParallelLayout(tp=2), ParallelLayout(tp=2).coords(0))


def test_unsharded_weights_are_rejected_by_the_parallel_pass(parallel_module):
    cfg, w = model("tiny-llama")
    with pytest.raises(ValueError, match="not sharded for this layout"):
        parallel_module._check_sharded(cfg, ParallelLayout(tp=2), w)
