"""engine/verify/agreement.py: paths teacher-forced on a float32 reference's tokens are judged
on the same positions; a pass that rounds like the stock pass in the same dtype passes, one that
drops precision does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.forward_pass.bundle import STOCK_BUNDLE_DIR
from shapeshift.engine.forward_pass.importer import build_forward_pass, load_bundle
from shapeshift.engine.models.loader import random_weights
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.verify.agreement import judge, score, teacher_forced

CANDIDATES = Path(__file__).resolve().parents[1] / "fixtures" / "candidates"
PROMPTS = [[5, 9, 14, 3, 7, 22, 31, 8], [40, 2, 2, 17, 60, 11, 4, 9], [3, 3, 81, 12, 5, 6, 70, 1]]
STEPS = 6


@pytest.fixture(scope="module")
def setup():
    preset = PRESETS["tiny-llama"]
    cfg = ModelConfig.from_hf(preset.hf_config)
    weights = random_weights(cfg, seed=preset.weight_seed, dtype=torch.bfloat16, device="cpu")
    ref_fp = build_forward_pass(load_bundle(STOCK_BUNDLE_DIR, {}), cfg, {k: v.float() for k, v in weights.items()})
    tokens, ref = teacher_forced(ref_fp, cfg, torch.float32, "cpu", PROMPTS, STEPS, len(PROMPTS))
    return cfg, weights, tokens, ref


def forced(setup, bundle, batch: int) -> list[torch.Tensor]:
    cfg, weights, tokens, _ = setup
    fp = build_forward_pass(bundle, cfg, weights)
    return teacher_forced(fp, cfg, torch.bfloat16, "cpu", PROMPTS, STEPS, batch, tokens)[1]


def test_teacher_forced_shapes_and_forcing(setup):
    cfg, _, tokens, ref = setup
    assert len(tokens) == len(PROMPTS) and all(len(t) == STEPS for t in tokens)
    assert len(ref) == STEPS and all(x.shape == (len(PROMPTS), cfg.vocab_size) for x in ref)
    # Greedy: each reference token is the argmax of the logits that chose it.
    for step, logits in enumerate(ref):
        assert logits.argmax(-1).tolist() == [t[step] for t in tokens]
    with pytest.raises(ValueError, match="batch"):
        teacher_forced(None, None, torch.float32, "cpu", PROMPTS, STEPS, 0)


def test_score_of_identical_logits_is_zero_error(setup):
    _, _, _, ref = setup
    s = score(ref, ref, 0.05)
    assert s["positions"] == len(PROMPTS) * STEPS == s["argmax_equal"]
    assert s["clear_argmax_flips"] == 0 and s["max_abs_logit_error"] == 0.0 and s["worst_deficit_logits"] == 0.0
    with pytest.raises(ValueError, match="different positions"):
        score(ref, ref[:-1], 0.05)


def test_a_pass_rounding_like_stock_passes_at_either_batch_shape(setup):
    _, _, _, ref = setup
    stock = load_bundle(STOCK_BUNDLE_DIR, {})
    fused = load_bundle(STOCK_BUNDLE_DIR, {"fuse_qkv": True, "fuse_gate_up": True})
    for batch in (len(PROMPTS), 1):
        control = forced(setup, stock, batch)
        verdict = judge(ref, forced(setup, fused, batch), control)
        assert verdict["passed"], verdict["failures"]
        # The control is judged against itself: it cannot flip past twice its own largest error.
        assert verdict["control"]["clear_argmax_flips"] == 0
        assert verdict["candidate"]["clear_margin_logits"] >= 2 * verdict["control"]["max_abs_logit_error"]
        assert 0 < verdict["control"]["rms_logit_error"] < 0.1  # bf16 rounding, measured, not zero


def test_a_pass_that_drops_precision_fails(setup):
    _, _, _, ref = setup
    control = forced(setup, load_bundle(STOCK_BUNDLE_DIR, {}), len(PROMPTS))
    worse = forced(setup, load_bundle(CANDIDATES / "precision_drop_8bit", allow_unmanifested=True), len(PROMPTS))
    verdict = judge(ref, worse, control)
    assert not verdict["passed"]
    assert any(f.startswith("rms_logit_error") for f in verdict["failures"]), verdict["failures"]
    assert verdict["candidate"]["rms_logit_error"] > verdict["limits"]["rms_logit_error"]
