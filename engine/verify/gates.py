"""Verification gates: named checks that a candidate forward pass must pass before it is served.

Data flow:

    candidate bundle --import in isolation--> module --build(model_config, weights, recipe)
      --> candidate pass;  reference pass (stock) built over the same weights
    each gate: fresh random prompts (a new seed every run) -> PagedDriver runs both passes
      -> evidence (numbers) -> GateReport(name, passed, evidence)
    -> VerificationReport(passed = every gate passed, gates=[...])

Gates (names are stable; reports and tests refer to them):
  smoke                       build + one prefill + one decode within a deadline, float32 [B, V]
  outputs.finite              no NaN/Inf logits, including long prompts
  outputs.agreement           greedy tokens over many steps (teacher-forced on the reference's
                              tokens; a flip is forgiven only at a near-tie) and logprob tolerance
                              (in half precision the bounds and the near-tie margin calibrated on
                              the reference's own rounding error)
  kv.prefix_hit_equals_miss   a prompt computed over a shared cached prefix == computed fresh
  kv.batched_equals_alone     each sequence's outputs do not depend on its batch mates
  kv.canary_isolation         a canary secret in one request never reaches another: outputs of a
                              request are the same next to a canary-carrying neighbour and in
                              blocks freed by it, and never contain the canary
  kv.swap_compatibility       same declared cache format -> each pass reads the other's cache;
                              different format -> the engine flushes on swap (recorded)
  coverage.shapes             every batch bucket for decode, odd prompt lengths for prefill
  anti_cheat.fresh_inputs     reused input buffers with new contents, same tokens in new contexts
  anti_cheat.poisoned_outputs returned logits are not changed after return; poisoned previous
                              outputs never leak into new ones
  anti_cheat.inputs_unchanged input tensors, context and the shared weights are unchanged
  anti_cheat.no_patching      no clock, sync, math or harness function replaced; no stray threads
  anti_cheat.speed_of_light   harness-timed decode step is not faster than bytes/bandwidth or
                              FLOPs/peak allow
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from shapeshift.engine.verify import anticheat  # first: captures clocks and function identities before any candidate
from shapeshift.engine.forward_pass.hot_reload import (DeadlineExceeded, LoadedBundle, ReloadError, fingerprint_diff, load_bundle_isolated,
                          run_with_deadline, weights_fingerprint)
from shapeshift.engine.verify.agreement import score
from shapeshift.engine.verify.driver import PagedDriver, Seq

GATE_NAMES = (
    "smoke", "outputs.finite", "outputs.agreement", "kv.prefix_hit_equals_miss", "kv.batched_equals_alone",
    "kv.canary_isolation", "kv.swap_compatibility", "coverage.shapes", "anti_cheat.fresh_inputs",
    "anti_cheat.poisoned_outputs", "anti_cheat.inputs_unchanged", "anti_cheat.speed_of_light",
    "anti_cheat.no_patching",
)

# dtype -> (logprob absolute tolerance, logit difference relative to the reference logits'
# standard deviation, near-tie margin in logits). float32: exact refactorings and fusions
# land around 1e-6 relative, while running one MLP in bfloat16 already costs ~5e-3, so the
# float32 bound sits between. Half precision: these are floors. What two correct half-precision
# passes may differ by grows with depth, vocabulary and the number of logits compared (the
# relative bound is a maximum over all of them), so no fixed figure fits every model: before
# the gates, the reference's own rounding error is measured against the same stock pass built
# in float32 over the same weights (`calibrate_tolerance`), and the bounds become
# PRECISION_FACTOR times that error where it is larger. Two passes each as precise as the
# reference differ by about sqrt(2) times it; a further precision drop (e.g. to 8 bits) costs
# an order of magnitude more and still fails.
TOLERANCES = {torch.float32: (1e-4, 1e-4, 1e-4), torch.bfloat16: (0.1, 5e-2, 0.1),
              torch.float16: (0.05, 2e-2, 0.05)}
PRECISION_FACTOR = 2.0


@dataclass
class GateSettings:
    seed: int | None = None  # None -> fresh from os.urandom every run
    num_prompts: int = 4
    steps: int = 16
    min_prompt_len: int = 3
    max_prompt_len: int = 70
    long_prompt_len: int = 200
    batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 5, 8)
    odd_lengths: tuple[int, ...] | None = None  # None -> derived from the block size
    block_size: int = 16
    num_blocks: int = 96
    gate_timeout_s: float = 120.0
    build_timeout_s: float = 120.0
    logprob_atol: float | None = None  # None -> TOLERANCES[dtype]
    logit_rtol: float | None = None
    tie_margin: float | None = None
    top_k_compare: int = 8
    # Half precision: measure the reference's rounding error against float32 first and widen
    # the logprob and logit bounds to precision_factor times it (see TOLERANCES).
    calibrate: bool = True
    precision_factor: float = PRECISION_FACTOR

    def odd(self) -> tuple[int, ...]:
        b = self.block_size
        return self.odd_lengths or (1, 2, 3, 5, 7, b - 1, b, b + 1, 2 * b - 1, 2 * b + 3, 3 * b + 5)


@dataclass
class GateReport:
    name: str
    passed: bool
    evidence: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False

    def __str__(self) -> str:
        state = "SKIP" if self.skipped else ("PASS" if self.passed else "FAIL")
        return f"{state} {self.name}: {self.evidence}"


@dataclass
class VerificationReport:
    candidate: str
    digest: str | None
    seed: int
    gates: list[GateReport]
    tolerance: dict[str, Any] = field(default_factory=dict)  # the bounds used and where they came from

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def failed(self) -> list[str]:
        return [g.name for g in self.gates if not g.passed]

    def gate(self, name: str) -> GateReport:
        return next(g for g in self.gates if g.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "digest": self.digest, "seed": self.seed, "passed": self.passed,
                "failed": self.failed, "tolerance": self.tolerance, "gates": [asdict(g) for g in self.gates]}


class GateFailure(AssertionError):
    def __init__(self, message: str, **evidence: Any) -> None:
        super().__init__(message)
        self.evidence = evidence


@dataclass
class GateContext:
    model_config: Any
    weights: dict[str, torch.Tensor]
    dtype: torch.dtype
    device: torch.device
    reference: Any
    candidate: Any
    reference_cache_format: str
    candidate_cache_format: str
    settings: GateSettings
    rng: random.Random
    seed: int
    # (logprob atol, logit rtol, near-tie margin) from calibrate_tolerance
    calibrated: tuple[float, float, float] | None = None

    @property
    def tol(self) -> tuple[float, float, float]:
        atol, rtol, tie = TOLERANCES.get(self.dtype, (0.1, 5e-2, 0.1))
        if self.calibrated is not None:
            atol, rtol, tie = (max(atol, self.calibrated[0]), max(rtol, self.calibrated[1]),
                               max(tie, self.calibrated[2]))
        s = self.settings
        return (s.logprob_atol or atol, s.logit_rtol or rtol, s.tie_margin or tie)

    def driver(self) -> PagedDriver:
        return PagedDriver(self.model_config, self.dtype, self.device, num_blocks=self.settings.num_blocks,
                           block_size=self.settings.block_size, seed=self.rng.getrandbits(31))

    def prompt(self, length: int | None = None) -> list[int]:
        s = self.settings
        n = length if length is not None else self.rng.randint(s.min_prompt_len, s.max_prompt_len)
        return [self.rng.randrange(self.model_config.vocab_size) for _ in range(n)]


# ------------------------------------------------------------------ comparisons


def compare(ref: list[torch.Tensor], cand: list[torch.Tensor], tol: tuple[float, float, float],
            top_k: int = 8) -> dict[str, Any]:
    """Logits lists (per step, [B, V]) -> agreement, logprob and relative-logit evidence. A
    position whose argmax differs is a flip when the reference's top-2 margin exceeds the
    near-tie margin, else a forgiven near-tie (agreement.score counts them)."""
    atol, rtol, tie = tol
    max_diff = max_rel = sq_rel = 0.0
    n_rel = steps = 0
    finite = True
    for r, c in zip(ref, cand, strict=True):
        if tuple(r.shape) != tuple(c.shape):
            return {"shape_mismatch": [tuple(r.shape), tuple(c.shape)], "ok": False, "finite": True}
        c = c.float()
        finite = finite and bool(torch.isfinite(c).all())
        if not finite:
            break
        lr, lc = torch.log_softmax(r.float(), -1), torch.log_softmax(c, -1)
        top = torch.topk(lr, min(top_k, lr.shape[-1]), dim=-1)
        diff = (lc.gather(-1, top.indices) - top.values).abs().max().item()
        max_diff = max(max_diff, diff)
        spread = r.float().std(dim=-1, keepdim=True).clamp_min(1e-12)  # [B, 1]
        rel = (c - r.float()).abs() / spread
        max_rel = max(max_rel, rel.max().item())
        sq_rel += rel.square().sum().item()
        n_rel += rel.numel()
        steps += 1
    positions = (score(ref[:steps], cand[:steps], tie) if steps else
                 {"positions": 0, "argmax_equal": 0, "clear_argmax_flips": 0, "max_abs_logit_error": 0.0})
    total, flips = positions["positions"], positions["clear_argmax_flips"]
    ok = finite and flips == 0 and max_diff <= atol and max_rel <= rtol
    return {"ok": ok, "finite": finite, "tokens": total, "flips": flips,
            "forgiven_near_ties": total - positions["argmax_equal"] - flips,
            "max_logprob_diff": float(max_diff), "logprob_atol": atol, "max_rel_logit_diff": float(max_rel),
            "logit_rtol": rtol, "rms_rel_logit_diff": (sq_rel / n_rel) ** 0.5 if n_rel else 0.0,
            "max_abs_logit_diff": positions["max_abs_logit_error"], "tie_margin": tie}


def run_pair(ctx: GateContext, prompts: list[list[int]], steps: int, setup: Callable[[PagedDriver, list[Seq]], None]
             | None = None) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Reference greedy on its own driver, candidate teacher-forced on the reference's tokens."""
    ref_driver, cand_driver = ctx.driver(), ctx.driver()
    ref_seqs = [Seq(list(p)) for p in prompts]
    ref_tokens, ref_logits = ref_driver.greedy(ctx.reference, ref_seqs, steps)
    cand_seqs = [Seq(list(p)) for p in prompts]
    _, cand_logits = cand_driver.greedy(ctx.candidate, cand_seqs, steps, forced=ref_tokens)
    return ref_tokens, ref_logits, cand_logits


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


