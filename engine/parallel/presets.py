"""Model presets the parallel benchmarks need beyond engine/presets.py.

Data flow: ``ensure_parallel_presets()`` adds these random-weight presets to
``shapeshift.engine.presets.PRESETS`` (idempotent; every rank calls it before loading),
so ``EngineConfig(model="moe-medium-shape")`` resolves like any other preset.

``moe-medium-shape``: a Qwen3-MoE-style model big enough that expert and tensor
parallelism matter on H200s, small enough for one GPU (about 5.8 B parameters, 11.6 GB
in bfloat16; about 1.5 B active per token): 16 layers, hidden 2048, 32 query / 4 KV
heads of 128, 64 experts top-8 of intermediate 768, vocabulary 151936.
"""

from __future__ import annotations

from shapeshift.engine import presets as engine_presets

MOE_MEDIUM_SHAPE = "moe-medium-shape"

_MOE_MEDIUM_CONFIG = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "eos_token_id": engine_presets.RANDOM_PRESET_EOS,
}

PARALLEL_PRESETS = {
    MOE_MEDIUM_SHAPE: engine_presets.Preset(
        MOE_MEDIUM_SHAPE, "Qwen3-MoE-style 64 experts top-8, ~5.8B params, random weights (parallel benchmarks)",
        hf_config=_MOE_MEDIUM_CONFIG, weight_seed=4321),
}


def ensure_parallel_presets() -> None:
    for name, preset in PARALLEL_PRESETS.items():
        engine_presets.PRESETS.setdefault(name, preset)
