"""Weights and tokenizer loading.

Data flow: ``EngineConfig.model`` -> presets.resolve_model -> either an HF-style folder
(config.json + *.safetensors + tokenizer.json) read with safetensors, or a random
preset drawn from a seeded generator -> one flat ``dict[str, Tensor]`` on the target
device and dtype, keyed by HF names, plus a ``ModelConfig`` and a ``Tokenizer``.

Canonical names: dense weights keep their HF names. MoE experts are stacked per layer
(the layout transformers itself uses in memory), so forward passes index experts
without Python loops over dict keys:
    model.layers.{i}.mlp.gate.weight                [E, H]        router
    model.layers.{i}.mlp.experts.gate_up_proj       [E, 2*I, H]   gate rows first, then up
    model.layers.{i}.mlp.experts.down_proj          [E, H, I]
Mixtral files (block_sparse_moe.experts.{e}.w1/w3/w2) and Qwen3-MoE files
(mlp.experts.{e}.gate_proj/up_proj/down_proj) are both converted to that.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shapeshift.engine.core.config import EngineConfig, ModelConfig
from shapeshift.engine.models.presets import Preset, resolve_model
from shapeshift.engine.models.tokenizer import Tokenizer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MIXTRAL_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_QWEN_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_ROLE = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


@dataclass
class LoadedModel:
    name: str
    model_config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str  # folder path or "preset:<name>"


def load_model(config: EngineConfig) -> LoadedModel:
    """Resolve ``config.model`` and load its weights once onto ``config``'s device."""
    device = torch.device(config.resolved_device())
    dtype = TORCH_DTYPES[config.resolved_dtype()]
    target = resolve_model(config.model)
    if isinstance(target, Preset):
        if target.is_random:
            model_config = ModelConfig.from_hf(target.hf_config)
            if config.num_layers_override is not None:
                model_config = model_config.with_num_layers(config.num_layers_override)
            weights = random_weights(model_config, seed=target.weight_seed, dtype=dtype, device=device,
                                     init_std=target.hf_config.get("initializer_range", 0.02))
            tokenizer = Tokenizer.byte_level()
            return LoadedModel(target.name, model_config, weights, tokenizer, f"preset:{target.name}")
        folder = target.folder()
        if not (folder / "config.json").is_file():
            if target.name == "smollm2-135m":
                from shapeshift.engine.models.smollm2 import import_smollm2  # needs transformers + gguf

                try:
                    folder = import_smollm2(folder)
                except ImportError as exc:
                    raise FileNotFoundError(
                        f"preset {target.name} is not imported yet ({folder} missing) and the import "
                        f"needs transformers and gguf ({exc}); run `shapeshift import-smollm2` on a "
                        "machine with the [test] extras installed") from exc
            else:
                raise FileNotFoundError(f"preset {target.name}: {folder} has no config.json")
        name = target.name
    else:
        folder = target
        name = folder.name
    model_config, weights = load_folder_weights(folder, dtype=dtype, device=device,
                                                num_layers=config.num_layers_override)
    tokenizer = Tokenizer.from_folder(folder, extra_eos_token_ids=model_config.eos_token_ids)
    return LoadedModel(name, model_config, weights, tokenizer, str(folder))


def load_folder_weights(folder: str | Path, dtype: torch.dtype, device: torch.device | str,
                        num_layers: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every *.safetensors file of an HF-style folder."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: a model folder needs config.json")
    model_config = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    if num_layers is not None:
        model_config = model_config.with_num_layers(num_layers)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {folder}; convert the checkpoint with "
            "model.save_pretrained(folder, safe_serialization=True)")
    weights: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                layer = _LAYER_RE.match(key)
                if layer and int(layer.group(1)) >= model_config.num_hidden_layers:
                    continue  # tiered loading: only the first N layers
                tensor = f.get_tensor(key).to(device=device, dtype=dtype)
                match = _MIXTRAL_EXPERT_RE.match(key) or _QWEN_EXPERT_RE.match(key)
                if match:
                    role = _EXPERT_ROLE[match.group(3)]
                    experts.setdefault((int(match.group(1)), role), {})[int(match.group(2))] = tensor
                    continue
                key = key.replace(".block_sparse_moe.gate.", ".mlp.gate.")
                weights[key] = tensor
    for layer_idx in sorted({layer_idx for layer_idx, _ in experts}):
        stacked = {}
        for role in ("gate", "up", "down"):
            per_expert = experts.get((layer_idx, role), {})
            if len(per_expert) != model_config.num_experts:
                raise ValueError(
                    f"layer {layer_idx}: found {len(per_expert)} '{role}' expert weights, config.json "
                    f"says num_experts={model_config.num_experts}; the checkpoint is incomplete")
            stacked[role] = torch.stack([per_expert[e] for e in range(model_config.num_experts)])
        prefix = f"model.layers.{layer_idx}.mlp.experts."
        weights[prefix + "gate_up_proj"] = torch.cat([stacked["gate"], stacked["up"]], dim=1)  # [E, 2I, H]
        weights[prefix + "down_proj"] = stacked["down"]  # [E, H, I]
    check_weights(model_config, weights)
    return model_config, weights


def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the stock forward pass reads, with its shape."""
    hidden, q_dim, kv_dim = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        if cfg.family == "moe":
            inter, experts = cfg.moe_intermediate_size, cfg.num_experts
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
            shapes[p + "mlp.experts.gate_up_proj"] = (experts, 2 * inter, hidden)
            shapes[p + "mlp.experts.down_proj"] = (experts, hidden, inter)
        else:
            inter = cfg.intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the head
    for name, shape in expected_weight_shapes(cfg).items():
        if name not in weights:
            raise ValueError(f"weight {name} missing from the checkpoint (config.json model_type "
                             f"{cfg.model_type!r}); is the folder complete and the config right?")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, config.json "
                             f"implies {shape}")


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device | str,
                   init_std: float = 0.02) -> dict[str, torch.Tensor]:
    """Seeded random weights with the canonical names (same seed -> same weights per device).

    Norm weights are drawn around 1 rather than set to 1 so that a forward pass which
    forgets a norm weight is caught by comparisons.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        else:
            # Generated in the target dtype directly: a 1B model in float32 would need
            # twice the memory just to be cast.
            t = torch.empty(shape, device=device, dtype=dtype).normal_(0.0, init_std, generator=gen)
        weights[name] = t.to(dtype)
    return weights
