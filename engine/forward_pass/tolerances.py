"""How far two forward passes' logits may differ and still count as the same: the verifier's
bounds (engine/verify/context.py) and the hot-reload KV check's (kv_handover.py)."""

from __future__ import annotations

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
