"""The SLO each tier's replays are scored by.

    full tier: the objective's SLO, as given (the CompileRun's spec.slo, or the flags)
    fast tier (a few layers deep, several times faster per user): that SLO scaled by the stock
      pass's speed there against the full tier (EngineEvaluator.calibrate_tier_slo measures it;
      calibrate_fast_tier_slo below writes it to the board once and restores it on a resume)
"""

from __future__ import annotations

import statistics
from typing import Any

from shapeshift.engine.compile.measure import FAST, Measurement
from shapeshift.engine.replay.slo import SLO


def slo_scaled_to_tier(slo: SLO, tier: Measurement, full: Measurement) -> SLO:
    """`slo` moved to another tier by the same pass's measured speed on both (`tier` and `full`,
    their p90 per-user speed and p90 TTFT averaged over repeats): each threshold keeps its ratio
    to what that pass achieves, so a promise the pass misses by 20% on the full model is missed
    by 20% on the other tier too. A threshold whose figures are missing or zero stays as given."""
    def ratio(a: list[float], b: list[float]) -> float | None:
        x, y = (statistics.fmean(a) if a else 0.0), (statistics.fmean(b) if b else 0.0)
        return x / y if x > 0 and y > 0 else None

    per_user, ttft = slo.per_user_tokens_per_s_p90, slo.ttft_p90_s
    speed = ratio(tier.per_user_p90, full.per_user_p90)
    wait = ratio(tier.ttft_p90, full.ttft_p90)
    return SLO(ttft_p90_s=ttft * wait if wait else ttft,
               per_user_tokens_per_s_p90=per_user * speed if speed and per_user > 0 else per_user)


def calibrate_fast_tier_slo(evaluator: Any, board: Any, stock: Any, full: Measurement) -> SLO | None:
    """The fast tier's SLO for this run: the one a `fast_tier_slo` note on the board recorded (a
    resumed run), else the evaluator's calibration against the stock pass's full-tier measurement
    `full`, recorded. None where the evaluator scales none (no SLO, or the fast tier is the model)."""
    calibrate = getattr(evaluator, "calibrate_tier_slo", None)
    if not callable(calibrate):
        return None
    recorded = [n for n in board.entries("note") if n.get("fast_tier_slo")]
    if recorded:
        slo = SLO(**recorded[-1]["fast_tier_slo"])
        evaluator.set_tier_slo(FAST, slo)
        return slo
    slo = calibrate(stock, full)
    if slo is not None:
        board.note("loop", f"fast tier scored at {slo.describe()}: the objective's SLO scaled by the stock pass's "
                           "speed there against the full tier", fast_tier_slo=slo.to_dict())
    return slo
