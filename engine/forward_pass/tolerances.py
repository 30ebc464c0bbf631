"""How far two forward passes' logits may differ and still count as the same, and the comparison
that says whether they do: the verifier's (engine/verify/context.py) and the hot-reload KV
check's (kv_handover.py). Here, below both, so that a serving engine's swap does not import
the verifier.

    logits lists (per step, [B, V]) --compare(ref, cand, tol)--> ok, finite, flips (score: an
    argmax that moved past the reference's near-tie margin), max logprob and relative logit diff
"""

from __future__ import annotations

from typing import Any

import torch

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
# How many times the reference's own rounding error (measured per verification, and per KV
# hand-over check in half precision) two passes of the same precision may differ by.
PRECISION_FACTOR = 2.0


def score(ref: list[torch.Tensor], cand: list[torch.Tensor], clear_margin: float) -> dict[str, Any]:
    """Per-position comparison of two logits lists (per step, [P, V]) on the same positions."""
    if len(ref) != len(cand) or any(r.shape != c.shape for r, c in zip(ref, cand)):
        raise ValueError("reference and candidate logits cover different positions")
    r = torch.cat(ref).float()
    c = torch.cat(cand).float().to(r.device)
    top2 = r.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    deficit = top2[:, 0] - r.gather(1, c.argmax(-1, keepdim=True)).squeeze(1)  # 0 where the argmax agrees
    flipped = deficit > 0
    clear = margin > clear_margin
    row_max = (c - r).abs().max(dim=-1).values
    return {"positions": int(r.shape[0]), "argmax_equal": int((~flipped).sum()),
            "clear_margin_logits": clear_margin, "clear_argmax_positions": int(clear.sum()),
            "clear_argmax_flips": int((clear & flipped).sum()),
            "largest_flipped_margin_logits": float(margin[flipped].max()) if bool(flipped.any()) else 0.0,
            "worst_deficit_logits": float(deficit.max()),
            "max_abs_logit_error": float(row_max.max()),
            "p99_row_max_abs_logit_error": float(row_max.quantile(0.99)),
            "rms_logit_error": float((c - r).square().mean().sqrt())}


def compare(ref: list[torch.Tensor], cand: list[torch.Tensor], tol: tuple[float, float, float],
            top_k: int = 8) -> dict[str, Any]:
    """Logits lists (per step, [B, V]) -> agreement, logprob and relative-logit evidence. A
    position whose argmax differs is a flip when the reference's top-2 margin exceeds the
    near-tie margin, else a forgiven near-tie (score counts them)."""
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
