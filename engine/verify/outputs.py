"""Output gates: the candidate's logits are well-formed, finite and agree with the reference.

Data flow: GateContext -> smoke (one prefill + one decode, float32 [B, V]), outputs.finite (no
NaN/Inf, long prompts too), outputs.agreement (greedy tokens and logprob tolerance), coverage.shapes
(every decode batch bucket, odd prefill lengths, chunked prefill) -> evidence. In half precision
the bounds are first calibrated on the reference's own rounding error against float32
(calibrate, calibrate_tolerance; see TOLERANCES in engine/verify/context.py).
"""

from __future__ import annotations

from typing import Any

import torch

from shapeshift.engine.forward_pass.importer import LoadedBundle
from shapeshift.engine.forward_pass.paged_driver import PagedDriver, Seq
from shapeshift.engine.verify.context import GateContext, GateFailure, compare, require, run_pair


def calibrate_tolerance(ctx: GateContext, reference_float32: Any, device: torch.device | None = None
                        ) -> dict[str, Any]:
    """The reference's own rounding error, against the same pass in float32, sets ctx.calibrated.

    Both run the same prompts; the half-precision reference is teacher-forced on the float32
    pass's tokens. ``device``: where the float32 pass lives (default: the verification's).
    The logprob and logit bounds become precision_factor x the measured error; the near-tie
    margin precision_factor x twice the largest logit error (a candidate off by e on two logits
    can swap a margin up to 2e without being worse than the reference: on a random-weight 1B
    model in bf16 e is ~0.16, well past the table's 0.1). Returns the evidence: the measured
    error and the bounds now in force.
    """
    s = ctx.settings
    prompts = [ctx.prompt() for _ in range(s.num_prompts)]
    exact_driver = PagedDriver(ctx.model_config, torch.float32, device or ctx.device, num_blocks=s.num_blocks,
                               block_size=s.block_size, seed=ctx.rng.getrandbits(31))
    tokens, exact = exact_driver.greedy(reference_float32, [Seq(list(p)) for p in prompts], s.steps)
    exact = [x.to(ctx.device) for x in exact]
    _, rounded = ctx.driver().greedy(ctx.reference, [Seq(list(p)) for p in prompts], s.steps, forced=tokens)
    ev = compare(exact, rounded, (float("inf"), float("inf"), ctx.tol[2]), s.top_k_compare)
    if not ev["finite"]:
        raise GateFailure("the reference itself returns non-finite logits", **ev)
    f = s.precision_factor
    ctx.calibrated = (f * ev["max_logprob_diff"], f * ev["max_rel_logit_diff"], f * 2 * ev["max_abs_logit_diff"])
    atol, rtol, tie = ctx.tol
    return {"calibrated": True, "tokens": ev["tokens"], "factor": f,
            "reference_vs_float32": {"max_logprob_diff": ev["max_logprob_diff"],
                                     "max_rel_logit_diff": ev["max_rel_logit_diff"],
                                     "rms_rel_logit_diff": ev["rms_rel_logit_diff"],
                                     "max_abs_logit_diff": ev["max_abs_logit_diff"], "flips": ev["flips"]},
            "logprob_atol": atol, "logit_rtol": rtol, "tie_margin": tie}


def gate_smoke(ctx: GateContext) -> dict[str, Any]:
    d = ctx.driver()
    seq = Seq(ctx.prompt(5))
    logits = d.step(ctx.candidate, [seq])
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32:
        raise GateFailure("forward must return float32 logits", got=str(getattr(logits, "dtype", type(logits))))
    if tuple(logits.shape) != (1, ctx.model_config.vocab_size):
        raise GateFailure("wrong logits shape", shape=tuple(logits.shape))
    seq.tokens.append(int(logits.argmax()))
    logits = d.step(ctx.candidate, [seq], [1])
    return {"prefill_and_decode": "ok", "shape": list(logits.shape)}


