"""Parallel layouts: validation against model configs, choice from a device count, rank coordinates."""

from __future__ import annotations

import pytest

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.parallel.layout import (LayoutError, ParallelLayout, candidate_layouts, choose_layout,
                                               valid_tp_degrees)
from shapeshift.engine.models.presets import PRESETS


def cfg(name: str) -> ModelConfig:
    preset = PRESETS[name]
    return ModelConfig.from_hf(preset.hf_config)


def test_heads_not_divisible_names_the_field_and_the_choices():
    with pytest.raises(LayoutError, match=r"tp=3 does not divide num_attention_heads=32.*\[1, 2, 4, 8, 16, 32\]"):
        ParallelLayout(tp=3).validate(cfg("llama-3.2-1b-shape"))


def test_kv_heads_replicated_when_tp_exceeds_them():
    llama = cfg("llama-3.2-1b-shape")  # 32 heads, 8 KV heads
    layout = ParallelLayout(tp=16).validate(llama)
    assert layout.local_heads(llama) == 2 and layout.local_kv_heads(llama) == 1
    # Ranks 2r and 2r+1 share KV head r; their q heads 4r..4r+3 are exactly that head's group of 4.
    assert [layout.first_kv_head(llama, r) for r in range(16)] == [r // 2 for r in range(16)]
    twelve = ModelConfig.from_hf({**PRESETS["tiny-llama"].hf_config, "num_attention_heads": 12,
                                  "num_key_value_heads": 4, "intermediate_size": 96})
    with pytest.raises(LayoutError, match=r"tp=6 and num_key_value_heads=4.*\[1, 2, 4, 12\]"):
        ParallelLayout(tp=6).validate(twelve)  # 6 divides 12 heads, but neither divides nor is a multiple of 4 KV heads


def test_expert_degree_must_divide_experts_and_needs_moe():
    moe = cfg("tiny-moe")  # 4 experts
    with pytest.raises(LayoutError, match=r"ep=8 does not divide num_experts=4"):
        ParallelLayout(ep=8).validate(moe)
    with pytest.raises(LayoutError, match="ep=2 needs a mixture-of-experts model"):
        ParallelLayout(ep=2).validate(cfg("tiny-llama"))


def test_tp_and_ep_must_nest():
    with pytest.raises(LayoutError, match="smaller degree must divide the larger"):
        ParallelLayout(tp=2, ep=3)
    with pytest.raises(LayoutError, match="integer >= 1"):
        ParallelLayout(tp=0)


def test_world_size_and_device_count():
    layout = ParallelLayout(tp=2, ep=4, dp=2)
    assert (layout.model_parallel_size, layout.expert_tp, layout.attention_replicas, layout.world_size) == (4, 1, 2, 8)
    with pytest.raises(LayoutError, match="needs 8 devices.*has 4"):
        layout.validate(cfg("moe-medium-shape"), num_devices=4)


def test_rank_coordinates_keep_tensor_groups_adjacent():
    layout = ParallelLayout(tp=2, ep=4, dp=2)
    c = [layout.coords(r) for r in range(8)]
    assert [x.dp_rank for x in c] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [x.tp_rank for x in c] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [x.ep_rank for x in c] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert layout.replica_ranks(1) == [4, 5, 6, 7]
    expert_tp = ParallelLayout(tp=4, ep=2).coords(3)
    assert (expert_tp.ep_rank, expert_tp.etp_rank) == (1, 1)
    with pytest.raises(LayoutError, match="outside layout"):
        layout.coords(8)


def test_choose_layout_from_hardware_count():
    llama = cfg("llama-3.2-1b-shape")
    assert choose_layout(llama, 1) == ParallelLayout()
    assert choose_layout(llama, 8) == ParallelLayout(tp=8)
    assert choose_layout(cfg("moe-medium-shape"), 4) == ParallelLayout(tp=4, ep=4)
    with pytest.raises(LayoutError, match=r"3 devices cannot split.*one of \[1, 2, 4, 8, 16, 32\]"):
        choose_layout(llama, 3)


def test_cost_model_choice_is_taken_when_valid():
    moe = cfg("moe-medium-shape")
    assert choose_layout(moe, 4, cost_model_choice={"tp": 2, "ep": 2, "dp": 2}) == ParallelLayout(tp=2, ep=2, dp=2)
    assert choose_layout(moe, 4, cost_model_choice="tp1-ep4") == ParallelLayout(ep=4)

    class RankingEntry:  # what a ranking row carries: degrees as attributes
        tp, ep, dp, pp = 4, 1, 1, 1

    assert choose_layout(moe, 4, cost_model_choice=RankingEntry()) == ParallelLayout(tp=4)
    with pytest.raises(LayoutError, match="needs 2 devices"):
        choose_layout(moe, 4, cost_model_choice={"tp": 2})
    with pytest.raises(LayoutError, match="pipeline"):
        choose_layout(moe, 4, cost_model_choice={"tp": 2, "pp": 2})


def test_parse_rejects_garbage():
    assert ParallelLayout.parse("tp=2, ep=2") == ParallelLayout(tp=2, ep=2)
    assert ParallelLayout.parse("tp4-ep1-dp2-pp1") == ParallelLayout(tp=4, dp=2)
    with pytest.raises(LayoutError, match="cannot read parallel layout"):
        ParallelLayout.parse("tp2-xx3")


def test_candidate_layouts_cover_each_product():
    llama = cfg("llama-3.2-1b-shape")
    names = [x.name for x in candidate_layouts(llama, 4)]
    assert names == ["tp1-ep1-dp4-pp1", "tp2-ep1-dp2-pp1", "tp4-ep1-dp1-pp1"]
    moe_names = {x.name for x in candidate_layouts(cfg("moe-medium-shape"), 2)}
    assert moe_names == {"tp1-ep1-dp2-pp1", "tp1-ep2-dp1-pp1", "tp2-ep1-dp1-pp1", "tp2-ep2-dp1-pp1"}
    assert all(x.world_size == 8 for x in candidate_layouts(cfg("moe-medium-shape"), 8, include_pipeline=True))
    assert valid_tp_degrees(cfg("tiny-llama")) == [1, 2, 4]


def test_padded_vocab_and_rank_view():
    qwen = cfg("tiny-qwen3")
    layout = ParallelLayout(tp=4)
    assert layout.padded_vocab(qwen) == 512
    odd = ModelConfig.from_hf({**PRESETS["tiny-llama"].hf_config, "vocab_size": 509})
    assert layout.padded_vocab(odd) == 512
    view = layout.rank_model_config(qwen)
    assert (view.num_attention_heads, view.num_key_value_heads, view.vocab_size) == (1, 1, 512)


def test_cost_model_ranking_yields_its_best_executable_layout():
    from shapeshift.engine.compile.cost_model import CostModel

    moe = cfg("moe-medium-shape")
    ranking = CostModel(moe).rank(4)
    chosen = choose_layout(moe, 4, cost_model_choice=ranking)
    best_runnable = next(p.layout for p in ranking if p.layout.pp == 1)
    assert chosen.name == str(best_runnable)
    runnable_entry = next(p for p in ranking if p.layout.pp == 1)  # one Prediction, not the list
    assert choose_layout(moe, 4, cost_model_choice=runnable_entry).name == str(runnable_entry.layout)
    pipelined = next(p for p in ranking if p.layout.pp > 1)
    with pytest.raises(LayoutError, match="pipeline"):
        choose_layout(moe, 4, cost_model_choice=pipelined)
