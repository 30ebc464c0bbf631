"""Every known-bad candidate is rejected by the gate that targets it; the good ones pass all gates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.models.loader import random_weights
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.verify import (GATE_NAMES, HARDWARE, GateSettings, check_speed_of_light,
                                      decode_step_lower_bound_s, verify_candidate)
from shapeshift.engine.verify import anticheat

CANDIDATES = Path(__file__).resolve().parents[1] / "fixtures" / "candidates"

# candidate folder -> the gate that must reject it
BAD = {
    "wrong_math": "outputs.agreement",
    "nan_output": "outputs.finite",
    "cached_by_input": "anti_cheat.fresh_inputs",
    "stale_kv": "kv.canary_isolation",
    "skipped_layer": "outputs.agreement",
    "precision_drop": "outputs.agreement",
    "precision_drop_8bit": "outputs.agreement",
    "low_rank": "outputs.agreement",
    "untested_branch": "coverage.shapes",
    "timing_trick": "anti_cheat.no_patching",
    "hang": "smoke",
    "crash_build": "smoke",
    "crash_forward": "smoke",
    "mutates_inputs": "anti_cheat.inputs_unchanged",
    "output_alias": "anti_cheat.poisoned_outputs",
    "kv_scaled_writes": "kv.swap_compatibility",
}
GOOD = ("good_refactored", "good_fused_mlp")


@pytest.fixture(scope="module")
def model():
    preset = PRESETS["tiny-llama"]
    cfg = ModelConfig.from_hf(preset.hf_config)
    return cfg, random_weights(cfg, seed=preset.weight_seed, dtype=torch.float32, device="cpu")


def settings(timeout_s: float = 30.0) -> GateSettings:
    # Generous on a loaded machine (each candidate runs in its own process); the hang's is short.
    return GateSettings(gate_timeout_s=timeout_s, build_timeout_s=timeout_s)


def test_every_fixture_is_classified():
    # The corpus grown against the verifier's holes (tests/verify/test_corpus.py) has a README each.
    corpus = {p.name for p in CANDIDATES.iterdir() if (p / "README.md").is_file()}
    folders = {p.name for p in CANDIDATES.iterdir() if (p / "forward.py").is_file()}
    assert folders == set(BAD) | set(GOOD) | corpus


@pytest.mark.parametrize("name", GOOD)
def test_good_candidates_pass_every_gate(model, name):
    cfg, weights = model
    report = verify_candidate(CANDIDATES / name, cfg, weights, settings=settings())
    assert [g.name for g in report.gates] == list(GATE_NAMES)
    assert report.passed, "\n".join(str(g) for g in report.gates if not g.passed)
    agreement = report.gate("outputs.agreement").evidence
    assert agreement["tokens"] >= 64 and agreement["flips"] == 0


def test_stock_passes_against_itself(model):
    from shapeshift.engine.forward_pass.bundle import stock_bundle_dir

    cfg, weights = model
    report = verify_candidate(stock_bundle_dir(), cfg, weights, settings=settings())
    assert report.passed, "\n".join(str(g) for g in report.gates if not g.passed)


@pytest.mark.parametrize("name,gate", sorted(BAD.items()))
def test_bad_candidate_rejected_by_its_gate(model, name, gate):
    cfg, weights = model
    report = verify_candidate(CANDIDATES / name, cfg, weights, settings=settings(4.0 if name == "hang" else 30.0))
    assert not report.passed
    target = report.gate(gate)
    assert not target.passed and not target.skipped, f"{gate} did not reject {name}: {target}"
    assert target.evidence.get("reason")
    print(f"{name}: {gate}: {target.evidence['reason']}")
    assert not anticheat.patched_functions()  # a cheating candidate never leaves the process patched
    if gate != "smoke":
        assert report.gate("smoke").passed  # it is a working pass, caught by the specific check


def test_a_reference_given_without_its_format_is_taken_as_the_stock_layout(model):
    """verify_candidate(reference=...) without reference_cache_format: the reference is taken
    to write the stock layout, so a candidate declaring it still gets the swap check."""
    from shapeshift.engine.forward_pass.importer import build_forward_pass, load_stock

    cfg, weights = model
    stock = load_stock()
    try:
        reference = build_forward_pass(stock, cfg, weights)
        report = verify_candidate(CANDIDATES / "kv_scaled_writes", cfg, weights, reference=reference,
                                  settings=settings(), only=("smoke", "kv.swap_compatibility"))
    finally:
        stock.unload()
    swap = report.gate("kv.swap_compatibility")
    assert not swap.passed and not swap.skipped and "cache_formats" not in swap.evidence, swap


@pytest.fixture(scope="module")
def model_bf16(model):
    cfg, weights = model
    return cfg, {name: w.to(torch.bfloat16) for name, w in weights.items()}


def test_half_precision_bounds_come_from_the_reference_rounding_error(model_bf16):
    """bf16: the bounds are max(table, 2 x the stock pass's own error against float32)."""
    cfg, weights = model_bf16
    report = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, settings=settings())
    assert report.passed, "\n".join(str(g) for g in report.gates if not g.passed)
    tol = report.tolerance
    assert tol["calibrated"] and tol["factor"] == 2.0
    measured = tol["reference_vs_float32"]
    assert 0 < measured["max_rel_logit_diff"] < 0.2 and 0 < measured["max_logprob_diff"] < 0.1
    assert tol["logit_rtol"] == pytest.approx(max(5e-2, 2 * measured["max_rel_logit_diff"]))
    assert tol["logprob_atol"] == pytest.approx(max(0.1, 2 * measured["max_logprob_diff"]))
    # The near-tie margin: twice the largest logit error (two logits off by e swap a margin of 2e), x 2.
    assert 0 < measured["max_abs_logit_diff"] < 1.0
    assert tol["tie_margin"] == pytest.approx(max(0.1, 2 * 2 * measured["max_abs_logit_diff"]))
    agreement = report.gate("outputs.agreement").evidence
    assert agreement["logit_rtol"] == tol["logit_rtol"] and agreement["tie_margin"] == tol["tie_margin"]