def gate_finite(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    prompts = [ctx.prompt() for _ in range(s.num_prompts - 1)] + [ctx.prompt(s.long_prompt_len)]
    d = ctx.driver()
    _, logits = d.greedy(ctx.candidate, [Seq(list(p)) for p in prompts], s.steps)
    bad = [i for i, x in enumerate(logits) if not bool(torch.isfinite(x).all())]
    if bad:
        raise GateFailure("non-finite logits", steps_with_nan_or_inf=bad[:8], prompt_lens=[len(p) for p in prompts])
    return {"steps": len(logits), "prompt_lens": [len(p) for p in prompts]}


def gate_agreement(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    prompts = [ctx.prompt() for _ in range(s.num_prompts)]
    _, ref, cand = run_pair(ctx, prompts, s.steps)
    ev = compare(ref, cand, ctx.tol, s.top_k_compare)
    ev["prompt_lens"] = [len(p) for p in prompts]
    return require(ev, "outputs differ from the reference")


def gate_coverage(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    covered = {"decode_batch_sizes": [], "prefill_lengths": []}
    for bs in s.decode_batch_sizes():
        prompts = [ctx.prompt(ctx.rng.randint(2, 24)) for _ in range(bs)]
        _, ref, cand = run_pair(ctx, prompts, 3)
        ev = compare(ref, cand, ctx.tol, s.top_k_compare)
        if not ev["ok"]:
            raise GateFailure(f"decode at batch size {bs} differs", batch_size=bs, **ev)
        covered["decode_batch_sizes"].append(bs)
    lengths = list(s.odd())
    for i in range(0, len(lengths), 3):  # odd lengths batched in threes: mixed-length prefill
        prompts = [ctx.prompt(n) for n in lengths[i:i + 3]]
        _, ref, cand = run_pair(ctx, prompts, 2)
        ev = compare(ref, cand, ctx.tol, s.top_k_compare)
        if not ev["ok"]:
            raise GateFailure("prefill at odd lengths differs", lengths=[len(p) for p in prompts], **ev)
        covered["prefill_lengths"].extend(len(p) for p in prompts)
    # chunked prefill: the same prompt computed in odd-sized chunks
    prompt = ctx.prompt(2 * s.block_size + 7)
    d_full, d_chunk = ctx.driver(), ctx.driver()
    tok, ref = d_full.greedy(ctx.reference, [Seq(list(prompt))], 3)
    _, cand = d_chunk.greedy(ctx.candidate, [Seq(list(prompt))], 3, prefill_chunk=s.block_size - 3, forced=tok)
    ev = compare(ref, cand, ctx.tol, s.top_k_compare)
    if not ev["ok"]:
        raise GateFailure("chunked prefill differs", chunk=s.block_size - 3, **ev)
    covered["chunked_prefill"] = s.block_size - 3
    return covered


def gate_long_context(ctx: GateContext) -> dict[str, Any]:
    """Contexts up to the deployment's max model length: one prompt that ends at the limit, and the
    traffic's own prompt lengths (settings.traffic_prompt_lens: the profile's p50, p90, p99) or,
    without them, one drawn from the upper half, each decoded a few steps, over a KV pool just
    large enough for it (so nearly every block id is used)."""
    s = ctx.settings
    steps = 4
    limit = s.max_model_len - steps
    traffic = sorted({min(limit, max(1, int(n))) for n in s.traffic_prompt_lens} - {limit})
    lengths = [limit] + (traffic or [ctx.rng.randint(max(1, limit // 2), limit)])
    covered = []
    for n in lengths:
        prompt = ctx.prompt(n)
        blocks = -(-(n + steps) // s.block_size) + 1
        d_ref, d_cand = ctx.driver(blocks), ctx.driver(blocks)
        tok, ref = d_ref.greedy(ctx.reference, [Seq(list(prompt))], steps)
        _, cand = d_cand.greedy(ctx.candidate, [Seq(list(prompt))], steps, forced=tok)
        ev = compare(ref, cand, ctx.tol, s.top_k_compare)
        if not ev["ok"]:
            raise GateFailure(f"a {n}-token context differs", context_len=n + steps, max_model_len=s.max_model_len,
                              **ev)
        covered.append(n + steps)
    return {"context_lens": covered, "max_model_len": s.max_model_len,
            "from_traffic": bool(traffic)}


def gate_mixed_steps(ctx: GateContext) -> dict[str, Any]:
    """The steps the scheduler builds under load, on one schedule for both passes: a decode row
    next to a prefill (and a prefill chunk), then a prefix donor batched with a child that borrows
    its full blocks, then the donor decoding again after its child ran (re-checked)."""
    s = ctx.settings
    bs = s.block_size
    donor_prompt = ctx.prompt(2 * bs + ctx.rng.randint(1, bs - 1))
    other = ctx.prompt(ctx.rng.randint(bs + 2, 3 * bs))
    chunked = ctx.prompt(2 * bs + 5)
    child_tail = ctx.prompt(ctx.rng.randint(2, bs))
    runs: dict[str, list[torch.Tensor]] = {}
    forced: list[int] = []
    for label, fp in (("reference", ctx.reference), ("candidate", ctx.candidate)):
        d = ctx.driver()
        donor, b, c = Seq(list(donor_prompt)), Seq(list(other)), Seq(list(chunked))
        out = [d.step(fp, [donor])]

        def next_token(k: int, logits: torch.Tensor, row: int) -> int:
            if label == "reference":
                forced.append(int(logits[row].argmax()))
            return forced[k]

        donor.tokens.append(next_token(0, out[-1], 0))
        out.append(d.step(fp, [donor, b, c], [1, len(other), bs - 3]))  # decode + prefill + chunk
        donor.tokens.append(next_token(1, out[-1], 0))
        out.append(d.step(fp, [donor, c], [1, len(chunked) - c.num_computed]))  # decode + chunk rest
        donor.tokens.append(next_token(2, out[-1], 0))
        shared = donor.num_computed // bs
        child = d.fork_prefix(donor, donor.tokens[:shared * bs] + child_tail, shared)
        out.append(d.step(fp, [donor, child], [1, len(child.tokens) - child.num_computed]))  # donor + child
        donor.tokens.append(next_token(3, out[-1], 0))
        out.append(d.step(fp, [donor], [1]))  # the donor after its child wrote next to its blocks
        runs[label] = out
    checks = ("prefill", "decode+prefill+chunk", "decode+chunk", "donor+child sharing blocks", "donor re-checked")
    for name, r, c in zip(checks, runs["reference"], runs["candidate"]):
        ev = compare([r], [c], ctx.tol, s.top_k_compare)
        if not ev["ok"]:
            raise GateFailure(f"a mixed step differs: {name}", step=name, **ev)
    return {"steps": list(checks)}


# (model, dtype, device, weights fingerprint, settings) -> (ctx.calibrated, evidence): the stock
# pass's rounding error is a property of the model and its weights, not of the candidate, so
# later verifications in the same process reuse it (it cost ~10 s of a ~22 s verification of
# the 1B shape on an H200). A few entries: one per model a process verifies.
_CALIBRATIONS: dict[tuple, tuple[tuple[float, float, float], dict[str, Any]]] = {}


def calibrate(ctx: GateContext, model_config: Any, weights: dict[str, torch.Tensor],
               stock: LoadedBundle | None, fingerprint: dict[str, tuple] | None = None) -> dict[str, Any]:
    """calibrate_tolerance for half precision, over the stock pass rebuilt in float32.

    The float32 copy is built on the verification's device, and on the host when the device
    has no room for it (4 bytes a parameter beside the measuring engines). Float32 runs keep
    the fixed table. A failure here leaves the table's bounds in force and is recorded, never
    silently. With the weights' fingerprint, a measurement of the same weights is reused.
    """
    s = ctx.settings
    if ctx.dtype in (torch.float32, torch.float64) or not s.calibrate:
        return _table_bounds(ctx, "float32 or wider: the fixed bounds" if s.calibrate else "calibration off")
    key = None
    if fingerprint is not None:
        key = (repr(model_config), str(ctx.dtype), str(ctx.device), tuple(sorted(fingerprint.items())),
               s.num_prompts, s.steps, s.precision_factor, s.top_k_compare)
        if key in _CALIBRATIONS:
            ctx.calibrated, evidence = _CALIBRATIONS[key]
            return {**evidence, "reused": True}
    evidence = _measure_calibration(ctx, model_config, weights, stock)
    if key is not None and evidence.get("calibrated"):
        while len(_CALIBRATIONS) >= 4:
            _CALIBRATIONS.pop(next(iter(_CALIBRATIONS)))
        _CALIBRATIONS[key] = (ctx.calibrated, evidence)
    return evidence


def _measure_calibration(ctx: GateContext, model_config: Any, weights: dict[str, torch.Tensor],
                         stock: LoadedBundle | None) -> dict[str, Any]:
    own = None
    out_of_memory: list[str] = []
    try:
        if stock is None:
            from shapeshift.engine.forward_pass.importer import load_stock as load_stock_isolated

            stock = own = load_stock_isolated()
        for place in _calibration_places(ctx.device):
            try:
                with torch.inference_mode():
                    weights32 = {name: w.to(place, torch.float32) for name, w in weights.items()}
                    reference32 = stock.module.build(model_config, weights32, dict(stock.recipe))
                    evidence = calibrate_tolerance(ctx, reference32, place)
                return {**evidence, "float32_on": str(place), **({"out_of_memory": out_of_memory} if out_of_memory
                                                                  else {})}
            except torch.cuda.OutOfMemoryError:
                weights32 = reference32 = None  # noqa: F841 - drop the partial copy before the next place
                if place.type == "cuda":
                    torch.cuda.empty_cache()
                out_of_memory.append(str(place))
        return _table_bounds(ctx, f"no room for a float32 copy of the weights on {', '.join(out_of_memory)}")
    except Exception as exc:  # noqa: BLE001 - recorded; the table's bounds stay
        return _table_bounds(ctx, f"{type(exc).__name__}: {exc}")
    finally:
        if own is not None:
            own.unload()


def _table_bounds(ctx: GateContext, reason: str) -> dict[str, Any]:
    """The evidence when the fixed table's bounds stay in force, and why."""
    atol, rtol, _ = ctx.tol
    return {"calibrated": False, "logprob_atol": atol, "logit_rtol": rtol, "reason": reason}


def _calibration_places(device: torch.device) -> list[torch.device]:
    """Where the float32 reference may live: the verification's device, then the host."""
    return [device] if device.type == "cpu" else [device, torch.device("cpu")]
