"""outputs.sampling: seeded sampled decoding through the candidate gives the reference's tokens.

The engine samples from the logits a forward pass returns (engine/core/sampling.py on the host,
each seeded request drawing its noise from its own torch.Generator; device_sampling.py's hashed
noise for multi-step chunks), so a pass honours temperature, top-p, top-k and the seed when its
logits are right along a sampled trajectory, not only along the greedy one. The greedy gates
only ever feed a pass its own argmax tokens; a pass that is exact there and wrong once its
inputs leave the greedy path (a sampled token fed back) passes every one of them.

Data flow: settings.sampling rows (temperature, top-p, top-k; a fresh seed each) + fresh prompts
-> the reference decodes free-running, each step's token drawn by the engine's sampler with the
row's seeded generator; the candidate decodes teacher-forced on those tokens, its own logits
sampled with a generator seeded the same (the same noise) and by the device sampler with the
same per-step seeds as the reference's -> a sampled token that differs is a flip unless it was a
near-tie of the sampler's race (argmax of log p - log E) under the reference's logits, or of the
edge of the top-k/top-p set (the two kept sets differ only where the row's logit error moves the
edge, and the candidate's token won the reference's race over its own set within the margin);
with compare() on every step's logits -> evidence.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shapeshift.engine.core.device_sampling import hashed_uniforms, sample_hashed
from shapeshift.engine.core.sampling import SamplingParams, apply_top_k_top_p, sample
from shapeshift.engine.forward_pass.paged_driver import Seq
from shapeshift.engine.verify.context import GateContext, GateFailure, compare


def _generator(device: torch.device, p: SamplingParams) -> torch.Generator | None:
    """As LLMEngine.add_request seeds a request: a generator of its own when seeded and not greedy."""
    if p.seed is None or p.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(p.seed)
    return g


def _host_noise(state: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """The Exp(1) noise sample() drew for a seeded row from a generator in ``state``."""
    g = torch.Generator(device=device)
    g.set_state(state)
    return torch.empty(vocab, dtype=torch.float32, device=device).exponential_(generator=g)


def _kept(scaled: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The tokens a row's top-k and top-p leave to the race (both samplers filter so)."""
    return torch.isfinite(apply_top_k_top_p(scaled[None], torch.tensor([p.top_k], device=scaled.device),
                                            torch.tensor([p.top_p], device=scaled.device))[0])