def test_half_precision_still_refuses_an_8bit_drop(model_bf16):
    cfg, weights = model_bf16
    report = verify_candidate(CANDIDATES / "precision_drop_8bit", cfg, weights, settings=settings())
    agreement = report.gate("outputs.agreement")
    assert report.tolerance["calibrated"] and not agreement.passed
    # Several times the reference's own error, not a near miss.
    floor = report.tolerance["reference_vs_float32"]["max_rel_logit_diff"]
    assert agreement.evidence["max_rel_logit_diff"] > 3 * floor


def test_calibration_sets_the_bound_in_force(model_bf16):
    """A wide factor lets the 8-bit drop through: the calibrated bound is the one applied."""
    cfg, weights = model_bf16
    wide = GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0, precision_factor=100.0)
    report = verify_candidate(CANDIDATES / "precision_drop_8bit", cfg, weights, settings=wide,
                              only=("outputs.agreement",))
    assert report.gate("outputs.agreement").passed, report.gate("outputs.agreement")
    off = GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0, calibrate=False)
    report = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, settings=off, only=("outputs.agreement",))
    assert report.tolerance == {"calibrated": False, "logprob_atol": 0.1, "logit_rtol": 5e-2,
                                "reason": "calibration off"}


def test_calibration_moves_to_the_host_when_the_device_has_no_room(model_bf16, monkeypatch):
    """Test double: the first place's float32 copy runs out of memory, as a full GPU would."""
    from shapeshift.engine.verify import outputs

    cfg, weights = model_bf16
    real = outputs.calibrate_tolerance
    places = []

    def first_place_full(ctx, reference, device=None):
        places.append(device)
        if len(places) == 1:
            raise torch.cuda.OutOfMemoryError("out of memory (test double)")
        return real(ctx, reference, device)

    monkeypatch.setattr(outputs, "_CALIBRATIONS", {})  # measure, not reuse
    monkeypatch.setattr(outputs, "_calibration_places", lambda device: [device, torch.device("cpu")])
    monkeypatch.setattr(outputs, "calibrate_tolerance", first_place_full)
    report = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, settings=settings(),
                              only=("outputs.agreement",))
    assert len(places) == 2 and report.passed
    assert report.tolerance["calibrated"] and report.tolerance["float32_on"] == "cpu"
    assert report.tolerance["out_of_memory"] == ["cpu"]

    def always_full(ctx, reference, device=None):
        raise torch.cuda.OutOfMemoryError("out of memory (test double)")

    monkeypatch.setattr(outputs, "_CALIBRATIONS", {})
    monkeypatch.setattr(outputs, "calibrate_tolerance", always_full)
    report = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, settings=settings(),
                              only=("outputs.agreement",))
    assert report.tolerance["calibrated"] is False and report.tolerance["logit_rtol"] == 5e-2
    assert report.tolerance["reason"] == "no room for a float32 copy of the weights on cpu, cpu"


