"""What a measured replay's tokens must share with the reference's on the same requests
(engine/verify/measured.py): first tokens nearly always, and a share of each sequence whose
floor is lower in half precision, where a change of schedule alone changes the rounding."""

from __future__ import annotations

from shapeshift.engine.verify.measured import check_measured_outputs
from shapeshift.engine.compile.measure import Measurement
from shapeshift.engine.verify.measured import (MIN_PREFIX_AGREEMENT, MIN_PREFIX_AGREEMENT_HALF,
                                               measured_outputs_agree, min_prefix_agreement)

REFERENCE = [list(range(100)) for _ in range(10)]


def parted_after(n: int) -> list[list[int]]:
    """The reference's sequences, each parting ways after its first `n` tokens."""
    return [seq[:n] + [t + 1000 for t in seq[n:]] for seq in REFERENCE]


def test_a_schedule_that_changes_rounding_passes_only_the_half_precision_floor():
    late = parted_after(25)  # 25% of every sequence shared, as a bf16 chunk-size change measured
    assert not measured_outputs_agree(late, REFERENCE)["ok"]
    assert min_prefix_agreement("torch.float32") == min_prefix_agreement(None) == MIN_PREFIX_AGREEMENT
    assert min_prefix_agreement("torch.bfloat16") == min_prefix_agreement("float16") == MIN_PREFIX_AGREEMENT_HALF
    ev = measured_outputs_agree(late, REFERENCE, "torch.bfloat16")
    assert ev["ok"] and ev["prefix_agreement"] == 0.25 and ev["min_prefix_agreement"] == MIN_PREFIX_AGREEMENT_HALF
    assert measured_outputs_agree(parted_after(60), REFERENCE)["ok"]


def test_right_on_the_first_token_and_wrong_after_it_fails_either_floor():
    lazy = parted_after(1)
    for dtype in ("torch.float32", "torch.bfloat16"):
        ev = measured_outputs_agree(lazy, REFERENCE, dtype)
        assert not ev["ok"] and ev["first_token_agreement"] == 1.0 and "token prefixes on 1%" in ev["reason"]
    wrong = parted_after(0)
    assert not measured_outputs_agree(wrong, REFERENCE, "torch.bfloat16")["ok"]


def test_the_evaluator_applies_the_floor_of_its_precision():
    def pair():
        return [Measurement(samples=[1.0]), Measurement(samples=[1.0])]

    tokens = {0: parted_after(25), 1: REFERENCE}
    full = pair()
    check_measured_outputs(full, tokens, "torch.float32")
    assert full[0].error.startswith("measured.outputs:") and full[1].error is None
    half = pair()
    check_measured_outputs(half, tokens, "torch.bfloat16")
    assert half[0].error is None and half[0].details["measured_outputs"]["ok"]