def _require(evidence: dict[str, Any], what: str) -> dict[str, Any]:
    if not evidence.get("ok", False):
        raise GateFailure(what, **evidence)
    return evidence


# ------------------------------------------------------------------ gates


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
    return _require(ev, "outputs differ from the reference")


def gate_prefix_hit(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    bs = s.block_size
    evidence = []
    for _ in range(2):
        shared = ctx.prompt(bs * ctx.rng.randint(1, 3))
        tail = ctx.prompt(ctx.rng.randint(1, bs + 3))
        full = shared + tail
        # miss: the whole prompt computed fresh by the candidate
        miss_driver = ctx.driver()
        miss_tokens, miss_logits = miss_driver.greedy(ctx.candidate, [Seq(list(full))], s.steps // 2)
        # hit: another request computed the shared prefix; this one only computes its tail
        hit_driver = ctx.driver()
        donor = Seq(list(shared) + ctx.prompt(3))
        hit_driver.step(ctx.candidate, [donor])
        child = hit_driver.fork_prefix(donor, full, len(shared) // bs)
        _, hit_logits = hit_driver.greedy(ctx.candidate, [child], s.steps // 2, forced=miss_tokens)
        ev = compare(miss_logits, hit_logits, ctx.tol, s.top_k_compare)
        ev["shared_tokens"] = len(shared)
        evidence.append(_require(ev, "a prefix-cache hit changes the outputs"))
    return {"cases": evidence}


def gate_batched_alone(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    prompts = [ctx.prompt() for _ in range(4)]
    d = ctx.driver()
    tokens_b, logits_b = d.greedy(ctx.candidate, [Seq(list(p)) for p in prompts], s.steps // 2)
    cases = []
    for i, p in enumerate(prompts):
        alone = ctx.driver()
        _, logits_a = alone.greedy(ctx.candidate, [Seq(list(p))], s.steps // 2, forced=[tokens_b[i]])
        ev = compare([x[i:i + 1] for x in logits_b], logits_a, ctx.tol, s.top_k_compare)
        cases.append(_require(ev, f"sequence {i} differs batched vs alone"))
    return {"sequences": len(prompts), "max_logprob_diff": max(c["max_logprob_diff"] for c in cases)}


def gate_canary(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    canary = ctx.prompt(12)  # the secret: a random 12-token string
    victim = ctx.prompt()
    steps = s.steps // 2
    # 1. victim next to a canary-carrying neighbour vs next to a plain neighbour
    d1 = ctx.driver()
    carrier = Seq(ctx.prompt(5) + canary + ctx.prompt(5))
    v1 = Seq(list(victim))
    tok1, log1 = d1.greedy(ctx.candidate, [carrier, v1], steps)
    d2 = ctx.driver()
    plain = Seq(ctx.prompt(len(carrier.tokens)))
    _, log2 = d2.greedy(ctx.candidate, [plain, Seq(list(victim))], steps, forced=[tok1[1], tok1[1]])
    neighbour = compare([x[1:2] for x in log1], [x[1:2] for x in log2], ctx.tol, s.top_k_compare)
    _require(neighbour, "a request's outputs depend on its neighbour's prompt")
    # 2. victim in blocks just freed by the canary carrier vs in never-used blocks
    d3 = ctx.driver()
    holder = Seq(ctx.prompt(3) + canary + ctx.prompt(20))
    d3.greedy(ctx.candidate, [holder], 2)
    freed = list(holder.blocks)
    d3.release(holder)
    v3 = Seq(list(victim))
    tok3, log3 = d3.greedy(ctx.candidate, [v3], steps)
    reused = sorted(set(freed) & set(v3.blocks))
    d4 = ctx.driver()
    _, log4 = d4.greedy(ctx.reference, [Seq(list(victim))], steps, forced=[tok3[0]])
    reuse = compare(log4, log3, ctx.tol, s.top_k_compare)
    reuse["reused_blocks"] = reused
    _require(reuse, "a request in freed blocks sees the previous request's KV")
    # 3. the canary never shows up in the victim's generated tokens
    generated = tok1[1] + tok3[0]
    n = 4
    grams = {tuple(canary[i:i + n]) for i in range(len(canary) - n + 1)}
    leaked = [tuple(generated[i:i + n]) for i in range(len(generated) - n + 1) if tuple(generated[i:i + n]) in grams]
    if leaked:
        raise GateFailure("canary tokens appear in another request's output", leaked=leaked[:3])
    return {"neighbour_max_logprob_diff": neighbour["max_logprob_diff"], "reused_blocks": reused,
            "reuse_max_logprob_diff": reuse["max_logprob_diff"], "canary_ngrams_in_output": 0}


def gate_swap(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    if ctx.candidate_cache_format != ctx.reference_cache_format:
        return {"cache_formats": [ctx.reference_cache_format, ctx.candidate_cache_format],
                "policy": "formats differ: the engine flushes the old pass's KV blocks on swap"}
    prompts = [ctx.prompt() for _ in range(3)]
    steps = s.steps // 2
    d_ref = ctx.driver()
    tok_ref, log_ref = d_ref.greedy(ctx.reference, [Seq(list(p)) for p in prompts], steps)
    results = {}
    for label, writer, reader in (("candidate_writes_reference_reads", ctx.candidate, ctx.reference),
                                  ("reference_writes_candidate_reads", ctx.reference, ctx.candidate)):
        d = ctx.driver()
        _, log_mix = d.greedy(writer, [Seq(list(p)) for p in prompts], steps, decode_fp=reader, forced=tok_ref)
        # The first logits come from the writer's prefill; compare the decode steps only.
        ev = compare(log_ref[1:], log_mix[1:], ctx.tol, s.top_k_compare)
        results[label] = _require(ev, f"declared the same cache format but {label.replace('_', ' ')} differs")
    return {"cache_format": ctx.candidate_cache_format, **results}


def gate_coverage(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    covered = {"decode_batch_sizes": [], "prefill_lengths": []}
    for bs in s.batch_sizes:
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


def gate_fresh_inputs(ctx: GateContext) -> dict[str, Any]:
    """Same token at the same position after different contexts; input buffers reused in place."""
    bs = ctx.settings.block_size
    d_ref, d_cand = ctx.driver(), ctx.driver()
    token = ctx.prompt(1)[0]
    n = bs + 3
    ids_buf = pos_buf = None
    mismatches = []
    for trial in range(3):
        context = ctx.prompt(n)
        outs = []
        for d, fp in ((d_ref, ctx.reference), (d_cand, ctx.candidate)):
            seq = Seq(list(context) + [token])
            d.step(fp, [seq], [n])
            input_ids, positions, actx = d.build_step([seq], [1])
            if fp is ctx.candidate:
                # Reuse one storage for every trial: a cache keyed by address sees "the same input".
                if ids_buf is None:
                    ids_buf, pos_buf = input_ids.clone(), positions.clone()
                ids_buf.copy_(input_ids)
                pos_buf.copy_(positions)
                input_ids, positions = ids_buf, pos_buf
            outs.append(fp.forward(input_ids, positions, actx, d.kv).float().clone())
            d.release(seq)
        ev = compare([outs[0]], [outs[1]], ctx.tol, ctx.settings.top_k_compare)
        if not ev["ok"]:
            mismatches.append({"trial": trial, **ev})
    if mismatches:
        raise GateFailure("outputs repeat earlier answers instead of following new inputs", mismatches=mismatches)
    return {"trials": 3, "same_token_position": True, "reused_input_storage": True}


def gate_poisoned_outputs(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    prompts = [ctx.prompt() for _ in range(3)]
    d_ref, d = ctx.driver(), ctx.driver()
    ref_seqs, seqs = [Seq(list(p)) for p in prompts], [Seq(list(p)) for p in prompts]
    r = d_ref.step(ctx.reference, ref_seqs)
    out = d.step(ctx.candidate, seqs)
    problems = []
    for step in range(s.steps // 2):
        nxt = r.argmax(-1).tolist()
        for q, t in zip(ref_seqs, nxt):
            q.tokens.append(t)
        for q, t in zip(seqs, nxt):
            q.tokens.append(t)
        kept = out.detach().clone()
        prev = out
        r = d_ref.step(ctx.reference, ref_seqs, [1] * len(ref_seqs))
        out = d.step(ctx.candidate, seqs, [1] * len(seqs))
        if not torch.equal(prev, kept):
            problems.append({"step": step, "problem": "an earlier output changed after it was returned"})
        prev.fill_(float("nan"))  # poison: the harness owns returned outputs
        ev = compare([r], [out], ctx.tol, s.top_k_compare)
        if not ev["ok"]:
            problems.append({"step": step, "problem": "output differs after the previous one was poisoned", **ev})
        if problems:
            break
    if problems:
        raise GateFailure("outputs alias or reuse earlier buffers", problems=problems)
    return {"steps": s.steps // 2, "poisoned_previous_outputs": True}


def gate_inputs_unchanged(ctx: GateContext, weights_before: dict[str, tuple]) -> dict[str, Any]:
    d = ctx.driver()
    seqs = [Seq(ctx.prompt()) for _ in range(3)]
    changed = []
    for decode in (False, True):
        if decode:
            for q in seqs:
                q.tokens.append(ctx.prompt(1)[0])
        num_new = [1] * len(seqs) if decode else None
        if num_new is None:
            num_new = [len(q.tokens) - q.num_computed for q in seqs]
        input_ids, positions, actx = d.build_step(seqs, num_new)
        before = {"input_ids": input_ids.clone(), "positions": positions.clone(),
                  **{f"ctx.{k}": v.clone() for k, v in vars(actx).items() if isinstance(v, torch.Tensor)}}
        ctx.candidate.forward(input_ids, positions, actx, d.kv)
        after = {"input_ids": input_ids, "positions": positions,
                 **{f"ctx.{k}": v for k, v in vars(actx).items() if isinstance(v, torch.Tensor)}}
        changed += [f"{'decode' if decode else 'prefill'}:{k}" for k in before if not torch.equal(before[k], after[k])]
        for q, n in zip(seqs, num_new):
            q.num_computed += n
    weights_changed = fingerprint_diff(weights_before, weights_fingerprint(ctx.weights))
    if changed or weights_changed:
        raise GateFailure("the candidate modified its inputs or the shared weights", inputs=changed,
                          weights=weights_changed[:8])
    return {"checked": ["input_ids", "positions", "attention context", f"{len(weights_before)} weight tensors"]}


def gate_no_patching(threads_before: set[int]) -> dict[str, Any]:
    patched = anticheat.patched_functions()
    threads = anticheat.foreign_threads(threads_before)
    if patched or threads:
        restored = anticheat.restore_patched()
        raise GateFailure("the candidate replaced functions the harness relies on or started threads",
                          patched=patched, restored=restored, threads=threads)
    return {"references_checked": len(anticheat._REFERENCE)}


def gate_speed_of_light(ctx: GateContext) -> dict[str, Any]:
    hw = anticheat.detect_hardware(ctx.device)
    batch = 4
    d = ctx.driver()
    seqs = [Seq(ctx.prompt(24)) for _ in range(batch)]
    d.step(ctx.candidate, seqs)
    for q in seqs:
        q.tokens.append(ctx.prompt(1)[0])
    input_ids, positions, actx = d.build_step(seqs, [1] * batch)

    def one_step() -> Any:
        return ctx.candidate.forward(input_ids, positions, actx, d.kv)

    seconds, _ = anticheat.timed(one_step, ctx.device)
    bound = anticheat.decode_step_lower_bound_s(ctx.model_config, ctx.weights, ctx.dtype, batch, 25, hw)
    ev = {"hardware": hw.name, "measured_s": seconds, **bound}
    if seconds < bound["bound_s"]:
        raise GateFailure("measured faster than physically possible", **ev)
    return ev


def check_speed_of_light(measured_s: float, bound: dict[str, float]) -> bool:
    """True when a measurement is physically possible (used by the compile loop on its own timings)."""
    return measured_s >= bound["bound_s"]


# ------------------------------------------------------------------ runner


def _run_gate(name: str, fn: Callable[[], dict[str, Any]], timeout_s: float) -> GateReport:
    def in_inference_mode() -> dict[str, Any]:
        with torch.inference_mode():  # as the runner calls passes (thread-local, so set in the worker)
            return fn()

    try:
        evidence = run_with_deadline(in_inference_mode, timeout_s, f"gate-{name}")
        return GateReport(name, True, evidence or {})
    except GateFailure as exc:
        return GateReport(name, False, {"reason": str(exc), **exc.evidence})
    except DeadlineExceeded as exc:
        return GateReport(name, False, {"reason": str(exc), "timeout": True})
    except BaseException as exc:
        return GateReport(name, False, {"reason": f"{type(exc).__name__}: {exc}"})


def verify_candidate(candidate: str | Path | LoadedBundle, model_config: Any, weights: dict[str, torch.Tensor],
                     *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     reference: Any = None, reference_cache_format: str | None = None,
                     settings: GateSettings | None = None, only: tuple[str, ...] | None = None) -> VerificationReport:
    """Run every gate (or ``only`` these) on a candidate bundle against the reference pass.

    ``reference`` defaults to the stock pass built over ``weights``. A candidate that
    fails ``smoke`` (import, build, crash, hang) gets every other gate marked failed
    and skipped: nothing else can be learned from it.
    """
    settings = settings or GateSettings()
    first = next(iter(weights.values()))
    dtype = dtype or first.dtype
    device = torch.device(device) if device is not None else first.device
    seed = settings.seed if settings.seed is not None else int.from_bytes(os.urandom(4), "little")
    threads_before = {t.ident for t in threading.enumerate()}
    weights_before = weights_fingerprint(weights)
    reports: list[GateReport] = []
    want = set(only or GATE_NAMES)

    stock: LoadedBundle | None = None  # the reference's bundle when loaded here (unloaded at the end)
    if reference is None:
        from shapeshift.engine.forward_pass.hot_reload import load_stock_isolated

        stock = load_stock_isolated()
        reference = stock.module.build(model_config, weights, dict(stock.recipe))
        reference_cache_format = stock.cache_format
    reference_cache_format = reference_cache_format or "kv-format-1"

    loaded: LoadedBundle | None = None
    label = str(candidate)
    fp = None
    try:
        if isinstance(candidate, LoadedBundle):
            loaded = candidate
        else:
            loaded = load_bundle_isolated(candidate, allow_unmanifested=True)
        label = loaded.manifest.name
        fp = run_with_deadline(lambda: loaded.module.build(model_config, weights, dict(loaded.recipe)),
                               settings.build_timeout_s, "build")
        if not callable(getattr(fp, "forward", None)):
            raise ReloadError("build", f"build() returned {type(fp).__name__} without forward()")
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        reports.append(GateReport("smoke", False, {"reason": reason, "stage": getattr(exc, "stage", "build"),
                                                   "timeout": isinstance(exc, DeadlineExceeded)}))
    ctx = GateContext(model_config=model_config, weights=weights, dtype=dtype, device=device, reference=reference,
                      candidate=fp, reference_cache_format=reference_cache_format,
                      candidate_cache_format=loaded.cache_format if loaded is not None else "",
                      settings=settings, rng=random.Random(seed), seed=seed)
    tolerance = _calibrate(ctx, model_config, weights, stock, weights_before) if fp is not None else {}
    plan: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("smoke", lambda: gate_smoke(ctx)),
        ("outputs.finite", lambda: gate_finite(ctx)),
        ("outputs.agreement", lambda: gate_agreement(ctx)),
        ("kv.prefix_hit_equals_miss", lambda: gate_prefix_hit(ctx)),
        ("kv.batched_equals_alone", lambda: gate_batched_alone(ctx)),
        ("kv.canary_isolation", lambda: gate_canary(ctx)),
        ("kv.swap_compatibility", lambda: gate_swap(ctx)),
        ("coverage.shapes", lambda: gate_coverage(ctx)),
        ("anti_cheat.fresh_inputs", lambda: gate_fresh_inputs(ctx)),
        ("anti_cheat.poisoned_outputs", lambda: gate_poisoned_outputs(ctx)),
        ("anti_cheat.inputs_unchanged", lambda: gate_inputs_unchanged(ctx, weights_before)),
        ("anti_cheat.speed_of_light", lambda: gate_speed_of_light(ctx)),
        ("anti_cheat.no_patching", lambda: gate_no_patching(threads_before)),
    ]
    smoke_failed = bool(reports)
    for name, fn in plan:
        if name == "smoke" and smoke_failed:
            continue
        if name not in want and name != "smoke":
            continue
        if smoke_failed and name != "anti_cheat.no_patching":
            reports.append(GateReport(name, False, {"reason": "not run: the candidate failed smoke"}, skipped=True))
            continue
        report = _run_gate(name, fn, settings.gate_timeout_s)
        reports.append(report)
        if name == "smoke" and not report.passed:
            smoke_failed = True
        if report.evidence.get("timeout"):
            smoke_failed = True  # a hung candidate's thread is still blocked; stop using it
    if loaded is not None and not isinstance(candidate, LoadedBundle):
        loaded.unload()
    if stock is not None:
        stock.unload()
    return VerificationReport(candidate=label, digest=loaded.manifest.digest if loaded else None, seed=seed,
                              gates=reports, tolerance=tolerance)


# (model, dtype, device, weights fingerprint, settings) -> (ctx.calibrated, evidence): the stock
# pass's rounding error is a property of the model and its weights, not of the candidate, so
# later verifications in the same process reuse it (it cost ~10 s of a ~22 s verification of
# the 1B shape on an H200). A few entries: one per model a process verifies.
_CALIBRATIONS: dict[tuple, tuple[tuple[float, float, float], dict[str, Any]]] = {}


def _calibrate(ctx: GateContext, model_config: Any, weights: dict[str, torch.Tensor],
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
            from shapeshift.engine.forward_pass.hot_reload import load_stock_isolated

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