def test_calibration_is_reused_for_the_same_weights_only(model_bf16, monkeypatch):
    from shapeshift.engine.verify import outputs

    cfg, weights = model_bf16
    monkeypatch.setattr(outputs, "_CALIBRATIONS", {})
    only = ("outputs.agreement",)
    first = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, settings=settings(), only=only).tolerance
    again = verify_candidate(CANDIDATES / "good_refactored", cfg, weights, settings=settings(), only=only).tolerance
    assert "reused" not in first and again["reused"] is True
    assert again["reference_vs_float32"] == first["reference_vs_float32"] and again["logit_rtol"] == first["logit_rtol"]
    other = {name: w.clone() for name, w in weights.items()}  # the same values in other tensors: measured anew
    fresh = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, other, settings=settings(), only=only).tolerance
    assert fresh["calibrated"] and "reused" not in fresh


def test_fresh_prompts_each_run(model):
    cfg, weights = model
    a = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, only=("outputs.agreement",))
    b = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, only=("outputs.agreement",))
    assert a.seed != b.seed
    assert a.gate("outputs.agreement").evidence["prompt_lens"] != b.gate("outputs.agreement").evidence["prompt_lens"]


def test_long_context_gate_decodes_at_the_traffics_prompt_lengths(model):
    """Given the replayed profile's prompt lengths (the compile evaluator passes p50, p90, p99), the
    long-context gate decodes at each of them besides the limit; without them, at one drawn length."""
    from dataclasses import replace

    cfg, weights = model
    only = ("coverage.long_context",)
    given = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, only=only,
                             settings=replace(settings(), traffic_prompt_lens=(26, 140, 900)))
    evidence = given.gate("coverage.long_context").evidence
    limit = settings().max_model_len
    assert given.passed and evidence["from_traffic"]
    assert evidence["context_lens"] == [limit, 26 + 4, 140 + 4]  # 900 is past the limit: the limit covers it
    drawn = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, only=only, settings=settings())
    assert drawn.passed and not drawn.gate("coverage.long_context").evidence["from_traffic"]
    assert len(drawn.gate("coverage.long_context").evidence["context_lens"]) == 2


