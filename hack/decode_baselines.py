#!/usr/bin/env python3
"""Decode baselines for hack/bench_decode.py, each run in a process of its own.

Data flow: bench_decode writes a spec JSON (preset, dtype, device, batch sizes, prompt and
output lengths, prompt seed, a fingerprint of the engine's weights, a deadline) and starts
    python3 hack/decode_baselines.py {hf-eager|hf-static|torch-compile} SPEC.json OUT.jsonl
-> the child redraws the preset's seeded random weights on the same device (the loader's
``random_weights``; same seed, device and torch -> the same tensors), checks them against the
fingerprint, builds its model over them -> for each batch size: greedy decode of seeded random
prompts, timed per step -> one JSON line per measured point appended to OUT.jsonl (flushed at
once, so a timeout or crash keeps every earlier point) -> exit.

Why a process each: Hugging Face's static cache compiles its forward with CUDA graph trees and
torch.compile's "reduce-overhead" mode does too; their private memory pools and cached graphs
must never share an address space with the engine's captured graphs (an earlier in-process
run ended in "CUDA error: an illegal memory access" in the engine after the HF run).

Baselines:
  hf-eager       transformers LlamaForCausalLM.generate, dynamic cache, eager
  hf-static      the same with cache_implementation="static" (transformers compiles it)
  torch-compile  the plain PyTorch Llama below (no engine code), static KV cache, decode step
                 compiled with torch.compile(mode="reduce-overhead") (CUDA graphs); the sampled
                 tokens are read back to the host every step, as a serving loop must.
Per-step times give inter-token latencies (ITL); a point's decode rate is
batch * steps / (time of the steps after the first token).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------- shared helpers
def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """The same prompts bench_decode gives the engine (same generator, same seed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (batch, prompt_len), generator=gen).tolist()


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """A cheap float64 checksum per tensor over a strided sample of its elements."""
    out = {}
    for name in sorted(weights):
        flat = weights[name].reshape(-1)
        step = max(1, flat.numel() // 4096)
        out[name] = float(flat[::step].double().sum().item())
    return out


def fingerprints_match(a: dict[str, float], b: dict[str, float]) -> str | None:
    """None when equal, else a message naming the first differing tensor."""
    if set(a) != set(b):
        return f"weight names differ: {sorted(set(a) ^ set(b))[:5]}"
    for name in a:
        if not (a[name] == b[name] or math.isclose(a[name], b[name], rel_tol=1e-9, abs_tol=1e-9)):
            return f"weight {name} differs from the engine's (checksum {b[name]} vs {a[name]})"
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def point(impl: str, batch: int, step_times: list[float], tokens_first: list[int], **extra: Any) -> dict[str, Any]:
    """A result row from per-step durations (s) of the decode steps after the first token."""
    total = sum(step_times)
    rate = batch * len(step_times) / total if total > 0 else None
    itl_p50, itl_p90 = percentile(step_times, 50), percentile(step_times, 90)
    return {"impl": impl, "batch": batch, "decode_tok_s": rate,
            "per_seq_tok_s": rate / batch if rate else None,
            "ms_per_step": 1e3 * total / len(step_times) if step_times else None,
            "itl_p50_ms": 1e3 * itl_p50 if itl_p50 else None, "itl_p90_ms": 1e3 * itl_p90 if itl_p90 else None,
            "p90_per_user_tok_s": 1.0 / itl_p90 if itl_p90 else None,
            "steps": len(step_times), "greedy_tokens_row0": tokens_first, **extra}


def load_weights(spec: dict[str, Any], device: torch.device, dtype: torch.dtype):
    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.models.loader import random_weights
    from shapeshift.engine.models.presets import PRESETS

    preset = PRESETS[spec["model"]]
    cfg = ModelConfig.from_hf(preset.hf_config)
    weights = random_weights(cfg, seed=preset.weight_seed, dtype=dtype, device=device,
                             init_std=preset.hf_config.get("initializer_range", 0.02))
    if spec.get("fingerprint"):
        problem = fingerprints_match(spec["fingerprint"], weights_fingerprint(weights))
        if problem:
            raise RuntimeError(f"redrawn weights are not the engine's: {problem}; the baselines would be measured "
                               "on other weights (is the child on the same device and torch as the engine?)")
    return preset, cfg, weights


# ----------------------------------------------------------------------------- Hugging Face
class StepClock:
    """A logits processor that only timestamps: HF calls it once per generated token, right
    after that step's forward, so consecutive stamps bracket one decode step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def build_hf_model(preset, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
    import transformers

    hf_config = {k: v for k, v in preset.hf_config.items() if k != "architectures"}
    config = transformers.LlamaConfig(**hf_config)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"HF model does not match the engine weights: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run_hf(spec: dict[str, Any], static: bool, emit) -> None:
    from transformers import LogitsProcessorList

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    preset, cfg, weights = load_weights(spec, device, dtype)
    model = build_hf_model(preset, weights, device, dtype)
    impl = "hf[static-cache]" if static else "hf[eager]"
    new_tokens = spec["new_tokens"]
    for batch in spec["batch_sizes"]:
        prompts = random_prompts(batch, spec["prompt_len"], cfg.vocab_size, seed=spec["prompt_seed"])
        input_ids = torch.tensor(prompts, device=device)
        kwargs = dict(attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        if static:
            kwargs["cache_implementation"] = "static"
        best = None
        for attempt in range(1 + spec.get("repeats", 1)):  # the first run warms up (and compiles)
            clock = StepClock(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids, logits_processor=LogitsProcessorList([clock]), **kwargs)
            print(f"  {impl} batch {batch} run {attempt}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
            if attempt == 0:
                continue
            steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
            row = point(impl, batch, steps, out[0, input_ids.shape[1]:].tolist())
            if best is None or (row["decode_tok_s"] or 0) > (best["decode_tok_s"] or 0):
                best = row
        emit(best)


# ----------------------------------------------------------------------------- plain PyTorch
def llama3_inv_freq(cfg, device: torch.device) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] with Llama 3's low-frequency stretching."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv_freq


class PlainLlama(torch.nn.Module):
    """A Llama decoder in plain PyTorch with a static KV cache [L, B, Hkv, S, D].

    ``prefill`` runs eagerly (causal SDPA over the prompt); ``decode`` takes one token per
    sequence at position ``pos`` (a 0-dim device tensor, so one compiled graph serves every
    step), attends over the whole static cache with a position mask, and returns the greedy
    next tokens [B]. Weights and caches are parameters/buffers: static addresses for CUDA graphs.
    """

    def __init__(self, cfg, weights: dict[str, torch.Tensor], batch: int, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        device, dtype = weights["model.embed_tokens.weight"].device, weights["model.embed_tokens.weight"].dtype
        self.w = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(t, requires_grad=False)
                                         for n, t in weights.items()})
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=dtype))
        angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), llama3_inv_freq(cfg, device))
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], -1).to(dtype))  # [S, D]
        self.register_buffer("sin", torch.cat([angles.sin(), angles.sin()], -1).to(dtype))
        self.max_len = max_len
        mark_static = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
        if mark_static is not None:
            # Fixed addresses for the CUDA graphs: the caches are mutated in place every step.
            for t in (self.k_cache, self.v_cache, self.cos, self.sin, *self.w.values()):
                mark_static(t)

    def p(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "__")]

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()
        return self.p(name) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """h: [B, T, H]; cos/sin broadcastable to [B, heads, T, D]; attend(i, q, k, v) -> [B, Hq, T, D]."""
        cfg = self.cfg
        B, T, _ = h.shape
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = self.norm(h, p + "input_layernorm.weight")
            q = F.linear(x, self.p(p + "self_attn.q_proj.weight")).view(B, T, -1, cfg.head_dim).transpose(1, 2)
            k = F.linear(x, self.p(p + "self_attn.k_proj.weight")).view(B, T, -1, cfg.head_dim).transpose(1, 2)
            v = F.linear(x, self.p(p + "self_attn.v_proj.weight")).view(B, T, -1, cfg.head_dim).transpose(1, 2)
            o = attend(i, self.rotate(q, cos, sin), self.rotate(k, cos, sin), v)  # [B, Hq, T, D]
            h = h + F.linear(o.transpose(1, 2).reshape(B, T, -1), self.p(p + "self_attn.o_proj.weight"))
            x = self.norm(h, p + "post_attention_layernorm.weight")
            gate = F.linear(x, self.p(p + "mlp.gate_proj.weight"))
            up = F.linear(x, self.p(p + "mlp.up_proj.weight"))
            h = h + F.linear(F.silu(gate) * up, self.p(p + "mlp.down_proj.weight"))
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        lm = self.p("model.embed_tokens.weight") if self.cfg.tie_word_embeddings else self.p("lm_head.weight")
        return F.linear(self.norm(h, "model.norm.weight"), lm).argmax(-1)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, P] -> next tokens [B]; fills cache positions [0, P)."""
        P = ids.shape[1]
        cos, sin = self.cos[:P], self.sin[:P]

        def attend(i, q, k, v):
            self.k_cache[i, :, :, :P] = k
            self.v_cache[i, :, :, :P] = v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        h = self.layers(F.embedding(ids, self.p("model.embed_tokens.weight")), cos, sin, attend)
        return self.head(h[:, -1])

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [B], pos 0-dim int64 (the position of these tokens) -> next tokens [B]."""
        cos = self.cos.index_select(0, pos.view(1))  # [1, D]
        sin = self.sin.index_select(0, pos.view(1))
        visible = (torch.arange(self.max_len, device=tokens.device) <= pos).view(1, 1, 1, -1)  # [1, 1, 1, S]

        def attend(i, q, k, v):
            self.k_cache[i].index_copy_(2, pos.view(1), k)
            self.v_cache[i].index_copy_(2, pos.view(1), v)
            return F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=visible,
                                                  enable_gqa=True)

        h = self.layers(F.embedding(tokens[:, None], self.p("model.embed_tokens.weight")), cos, sin, attend)
        return self.head(h[:, -1])


def run_torch_compile(spec: dict[str, Any], emit) -> None:
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    _, cfg, weights = load_weights(spec, device, dtype)
    new_tokens, prompt_len = spec["new_tokens"], spec["prompt_len"]
    max_len = prompt_len + new_tokens + 1
    mode = spec.get("compile_mode", "reduce-overhead")
    mark_step = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None) if mode != "none" else None
    for batch in spec["batch_sizes"]:
        model = PlainLlama(cfg, weights, batch, max_len)
        step = torch.compile(model.decode, mode=mode, fullgraph=True, dynamic=False) if mode != "none" else model.decode
        prompts = random_prompts(batch, prompt_len, cfg.vocab_size, seed=spec["prompt_seed"])
        ids = torch.tensor(prompts, device=device)
        best = None
        for attempt in range(1 + spec.get("repeats", 1)):  # the first run compiles and records graphs
            t0 = time.perf_counter()
            with torch.inference_mode():
                tok = model.prefill(ids)
                generated = [tok.tolist()]
                sync(device)
                stamps = [time.perf_counter()]
                for i in range(new_tokens - 1):
                    pos = torch.tensor(prompt_len + i, device=device)
                    if mark_step is not None:
                        mark_step()  # a new iteration for CUDA graph trees (inference loop, no backward)
                    tok = step(tok, pos).clone()  # clone: the graph's output buffer is reused next replay
                    generated.append(tok.tolist())  # host readback each step, as a serving loop does
                    stamps.append(time.perf_counter())
            print(f"  torch.compile batch {batch} run {attempt}: {time.perf_counter() - t0:.1f}s", file=sys.stderr,
                  flush=True)
            if attempt == 0:
                continue
            steps = [b - a for a, b in zip(stamps, stamps[1:])]
            row = point(f"torch.compile[{mode}]", batch, steps, [g[0] for g in generated])
            if best is None or (row["decode_tok_s"] or 0) > (best["decode_tok_s"] or 0):
                best = row
        emit(best)
        del model, step
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- main
RUNNERS = {
    "hf-eager": lambda spec, emit: run_hf(spec, False, emit),
    "hf-static": lambda spec, emit: run_hf(spec, True, emit),
    "torch-compile": run_torch_compile,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", choices=sorted(RUNNERS))
    parser.add_argument("spec", help="spec JSON written by bench_decode")
    parser.add_argument("out", help="JSON-lines file; one line per measured point is appended")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    out_path = Path(args.out)

    def emit(row: dict[str, Any] | None) -> None:
        if row is None:
            return
        with out_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"  {row['impl']} batch {row['batch']}: {row['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)

    torch.manual_seed(0)
    try:
        RUNNERS[args.baseline](spec, emit)
    except Exception as exc:  # record the failure for the parent, then fail loudly
        with out_path.open("a") as f:
            f.write(json.dumps({"impl": args.baseline, "error": repr(exc), "traceback": traceback.format_exc()[-4000:]})
                    + "\n")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
