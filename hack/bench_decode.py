#!/usr/bin/env python3
"""Decode throughput of the engine next to Hugging Face transformers and torch.compile on the
same weights, against the memory-bandwidth floor.

Data flow (default mode):
  ceilings: device-to-device copy bandwidth (and bf16 matmul rate) measured in this run
  -> floor: bytes a decode step must read (every weight once + the KV cache at the mean
     context) / copy bandwidth (or FLOPs / matmul rate if larger), per batch size
  -> one engine (the preset's seeded random weights); for each recipe (hot-swapped, graphs
     re-captured) and batch size: B seeded random prompts, greedy, --new-tokens each, timed per
     step after every request's first token -> rows
  -> agreement check (engine/verify/agreement.py): the best recipe and the stock pass in the
     engine's dtype, teacher-forced on the float32 stock pass's tokens (same weights upcast), are
     scored on the same positions; the recipe may not round worse than the stock pass; each
     path's free-running greedy tokens are reported beside it
  -> baselines, each in a process of its own (hack/decode_baselines.py; the engine is never
     used again after another framework ran in its process): HF eager, torch.compile with CUDA
     graphs (plain PyTorch model), HF static cache
  -> a table on stdout, JSON (commit, GPU, command, ceilings, floor, every figure) rewritten
     after every measured point, and a PNG plot under bench/results/.

--curve: the best recipe and HF static cache at batch sizes 1..256 -> throughput against p90
  per-user tokens/s (1 / p90 inter-token latency); at equal p90 per-user tokens/s, our
  throughput over HF's (log-log interpolation of HF's curve), plotted.
--profile: per-kernel GPU time of one batch-1 decode step (torch.profiler over graph replays),
  kernels per step, GPU busy time against wall time per step, host time per step phase.

    # H200, the figures of record (each fits the 5-minute budget; see --time-budget)
    python3 hack/bench_decode.py
    python3 hack/bench_decode.py --curve
    python3 hack/bench_decode.py --profile
    # CPU smoke test
    python3 hack/bench_decode.py --device cpu --model tiny-llama --batch-sizes 1,2 --prompt-len 16 \\
        --new-tokens 16 --out-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.forward_pass.bundle import STOCK_BUNDLE_DIR
from shapeshift.engine.forward_pass.importer import build_forward_pass, load_bundle
from shapeshift.engine.core.kv_cache import bytes_per_token
from shapeshift.engine.core.llm_engine import LLMEngine
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.verify.agreement import judge, teacher_forced
from shapeshift.kernels.checks import pdl_families

REPO_ROOT = Path(__file__).resolve().parent.parent
BASELINES_SCRIPT = Path(__file__).resolve().parent / "decode_baselines.py"
sys.path.insert(0, str(BASELINES_SCRIPT.parent))
import decode_baselines as baselines  # noqa: E402  (sibling script: prompts, fingerprint, percentiles)
from benchmeta import claim_result_name, git_commit, hardware_slug, result_name  # noqa: E402  (sibling module)

# The serving recipes (engine/forward_pass/recipes.py); the plain-torch one is "stock" here, the name its
# rows carry in recorded results.
RECIPES: dict[str, dict[str, Any]] = {("stock" if name == "torch" else name): knobs
                                      for name, knobs in NAMED_RECIPES.items()}
BEST_RECIPE = "fast"
BASELINE_ORDER = ("hf-eager", "torch-compile", "hf-static")
BASELINE_WEIGHT = {"hf-eager": 1.0, "torch-compile": 2.0, "hf-static": 3.0}  # time-budget shares
PROMPT_SEED = 100
CURVE_BATCH_SIZES = "1,2,4,8,16,32,64,128,256"


def needs_triton(knobs: dict[str, Any]) -> bool:
    """A recipe whose knobs switch on a Triton kernel (some *_backend: triton; every fusion knob of
    the Triton kernels needs one) cannot run without CUDA here (the interpreter is far too slow)."""
    return any(v == "triton" for k, v in knobs.items() if k.endswith("_backend"))


def recipe_with_overrides(spec: str) -> dict[str, Any]:
    """Knobs of a recipe spec: a named recipe, optionally followed by `+knob=value` overrides
    (e.g. `fast+fuse_gate_up_activation=false`), so one run can measure a knob against its
    recipe. Values are JSON (true, 4, "torch"), else taken as strings."""
    name, *overrides = spec.split("+")
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r} in {spec!r}; choose from {sorted(n for n in RECIPES if '+' not in n)}")
    knobs = dict(RECIPES[name])
    for item in overrides:
        knob, sep, raw = item.partition("=")
        if not sep or not knob:
            raise ValueError(f"recipe override {item!r} in {spec!r} is not knob=value")
        try:
            knobs[knob] = json.loads(raw)
        except json.JSONDecodeError:
            knobs[knob] = raw
    return knobs


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


# ----------------------------------------------------------------------------- results file
class Recorder:
    """The result document, rewritten (atomically) after every change so a crash or a kill
    half way keeps everything measured so far."""

    def __init__(self, path: Path, doc: dict[str, Any]) -> None:
        self.path = path
        self.doc = doc
        self.doc.setdefault("results", [])
        self.save()

    def add(self, row: dict[str, Any]) -> None:
        self.doc["results"].append(row)
        self.save()

    def set(self, key: str, value: Any) -> None:
        self.doc[key] = value
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


# ----------------------------------------------------------------------------- ceilings, floor
def measure_ceilings(device: torch.device) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second) and, on CUDA, the bf16 matmul rate."""
    if device.type != "cuda":
        n = 64 << 20
        src, dst = torch.ones(n // 4), torch.empty(n // 4)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return {"copy_gbps": 2 * n / sorted(times)[2] / 1e9, "matmul_tflops": None, "copy_bytes": 2 * n}
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = _time_cuda(lambda: dst.copy_(src), reps=10)
    del src, dst
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_ms = _time_cuda(lambda: a @ b, reps=10)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_gbps": 2 * n / (copy_ms * 1e-3) / 1e9, "matmul_tflops": 2 * size ** 3 / (mm_ms * 1e-3) / 1e12,
            "copy_bytes": 2 * n, "matmul_shape": [size, size, size]}