def test_speed_of_light_bound():
    cfg = ModelConfig.from_hf(PRESETS["llama-3.2-1b-shape"].hf_config)
    # Shapes only: meta tensors carry sizes and dtypes without memory.
    from shapeshift.engine.models.loader import expected_weight_shapes

    weights = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in expected_weight_shapes(cfg).items()}
    bound = decode_step_lower_bound_s(cfg, weights, torch.bfloat16, batch_size=4, context_len=512, hw=HARDWARE["h200"])
    # ~2.5 GB of bf16 weights through 4.8 TB/s: about half a millisecond at least.
    assert 4e-4 < bound["memory_s"] < 7e-4
    assert bound["bound_s"] == max(bound["memory_s"], bound["compute_s"])
    assert not check_speed_of_light(1e-5, bound)  # 10 us for a 1B decode step: impossible
    assert check_speed_of_light(2e-3, bound)


def test_compare_tells_flips_from_forgiven_near_ties():
    """compare(): an argmax change where the reference's margin is under the near-tie margin is
    forgiven, above it a flip that fails; shapes that differ and non-finite logits fail too."""
    from shapeshift.engine.verify.context import compare

    ref = torch.tensor([[5.0, 4.95, 0.0, 0.0], [5.0, 3.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    near = ref.clone()
    near[0, 1] = 5.05  # margin 0.05: swapped
    ev = compare([ref], [near], (1.0, 1.0, 0.1))
    assert (ev["tokens"], ev["flips"], ev["forgiven_near_ties"]) == (3, 0, 1) and ev["ok"]
    assert ev["max_abs_logit_diff"] == pytest.approx(0.1, abs=1e-5) and ev["tie_margin"] == 0.1
    clear = near.clone()
    clear[1, 1] = 5.5  # margin 2.0: swapped
    ev = compare([ref, ref], [near, clear], (10.0, 10.0, 0.1))
    assert (ev["tokens"], ev["flips"], ev["forgiven_near_ties"]) == (6, 1, 2) and not ev["ok"]
    assert compare([ref], [ref[:2]], (1.0, 1.0, 0.1))["shape_mismatch"] == [(3, 4), (2, 4)]
    bad = ref.clone()
    bad[2, 3] = float("nan")
    ev = compare([ref, ref], [bad, ref], (1.0, 1.0, 0.1))
    assert not ev["finite"] and not ev["ok"] and ev["tokens"] == 0  # stops at the first non-finite step


def test_in_process_only_where_the_candidate_cannot_have_a_process(model, monkeypatch):
    """Every candidate gets a process of its own; the one exception (a GPU that refuses CUDA IPC)
    verifies in-process and says so in the report. Test double: the refusal, on the host."""
    from shapeshift.engine.verify import gates

    cfg, weights = model
    report = verify_candidate(CANDIDATES / "good_refactored", cfg, weights, settings=settings(),
                              only=("outputs.agreement",))
    assert report.passed and report.isolation["process"].startswith("the candidate's own")
    assert report.isolation["forward_calls"] > 0
    monkeypatch.setattr(gates, "_isolation_problem", lambda device: "CUDA IPC unavailable: test double")
    report = verify_candidate(CANDIDATES / "wrong_math", cfg, weights, settings=settings(),
                              only=("outputs.agreement",))
    assert report.isolation == {"process": "in-process", "reason": "CUDA IPC unavailable: test double"}
    assert not report.gate("outputs.agreement").passed


def test_gate_prompts_are_fresh_spans_of_the_replay_text(model):
    """With the replays' text, every gate prompt is a span of it from a fresh offset (the canary
    stays random ids); a good pass still passes and a wrong one is still refused."""
    import random

    from shapeshift.engine.verify.context import GateContext

    cfg, weights = model
    text = tuple((7 * i) % 500 + 3 for i in range(997))  # a stand-in text: any token string will do
    s = GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0, prompt_tokens=text)
    ctx = GateContext(model_config=cfg, weights=weights, dtype=torch.float32, device=torch.device("cpu"),
                      reference=None, candidate=None, reference_cache_format="", candidate_cache_format="",
                      settings=s, rng=random.Random(1), seed=1)
    joined = ",".join(map(str, text + text))
    spans = [ctx.prompt(n) for n in (5, 40, 300)]
    assert all(len(p) == n for p, n in zip(spans, (5, 40, 300)))
    assert all(",".join(map(str, p)) in joined for p in spans[:2])  # contiguous text (the 300 may wrap twice)
    assert len({tuple(ctx.prompt(20)) for _ in range(5)}) == 5  # fresh offsets
    assert ",".join(map(str, ctx.prompt(12, text=False))) not in joined
    only = ("outputs.agreement", "kv.canary_isolation", "coverage.mixed_steps")
    assert verify_candidate(CANDIDATES / "good_refactored", cfg, weights, settings=s, only=only).passed
    assert not verify_candidate(CANDIDATES / "wrong_math", cfg, weights, settings=s,
                                only=("outputs.agreement",)).gate("outputs.agreement").passed


def stock_subclass(folder, imports: str, before_forward: str):
    """A candidate bundle folder whose forward.py subclasses the stock pass and runs
    `before_forward` (source lines, indented for the method body) ahead of the stock forward."""
    folder.mkdir()
    (folder / "forward.py").write_text(
        f"{imports}\n"
        "from shapeshift.engine.forward_pass.importer import import_stock_module\n"
        "stock = import_stock_module()\n"
        "CACHE_FORMAT_VERSION = stock.CACHE_FORMAT_VERSION\n"
        "class Candidate(stock.StockForwardPass):\n"
        "    def forward(self, input_ids, positions, ctx, kv_cache):\n"
        f"{before_forward}"
        "        return super().forward(input_ids, positions, ctx, kv_cache)\n"
        "def build(model_config, weights, recipe):\n"
        "    return Candidate(model_config, weights, recipe)\n")
    return folder


def test_a_candidate_that_forges_the_wire_is_killed(model, tmp_path):
    """The candidate's process can write to its own socket; a message the harness there would
    never send (here: a prefix announcing more bytes than the limits allow) ends the verification
    with that reason, and the candidate's process is killed."""
    cfg, weights = model
    folder = stock_subclass(tmp_path / "forges_the_wire", "import os, socket, struct",
                            "        for fd in range(3, 64):\n"
                            "            try:\n"
                            "                s = socket.socket(fileno=os.dup(fd))\n"
                            "                if s.family == socket.AF_UNIX:\n"
                            "                    s.sendall(struct.pack('<IQ', 2, 1 << 40) + b'{}')\n"
                            "            except OSError:\n"
                            "                pass\n")
    report = verify_candidate(folder, cfg, weights, settings=settings(), only=("outputs.agreement",))
    smoke = report.gate("smoke")
    assert not smoke.passed and "malformed message" in smoke.evidence["reason"], smoke
    assert report.gate("outputs.agreement").skipped


@pytest.mark.parametrize("death", ["os._exit(3)", "os.kill(os.getpid(), signal.SIGSEGV)"])
def test_a_candidate_whose_process_dies_fails_with_a_clear_message(model, tmp_path, death):
    """A candidate that ends its process (an exit, a crash by signal) mid-verification fails smoke
    with the reason and its last words; this process carries on."""
    cfg, weights = model
    folder = stock_subclass(tmp_path / "dies", "import os, signal, sys",
                            "        if not ctx.is_prefill:\n"
                            "            print('about to go', file=sys.stderr, flush=True)\n"
                            f"            {death}\n")
    report = verify_candidate(folder, cfg, weights, settings=settings())
    smoke = report.gate("smoke")
    assert not smoke.passed and smoke.evidence.get("died"), smoke
    assert "the candidate's process died during forward" in smoke.evidence["reason"]
    assert "about to go" in smoke.evidence["reason"]
    assert all(g.skipped for g in report.gates if g.name not in ("smoke", "anti_cheat.no_patching"))
    assert verify_candidate(CANDIDATES / "good_refactored", cfg, weights, settings=settings(),
                            only=("outputs.agreement",)).passed  # the verifier is unharmed