def _on_the_edge(row: torch.Tensor, p: SamplingParams, tokens: torch.Tensor, delta: float) -> bool:
    """Whether every one of ``tokens`` (ids) sits where a logit error of ``delta`` can move the
    edge of the reference row's kept set: within 2 delta of the k-th logit, or (top-p) with a mass
    of more likely tokens within a factor exp(2 delta / T) of top_p."""
    scaled = row / p.temperature
    vocab = row.shape[-1]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    ordered, order = torch.sort(scaled, descending=True)
    near = torch.zeros(vocab, dtype=torch.bool, device=row.device)
    if k < vocab:
        kth = float(ordered[k - 1]) * p.temperature
        near |= (row - kth).abs() <= 2 * delta
    if p.top_p < 1.0:
        masked = ordered.masked_fill(torch.arange(vocab, device=row.device) >= k, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        factor = math.exp(2 * delta / p.temperature) * (1 + 1e-6)
        window = (before >= p.top_p / factor) & (before <= p.top_p * factor) & torch.isfinite(masked)
        near |= torch.zeros_like(near).scatter(0, order, window)
    return bool(near[tokens].all())


def _near_tie(ref_row: torch.Tensor, p: SamplingParams, noise: torch.Tensor | None, ref_tok: int, cand_tok: int,
              tie: float, cand_row: torch.Tensor | None = None) -> tuple[bool, float]:
    """Whether the candidate's token, drawn with the reference's noise, lost the reference's race
    by no more than the near-tie margin (tie logits / temperature), and by how much it lost. A
    token outside the reference's top-k/top-p set counts only when its logit is within the
    margin of the set's edge (a logit error of that size moves the edge).

    With top-k or top-p, the candidate's own kept set (``cand_row``'s) can differ from the
    reference's at the edge: a token the reference kept the candidate may have cut, so the
    candidate's race was run over other tokens. Such a draw is a near-tie when every token the two
    sets disagree on sits where the row's measured logit error (at most the margin) moves the
    edge, and the candidate's token lost the reference's race over the candidate's set by no more
    than the margin."""
    row = ref_row.float()
    if p.argmax or noise is None:
        deficit = float(row[ref_tok] - row[cand_tok])
        return deficit <= tie, deficit
    scaled = row / p.temperature
    race = scaled - noise.log()  # log p - log E up to the row's constant
    deficit = float(race[ref_tok] - race[cand_tok])
    if p.top_k > 0 or p.top_p < 1.0:
        kept = _kept(scaled, p)
        if cand_row is not None:
            theirs = _kept(cand_row.float() / p.temperature, p)
            differ = (kept ^ theirs).nonzero().flatten()
            if bool(theirs[cand_tok]) and differ.numel():
                delta = min(tie, float((cand_row.float() - row)[kept | theirs].abs().max()))
                best = float(race.masked_fill(~theirs, float("-inf")).max())
                shifted = best - float(race[cand_tok])
                if shifted <= tie / p.temperature and _on_the_edge(row, p, differ, delta):
                    return True, shifted
        if not bool(kept[cand_tok]) and float(row[cand_tok]) < float(row[kept].min()) - tie:
            return False, deficit
    return deficit <= tie / p.temperature, deficit


def gate_sampling(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    device, vocab = ctx.device, ctx.model_config.vocab_size
    params = [SamplingParams(max_tokens=s.steps, temperature=t, top_p=p, top_k=k, seed=ctx.rng.getrandbits(31))
              for t, p, k in s.sampling]
    n = len(params)
    prompts = [ctx.prompt() for _ in params]
    gens = {side: [_generator(device, p) for p in params] for side in ("reference", "candidate")}
    temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    d_ref, d_cand = ctx.driver(), ctx.driver()
    ref_seqs, cand_seqs = [Seq(list(q)) for q in prompts], [Seq(list(q)) for q in prompts]
    r, c = d_ref.step(ctx.reference, ref_seqs), d_cand.step(ctx.candidate, cand_seqs)
    ref_logits: list[torch.Tensor] = []
    cand_logits: list[torch.Tensor] = []
    flips: list[dict[str, Any]] = []
    forgiven = off_greedy = 0
    tie = ctx.tol[2]
    for step in range(s.steps):
        r, c = r.float(), c.float().to(device)
        ref_logits.append(r)
        cand_logits.append(c)
        states = [g.get_state() if g is not None else None for g in gens["reference"]]
        ref_tok, _ = sample(r, params, gens["reference"])
        cand_tok, _ = sample(c, params, gens["candidate"])
        seeds = torch.tensor([ctx.rng.getrandbits(62) for _ in params], dtype=torch.int64, device=device)
        hashed = [torch.empty(n, dtype=torch.int64, device=device) for _ in range(2)]
        for logits, out in zip((r, c), hashed):
            sample_hashed(logits, temperature, top_k, top_p, seeds, out)
        dev_ref, dev_cand = hashed[0].tolist(), hashed[1].tolist()
        greedy = r.argmax(-1).tolist()
        for i, p in enumerate(params):
            off_greedy += int(ref_tok[i] != greedy[i])
            for sampler, a, b in (("host", ref_tok[i], cand_tok[i]), ("device", dev_ref[i], dev_cand[i])):
                if a == b:
                    continue
                if sampler == "host":
                    noise = _host_noise(states[i], vocab, device) if states[i] is not None else None
                else:
                    noise = -torch.log(hashed_uniforms(seeds[i:i + 1], vocab)[0])
                tied, deficit = _near_tie(r[i], p, noise, a, b, tie, cand_row=c[i])
                if tied:
                    forgiven += 1
                else:
                    flips.append({"step": step, "row": i, "sampler": sampler, "reference_token": a,
                                  "candidate_token": b, "race_deficit": round(deficit, 4),
                                  "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k})
        for i, t in enumerate(ref_tok):  # both decode the reference's sampled tokens
            ref_seqs[i].tokens.append(t)
            cand_seqs[i].tokens.append(t)
        if step + 1 < s.steps:
            r, c = d_ref.step(ctx.reference, ref_seqs, [1] * n), d_cand.step(ctx.candidate, cand_seqs, [1] * n)
    ev = compare(ref_logits, cand_logits, ctx.tol, s.top_k_compare)
    ev.update(sampled_token_flips=len(flips), forgiven_sampling_near_ties=forgiven,
              tokens_off_the_greedy_path=off_greedy, rows=[{"temperature": p.temperature, "top_p": p.top_p,
                                                           "top_k": p.top_k, "seed": p.seed} for p in params])
    if flips or not ev["ok"]:
        raise GateFailure("seeded sampled decoding differs from the reference", first_flips=flips[:4], **ev)
    return ev
