"""Verification of a confirmed winner before it may become the incumbent.

Data flow: engine (weights, model config, dtype, device) + candidate bundle + stock bundle
    --> the engine's verification suite (shapeshift.engine.verify) when it offers one,
        else the checks below, each on fresh random prompts through a paged driver whose
        free KV blocks are filled with poison
    --> Verification(passed, gates={name: ok}, report={name: details})

Checks (each must pass):
  builds             the bundle imports in isolation and build() returns a forward pass
  correctness        teacher-forced greedy decoding against the stock pass: token agreement,
                     max |logprob difference| under a dtype-dependent tolerance, finite logits
  batched_eq_alone   a sequence decoded in a batch gets the logits it gets alone
  chunked_prefill    prefill in chunks (odd sizes) equals prefill in one step
  cache_compat       cache written by the candidate, read by the stock pass (and back) decodes the same
  fresh_inputs       a second draw of prompts (new seed) passes correctness too: no answer caching
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .measure import Verification

log = logging.getLogger(__name__)

TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25, "float16": 0.1}  # max |delta logprob| on chosen tokens
MIN_AGREEMENT = 0.98


def _suite() -> Any | None:
    """The engine's own gate runner, when present: verify.run_gates(engine, bundle, stock_bundle)."""
    try:
        import importlib

        mod = importlib.import_module("shapeshift.engine.verify")
    except ImportError:
        return None
    for name in ("run_gates", "verify_candidate"):
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    return None


def run_gates(engine: Any, candidate_path: Path, stock_path: Path, prompts: int = 8, steps: int = 24) -> Verification:
    suite = _suite()
    if suite is not None:
        return _from_suite(suite(engine, candidate_path, stock_path))
    return _builtin_gates(engine, candidate_path, stock_path, prompts, steps)


def _from_suite(report: Any) -> Verification:
    """Adapt the engine suite's report (object or dict with passed + per-gate results)."""
    data = report.to_dict() if hasattr(report, "to_dict") else dict(report) if isinstance(report, dict) else {"repr": repr(report)}
    passed = bool(getattr(report, "passed", data.get("passed", False)))
    gates: dict[str, bool] = {}
    raw_gates = getattr(report, "gates", None) or data.get("gates") or []
    items = raw_gates.items() if isinstance(raw_gates, dict) else [(getattr(g, "name", str(i)), g) for i, g in enumerate(raw_gates)]
    for name, g in items:
        ok = g if isinstance(g, bool) else bool(getattr(g, "passed", g.get("passed") if isinstance(g, dict) else False))
        gates[str(name)] = ok
    return Verification(passed=passed and all(gates.values()), gates=gates, report={"suite": "engine", **data})


