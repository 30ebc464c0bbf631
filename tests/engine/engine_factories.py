"""Small factories for engine tests: random HF checkpoints, engines, schedulers, requests.

Checkpoints are built with transformers itself (``save_pretrained``), so the engine is
compared against the reference implementation on exactly the weights it loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shapeshift.engine.core.block_manager import BlockManager
from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.core.llm_engine import LLMEngine
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.core.scheduler import Scheduler
from shapeshift.engine.core.sequence import Sequence
from shapeshift.engine.models.tokenizer import Tokenizer

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              initializer_range=0.15, tie_word_embeddings=False)


def hf_config(kind: str) -> Any:
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**COMMON, intermediate_size=128, head_dim=16,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                              rope_theta=10000.0)
    if kind == "llama-tied":
        return tf.LlamaConfig(**{**COMMON, "tie_word_embeddings": True}, intermediate_size=128)
    if kind == "qwen2":
        return tf.Qwen2Config(**COMMON, intermediate_size=128)
    if kind == "qwen3":
        return tf.Qwen3Config(**COMMON, intermediate_size=128, head_dim=32)
    if kind == "mixtral":
        return tf.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=6,
                                 num_experts_per_tok=2, norm_topk_prob=False, head_dim=16)
    raise ValueError(kind)


def make_hf_checkpoint(kind: str, folder: Path, seed: int = 0) -> Any:
    """Random HF model of ``kind`` saved to ``folder`` (+ a byte-level tokenizer); returns it."""
    import transformers as tf

    torch.manual_seed(seed)
    config = hf_config(kind)
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Perturb norms and biases away from their 1/0 init so a forward pass that
            # skips one of them is caught.
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder, safe_serialization=True)
    Tokenizer.byte_level().save(folder)
    return model


def make_engine(model: str | Path, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = dict(model=str(model), device="cpu", dtype="float32", max_num_seqs=8,
                                    max_model_len=256, block_size=4, max_num_batched_tokens=64)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy continuation and the float32 logits [N, V] it chose from."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat([l.float() for l in out.logits], dim=0)


def make_scheduler(num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 4,
                   max_num_batched_tokens: int = 16, max_model_len: int = 128,
                   enable_prefix_caching: bool = True, eos_token_ids: list[int] | None = None,
                   tokenizer: Tokenizer | None = None) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, tokenizer=tokenizer,
                     eos_token_ids=eos_token_ids)


def make_requests(lengths: list[int], max_tokens: int = 4, prefix: list[int] | None = None,
                  start_token: int = 10, id_prefix: str = "r") -> list[Sequence]:
    """Sequences with distinct prompts of the given lengths (after an optional shared prefix)."""
    seqs = []
    for i, n in enumerate(lengths):
        body = [start_token + 7 * i + j for j in range(n)]
        seqs.append(Sequence(request_id=f"{id_prefix}{i}", prompt_token_ids=list(prefix or []) + body,
                             params=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    return seqs


def scripted_next_token(token_ids: list[int]) -> int:
    """A stand-in for the model in scheduler-only tests (named fake: no weights involved):
    the next token is a fixed function of the whole history, so any scheduling that feeds
    the right history gives the same continuation."""
    return (sum((i + 1) * t for i, t in enumerate(token_ids)) * 31) % 200 + 20


def run_scheduler(scheduler: Scheduler, seqs: list[Sequence], next_token=scripted_next_token,
                  max_steps: int = 1000) -> tuple[dict[str, list], list]:
    """Drive ``scheduler`` to completion with ``next_token`` as the model.

    Returns (outputs per request id, the scheduled batches as (ids, num_new_tokens)).
    """
    from shapeshift.engine.core.scheduler import RunnerOutput

    for seq in seqs:
        scheduler.add(seq)
    outputs: dict[str, list] = {seq.request_id: [] for seq in seqs}
    batches = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        batches.append(([s.request_id for s in batch.seqs], list(batch.num_new_tokens),
                        [s.request_id for s in batch.preempted]))
        tokens = [next_token(s.token_ids) if batch.samples(i) else None for i, s in enumerate(batch.seqs)]
        for out in scheduler.postprocess(batch, RunnerOutput(token_ids=tokens)):
            outputs[out.request_id].append(out)
    else:
        raise AssertionError(f"scheduler did not finish within {max_steps} steps")
    return outputs, batches
