#!/usr/bin/env python3
"""How far each recipe's decode logits are from the float32 reference, on the same positions,
and which layer the distance comes from.

bench_decode's agreement check scores each path on the sequence it chose itself, so two paths
are compared at different positions once a near-tie flips a token. Here every path is
teacher-forced on one trajectory, so each position is scored for every path:

  seeded random weights of a preset (bf16), the same upcast to float32
  -> reference: the stock pass in float32, greedy from --prompts random prompts, all decoding as
     one batch (engine/verify/agreement.teacher_forced, eager) -> tokens, float32 logits per decode step, and the hidden
     state after every layer (the residual stream, layer by layer)
  -> each recipe in the model's dtype, teacher-forced on the reference's tokens, decoding the
     prompts either as one batch (--batch all) or one at a time (--batch 1)
  -> per recipe and batch shape: argmax-equal positions, clear-argmax flips (reference top-2
     margin above --clear-margin), the worst deficit of its argmax under the reference logits,
     logit error against the reference (max and RMS, relative to each row's logit spread), and
     per layer the relative RMS error of the hidden state (batched decode only: the batch-1
     layer-tail path runs whole layers inside one kernel), and the verdict of
     engine/verify/agreement.judge against the stock pass at the same batch shape (the rule
     bench_decode's agreement check applies)
  -> a table on stdout and JSON under bench/results/ (commit, device, command).

The stock pass in the model's dtype is the control: what rounding alone does on these
positions. A recipe whose errors stay near the control's rounds no worse than plain bf16.

    # H200
    python3 hack/bench_agreement.py --recipes stock,fast,fast+fuse_rotary_into_attention=true
    # CPU (Triton recipes through the interpreter: set TRITON_INTERPRET=1)
    python3 hack/bench_agreement.py --device cpu --model tiny-llama --prompts 4 --tokens 8 --prompt-len 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.forward_pass.bundle import STOCK_BUNDLE_DIR
from shapeshift.engine.forward_pass.importer import build_forward_pass, load_bundle
from shapeshift.engine.models.loader import load_model
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.verify.agreement import judge, score, teacher_forced

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import RECIPES, Recorder, log, needs_triton, recipe_with_overrides  # noqa: E402  (sibling)
from benchmeta import REPO_ROOT, claim_result_name, git_commit, hardware_slug, result_name  # noqa: E402
from decode_baselines import random_prompts  # noqa: E402

PROMPT_SEED = 7  # bench_decode's agreement check draws its prompts with this seed


class LayerProbe:
    """Hidden state after every layer of each decode forward of ``fp`` (float32 copies).

    The stock pass's layer loop hands the post-attention residual out of its norm (or fused
    norm + GEMV) and the MLP's output out of mlp(); their sum is the residual stream after the
    layer. Wraps those three methods on the instance and forward() to group them by step."""

    def __init__(self, fp: Any) -> None:
        self.steps: list[list[torch.Tensor]] = []  # per decode forward: [layers] of [B, H]
        self._layers: list[torch.Tensor] = []
        self._residual: torch.Tensor | None = None
        for name in ("norm", "norm_linear"):
            setattr(fp, name, self._keep_residual(getattr(fp, name)))
        mlp, forward = fp.mlp, fp.forward

        def probed_mlp(*args: Any, **kwargs: Any) -> torch.Tensor:
            h = mlp(*args, **kwargs)
            if self._residual is not None:
                self._layers.append(h.float() + self._residual.float())
            return h

        def probed_forward(input_ids: Any, positions: Any, ctx: Any, kv_cache: Any) -> torch.Tensor:
            self._layers, self._residual = [], None
            logits = forward(input_ids, positions, ctx, kv_cache)
            if not ctx.is_prefill and self._layers:
                self.steps.append(self._layers)
            return logits

        fp.mlp, fp.forward = probed_mlp, probed_forward

    def _keep_residual(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self._residual = out[1]
            return out
        return wrapped


def layer_errors(ref: list[list[torch.Tensor]], cand: list[list[torch.Tensor]]) -> list[float]:
    """Relative RMS error of the hidden state after each layer over every probed step."""
    if not ref or not cand or len(ref) != len(cand):
        return []
    out = []
    for layer in range(len(ref[0])):
        r = torch.cat([s[layer] for s in ref])
        c = torch.cat([s[layer].to(r.device) for s in cand])
        out.append(float((c - r).norm() / r.norm().clamp_min(1e-12)))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b-shape", help="a random preset")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--recipes", default="stock,fast",
                   help="comma-separated recipe specs (name[+knob=value...]); include stock as the control")
    p.add_argument("--batch", default="all,1",
                   help="comma-separated batch shapes the recipes decode in: all (every prompt in one batch) or 1")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32, help="decode steps per prompt")
    p.add_argument("--clear-margin", type=float, default=0.05,
                   help="a reference top-2 margin above this (logits) is a clear argmax a path must keep")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = PRESETS.get(args.model)
    if preset is None or not preset.is_random:
        raise SystemExit(f"--model must be a random preset ({[n for n, p in PRESETS.items() if p.is_random]})")
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        RECIPES.setdefault(r, recipe_with_overrides(r))
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        skipped = [r for r in recipes if needs_triton(RECIPES[r])]
        if skipped:
            log(f"recipes {skipped} need CUDA or TRITON_INTERPRET=1; skipped")
        recipes = [r for r in recipes if r not in skipped]
    shapes = [s for s in args.batch.split(",") if s]
    bad = [s for s in shapes if s not in ("all", "1")]
    if bad or not recipes:
        raise SystemExit(f"--batch takes all and/or 1 (got {bad}); --recipes must leave one to run")
    loaded = load_model(EngineConfig(model=args.model, device=str(device), dtype=args.dtype, max_model_len=256))
    cfg, weights = loaded.model_config, loaded.weights
    prompts = random_prompts(args.prompts, args.prompt_len, cfg.vocab_size, seed=PROMPT_SEED)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    out_dir = Path(args.out_dir)
    name = claim_result_name(out_dir, result_name("agreement", args.model, hardware_slug(gpu)))
    rec = Recorder(out_dir / f"{name}.json", {
        "benchmark": "agreement", "git_commit": git_commit(), "gpu": gpu, "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model, "dtype": args.dtype, "prompts": args.prompts, "prompt_len": args.prompt_len,
        "tokens": args.tokens, "clear_margin_logits": args.clear_margin,
        "reference": "stock forward pass, float32, same weights upcast, all prompts as one batch"})

    t0 = time.perf_counter()
    ref_weights = {k: v.float() for k, v in weights.items()}
    ref_fp = build_forward_pass(load_bundle(STOCK_BUNDLE_DIR, {}), cfg, ref_weights)
    ref_probe = LayerProbe(ref_fp)
    ref_tokens, ref_logits = teacher_forced(ref_fp, cfg, torch.float32, device, prompts, args.tokens, len(prompts))
    ref_layers = ref_probe.steps
    del ref_fp, ref_weights
    log(f"reference: {len(prompts)} prompts x {args.tokens} tokens in {time.perf_counter() - t0:.1f} s")

    dtype = weights[next(iter(weights))].dtype
    controls: dict[int, list[torch.Tensor]] = {}  # batch -> the stock pass's logits (run it first)
    if "stock" in recipes:
        recipes = ["stock", *[r for r in recipes if r != "stock"]]
    for recipe in recipes:
        fp = build_forward_pass(load_bundle(STOCK_BUNDLE_DIR, RECIPES[recipe]), cfg, weights)
        probe = LayerProbe(fp)
        for shape in shapes:
            batch = len(prompts) if shape == "all" else 1
            probe.steps = []
            t0 = time.perf_counter()
            _, logits = teacher_forced(fp, cfg, dtype, device, prompts, args.tokens, batch, ref_tokens)
            row = {"recipe": recipe, "batch": batch, **score(ref_logits, logits, args.clear_margin),
                   "layer_rel_rms_error": layer_errors(ref_layers, probe.steps) if batch > 1 else [],
                   "seconds": time.perf_counter() - t0}
            if recipe == "stock":
                controls[batch] = logits
            elif batch in controls:  # the verdict bench_decode's agreement check gives
                verdict = judge(ref_logits, logits, controls[batch], args.clear_margin)
                row["verdict"] = {k: verdict[k] for k in ("passed", "failures", "limits")}
                row["verdict"]["clear_margin_logits"] = verdict["candidate"]["clear_margin_logits"]
            rec.add(row)
            log(f"{recipe} at batch {batch}: flips {row['clear_argmax_flips']}/{row['clear_argmax_positions']}, "
                f"worst deficit {row['worst_deficit_logits']:.4f}, rms error {row['rms_logit_error']:.4f}")
        del fp
    print_table(rec.doc)
    print(f"saved {rec.path}")
    return 0


def verdict_text(verdict: dict[str, Any] | None) -> str:
    if verdict is None:
        return ""
    return "PASS" if verdict["passed"] else "FAIL: " + "; ".join(verdict["failures"])


def print_table(doc: dict[str, Any]) -> None:
    print(f"\n{doc['model']} {doc['dtype']} on {doc['gpu']}: {doc['prompts']} prompts x {doc['tokens']} "
          f"teacher-forced decode steps on the float32 reference's tokens")
    head = (f"{'recipe':44} {'batch':>5} {'argmax=':>9} {'flips':>9} {'worst def':>9} {'max err':>8} "
            f"{'p99 err':>8} {'rms err':>8}  verdict against stock")
    print(head)
    for r in doc["results"]:
        print(f"{r['recipe']:44} {r['batch']:>5} {r['argmax_equal']:>4}/{r['positions']:<4} "
              f"{r['clear_argmax_flips']:>3}/{r['clear_argmax_positions']:<5} {r['worst_deficit_logits']:>9.4f} "
              f"{r['max_abs_logit_error']:>8.4f} {r['p99_row_max_abs_logit_error']:>8.4f} {r['rms_logit_error']:>8.4f}  "
              f"{verdict_text(r.get('verdict'))}")
    layered = [r for r in doc["results"] if r["layer_rel_rms_error"]]
    if layered:
        print("\nrelative RMS error of the hidden state after each layer (batched decode)")
        print(f"{'layer':>5} " + " ".join(f"{r['recipe'][:22]:>22}" for r in layered))
        for i in range(len(layered[0]["layer_rel_rms_error"])):
            print(f"{i:>5} " + " ".join(f"{r['layer_rel_rms_error'][i]:>22.5f}" for r in layered))


if __name__ == "__main__":
    sys.exit(main())
