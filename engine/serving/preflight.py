"""`shapeshift serve`'s checks before the model loads, and the context length it serves.

Data flow: CLI flags -> `check_model` (preset or folder: config.json, tokenizer.json,
weights) -> `check_device` (a CUDA device that exists) -> `choose_max_model_len` (the
model's max_position_embeddings, bounded by what the KV cache can hold; an explicit
--max-model-len above the model's limit is refused) -> EngineConfig -> the port bound
(`bind_socket`) -> the model loads. Every failure is a `ServeUsageError`: one line
saying what was wrong and what to do, which the CLI prints and exits 2 on.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ServeUsageError(ValueError):
    """A user error found before loading; the message is one actionable line."""


@dataclass
class ModelInfo:
    name: str
    hf_config: dict[str, Any] | None  # None: an imported preset not on disk whose preset names no config
    weight_bytes: int  # on disk (folders) or as float32 (random presets, imported ones not yet on disk); 0: unknown
    is_random: bool = False

    @property
    def max_position_embeddings(self) -> int | None:
        return None if self.hf_config is None else int(self.hf_config.get("max_position_embeddings", 4096))


def check_model(model: str) -> ModelInfo:
    """The model's config without loading its weights; raises naming what is missing."""
    from shapeshift.engine.models.presets import PRESETS, resolve_model

    try:
        target = resolve_model(model)
    except ValueError:
        raise ServeUsageError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a folder; "
                              "pass a preset name or the path of a Hugging Face style model folder") from None
    if isinstance(target, Path):
        folder, name = target, target.name
    elif target.is_random:
        return ModelInfo(target.name, dict(target.hf_config), _random_weight_bytes(target.hf_config), is_random=True)
    else:
        folder, name = target.folder(), target.name
        if not (folder / "config.json").is_file():
            # imported on load (or the loader says how): the preset's own config stands in until then,
            # its weights counted as the import writes them (float32)
            if not target.hf_config:
                return ModelInfo(name, None, 0)
            return ModelInfo(name, dict(target.hf_config), _random_weight_bytes(target.hf_config))
    if not (folder / "config.json").is_file():
        raise ServeUsageError(f"model folder {folder} has no config.json; point --model at a Hugging Face "
                              "style folder (config.json, *.safetensors, tokenizer.json)")
    if not (folder / "tokenizer.json").is_file():
        raise ServeUsageError(f"model folder {folder} has no tokenizer.json; save the model's tokenizer into it "
                              "(tokenizer.save_pretrained(folder) with transformers) and start again")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ServeUsageError(f"model folder {folder} has no *.safetensors weights; convert the checkpoint "
                              "(model.save_pretrained(folder, safe_serialization=True)) and start again")
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ServeUsageError(f"{folder / 'config.json'} is not valid JSON ({exc}); fix or replace it") from None
    return ModelInfo(name, hf_config, sum(f.stat().st_size for f in weights))


def _random_weight_bytes(hf_config: dict[str, Any]) -> int:
    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.models.loader import expected_weight_shapes

    shapes = expected_weight_shapes(ModelConfig.from_hf(hf_config))
    return 4 * sum(math.prod(s) for s in shapes.values())


def check_device(device: str | None) -> str:
    """The device to serve on; `cuda` without a visible GPU is refused."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ServeUsageError(f"--device {device}, but no CUDA GPU is visible here "
                                  "(torch.cuda.is_available() is False); use --device cpu, or check the driver "
                                  "and CUDA_VISIBLE_DEVICES")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ServeUsageError(f"--device {device}, but only {torch.cuda.device_count()} CUDA device(s) are "
                                  f"visible; use cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return device
    if device != "cpu":
        raise ServeUsageError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N")
    return device


def choose_max_model_len(info: ModelInfo, requested: int | None, *, device: str, dtype: str | None,
                         block_size: int, num_kv_blocks: int | None,
                         gpu_memory_utilization: float) -> tuple[int | None, str]:
    """(max_model_len, why). An explicit value above the model's limit is refused; without one,
    the model's max_position_embeddings, lowered to the tokens the KV cache can hold (the
    given --num-kv-blocks, else the memory the cache would get). (None, why) keeps the
    engine's default (the model's config is not on disk yet)."""
    model_max = info.max_position_embeddings
    if requested is not None:
        if model_max is not None and requested > model_max:
            raise ServeUsageError(f"--max-model-len {requested} is longer than {info.name} allows "
                                  f"(max_position_embeddings={model_max} in its config); use at most {model_max}")
        return requested, "--max-model-len"
    if model_max is None:
        return None, "the engine default (the model's config is read when it is imported)"
    cache_tokens, source = _kv_cache_tokens(info, device=device, dtype=dtype, block_size=block_size,
                                            num_kv_blocks=num_kv_blocks,
                                            gpu_memory_utilization=gpu_memory_utilization)
    if cache_tokens is None or cache_tokens >= model_max:
        return model_max, f"the model's max_position_embeddings ({model_max})"
    # One sequence of max_model_len must fit (plus the engine's spare block).
    chosen = max(block_size, (cache_tokens // block_size - 1) * block_size)
    return chosen, (f"the model allows {model_max}, but {source} holds {cache_tokens} tokens; "
                    "pass --max-model-len (and --num-kv-blocks) to choose")


def _kv_cache_tokens(info: ModelInfo, *, device: str, dtype: str | None, block_size: int,
                     num_kv_blocks: int | None, gpu_memory_utilization: float) -> tuple[int | None, str]:
    import torch

    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.core.kv_cache import CPU_KV_BUDGET_BYTES, bytes_per_token
    from shapeshift.engine.models.loader import TORCH_DTYPES

    if num_kv_blocks is not None:
        return num_kv_blocks * block_size, f"--num-kv-blocks {num_kv_blocks}"
    torch_dtype = TORCH_DTYPES[dtype or ("float32" if device == "cpu" else "bfloat16")]
    per_token = bytes_per_token(ModelConfig.from_hf(info.hf_config), torch_dtype)
    if device == "cpu":
        return CPU_KV_BUDGET_BYTES // per_token, f"the CPU KV budget ({CPU_KV_BUDGET_BYTES >> 20} MiB)"
    free, total = torch.cuda.mem_get_info(torch.device(device))
    weights = info.weight_bytes
    if info.is_random:  # made on the device in the serving dtype
        weights = weights // 4 * torch.empty((), dtype=torch_dtype).element_size()
    budget = free - total * (1.0 - gpu_memory_utilization) - weights
    return max(int(budget // per_token), 0), (f"the GPU memory left for the KV cache "
                                              f"(~{max(budget, 0) / 2**30:.1f} GiB)")


class PortInUseError(OSError):
    """The address to serve on cannot be bound (taken, or not this host's)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), bound before the model loads so a taken port is
    found at once; uvicorn serves on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port "
                                        "(or stop what holds it) or another --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
