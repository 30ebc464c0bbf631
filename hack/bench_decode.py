#!/usr/bin/env python3
"""Decode throughput of the engine next to Hugging Face transformers on the same weights.

Data flow: the preset's random weights are drawn once by the engine -> for each recipe
(hot-swapped into the same engine, graphs re-captured) and each batch size: B random
prompts of --prompt-len tokens, greedy, --new-tokens each; decode tokens/s counts the
tokens after every request's first one, timed from the step that completed the last
prefill to the end -> an HF LlamaForCausalLM is built from the same config and loaded
with the engine's tensors -> HF `generate` eager (dynamic cache) and static cache,
decode time = t(N new tokens) - t(1 new token) -> a table on stdout and a JSON file
(commit, GPU, command line, figures) under bench/results/.

    # H200 (the figure of record)
    python hack/bench_decode.py
    # CPU smoke test
    python hack/bench_decode.py --device cpu --model tiny-llama --batch-sizes 1,4 \
        --prompt-len 16 --new-tokens 16 --recipes stock --out-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from shapeshift.engine.config import EngineConfig
from shapeshift.engine.forward_pass import STOCK_BUNDLE_DIR, load_bundle
from shapeshift.engine.llm_engine import LLMEngine
from shapeshift.engine.presets import PRESETS
from shapeshift.engine.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "stock": {},
    "fused": {"fuse_qkv": True, "fuse_gate_up": True},
    "triton": {"fuse_qkv": True, "fuse_gate_up": True, "attention_backend": "triton", "norm_backend": "triton",
               "rotary_backend": "triton", "activation_backend": "triton"},
}


def git_commit() -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                                    capture_output=True, text=True).stdout.strip())
        return commit, dirty
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown", True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (batch, prompt_len), generator=gen).tolist()


# ----------------------------------------------------------------------------- engine
def engine_decode_rate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over all requests (after each one's first token), and the outputs."""
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
    sync(engine.device)
    start = time.perf_counter()
    decoded = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            decoded += len(o.new_token_ids)
            if o.finished:
                outputs[o.request_id] = o.output_token_ids
    sync(engine.device)
    elapsed = time.perf_counter() - start
    return decoded / elapsed, [outputs[rid] for rid in ids]


