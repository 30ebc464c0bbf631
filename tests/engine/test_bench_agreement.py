"""hack/bench_agreement.py runs end to end on the CPU (tiny preset, float32): every recipe is
scored on the reference's positions, judged against the stock control, with per-layer errors."""

from __future__ import annotations

import json

from harness.scripts import load_hack_script


def load_bench():
    return load_hack_script("bench_agreement")


def test_bench_agreement_cpu(tmp_path, capsys):
    bench = load_bench()
    # fused before stock on the command line: the control still runs first.
    assert bench.main(["--device", "cpu", "--model", "tiny-llama", "--dtype", "float32", "--prompts", "3",
                       "--prompt-len", "8", "--tokens", "4", "--recipes", "fused,stock", "--out-dir", str(tmp_path)]) == 0
    files = list(tmp_path.glob("agreement-tiny-llama-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert {"git_commit", "gpu", "command", "results"} <= set(doc)
    rows = {(r["recipe"], r["batch"]): r for r in doc["results"]}
    assert list(rows) == [("stock", 3), ("stock", 1), ("fused", 3), ("fused", 1)]
    for (recipe, batch), row in rows.items():
        assert row["positions"] == 3 * 4
        # float32 on the float32 reference's own weights: the same tokens, errors at rounding level.
        assert row["argmax_equal"] == row["positions"] and row["rms_logit_error"] < 1e-4
        assert ("verdict" in row) == (recipe != "stock")
        # Per-layer errors of the batched decode (tiny-llama has 2 layers), none at batch 1.
        assert len(row["layer_rel_rms_error"]) == (2 if batch > 1 else 0)
        assert all(e < 1e-4 for e in row["layer_rel_rms_error"])
    assert rows[("fused", 3)]["verdict"]["passed"] and rows[("fused", 1)]["verdict"]["passed"]
    out = capsys.readouterr().out
    assert "PASS" in out and "relative RMS error of the hidden state" in out


def test_layer_probe_sees_every_layer_of_a_decode_step():
    """The probe's per-layer hidden states add up: the last one, normed, gives the logits."""
    import torch

    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.forward_pass.bundle import STOCK_BUNDLE_DIR
    from shapeshift.engine.forward_pass.importer import build_forward_pass, load_bundle
    from shapeshift.engine.models.loader import random_weights
    from shapeshift.engine.models.presets import PRESETS
    from shapeshift.engine.verify.agreement import teacher_forced

    bench = load_bench()
    preset = PRESETS["tiny-llama"]
    cfg = ModelConfig.from_hf(preset.hf_config)
    weights = random_weights(cfg, seed=preset.weight_seed, dtype=torch.float32, device="cpu")
    fp = build_forward_pass(load_bundle(STOCK_BUNDLE_DIR, {}), cfg, weights)
    probe = bench.LayerProbe(fp)
    _, logits = teacher_forced(fp, cfg, torch.float32, "cpu", [[5, 6, 7, 8], [9, 10, 11, 12]], 3, 2)
    assert len(probe.steps) == 2 and all(len(step) == cfg.num_hidden_layers for step in probe.steps)  # decode only
    last = probe.steps[-1][-1]  # [B, H] after the last layer, at the last step
    expected = fp.linear(fp.norm(last, fp.final_norm, None)[0], fp.lm_head, float32_out=True)
    torch.testing.assert_close(expected, logits[-1], atol=1e-5, rtol=1e-5)


def test_probe_agreement_gate_cpu(tmp_path, capsys):
    """hack/probe_agreement_gate.py: the gate passes a recipe that rounds like stock, on every
    seed, with the near-tie margin calibrated beside the bounds (bf16, tiny model)."""
    probe = load_hack_script("probe_agreement_gate")
    assert probe.main(["--model", "tiny-llama", "--device", "cpu", "--recipe", "fused", "--seeds", "1,2",
                       "--out-dir", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("agreement-gate-tiny-llama-*.json")).read_text())
    assert [r["seed"] for r in doc["rows"]] == [1, 2] and all(r["passed"] for r in doc["rows"])
    tol = doc["rows"][0]["tolerance"]
    assert tol["calibrated"] and tol["tie_margin"] == doc["rows"][0]["agreement"]["tie_margin"]
    assert tol["tie_margin"] >= 2 * 2 * tol["reference_vs_float32"]["max_abs_logit_diff"] - 1e-9
    assert doc["rows"][1]["tolerance"].get("reused") is True  # measured once per weights