def _time_cuda(fn, reps: int) -> float:
    """Median milliseconds of fn() timed with CUDA events (after two warm-up calls)."""
    fn(), fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def step_traffic(engine: LLMEngine) -> dict[str, Any]:
    """Bytes every decode step must read regardless of batch (weights), KV bytes per cached
    token, and matmul FLOPs per token (2 per weight element of the projections and lm_head)."""
    cfg = engine.model_config
    weight_bytes = 0
    matmul_params = 0
    for name, t in engine.weights.items():
        nbytes = t.numel() * t.element_size()
        if name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            continue  # untied: decode gathers B rows only; the lm_head is counted on its own
        weight_bytes += nbytes
        if t.dim() >= 2:
            matmul_params += t.numel()
    # MoE: every expert is counted, although batch 1 reads only the routed ones; the floor
    # stays the dense upper bound.
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": bytes_per_token(cfg, engine.dtype),
            "matmul_flops_per_token": 2 * matmul_params}


def floor_tok_s(traffic: dict[str, Any], ceilings: dict[str, Any], batch: int, mean_context: float) -> dict[str, float]:
    bytes_step = traffic["weight_bytes"] + batch * mean_context * traffic["kv_bytes_per_token"]
    t_bytes = bytes_step / (ceilings["copy_gbps"] * 1e9)
    t_flops = 0.0
    if ceilings.get("matmul_tflops"):
        t_flops = batch * traffic["matmul_flops_per_token"] / (ceilings["matmul_tflops"] * 1e12)
    t = max(t_bytes, t_flops)
    return {"floor_ms_per_step": 1e3 * t, "floor_tok_s": batch / t, "floor_bytes_per_step": bytes_step,
            "floor_bound": "bytes" if t_bytes >= t_flops else "flops"}