# ----------------------------------------------------------------------------- HF
def build_hf_model(engine: LLMEngine, preset_config: dict, device: torch.device, dtype: torch.dtype):
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in preset_config.items() if k not in ("architectures",)})
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    missing, unexpected = model.load_state_dict(engine.weights, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"HF model does not match the engine weights: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class StepClock:
    """A logits processor that only timestamps: HF calls it once per generated token,
    right after that step's forward, so consecutive stamps bracket one decode step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def hf_decode_rate(model, prompts: list[list[int]], new_tokens: int, static: bool, device: torch.device
                   ) -> tuple[float, list[int]]:
    """Decode tokens/s of HF generate (first stamp after prefill to the last), and the
    greedy tokens of the first prompt."""
    from transformers import LogitsProcessorList

    input_ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    best, out = 0.0, None
    for attempt in range(2):  # the first run warms up (and compiles, for the static cache)
        clock = StepClock(device)
        with torch.inference_mode():
            out = model.generate(input_ids, logits_processor=LogitsProcessorList([clock]), **kwargs)
        steps = len(clock.stamps) - 1
        if attempt > 0 and steps > 0:
            best = max(best, len(prompts) * steps / (clock.stamps[-1] - clock.stamps[0]))
    return best, out[0, input_ids.shape[1]:].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b-shape", help="a random preset (weights are shared with HF)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--recipes", default="stock,fused,triton",
                        help=f"comma list of {sorted(RECIPES)}; triton is skipped without CUDA")
    parser.add_argument("--repeats", type=int, default=3, help="engine runs per point (best is reported)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-hf-static", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = PRESETS.get(args.model)
    if preset is None or not preset.is_random:
        parser.error(f"--model must be a random preset ({[n for n, p in PRESETS.items() if p.is_random]})")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        if r not in RECIPES:
            parser.error(f"unknown recipe {r!r}; choose from {sorted(RECIPES)}")
    if device.type != "cuda" and "triton" in recipes:
        print("note: recipe 'triton' needs CUDA here; skipped", file=sys.stderr)
        recipes.remove("triton")
    max_batch = max(batch_sizes)
    block_size = 16
    max_model_len = int(math.ceil((args.prompt_len + args.new_tokens + 1) / block_size) * block_size)
    config = EngineConfig(
        model=args.model, device=str(device), dtype=args.dtype, max_num_seqs=max_batch, max_model_len=max_model_len,
        block_size=block_size, num_kv_blocks=max_batch * (max_model_len // block_size) + 8,
        max_num_batched_tokens=max(2048, max_batch), enforce_eager=args.enforce_eager,
        cuda_graph_context_lens=[max_model_len])
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    print(f"engine ready in {time.perf_counter() - t0:.1f}s: {args.model} on {device} ({config.resolved_dtype()}), "
          f"graphs: {sorted(engine.runner.graphs) or 'none'}", file=sys.stderr)
    vocab = engine.model_config.vocab_size

    rows = []
    for recipe_index, recipe_name in enumerate(recipes):
        if recipe_index > 0 or recipe_name != "stock":
            t0 = time.perf_counter()
            engine.set_forward_pass(load_bundle(STOCK_BUNDLE_DIR, RECIPES[recipe_name]))
            print(f"recipe {recipe_name}: built and captured in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        engine_decode_rate(engine, random_prompts(max_batch, args.prompt_len, vocab, seed=1), 8)  # warm-up
        for batch in batch_sizes:
            best, outs = 0.0, None
            for rep in range(args.repeats):
                rate, outs = engine_decode_rate(engine, random_prompts(batch, args.prompt_len, vocab, seed=100 + rep),
                                                args.new_tokens)
                best = max(best, rate)
            rows.append({"impl": f"shapeshift[{recipe_name}]", "batch": batch, "decode_tok_s": best,
                         "per_seq_tok_s": best / batch, "cuda_graphs": bool(engine.runner.graphs)})
            print(f"  shapeshift[{recipe_name}] batch {batch}: {best:.1f} tok/s", file=sys.stderr)

    if not args.skip_hf:
        engine.set_forward_pass(load_bundle(STOCK_BUNDLE_DIR))  # drop fused copies before HF takes memory
        dtype = engine.dtype
        model = build_hf_model(engine, preset.hf_config, device, dtype)
        modes = [("eager", False)] + ([] if args.skip_hf_static else [("static-cache", True)])
        for mode, static in modes:
            for batch in batch_sizes:
                prompts = random_prompts(batch, args.prompt_len, vocab, seed=100)
                try:
                    rate, hf_first = hf_decode_rate(model, prompts, args.new_tokens, static, device)
                except Exception as exc:  # report, keep the other figures
                    print(f"  hf[{mode}] batch {batch} failed: {exc!r}", file=sys.stderr)
                    rows.append({"impl": f"hf[{mode}]", "batch": batch, "decode_tok_s": None, "error": repr(exc)})
                    continue
                row = {"impl": f"hf[{mode}]", "batch": batch, "decode_tok_s": rate, "per_seq_tok_s": rate / batch}
                if batch == batch_sizes[0]:
                    # Greedy agreement on the same weights (bf16 may legitimately drift late).
                    ours = engine_decode_rate(engine, prompts[:1], args.new_tokens)[1][0]
                    row["greedy_prefix_match"] = common_prefix(ours, hf_first)
                    row["greedy_compared"] = len(hf_first)
                rows.append(row)
                print(f"  hf[{mode}] batch {batch}: {rate:.1f} tok/s", file=sys.stderr)
        del model
        gc.collect()

    commit, dirty = git_commit()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {
        "benchmark": "decode",
        "git_commit": commit,
        "git_dirty": dirty,
        "gpu": gpu,
        "device": str(device),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "python": platform.python_version(),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "dtype": config.resolved_dtype(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "engine_config": {k: v for k, v in vars(config).items() if k != "forward_pass_recipe"},
        "results": rows,
    }
    print(f"\n{args.model} decode, prompt {args.prompt_len}, {args.new_tokens} new tokens, {gpu}, "
          f"{config.resolved_dtype()}, commit {commit[:12]}{'+dirty' if dirty else ''}")
    print(f"{'implementation':<24}{'batch':>6}{'tok/s':>12}{'tok/s/seq':>12}")
    for row in rows:
        rate = row["decode_tok_s"]
        shown = f"{rate:12.1f}{rate / row['batch']:12.1f}" if rate is not None else f"{'failed':>12}{'':>12}"
        print(f"{row['impl']:<24}{row['batch']:>6}{shown}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-") or "device"
    out_file = out_dir / f"decode-{args.model}-{slug}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out_file.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"saved {out_file}")
    return 0


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