def _builtin_gates(engine: Any, candidate_path: Path, stock_path: Path, prompts: int, steps: int) -> Verification:
    import torch

    from ..hot_reload import load_bundle_isolated
    from ..verify.driver import PagedDriver, Seq

    cfg = engine.model_config
    dtype_name = str(engine.dtype).replace("torch.", "")
    tol = TOLERANCE.get(dtype_name, 0.1)
    gates: dict[str, bool] = {}
    report: dict[str, Any] = {"suite": "compile-builtin", "dtype": dtype_name, "tolerance": tol}
    try:
        cand_mod = load_bundle_isolated(candidate_path)
        stock_mod = load_bundle_isolated(stock_path) if (Path(stock_path) / "manifest.json").is_file() else None
        from ..forward_pass import load_bundle

        cand = cand_mod.module.build(cfg, engine.weights, dict(cand_mod.recipe))
        stock = (stock_mod.module.build(cfg, engine.weights, dict(stock_mod.recipe)) if stock_mod is not None else
                 load_bundle(stock_path).module.build(cfg, engine.weights, load_bundle(stock_path).recipe))
        gates["builds"] = True
    except Exception as exc:  # noqa: BLE001
        gates["builds"] = False
        report["builds"] = f"{type(exc).__name__}: {exc}"
        return Verification(False, gates, report)

    block = engine.kv_cache.block_size
    device, dtype = engine.device, engine.dtype

    def draw(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        lengths = [int(x) for x in torch.randint(2, 3 * block + 3, (prompts,), generator=g)]
        return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def blocks_for(ps: list[list[int]]) -> int:
        return sum(-(-(len(p) + steps + 1) // block) for p in ps) + 4

    def compare(ps: list[list[int]], seed: int, **kw: Any) -> dict[str, Any]:
        with torch.inference_mode():
            ref = PagedDriver(cfg, dtype, device, num_blocks=blocks_for(ps), block_size=block, seed=seed)
            ref_tok, ref_logits = ref.greedy(stock, [Seq(list(p)) for p in ps], steps)
            run = PagedDriver(cfg, dtype, device, num_blocks=blocks_for(ps), block_size=block, seed=seed + 1)
            tok, logits = run.greedy(kw.get("fp", cand), [Seq(list(p)) for p in ps], steps, forced=ref_tok,
                                     decode_fp=kw.get("decode_fp"), prefill_chunk=kw.get("prefill_chunk"))
        finite = all(bool(torch.isfinite(x).all()) for x in logits)
        total = sum(len(t) for t in ref_tok)
        agree = sum(a == b for x, y in zip(tok, ref_tok) for a, b in zip(x, y)) / max(total, 1)
        # |logprob(candidate) - logprob(stock)| of the stock's chosen token at every step.
        diff = 0.0
        for c, r, step_tokens in zip(logits, ref_logits, zip(*ref_tok)):
            idx = torch.tensor(step_tokens, device=c.device)[:, None]
            lc = torch.log_softmax(c.float(), -1).gather(1, idx)
            lr = torch.log_softmax(r.float(), -1).gather(1, idx)
            diff = max(diff, float((lc - lr).abs().max()))
        ok = finite and agree >= MIN_AGREEMENT and diff <= tol
        return {"passed": ok, "finite": finite, "agreement": round(agree, 4), "max_logprob_diff": diff, "tokens": total}

    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every verification
    checks = {
        "correctness": lambda: compare(draw(seed), seed),
        "chunked_prefill": lambda: compare(draw(seed + 11), seed + 11, prefill_chunk=max(1, block // 2 - 1)),
        "cache_compat": lambda: _both(compare(draw(seed + 23), seed + 23, decode_fp=stock),
                                      compare(draw(seed + 29), seed + 29, fp=stock, decode_fp=cand)),
        "fresh_inputs": lambda: compare(draw(seed + 101), seed + 101),
        "batched_eq_alone": lambda: _batched_eq_alone(cand, cfg, dtype, device, block, draw(seed + 37)[:3], steps, tol),
    }
    for name, check in checks.items():
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 - a crash is a failed gate
            result = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        gates[name] = bool(result.get("passed"))
        report[name] = result
    report["seed"] = seed
    return Verification(all(gates.values()), gates, report)


def _both(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {"passed": a["passed"] and b["passed"], "candidate_writes_stock_reads": a, "stock_writes_candidate_reads": b}


def _batched_eq_alone(fp: Any, cfg: Any, dtype: Any, device: Any, block: int, prompts: list[list[int]], steps: int,
                      tol: float) -> dict[str, Any]:
    import torch

    from ..verify.driver import PagedDriver, Seq

    nblocks = sum(-(-(len(p) + steps + 1) // block) for p in prompts) + 4
    with torch.inference_mode():
        together = PagedDriver(cfg, dtype, device, num_blocks=nblocks, block_size=block, seed=5)
        tok_b, logits_b = together.greedy(fp, [Seq(list(p)) for p in prompts], steps)
        worst = 0.0
        same = True
        for i, p in enumerate(prompts):
            alone = PagedDriver(cfg, dtype, device, num_blocks=nblocks, block_size=block, seed=9 + i)
            tok_a, logits_a = alone.greedy(fp, [Seq(list(p))], steps, forced=[tok_b[i]])
            for la, lb in zip(logits_a, logits_b):
                pa = torch.log_softmax(la[0].float(), -1)
                pb = torch.log_softmax(lb[i].float(), -1)
                worst = max(worst, float((pa - pb).abs().max()))
            same = same and tok_a[0] == tok_b[i]
    return {"passed": same and worst <= max(tol, 1e-3) * 4, "max_logprob_diff": worst, "same_tokens": same}
