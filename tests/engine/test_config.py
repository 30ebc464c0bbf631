"""EngineConfig / ModelConfig validation: invalid settings fail early, naming the field."""

from __future__ import annotations

import pytest

from shapeshift.engine.core.config import EngineConfig, ModelConfig
from shapeshift.engine.models.presets import PRESETS, resolve_model


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "fp8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"device": "neuron"}, "no Neuron backend"),
    ({"block_size": 12}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"num_kv_blocks": 4, "max_model_len": 128, "block_size": 16}, "num_kv_blocks"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
    ({"cuda_graph_batch_sizes": [0, 4]}, "cuda_graph_batch_sizes"),
    ({"num_layers_override": 0}, "num_layers_override"),
])
def test_engine_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_engine_config_defaults():
    cfg = EngineConfig(max_num_seqs=6, max_model_len=4096)
    assert cfg.cuda_graph_batch_sizes == [1, 2, 4, 6]
    assert cfg.cuda_graph_context_lens == [512, 2048, 4096]
    assert EngineConfig(device="cpu").resolved_dtype() == "float32"
    assert EngineConfig(device="cuda").resolved_dtype() == "bfloat16"


def test_model_config_from_presets_and_errors():
    llama = ModelConfig.from_hf(PRESETS["llama-3.2-1b-shape"].hf_config)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads, llama.head_dim) == (2048, 16, 8, 64)
    assert llama.tie_word_embeddings and llama.rope_scaling["rope_type"] == "llama3"
    moe = ModelConfig.from_hf(PRESETS["tiny-moe"].hf_config)
    assert moe.family == "moe" and moe.num_experts == 4 and moe.moe_intermediate_size == 96
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf({**PRESETS["tiny-llama"].hf_config, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_layers_override"):
        llama.with_num_layers(17)
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_model("no-such-model-or-folder")


def test_the_token_budget_default_depends_on_the_device():
    """4096 tokens a step on CUDA (the regime matrix's best static configuration on an H200),
    2048 on the CPU; an explicit value wins everywhere; a wide batch alone raises the budget."""
    assert EngineConfig(device="cpu").max_num_batched_tokens == 2048
    assert EngineConfig(device="cuda").max_num_batched_tokens == 4096
    assert EngineConfig(device="cuda:1", max_num_batched_tokens=1024).max_num_batched_tokens == 1024
    assert EngineConfig.fit_token_budget({"max_num_seqs": 64}) == {"max_num_seqs": 64}
    assert EngineConfig.fit_token_budget({"max_num_seqs": 3000}) == {"max_num_seqs": 3000, "max_num_batched_tokens": 3000}


def test_the_compile_space_defaults_to_the_token_budget_serve_runs():
    from shapeshift.engine.compile.search_space import build_search_space

    for device, tokens in (("cpu", 2048), ("cuda", 4096)):
        space = build_search_space(device=device, max_model_len=256)
        knob = next(k for k in space.knobs if k.name == "engine.max_num_batched_tokens")
        assert knob.default == tokens and tokens in knob.values, (device, knob)
