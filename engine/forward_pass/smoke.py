"""The smoke check a hot-reload candidate passes before it may serve.

Fresh random prompts run through the candidate and the incumbent, each on a private KV
cache (``paged_driver``), off the serving path: the candidate's logits must be finite and
of the incumbent's shape, and its greedy tokens (teacher-forced on the incumbent's) may lose
to the incumbent's own by more than a tolerance at only a few positions.
"""

from __future__ import annotations

import os
from typing import Any

from shapeshift.engine.forward_pass.importer import ReloadError


def smoke_check(engine: Any, incumbent: Any, candidate: Any, *, prompts: int, steps: int, min_agreement: float,
                logit_tolerance: float | None) -> dict[str, Any]:
    """Raises ReloadError("smoke"); returns the evidence (seed, agreement, tolerance...).

    ``logit_tolerance`` None: 0.25 for 16-bit dtypes, 1e-3 for float32.
    """
    import torch

    from shapeshift.engine.forward_pass.paged_driver import PagedDriver, Seq

    cfg = engine.model_config
    seed = int.from_bytes(os.urandom(4), "little")  # fresh every time
    gen = torch.Generator().manual_seed(seed)
    block_size = engine.kv_cache.block_size
    lengths = [int(x) for x in torch.randint(3, 4 * block_size, (prompts,), generator=gen)]
    prompt_ids = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    need = sum(-(-(n + steps) // block_size) for n in lengths) + 2
    with torch.inference_mode():
        ref_driver = PagedDriver(cfg, engine.dtype, engine.device, num_blocks=need, block_size=block_size, seed=seed)
        ref_tokens, ref_logits = ref_driver.greedy(incumbent, [Seq(list(p)) for p in prompt_ids], steps)
        cand_driver = PagedDriver(cfg, engine.dtype, engine.device, num_blocks=need, block_size=block_size,
                                  seed=seed + 1)
        cand_tokens, cand_logits = cand_driver.greedy(candidate, [Seq(list(p)) for p in prompt_ids], steps,
                                                      forced=ref_tokens)
    finite = all(bool(torch.isfinite(x).all()) for x in cand_logits)
    if not finite:
        raise ReloadError("smoke", "candidate produced NaN/Inf logits on fresh prompts")
    shape_ok = all(tuple(c.shape) == tuple(r.shape) for c, r in zip(cand_logits, ref_logits))
    if not shape_ok:
        raise ReloadError("smoke", f"candidate logits have shape {tuple(cand_logits[0].shape)}, "
                                   f"expected {tuple(ref_logits[0].shape)}")
    tolerance = logit_tolerance
    if tolerance is None:
        tolerance = 0.25 if engine.dtype in (torch.bfloat16, torch.float16) else 1e-3
    # Teacher-forced positions where the candidate's token is worse than the incumbent's
    # own by more than the tolerance, under the incumbent's logits (counted on the device).
    logits = torch.stack(ref_logits).float()  # [steps, B, V]
    mine = torch.tensor(ref_tokens, device=logits.device).T  # [steps, B]
    theirs = torch.tensor(cand_tokens, device=logits.device).T
    deficit = logits.gather(2, mine[..., None]) - logits.gather(2, theirs[..., None])  # [steps, B, 1]
    total, agree = mine.numel(), int((mine == theirs).sum())
    clear = int((deficit > tolerance).sum())  # equal tokens have deficit 0
    agreement = 1.0 - clear / max(total, 1)
    if agreement < min_agreement:
        raise ReloadError("smoke", f"candidate's greedy token is worse than the incumbent's by more than "
                                   f"{tolerance:g} logits at {clear} of {total} positions (at most "
                                   f"{1 - min_agreement:.0%} allowed; {agree} of {total} tokens equal)")
    return {"seed": seed, "prompts": len(prompt_ids), "tokens": total, "agreement": round(agreement, 4),
            "equal_tokens": agree, "logit_tolerance": tolerance}