# ----------------------------------------------------------------------------- engine
def make_engine(args, device: torch.device, max_batch: int, max_model_len: int, recipe: str) -> LLMEngine:
    block_size = 16
    config = EngineConfig(
        model=args.model, device=str(device), dtype=args.dtype, max_num_seqs=max_batch, max_model_len=max_model_len,
        block_size=block_size, num_kv_blocks=max_batch * (max_model_len // block_size) + 8,
        # One prefill step for every prompt: all requests start decoding together.
        max_num_batched_tokens=min(65536, max(2048, max_batch * args.prompt_len)),
        enforce_eager=args.enforce_eager, cuda_graph_context_lens=[max_model_len],
        # Every run prefills its prompts in full: with prefix caching, a repeat (or the next
        # decode_steps setting) would reuse the first run's prompt blocks and start from a
        # prefill computed another way, and bf16 greedy tokens then differ for that reason alone.
        enable_prefix_caching=False, chunk_graph_max_batch=args.chunk_graph_max_batch,
        forward_pass_recipe=RECIPES[recipe] or None)
    return LLMEngine(config)


def engine_decode(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Greedy decode of every prompt; per-step wall times after every request's first token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tag = time.monotonic_ns()
    ids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    have_first: set[str] = set()
    outputs: dict[str, list[int]] = {}
    while len(have_first) < len(ids):
        for o in engine.step():
            have_first.add(o.request_id)
            if o.finished:
                outputs[o.request_id] = o.output_token_ids
    baselines.sync(engine.device)
    decoded = 0
    step_times: list[float] = []
    batch_sizes: list[int] = []
    widths: list[int] = []  # tokens each request got from one engine.step() (k with multi-step decode)
    last = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        step_times.append(now - last)
        batch_sizes.append(len(outs))
        widths.append(max((len(o.new_token_ids) for o in outs), default=1) or 1)
        last = now
        for o in outs:
            decoded += len(o.new_token_ids)
            if o.finished:
                outputs[o.request_id] = o.output_token_ids
    elapsed = sum(step_times)
    if not step_times or elapsed <= 0:
        raise ValueError(f"no decode steps were timed (new tokens {new_tokens}); use --new-tokens >= 2")
    per_token_steps = [t / w for t, w in zip(step_times, widths)]  # one decode step's share of each
    full = [t for t, b in zip(per_token_steps, batch_sizes) if b == len(prompts)] or per_token_steps
    itl_p50, itl_p90 = baselines.percentile(full, 50), baselines.percentile(full, 90)
    # ms_per_step is per decode step (token per sequence), however many an engine.step() ran.
    return {"decode_tok_s": decoded / elapsed, "ms_per_step": 1e3 * elapsed / sum(widths),
            "engine_steps": len(step_times),
            "itl_p50_ms": 1e3 * itl_p50, "itl_p90_ms": 1e3 * itl_p90, "p90_per_user_tok_s": 1.0 / itl_p90,
            "steps": len(step_times), "outputs": [outputs[rid] for rid in ids]}


def measure_recipe(engine: LLMEngine, recipe: str, batch_sizes: list[int], args, rec: Recorder,
                   traffic, ceilings, mean_context: float, impl_prefix: str = "shapeshift",
                   decode_steps: int = 1, overlap: bool = False) -> dict[int, list[int]]:
    """Rows for one recipe at every batch size; returns batch -> greedy tokens of prompt 0.

    ``decode_steps`` > 1 runs the engine's multi-step decode (k steps per host round trip);
    its rows are named ``shapeshift[<recipe>+k<k>]``, or ``+k<k>o`` with ``overlap`` (the next
    chunk launched before the host reads the current one: EngineConfig.overlap_decode).
    """
    engine.set_runtime_settings({"decode_steps": decode_steps, "overlap_decode": overlap})  # chunk graphs follow
    label = recipe if decode_steps == 1 else f"{recipe}+{steps_label(decode_steps, overlap)}"
    vocab = engine.model_config.vocab_size
    engine_decode(engine, baselines.random_prompts(min(batch_sizes), args.prompt_len, vocab, seed=1), 8)  # warm-up
    first_tokens = {}
    for batch in batch_sizes:
        best = None
        for rep in range(args.repeats):
            m = engine_decode(engine, baselines.random_prompts(batch, args.prompt_len, vocab, seed=PROMPT_SEED),
                              args.new_tokens)
            if best is None or m["decode_tok_s"] > best["decode_tok_s"]:
                best = m
        first_tokens[batch] = best.pop("outputs")[0]
        row = {"impl": f"{impl_prefix}[{label}]", "batch": batch, "decode_steps": decode_steps,
               "overlap_decode": overlap, **best, "per_seq_tok_s": best["decode_tok_s"] / batch,
               "cuda_graphs": bool(engine.runner.graphs), "greedy_tokens_row0": first_tokens[batch]}
        add_floor_share(row, traffic, ceilings, mean_context)
        rec.add(row)
        log(f"{row['impl']} batch {batch}: {row['decode_tok_s']:.1f} tok/s "
            f"({row['ms_per_step']:.3f} ms/step, {100 * row['share_of_floor']:.1f}% of floor)")
    return first_tokens


def steps_label(k: int, overlap: bool) -> str:
    return f"k{k}{'o' if overlap else ''}"


def parse_decode_steps(spec: str) -> list[tuple[int, bool]]:
    """--decode-steps "1,8,8o" -> [(1, False), (8, False), (8, True)]: k, and whether the
    chunks overlap the host's work ("o": EngineConfig.overlap_decode, k >= 2)."""
    out = []
    for item in (i.strip() for i in spec.split(",") if i.strip()):
        overlap = item.endswith("o")
        try:
            k = int(item[:-1] if overlap else item)
        except ValueError:
            raise ValueError(f"--decode-steps: {item!r} is not a step count (e.g. 8) or an overlapped one (8o)") from None
        if k < 1 or (overlap and k < 2):
            raise ValueError(f"--decode-steps: {item!r} needs k >= 1 (k >= 2 to overlap)")
        out.append((k, overlap))
    if not out:
        raise ValueError("--decode-steps: give at least one step count")
    return out


def add_floor_share(row: dict[str, Any], traffic, ceilings, mean_context: float) -> None:
    if row.get("decode_tok_s") and ceilings:
        f = floor_tok_s(traffic, ceilings, row["batch"], mean_context)
        row["floor_tok_s"] = f["floor_tok_s"]
        row["share_of_floor"] = row["decode_tok_s"] / f["floor_tok_s"]


# ----------------------------------------------------------------------------- agreement check
def agreement_check(engine: LLMEngine, recipe: str, args, device: torch.device) -> dict[str, Any]:
    """``recipe`` (the engine's current pass) against the float32 stock pass on the same weights
    upcast, with the stock pass in the engine's dtype as the control (what rounding alone does).

    teacher-forced (the verdict, engine/verify/agreement.py): both paths decode the prompts on
      the float32 reference's tokens, as many at a time as the engine would batch them; on the
      same positions, the recipe's p99 and RMS logit errors must stay within 1.25x the control's
      and no argmax clearer than twice the control's largest error (at least --check-tolerance)
      may flip.
    free-running (reported, not judged): each path's own greedy tokens from the engine, compared
      with the reference's token for token; random-weight logits are full of near-ties, so any
      two half-precision paths part after a few tokens.
    Leaves the engine on the stock pass (the caller does not use it again).
    """
    cfg = engine.model_config
    prompts = baselines.random_prompts(args.check_prompts, args.prompt_len, cfg.vocab_size, seed=7)
    batch = min(len(prompts), engine.config.max_num_seqs)  # the batch shape the engine decodes them in
    params = SamplingParams(max_tokens=args.check_tokens, temperature=0.0, ignore_eos=True)
    candidate_fp = engine.forward_pass
    free = {recipe: engine.generate(prompts, params)}
    stock_bundle = load_bundle(STOCK_BUNDLE_DIR, RECIPES["stock"])
    stock_fp = build_forward_pass(stock_bundle, cfg, engine.weights)
    if recipe != "stock":
        engine.set_forward_pass(stock_bundle, stock_fp)
        free["stock"] = engine.generate(prompts, params)
    ref_fp = build_forward_pass(stock_bundle, cfg, {name: t.float() for name, t in engine.weights.items()})
    ref_tokens, ref = teacher_forced(ref_fp, cfg, torch.float32, device, prompts, args.check_tokens, len(prompts))
    del ref_fp

    def forced(fp) -> list[torch.Tensor]:
        return teacher_forced(fp, cfg, engine.dtype, device, prompts, args.check_tokens, batch, ref_tokens)[1]

    verdict = judge(ref, forced(candidate_fp), forced(stock_fp), min_clear_margin=args.check_tolerance)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    def free_running(outputs: list[list[int]]) -> dict[str, Any]:
        prefix = [baselines_common_prefix(mine, theirs) for mine, theirs in zip(outputs, ref_tokens)]
        return {"identical_prompts": sum(p == len(o) for p, o in zip(prefix, outputs)), "prefix_match": prefix}

    return {"recipe": recipe, "reference": "stock forward pass, float32, same weights upcast",
            "control": f"stock forward pass in {str(engine.dtype).replace('torch.', '')}",
            "prompts": len(prompts), "tokens_per_prompt": args.check_tokens, "batch": batch,
            "passed": verdict["passed"], "failures": verdict["failures"], "limits": verdict["limits"],
            "error_factor": verdict["error_factor"], "teacher_forced": verdict["candidate"],
            "control_result": verdict["control"],
            "free_running": {name: free_running(outputs) for name, outputs in free.items()}}


def baselines_common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------- baselines
def run_baseline(name: str, spec: dict[str, Any], workdir: Path, timeout: float) -> list[dict[str, Any]]:
    """Run one baseline in its own process; returns every point it finished (also on timeout)."""
    spec_path = workdir / f"{name}.spec.json"
    out_path = workdir / f"{name}.jsonl"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONSAFEPATH="1")
    log(f"baseline {name}: starting (time limit {timeout:.0f}s)")
    t0 = time.perf_counter()
    status = "ok"
    try:
        proc = subprocess.run([sys.executable, str(BASELINES_SCRIPT), name, str(spec_path), str(out_path)],
                              env=env, timeout=max(1.0, timeout), stdout=subprocess.PIPE, stderr=None, text=True)
        if proc.returncode != 0:
            status = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timeout after {timeout:.0f}s"
    rows = []
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    log(f"baseline {name}: {status} in {time.perf_counter() - t0:.0f}s, {sum('error' not in r for r in rows)} points")
    if status != "ok" and not any("error" in r for r in rows):
        rows.append({"impl": name, "error": status})
    return rows


def baseline_spec(args, device: torch.device, dtype: str, batch_sizes: list[int], new_tokens: int,
                  fingerprint: dict[str, float]) -> dict[str, Any]:
    """What a baseline process needs; ``dtype`` is the engine's ("bfloat16", ...)."""
    return {"model": args.model, "device": str(device), "dtype": dtype,
            "batch_sizes": batch_sizes, "prompt_len": args.prompt_len, "new_tokens": new_tokens,
            "prompt_seed": PROMPT_SEED, "fingerprint": fingerprint, "repeats": 1,
            "compile_mode": "reduce-overhead" if device.type == "cuda" else "none"}


# ----------------------------------------------------------------------------- curve
def spread_order(values: list[int]) -> list[int]:
    """[1, 2, 4, ..., 256] -> [1, 256, 16, 2, 4, ...]: ends first, then repeated midpoints."""
    ordered = sorted(values)
    if len(ordered) <= 2:
        return ordered
    out = [ordered[0], ordered[-1]]
    spans = [(0, len(ordered) - 1)]
    while spans:
        lo, hi = spans.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        out.append(ordered[mid])
        spans += [(lo, mid), (mid, hi)]
    return out + [v for v in ordered if v not in out]


def curve_comparison(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At each of our points, our throughput over HF's at the same p90 per-user tokens/s
    (HF's curve interpolated log-log between its measured points; no extrapolation)."""
    pts = sorted((r["p90_per_user_tok_s"], r["decode_tok_s"]) for r in theirs
                 if r.get("p90_per_user_tok_s") and r.get("decode_tok_s"))
    out = []
    for r in ours:
        x = r.get("p90_per_user_tok_s")
        if not x or not r.get("decode_tok_s"):
            continue
        hf = None
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= x <= x1:
                w = 0.0 if x1 == x0 else (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
                hf = math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
                break
        note = None
        if hf is None and pts:
            note = (f"HF never reaches this per-user rate (its best is {pts[-1][0]:.1f})" if x > pts[-1][0]
                    else f"below HF's lowest measured per-user rate ({pts[0][0]:.1f})")
        out.append({"kind": "ours_vs_hf_interpolated", "batch": r["batch"], "p90_per_user_tok_s": x,
                    "ours_tok_s": r["decode_tok_s"], "hf_tok_s_at_same_per_user": hf,
                    "ratio": r["decode_tok_s"] / hf if hf else None, "note": note})
    return out


def curve_dominance(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each HF point, our best throughput among points at least as interactive (p90
    per-user tok/s >= HF's): a lower bound on our throughput at HF's per-user rate, since
    throughput falls as per-user rate rises. Needs no interpolation."""
    out = []
    for h in sorted(theirs, key=lambda r: r["batch"]):
        x, y = h.get("p90_per_user_tok_s"), h.get("decode_tok_s")
        if not x or not y:
            continue
        eligible = [r for r in ours if (r.get("p90_per_user_tok_s") or 0) >= x and r.get("decode_tok_s")]
        best = max(eligible, key=lambda r: r["decode_tok_s"], default=None)
        out.append({"kind": "ours_at_least_as_interactive", "hf_batch": h["batch"], "hf_p90_per_user_tok_s": x,
                    "hf_tok_s": y, "ours_batch": best["batch"] if best else None,
                    "ours_p90_per_user_tok_s": best["p90_per_user_tok_s"] if best else None,
                    "ours_tok_s": best["decode_tok_s"] if best else None,
                    "ratio_lower_bound": best["decode_tok_s"] / y if best else None})
    return out


# ----------------------------------------------------------------------------- profile
KERNEL_CATEGORIES = (
    ("gemv / gemm", ("gemv", "gemm", "cutlass", "sm90_xmma", "ampere", "cublas", "splitk", "matmul", "nvjet")),
    ("attention", ("attention", "attn", "flash", "fmha", "sdpa")),
    ("norm", ("rmsnorm", "norm")),
    ("rotary / kv write", ("rope", "rotary", "index_copy", "kv_write")),
    ("activation", ("silu", "act_and_mul")),
    ("sampling", ("argmax", "argmin", "sample", "reduce_kernel")),
    ("copy / cast", ("memcpy", "memset", "copy", "cast", "elementwise", "fill")),
    ("embedding / gather", ("embedding", "index", "gather")),
)


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def profile_decode(engine: LLMEngine, args, steps: int = 20) -> dict[str, Any]:
    """Per-kernel GPU time of decode steps at batch --profile-batch (after the prompts), averaged per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.model_config.vocab_size
    rows_per_step = args.profile_batch
    prompts = baselines.random_prompts(rows_per_step, args.prompt_len, vocab, seed=PROMPT_SEED)
    tokens_per_step = max(1, engine.config.decode_steps)  # an engine step of multi-step decode makes k tokens
    total = (3 * steps + 8) * tokens_per_step
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
    while any(len(s.output_token_ids) < 3 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills, first decode steps (lazy init)
    engine.step()
    baselines.sync(engine.device)
    # Wall time per step without the profiler, and host time per phase of a step.
    phases = {"schedule": 0.0, "run (incl. GPU wait)": 0.0, "postprocess": 0.0}
    seen_rows = 0
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = engine.scheduler.schedule()
        seen_rows += len(batch.seqs)
        t1 = time.perf_counter()
        out = engine.runner.run(batch)
        t2 = time.perf_counter()
        engine.scheduler.postprocess(batch, out)
        t3 = time.perf_counter()
        phases["schedule"] += t1 - t0
        phases["run (incl. GPU wait)"] += t2 - t1
        phases["postprocess"] += t3 - t2
    wall_ms = 1e3 * (time.perf_counter() - t_start) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    replays = engine.runner.num_graph_replays
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        baselines.sync(engine.device)
    made = (engine.runner.num_graph_replays - replays) * rows_per_step  # tokens the GPU made in the window
    while engine.has_unfinished_requests():
        engine.step()
    kernels: dict[str, dict[str, float]] = {}
    spans = []
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        k = kernels.setdefault(e.name, {"calls": 0, "us": 0.0})
        k["calls"] += 1
        k["us"] += us
        spans.append((e.time_range.start, e.time_range.end, e.name))
    rows = sorted(({"kernel": n, "calls_per_step": v["calls"] / steps, "us_per_step": v["us"] / steps,
                    "category": categorize(n)} for n, v in kernels.items()), key=lambda r: -r["us_per_step"])
    busy = sum(r["us_per_step"] for r in rows)
    by_category: dict[str, dict[str, float]] = {}
    for r in rows:
        c = by_category.setdefault(r["category"], {"us_per_step": 0.0, "kernels_per_step": 0.0})
        c["us_per_step"] += r["us_per_step"]
        c["kernels_per_step"] += r["calls_per_step"]
    return {"batch": rows_per_step, "mean_rows_per_step": seen_rows / steps, "steps": steps, "wall_ms_per_step": wall_ms, "gpu_busy_us_per_step": busy,
            "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "host_ms_per_step": {k: 1e3 * v / steps for k, v in phases.items()},
            "by_category": by_category, "kernels": rows, "cuda_graphs": bool(engine.runner.graphs),
            "decode_steps": engine.config.decode_steps, "overlap_decode": engine.config.overlap_decode,
            "timeline": gpu_timeline(spans, made)}


def gpu_timeline(spans: list[tuple[float, float, str]], tokens: int, top: int = 12) -> dict[str, Any]:
    """Where the GPU idles in a profiled window: spans (start_us, end_us, kernel) of every GPU
    event, tokens made in the window (summed over rows). Busy is the union of the spans; each
    idle gap (the next span starting after everything before it ended) is charged to the pair
    (kernel that ended last, kernel that starts). Per token: span of the window, busy, idle."""
    if not spans or not tokens:
        return {"tokens": tokens}
    spans = sorted(spans)
    busy = idle = 0.0
    end, last = spans[0][0], spans[0][2]
    pairs: dict[tuple[str, str], list[float]] = {}
    for start, stop, name in spans:
        if start > end:
            gap = start - end
            idle += gap
            pair = pairs.setdefault((last, name), [0, 0.0])
            pair[0] += 1
            pair[1] += gap
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, last = stop, name
    window = end - spans[0][0]
    worst = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    return {"tokens": tokens, "window_us_per_token": window / tokens, "busy_us_per_token": busy / tokens,
            "idle_us_per_token": idle / tokens,
            "idle_by_pair": [{"after": a, "before": b, "gaps_per_token": n / tokens, "us_per_token": us / tokens}
                             for (a, b), (n, us) in worst]}


def print_profile(name: str, p: dict[str, Any]) -> None:
    print(f"\nprofile {name}: batch {p.get('batch', 1)}, {p['steps']} steps, CUDA graphs {p['cuda_graphs']}: wall "
          f"{p['wall_ms_per_step']:.3f} ms/step, GPU busy {p['gpu_busy_us_per_step']:.1f} us/step, "
          f"{p['kernels_per_step']:.1f} kernels/step")
    print("  host per step: " + ", ".join(f"{k} {v:.3f} ms" for k, v in p["host_ms_per_step"].items()))
    t = p.get("timeline") or {}
    if t.get("tokens"):
        print(f"  profiled window ({p.get('decode_steps', 1)} steps a round trip, overlap {p.get('overlap_decode')}): "
              f"{t['tokens']} tokens, {t['window_us_per_token']:.1f} us a token on the GPU's clock, busy "
              f"{t['busy_us_per_token']:.1f}, idle {t['idle_us_per_token']:.1f}; idle by kernel pair (us a token):")
        for g in t["idle_by_pair"]:
            print(f"    {g['us_per_token']:7.2f} us ({g['gaps_per_token']:.2f} gaps) after {g['after'][:45]} "
                  f"before {g['before'][:45]}")
    print(f"  {'category':<22}{'us/step':>10}{'kernels':>9}{'share':>8}")
    for c, v in sorted(p["by_category"].items(), key=lambda kv: -kv[1]["us_per_step"]):
        share = v["us_per_step"] / max(p["gpu_busy_us_per_step"], 1e-9)
        print(f"  {c:<22}{v['us_per_step']:>10.1f}{v['kernels_per_step']:>9.1f}{100 * share:>7.1f}%")
    print(f"  {'kernel':<70}{'calls':>7}{'us/step':>10}{'us/call':>9}")
    for r in p["kernels"][:40]:
        per_call = r["us_per_step"] / max(r["calls_per_step"], 1e-9)
        print(f"  {r['kernel'][:69]:<70}{r['calls_per_step']:>7.1f}{r['us_per_step']:>10.1f}{per_call:>9.2f}")


# ----------------------------------------------------------------------------- plots
def plot(out_png: Path, doc: dict[str, Any], mode: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib missing ({exc})"
    rows = [r for r in doc["results"] if r.get("decode_tok_s")]
    fig, ax = plt.subplots(figsize=(9, 6))
    title = f"{doc['model']} decode on {doc['gpu']} ({doc['dtype']}), commit {doc['git_commit'][:10]}"
    if mode == "curve":
        for impl in sorted({r["impl"] for r in rows}):
            pts = sorted((r["p90_per_user_tok_s"], r["decode_tok_s"], r["batch"]) for r in rows
                         if r["impl"] == impl and r.get("p90_per_user_tok_s"))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            for x, y, b in pts:
                ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        floor = doc.get("floor_curve") or []
        if floor:
            ax.plot([f["per_user_tok_s"] for f in floor], [f["tok_s"] for f in floor], linestyle="--", color="gray",
                    label="memory-bandwidth floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("p90 per-user tokens/s (1 / p90 inter-token latency)")
        ax.set_ylabel("throughput, tokens/s (all users)")
        ax.set_title(title + "\nlabels: batch size", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    else:
        batches = sorted({r["batch"] for r in rows})
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        width = 0.8 / max(1, len(batches))
        for j, batch in enumerate(batches):
            vals = [next((r["decode_tok_s"] for r in rows if r["impl"] == i and r["batch"] == batch), 0) for i in impls]
            xs = [i + j * width for i in range(len(impls))]
            ax.bar(xs, vals, width=width, label=f"batch {batch}")
            floor = next((r.get("floor_tok_s") for r in rows if r["batch"] == batch and r.get("floor_tok_s")), None)
            if floor:
                ax.axhline(floor, linestyle="--", color=f"C{j}", alpha=0.6)
                ax.annotate(f"floor b{batch}: {floor:.0f}", (len(impls) - 0.9, floor), fontsize=8)
        ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(impls))])
        ax.set_xticklabels(impls, rotation=20, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b-shape", help="a random preset (baselines redraw its weights)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-sizes", default=None, help=f"default 1,32; --curve: {CURVE_BATCH_SIZES}")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=None, help="engine tokens per request (default 256; "
                        "--curve 128)")
    parser.add_argument("--baseline-new-tokens", type=int, default=128,
                        help="tokens per request for the HF / torch.compile baselines (rates need fewer)")
    parser.add_argument("--recipes", default=None,
                        help=f"comma list of {sorted(RECIPES)} (default stock,triton,{BEST_RECIPE}; --curve: "
                             f"{BEST_RECIPE}; --profile: stock,triton,gemv,{BEST_RECIPE}), each optionally with "
                             "+knob=value overrides (fast+fuse_gate_up_activation=false); Triton recipes are "
                             "skipped without CUDA")
    parser.add_argument("--recipe-file", default=None,
                        help="JSON object {name: knobs} of more recipes to measure by name in --recipes (e.g. "
                             "per-shape gemv_configs); they may also take +knob=value overrides")
    parser.add_argument("--decode-steps", default=None,
                        help="comma list of EngineConfig.decode_steps values measured per recipe (multi-step "
                             "decode: k greedy steps per host round trip), e.g. 1,8; a trailing o (8o) also "
                             "overlaps the host's work with the next chunk (EngineConfig.overlap_decode). "
                             "Default: 1,8o for the table, 8o for --curve, 1 for --profile")
    parser.add_argument("--repeats", type=int, default=2, help="engine runs per point (best is reported)")
    parser.add_argument("--baselines", default=",".join(BASELINE_ORDER),
                        help=f"comma list of {list(BASELINE_ORDER)} or 'none'; each runs in its own process")
    parser.add_argument("--skip-hf", action="store_true", help="drop the hf-* baselines")
    parser.add_argument("--compile-batch-sizes", default="1",
                        help="batch sizes of the torch.compile baseline (each one compiles anew); '' = --batch-sizes")
    parser.add_argument("--skip-check", action="store_true", help="skip the float32 agreement check")
    parser.add_argument("--check-recipe", default=None,
                        help=f"recipe spec the agreement check runs (default: {BEST_RECIPE} when measured, else the "
                             "first of triton, fused, stock measured, else the last recipe)")
    parser.add_argument("--check-prompts", type=int, default=16,
                        help="prompts of the agreement check (x --check-tokens teacher-forced positions); they "
                             "decode together up to the largest --batch-sizes, as the engine would batch them")
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument("--check-tolerance", type=float, default=0.05,
                        help="least reference top-2 margin (logits) counted as a clear argmax that must not "
                             "flip; the check raises it to twice the bf16 control's largest logit error")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds for the whole run; baselines get what is left (each point is saved)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    parser.add_argument("--chunk-graph-max-batch", type=int, default=EngineConfig.chunk_graph_max_batch,
                        help="EngineConfig.chunk_graph_max_batch: batches up to this size replay one graph per chunk "
                             "of multi-step decode (0: a graph launch per step; default %(default)s)")
    parser.add_argument("--curve", action="store_true", help="throughput vs p90 per-user tok/s, batch 1..256")
    parser.add_argument("--profile", action="store_true", help="per-kernel GPU time of a batch-1 decode step")
    parser.add_argument("--profile-batch", type=int, default=1,
                        help="--profile: sequences decoding together in the profiled steps (default 1)")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t_begin = time.perf_counter()
    parser, args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = PRESETS.get(args.model)
    if preset is None or not preset.is_random:
        parser.error(f"--model must be a random preset ({[n for n, p in PRESETS.items() if p.is_random]})")
    mode = "curve" if args.curve else "profile" if args.profile else "table"
    args.new_tokens = args.new_tokens or (128 if mode == "curve" else 256)
    batch_sizes = [int(b) for b in (args.batch_sizes or (CURVE_BATCH_SIZES if mode == "curve" else "1,32")).split(",")]
    if mode == "profile":
        batch_sizes = [args.profile_batch]
    default_recipes = {"table": f"stock,triton,{BEST_RECIPE}", "curve": BEST_RECIPE,
                       "profile": f"stock,triton,gemv,{BEST_RECIPE}"}[mode]
    if args.recipe_file:
        try:
            extra = json.loads(Path(args.recipe_file).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"--recipe-file {args.recipe_file}: {exc}")
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            parser.error(f"--recipe-file {args.recipe_file}: expected a JSON object of name -> knob object")
        clash = sorted(set(extra) & set(NAMED_RECIPES))
        if clash:
            parser.error(f"--recipe-file {args.recipe_file}: {clash} would replace named recipes; rename them")
        RECIPES.update(extra)
    recipes = [r for r in (args.recipes or default_recipes).split(",") if r]
    for r in recipes:
        try:
            RECIPES.setdefault(r, recipe_with_overrides(r))
        except ValueError as exc:
            parser.error(str(exc))
    if device.type != "cuda":
        skipped = [r for r in recipes if needs_triton(RECIPES[r])]
        if skipped:
            log(f"recipes {skipped} need CUDA (Triton) here; skipped")
        recipes = [r for r in recipes if not needs_triton(RECIPES[r])] or ["stock"]
    try:
        decode_steps = parse_decode_steps(args.decode_steps or {"table": "1,8o", "curve": "8o", "profile": "1"}[mode])
    except ValueError as exc:
        parser.error(str(exc))
    wanted_baselines = [] if args.baselines == "none" else [b for b in args.baselines.split(",") if b]
    for b in wanted_baselines:
        if b not in BASELINE_ORDER:
            parser.error(f"unknown baseline {b!r}; choose from {list(BASELINE_ORDER)}")
    if mode == "curve":
        wanted_baselines = [b for b in wanted_baselines if b == "hf-static"]
    if mode == "profile":
        wanted_baselines = []
    if args.skip_hf:
        wanted_baselines = [b for b in wanted_baselines if not b.startswith("hf-")]

    commit, dirty = git_commit()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    out_dir = Path(args.out_dir)
    benchmark = "decode" if mode == "table" else f"decode-{mode}"
    base_name = claim_result_name(out_dir, result_name(benchmark, args.model, hardware_slug(gpu)))
    out_json = out_dir / f"{base_name}.json"
    max_batch = max(batch_sizes)
    max_model_len = int(math.ceil((args.prompt_len + max(args.new_tokens, args.check_tokens) + 1) / 16) * 16)
    mean_context = args.prompt_len + args.new_tokens / 2
    rec = Recorder(out_json, {
        "benchmark": f"decode-{mode}", "git_commit": commit, "git_dirty": dirty, "gpu": gpu, "device": str(device),
        "torch": torch.__version__, "transformers": _version("transformers"), "triton": _version("triton"),
        "python": platform.python_version(),
        "command": " ".join(["python3", "hack/bench_decode.py"] + (argv if argv is not None else sys.argv[1:])),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "model": args.model,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "baseline_new_tokens": args.baseline_new_tokens,
        "batch_sizes": batch_sizes, "recipes": {r: RECIPES[r] for r in recipes}, "status": "running",
        # Engine switches read from the environment (diagnostics that change what is measured).
        "environment": {k: v for k, v in os.environ.items() if k.startswith("SHAPESHIFT_") and k != "SHAPESHIFT_GIT_COMMIT"},
        # The kernel families launched with programmatic dependent launch where the GPU allows it
        # (SHAPESHIFT_PDL, or its default when unset).
        "pdl_families": sorted(pdl_families())})
    log(f"{mode} run: {args.model} on {gpu}; results -> {out_json}")

    ceilings = measure_ceilings(device)
    rec.set("ceilings", ceilings)
    log(f"copy {ceilings['copy_gbps']:.0f} GB/s" + (f", bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s"
                                                     if ceilings.get("matmul_tflops") else ""))

    t0 = time.perf_counter()
    engine = make_engine(args, device, max_batch, max_model_len, recipes[0])
    rec.set("dtype", str(engine.dtype).replace("torch.", ""))
    rec.set("engine_config", {k: v for k, v in vars(engine.config).items() if k != "forward_pass_recipe"})
    traffic = step_traffic(engine)
    floors = {b: floor_tok_s(traffic, ceilings, b, mean_context) for b in batch_sizes}
    rec.set("floor", {"traffic": traffic, "mean_context": mean_context, "per_batch": floors})
    log(f"engine ready in {time.perf_counter() - t0:.1f}s (recipe {recipes[0]}, graphs {sorted(engine.runner.graphs)}); "
        f"floor at batch 1: {traffic['weight_bytes'] / 1e9:.3f} GB/step -> {floors[min(batch_sizes)]['floor_tok_s']:.0f} "
        f"tok/s ({floors[min(batch_sizes)]['floor_ms_per_step']:.3f} ms/step)")
    fingerprint = baselines.weights_fingerprint(engine.weights)

    if mode == "profile":
        profiles = {}
        engine.set_runtime_settings(dict(zip(("decode_steps", "overlap_decode"), decode_steps[0])))
        for recipe in recipes:
            if recipe != recipes[0]:
                engine.set_forward_pass(load_bundle(STOCK_BUNDLE_DIR, RECIPES[recipe]))
            try:
                p = profile_decode(engine, args)
                note = "eager decode (graph replays showed no kernels to the profiler)"
            except Exception as exc:  # a profiler that cannot trace graph replays: fall back to eager
                p, note = {"kernels_per_step": 0}, f"eager decode (profiling graph replays failed: {exc!r})"
                while engine.has_unfinished_requests():
                    engine.step()
            if p["kernels_per_step"] == 0 and engine.runner.graphs:
                log(f"profiling {note}")
                graphs = dict(engine.runner.graphs)
                engine.runner.graphs.clear()
                try:
                    p = profile_decode(engine, args)
                finally:
                    engine.runner.graphs.update(graphs)
                p["note"] = note
            profiles[recipe] = p
            rec.set("profiles", profiles)
            print_profile(recipe, p)
        rec.set("status", "complete")
        print(f"saved {out_json}")
        return 0

    first_tokens: dict[str, dict[int, list[int]]] = {}
    for index, recipe in enumerate(recipes):
        if index > 0:
            t0 = time.perf_counter()
            engine.set_forward_pass(load_bundle(STOCK_BUNDLE_DIR, RECIPES[recipe]))
            log(f"recipe {recipe}: built and captured in {time.perf_counter() - t0:.1f}s")
        for k, overlap in decode_steps:
            tokens = measure_recipe(engine, recipe, batch_sizes, args, rec, traffic, ceilings, mean_context,
                                    decode_steps=k, overlap=overlap)
            if (k, overlap) == decode_steps[0]:
                first_tokens[recipe] = tokens
            elif tokens != first_tokens[recipe]:
                log(f"recipe {recipe}: decode steps {steps_label(k, overlap)} gave other greedy tokens than "
                    f"{steps_label(*decode_steps[0])}")
                rec.add({"impl": f"shapeshift[{recipe}+{steps_label(k, overlap)}]",
                         "error": "greedy tokens differ from single steps"})
        engine.set_runtime_settings({"decode_steps": 1, "overlap_decode": False})

    best = args.check_recipe or next((r for r in (BEST_RECIPE, "triton", "fused", "stock") if r in recipes),
                                     recipes[-1])
    if not args.skip_check and mode == "table":
        t0 = time.perf_counter()
        if recipes[-1] != best:
            engine.set_forward_pass(load_bundle(STOCK_BUNDLE_DIR, recipe_with_overrides(best)))
        try:
            check = agreement_check(engine, best, args, device)
        except Exception as exc:  # keep the throughput figures
            check = {"recipe": best, "error": repr(exc), "passed": False}
        rec.set("agreement", check)
        log(f"agreement check ({time.perf_counter() - t0:.0f}s): {json.dumps({k: v for k, v in check.items() if k != 'per_prompt'})}")
    del engine  # never used again: the baselines below run in their own processes
    if device.type == "cuda":
        torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        todo = [b for b in BASELINE_ORDER if b in wanted_baselines]
        for index, name in enumerate(todo):
            # Each baseline gets its weighted share of the time left (compiles cost the most);
            # whatever one leaves unused passes to the next.
            total_left = args.time_budget - (time.perf_counter() - t_begin) - 5
            share = BASELINE_WEIGHT[name] / sum(BASELINE_WEIGHT[b] for b in todo[index:])
            left = min(total_left, max(45.0, total_left * share))  # at least enough for one point
            if left < 20:
                log(f"baseline {name}: skipped, time budget spent ({args.time_budget:.0f}s)")
                rec.add({"impl": name, "error": "skipped: time budget spent"})
                continue
            new_tokens = args.new_tokens if mode == "curve" else args.baseline_new_tokens
            # Curve: extremes first, then midpoints, so a timeout still leaves a spread of points.
            order = spread_order(batch_sizes) if mode == "curve" else batch_sizes
            if name == "torch-compile" and mode == "table":
                # One compile per batch size (tens of seconds each): batch 1 by default.
                order = [int(b) for b in args.compile_batch_sizes.split(",")] if args.compile_batch_sizes else order
            spec = baseline_spec(args, device, rec.doc["dtype"], order, new_tokens, fingerprint)
            for row in run_baseline(name, spec, Path(tmp), timeout=left):
                if "error" not in row:
                    add_floor_share(row, traffic, ceilings, mean_context)
                    ref = first_tokens.get("stock", next(iter(first_tokens.values()))).get(row["batch"])
                    if ref is not None and row.get("greedy_tokens_row0"):
                        row["greedy_prefix_match_vs_engine_stock"] = baselines_common_prefix(ref, row["greedy_tokens_row0"])
                        row["greedy_compared"] = min(len(ref), len(row["greedy_tokens_row0"]))
                rec.add(row)

    if mode == "curve":
        label = best if decode_steps[-1][0] == 1 else f"{best}+{steps_label(*decode_steps[-1])}"
        ours = [r for r in rec.doc["results"] if r["impl"] == f"shapeshift[{label}]"]
        theirs = [r for r in rec.doc["results"] if r["impl"] == "hf[static-cache]"]
        rec.set("curve_comparison", curve_comparison(ours, theirs))
        rec.set("curve_dominance", curve_dominance(ours, theirs))
        rec.set("floor_curve", [{"batch": b, "tok_s": f["floor_tok_s"], "per_user_tok_s": f["floor_tok_s"] / b}
                                for b, f in floors.items()])

    rec.set("status", "complete")
    rec.set("wall_seconds", time.perf_counter() - t_begin)
    print_table(rec.doc, floors, traffic, ceilings, mode)
    png = out_json.with_suffix(".png")
    problem = plot(png, rec.doc, mode)
    if problem:
        log(problem)
    else:
        rec.set("plot", png.name)
        print(f"saved {png}")
    print(f"saved {out_json}")
    return 0


def print_table(doc: dict[str, Any], floors, traffic, ceilings, mode: str) -> None:
    print(f"\n{doc['model']} decode, prompt {doc['prompt_len']}, {doc['new_tokens']} new tokens (baselines "
          f"{doc['baseline_new_tokens'] if mode == 'table' else doc['new_tokens']}), {doc['gpu']}, {doc['dtype']}, "
          f"commit {doc['git_commit'][:12]}{'+dirty' if doc['git_dirty'] else ''}")
    print(f"floor: {traffic['weight_bytes'] / 1e9:.3f} GB weights per step (+ KV at the mean context) / measured copy "
          f"{ceilings['copy_gbps']:.0f} GB/s")
    for b, f in floors.items():
        print(f"  batch {b:>4}: {f['floor_ms_per_step']:.3f} ms/step = {f['floor_tok_s']:.0f} tok/s ({f['floor_bound']})")
    print(f"{'implementation':<34}{'batch':>6}{'tok/s':>11}{'tok/s/seq':>11}{'ms/step':>9}{'p90 ITL':>9}{'floor':>8}")
    for row in doc["results"]:
        if "error" in row:
            print(f"{row['impl']:<34}{'':>6}  failed: {row['error'][:80]}")
            continue
        share = f"{100 * row['share_of_floor']:.1f}%" if row.get("share_of_floor") else ""
        print(f"{row['impl']:<34}{row['batch']:>6}{row['decode_tok_s']:>11.1f}{row['per_seq_tok_s']:>11.1f}"
              f"{row['ms_per_step']:>9.3f}{row['itl_p90_ms']:>9.3f}{share:>8}")
    check = doc.get("agreement")
    if check:
        if "error" in check:
            print(f"agreement check failed to run: {check['error']}")
        else:
            tf, ctl = check["teacher_forced"], check["control_result"]
            free = check["free_running"]
            print(f"agreement [{check['recipe']}] vs float32 stock, {check['prompts']} prompts x "
                  f"{check['tokens_per_prompt']} tokens teacher-forced at batch {check['batch']}: argmax-equal "
                  f"{tf['argmax_equal']}/{tf['positions']} ({check['control']}: {ctl['argmax_equal']}), p99 logit "
                  f"error {tf['p99_row_max_abs_logit_error']:.4f} ({ctl['p99_row_max_abs_logit_error']:.4f}), RMS "
                  f"{tf['rms_logit_error']:.4f} ({ctl['rms_logit_error']:.4f}), clear-argmax flips "
                  f"{tf['clear_argmax_flips']}/{tf['clear_argmax_positions']} above {tf['clear_margin_logits']:.4f} "
                  f"-> {'PASS' if check['passed'] else 'FAIL: ' + '; '.join(check['failures'])}")
            print("  free-running, prompts identical to the reference over every token: "
                  + ", ".join(f"{name} {f['identical_prompts']}/{check['prompts']}" for name, f in free.items()))
    for row in doc["results"]:
        if "greedy_prefix_match_vs_engine_stock" in row:
            print(f"greedy {row['impl']} batch {row['batch']} vs engine stock: first "
                  f"{row['greedy_prefix_match_vs_engine_stock']}/{row['greedy_compared']} tokens equal")
    for c in doc.get("curve_comparison") or []:
        ratio = f"{c['ratio']:.2f}x" if c["ratio"] else (c.get("note") or "no HF point")
        print(f"curve: our batch {c['batch']:>4}: p90 per-user {c['p90_per_user_tok_s']:.1f} tok/s, "
              f"{c['ours_tok_s']:.0f} tok/s; over HF static at the same per-user rate: {ratio}")
    for c in doc.get("curve_dominance") or []:
        if c["ours_tok_s"] is None:
            print(f"curve: HF batch {c['hf_batch']:>4} ({c['hf_p90_per_user_tok_s']:.1f} per-user tok/s, "
                  f"{c['hf_tok_s']:.0f} tok/s): no point of ours at least as interactive")
            continue
        print(f"curve: HF batch {c['hf_batch']:>4} ({c['hf_p90_per_user_tok_s']:.1f} per-user tok/s, "
              f"{c['hf_tok_s']:.0f} tok/s) <= ours at batch {c['ours_batch']} ({c['ours_p90_per_user_tok_s']:.1f} "
              f"per-user tok/s, {c['ours_tok_s']:.0f} tok/s): >= {c['ratio_lower_bound']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
