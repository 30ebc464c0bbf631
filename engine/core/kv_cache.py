"""The paged KV cache: preallocated per-layer block pools.

Layout (kernels use exactly this): per layer ``k[l]`` and ``v[l]`` of shape
[num_blocks + 1, block_size, num_kv_heads, head_dim] in the model dtype; a slot index
s maps to (s // block_size, s % block_size). The extra last block (``null_block``) is
never handed out by the block manager: padded rows of a CUDA graph batch write their
keys there, so a replay never scribbles over live cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shapeshift.engine.core.config import EngineConfig, ModelConfig


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [num_blocks + 1, block_size, num_kv_heads, head_dim]
    v: list[torch.Tensor]
    block_size: int
    num_blocks: int  # usable blocks (0..num_blocks-1); block num_blocks is the null block

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def null_slot(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def allocate(cls, model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> KVCache:
        shape = (num_blocks + 1, block_size, model_config.num_key_value_heads, model_config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_hidden_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_hidden_layers)]
        return cls(k=k, v=v, block_size=block_size, num_blocks=num_blocks)


def bytes_per_token(model_config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim * elem


CPU_KV_BUDGET_BYTES = 1 << 30


def choose_num_blocks(model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                      device: torch.device) -> int:
    """How many blocks to preallocate when ``config.num_kv_blocks`` is None.

    CUDA: what is left of ``gpu_memory_utilization`` of the device after the weights,
    minus an estimate of the activation peak, capped at four full batches of
    max_model_len (more only feeds the prefix cache). CPU: enough for every sequence
    at full length, capped at 1 GiB. Never fewer blocks than one max_model_len
    sequence needs, so a lone request can always finish.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_token(model_config, dtype) * config.block_size
    min_blocks = math.ceil(config.max_model_len / config.block_size) + 1
    full_batch_blocks = math.ceil(config.max_num_seqs * config.max_model_len / config.block_size)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        elem = torch.empty((), dtype=dtype).element_size()
        hidden = model_config.hidden_size
        inter = max(model_config.intermediate_size, model_config.moe_intermediate_size * max(1, model_config.num_experts_per_tok))
        activations = config.max_num_batched_tokens * (4 * hidden + 3 * inter) * elem * 2
        logits = max(config.max_num_seqs, max(config.cuda_graph_batch_sizes or [1])) * model_config.vocab_size * 4 * 4
        budget = free - total * (1.0 - config.gpu_memory_utilization) - activations - logits
        blocks = int(budget // per_block)
        blocks = min(blocks, 4 * full_batch_blocks)
        if blocks < min_blocks:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after weights "
                f"allows {max(blocks, 0)} blocks, max_model_len={config.max_model_len} needs {min_blocks}; "
                "lower max_model_len / max_num_batched_tokens or raise gpu_memory_utilization")
        return blocks
    blocks = min(full_batch_blocks, CPU_KV_BUDGET_BYTES // per_block)
    return max(blocks, min_blocks)
