"""Does a forward pass round no worse than the stock pass in the same dtype? Position by position
against a float32 reference.

A random-weight model's logits are full of near-ties, so two half-precision paths part ways
after a few dozen greedy tokens whatever their quality; and a path scored on the sequence it
chose itself is scored on other positions than its control. Here every path is teacher-forced
on the reference's tokens, so each position is scored for every path:

  reference (float32 pass on the same weights upcast): greedy from the prompts
    -> tokens, logits [P, V] per step
  candidate and control (stock pass in the model's dtype), teacher-forced on those tokens,
    decoding ``batch`` prompts at a time -> logits per step
  -> score(): argmax agreement, logit error (max, p99 of each row's max, RMS), flips of a clear
     argmax (reference top-2 margin above a threshold), worst deficit of the chosen token
  -> judge(): the candidate passes when its p99 and RMS logit errors are within ``factor`` of the
     control's and no argmax clearer than twice the control's largest logit error flips (an
     error of e on two logits can swap a margin up to 2e: below that a flip is rounding luck).

The first logits of each prompt come from its prefill, the rest from decode steps.
"""

from __future__ import annotations

from typing import Any

import torch

from shapeshift.engine.forward_pass.paged_driver import DEFAULT_BLOCK_SIZE, PagedDriver, Seq
# score() lives with the comparison the gates and the hot-reload KV check share
from shapeshift.engine.forward_pass.tolerances import score

ERROR_FACTOR = 1.25  # candidate p99 / RMS logit error allowed over the control's
ABS_SLACK = 1e-3  # logits: lets float32 paths (control error ~0) pass on summation order alone


def teacher_forced(fp: Any, model_config: Any, dtype: torch.dtype, device: torch.device | str,
                   prompts: list[list[int]], steps: int, batch: int, forced: list[list[int]] | None = None
                   ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy (or, with ``forced``, teacher-forced) decode of every prompt by ``fp`` over a paged
    cache of ``dtype`` (a PagedDriver holding one group's blocks), ``batch`` sequences at a time
    -> (argmax tokens per prompt, float32 logits [P, V] per step, prompts in order)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    blocks_per_seq = -(-(max(len(p) for p in prompts) + steps + 1) // DEFAULT_BLOCK_SIZE)
    driver = PagedDriver(model_config, dtype, device, num_blocks=min(batch, len(prompts)) * blocks_per_seq + 8)
    tokens: list[list[int]] = []
    groups: list[list[torch.Tensor]] = []
    for start in range(0, len(prompts), batch):
        seqs = [Seq(list(p)) for p in prompts[start:start + batch]]
        got, logits = driver.greedy(fp, seqs, steps, forced=None if forced is None else forced[start:start + batch])
        tokens += got
        groups.append([x.float() for x in logits])
        for seq in seqs:
            driver.release(seq)
    return tokens, [torch.cat(rows) for rows in zip(*groups)]


def judge(ref: list[torch.Tensor], cand: list[torch.Tensor], control: list[torch.Tensor],
          min_clear_margin: float = 0.05, factor: float = ERROR_FACTOR) -> dict[str, Any]:
    """The verdict on ``cand`` against ``control`` (both scored against ``ref``)."""
    control_error = max(float((c.float().to(r.device) - r.float()).abs().max()) for r, c in zip(ref, control))
    margin = max(min_clear_margin, 2.0 * control_error)
    ctl, mine = score(ref, control, margin), score(ref, cand, margin)
    limits = {key: factor * ctl[key] + ABS_SLACK for key in ("p99_row_max_abs_logit_error", "rms_logit_error")}
    failures = [f"{key} {mine[key]:.4f} > {limit:.4f} ({factor} x the control's {ctl[key]:.4f})"
                for key, limit in limits.items() if mine[key] > limit]
    if mine["clear_argmax_flips"]:
        failures.append(f"{mine['clear_argmax_flips']} flips of an argmax clearer than {margin:.4f} logits")
    return {"passed": not failures, "failures": failures, "limits": limits, "error_factor": factor,
            "candidate": mine, "control": ctl}


__all__ = ["ERROR_FACTOR", "judge", "score", "teacher_forced"]
