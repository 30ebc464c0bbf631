"""The adversarial corpus grown against the verifier's known holes (issue 31), one entry per
class of hole: each known-bad candidate must be rejected by the gate named here, with a reason.

Class 1 (tampering with the verifier from inside its process) is closed by running every
candidate in a process of its own, to be verified (engine/verify/isolated.py) and to be measured
(engine/verify/measured_engine.py): what the candidate edits there is not what judges or times
it. A candidate that patches the clocks or the harness there anyway is caught after the replay
(`measured.no_patching`, from that process's own record of the harness before it ran); with
measurement in the worker's process (isolate_measurement off) the evaluator times with the
clocks captured before any candidate loaded and puts back what it changed
(forward_pass/patch_guard.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.forward_pass.importer import load_bundle
from shapeshift.engine.forward_pass.weights_guard import WeightsBaseline
from shapeshift.engine.models.loader import random_weights
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.verify import GateSettings, anticheat, verify_candidate
from shapeshift.engine.verify import context as verify_context

CANDIDATES = Path(__file__).resolve().parents[1] / "fixtures" / "candidates"

# candidate -> (class of hole, the gate that must reject it)
CORPUS = {
    "tamper_tolerances": (1, "outputs.agreement"),
    "tamper_reference": (1, "outputs.agreement"),
    "tamper_verify_candidate": (1, "measured.no_patching"),
    "tamper_measured_thresholds": (1, "measured.no_patching"),
    "lazy_off_gate_thread": (2, "measured.outputs"),
    "lazy_off_verifier_stack": (2, "measured.outputs"),
    "long_context_window": (3, "coverage.long_context"),
    "odd_batch_sizes": (3, "coverage.shapes"),
    "mixed_step": (3, "coverage.mixed_steps"),
    "sampling_off_greedy_path": (3, "outputs.sampling"),
    "shared_call_state": (3, "coverage.concurrent_calls"),
    "odd_batch_above_16": (3, "coverage.shapes"),
    "padded_rows_wrap_slot": (3, "coverage.padded_batches"),
    "padded_batch_lazy": (3, "coverage.padded_batches"),
    "compact_block_table": (3, "coverage.block_pool"),
    "high_blocks_lazy": (3, "coverage.block_pool"),
    "mixed_graph_lazy": (3, "coverage.padded_batches"),
    "weights_swap_keeps_sum": (4, "anti_cheat.inputs_unchanged"),
    "weights_touched_when_measured": (4, "anti_cheat.inputs_unchanged"),
    "thread_named_shapeshift": (5, "anti_cheat.no_patching"),
    "unwatched_thread_clock": (5, "anti_cheat.no_patching"),
    "work_in_another_process": (5, "measured.no_processes"),
}
# Caught by their gate and by no other: every other gate passes them.
ONLY_THEIR_GATE = {"sampling_off_greedy_path", "shared_call_state", "odd_batch_above_16", "padded_rows_wrap_slot",
                   "padded_batch_lazy", "compact_block_table", "high_blocks_lazy", "mixed_graph_lazy"}
# Verified with the serving coverage of a deployment (EngineConfig fields): its graph buckets and
# largest batch, as the compile loop's promotion check verifies (promotion.serving_coverage).
DEPLOYMENT = {"odd_batch_above_16": {"max_num_seqs": 48}, "compact_block_table": {"num_kv_blocks": 1024},
              "high_blocks_lazy": {"num_kv_blocks": 1024}}
# Exact while verified by design: caught where they are measured (the compile loop's replays).
MEASURED = sorted(n for n, (_, gate) in CORPUS.items() if gate == "measured.outputs")
# Tamper with the measuring process they are hot-reloaded into: caught there, after their measurement.
PATCHING = sorted(n for n, (_, gate) in CORPUS.items() if gate == "measured.no_patching")
# Hide work from the measuring clock: caught after their measurement.
HIDING = sorted(n for n, (_, gate) in CORPUS.items() if gate == "measured.no_processes")


@pytest.fixture(scope="module")
def model():
    preset = PRESETS["tiny-llama"]
    cfg = ModelConfig.from_hf(preset.hf_config)
    return cfg, random_weights(cfg, seed=preset.weight_seed, dtype=torch.float32, device="cpu")


@pytest.fixture
def verifier_state():
    """Candidates of class 1 edit the verifier's module state where they run: never here."""
    tolerances = dict(verify_context.TOLERANCES)
    yield
    assert verify_context.TOLERANCES == tolerances, "a candidate changed this process's tolerance table"
    assert not anticheat.patched_functions()


def test_every_corpus_candidate_has_a_readme_naming_its_gate():
    for name, (_, gate) in CORPUS.items():
        readme = (CANDIDATES / name / "README.md").read_text()
        assert f"`{gate}`" in readme, f"{name}/README.md does not name {gate}"


def _verify(name: str, cfg, weights, only=None):
    path = CANDIDATES / name
    baseline = None
    if name == "weights_touched_when_measured":  # the measured hot reload builds it first
        baseline = WeightsBaseline(weights)  # as the compile loop takes it, before the first load
        loaded = load_bundle(path, allow_unmanifested=True)
        loaded.module.build(cfg, weights, dict(loaded.recipe))
        loaded.unload()
    serving = {}
    if name in DEPLOYMENT:
        from shapeshift.engine.compile.promotion import serving_coverage
        from shapeshift.engine.core.config import EngineConfig

        serving = serving_coverage(EngineConfig(device="cpu", max_model_len=512, **DEPLOYMENT[name]))
    settings = GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0, **serving)
    return verify_candidate(path, cfg, weights, settings=settings, weights_baseline=baseline, only=only)


@pytest.mark.parametrize("name", sorted(set(CORPUS) - set(MEASURED) - set(PATCHING) - set(HIDING)))
def test_corpus_candidate_rejected_by_its_gate(model, verifier_state, name):
    cfg, weights = model
    weights = {k: w.clone() for k, w in weights.items()}  # weights tampering stays in this copy
    report = _verify(name, cfg, weights)
    gate = CORPUS[name][1]
    assert not report.passed
    names = [g.name for g in report.gates]
    assert gate in names, f"no gate {gate} in {names}"
    target = report.gate(gate)
    assert not target.passed and not target.skipped and target.evidence.get("reason"), str(target)
    assert report.gate("smoke").passed
    if name in ONLY_THEIR_GATE:
        assert report.failed == [gate], f"{name} failed {report.failed}, not only {gate}"
    print(f"{name}: {gate}: {target.evidence['reason']}")


def test_batch_coverage_reaches_between_the_buckets_past_16():
    """The promotion check's decode batch sizes: every size to 16, every graph bucket up to the
    deployment's max_num_seqs, and three between each bucket past 16 and the next."""
    from shapeshift.engine.compile.promotion import serving_coverage
    from shapeshift.engine.core.config import EngineConfig

    def sizes(**engine):
        return GateSettings(**serving_coverage(EngineConfig(device="cpu", **engine))).decode_batch_sizes()

    assert sizes(max_num_seqs=48) == list(range(1, 18)) + [25, 31, 32, 33, 41, 47, 48]
    assert [n for n in sizes(max_num_seqs=256) if n > 16] == [17, 25, 31, 32, 33, 49, 63, 64, 65, 97, 127, 128,
                                                              129, 193, 255, 256]
    assert sizes(max_num_seqs=16) == list(range(1, 17))
    assert sizes(max_num_seqs=48, cuda_graph_batch_sizes=[8, 24]) == list(range(1, 18)) + [21, 23, 24, 25, 37, 47, 48]


def test_overlapping_calls_are_checked_in_process_too(model, monkeypatch):
    """Where the candidate shares the verifier's process (CUDA IPC refused; forced here), its
    overlapping calls run in two threads of this process: the shared per-call state is caught
    there too, and the good candidate passes."""
    from shapeshift.engine.verify import gates

    cfg, weights = model
    monkeypatch.setattr(gates, "_isolation_problem", lambda device: "forced: the candidate shares this process")
    only = ("coverage.concurrent_calls",)
    for name, passes in (("shared_call_state", False), ("good_refactored", True)):
        report = _verify(name, cfg, weights, only=only)
        assert report.isolation["process"] == "in-process"
        gate = report.gate("coverage.concurrent_calls")
        assert gate.passed is passes, str(gate)
        if not passes:
            assert gate.evidence["mode"] == "overlapping" and gate.evidence["interleaved_max_logprob_diff"] == 0.0


def test_tampered_weights_are_seen_and_never_reach_the_caller(model):
    """On the host the candidate's process maps a copy of the weights: its write is seen there
    (by content), and the caller's tensors are never written."""
    cfg, weights = model
    weights = {k: w.clone() for k, w in weights.items()}
    pristine = {k: w.clone() for k, w in weights.items()}
    report = _verify("weights_swap_keeps_sum", cfg, weights)
    gate = report.gate("anti_cheat.inputs_unchanged")
    assert not gate.passed and "model.embed_tokens.weight" in gate.evidence["weights"]
    assert gate.evidence["restored"] == []  # nothing of the caller's to restore
    assert all(torch.equal(weights[k], pristine[k]) for k in weights)


def test_damage_done_before_verification_is_restored(model):
    """Weights written before verification (while measured in this process) are found against the
    baseline, put back before the candidate's process maps them, and fail inputs_unchanged."""
    cfg, weights = model
    weights = {k: w.clone() for k, w in weights.items()}
    pristine = {k: w.clone() for k, w in weights.items()}
    baseline = WeightsBaseline(weights, keep_copy=True)
    with torch.no_grad():
        weights["model.norm.weight"].mul_(1.01)
    report = verify_candidate(CANDIDATES / "good_refactored", cfg, weights, weights_baseline=baseline,
                              settings=GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0),
                              only=("outputs.agreement", "anti_cheat.inputs_unchanged"))
    gate = report.gate("anti_cheat.inputs_unchanged")
    assert not gate.passed and gate.evidence["before_verification"] == ["model.norm.weight"]
    assert gate.evidence["restored"] == ["model.norm.weight"] and "discard_engine" not in gate.evidence
    assert report.gate("outputs.agreement").passed  # verified over the pristine weights
    assert all(torch.equal(weights[k], pristine[k]) for k in weights)


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory):
    from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
    from shapeshift.engine.contracts.traffic_profile import builtin_profile

    return EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", max_model_len=256, screen_requests=6, confirm_requests=6,
        screen_repeats=1, confirm_repeats=1, cpu_threads=1, work_dir=str(tmp_path_factory.mktemp("work"))))


@pytest.mark.parametrize("name", MEASURED + ["good_refactored"])
def test_measured_outputs_checked_against_the_incumbent(evaluator, name):
    """A pass exact only while verified passes verification, and its measured replays are not a
    result: their tokens differ from the incumbent's on the same requests."""
    from shapeshift.engine.compile.candidate import Candidate

    space = evaluator.space()
    stock = Candidate(space.default(), evaluator.stock_source, "test", "stock")
    cand = Candidate(space.default(), (CANDIDATES / name / "forward.py").read_text(), "test", name)
    cand_m, stock_m = evaluator.compare(cand, stock, repeats=1)
    assert stock_m.error is None
    ev = cand_m.details["measured_outputs"]
    if name.startswith("good_"):
        assert cand_m.error is None and ev["ok"] and ev["first_token_agreement"] == 1.0
        return
    assert cand_m.error and cand_m.error.startswith("measured.outputs: measured outputs diverge"), cand_m.error
    assert not ev["ok"] and ev["first_token_agreement"] < 0.9
    print(f"{name}: {cand_m.error}")
    cfg = evaluator.model_config()
    weights = evaluator._engine("full", {}).weights
    report = verify_candidate(CANDIDATES / name, cfg, weights, settings=GateSettings(gate_timeout_s=30.0))
    # Its tell (the serving loop's thread, or a caller frame of the verifier) says "verified" there:
    # verification alone passes it; only the measured replays, which run as serving does, catch it.
    assert report.passed, report.failed


def test_weights_touched_while_measured_never_reach_the_worker(evaluator):
    """The measured hot reload is where weights_touched_when_measured writes: in the candidate's own
    process, on that process's copy of the weights. The measurement is not a result (the reload's
    weights check refuses it, naming the tensor), the worker's engine and its weights are the same
    objects with the same contents, and the incumbent measured beside it is judged as before."""
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.forward_pass.weights_guard import weights_fingerprint

    space = evaluator.space()
    eng = evaluator._engine("full", {})
    before = weights_fingerprint(eng.weights)
    stock = Candidate(space.default(), evaluator.stock_source, "test", "stock")
    source = (CANDIDATES / "weights_touched_when_measured" / "forward.py").read_text()
    cand_m, stock_m = evaluator.compare(Candidate(space.default(), source, "test", "tamper"), stock, repeats=1)
    assert evaluator.describe()["measurement"] == "in the candidate's own process"
    assert cand_m.error and "modified the engine's shared weights" in cand_m.error, cand_m.error
    assert "model.norm.weight" in cand_m.error and not cand_m.samples
    assert stock_m.error is None and stock_m.samples
    assert evaluator._engine("full", {}) is eng and weights_fingerprint(eng.weights) == before


def test_weights_touched_in_process_discard_the_engine(evaluator, monkeypatch):
    """Measured in the worker's process (isolate_measurement off), the same write reaches the tier
    engine's weights: that measurement is not a result, the engine is rebuilt from the checkpoint,
    and its weights are the pristine ones."""
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.forward_pass.weights_guard import weights_fingerprint

    monkeypatch.setattr(evaluator, "_isolation", (False, "off for this test"))
    space = evaluator.space()
    before = weights_fingerprint(evaluator._engine("full", {}).weights)
    stock = Candidate(space.default(), evaluator.stock_source, "test", "stock")
    source = (CANDIDATES / "weights_touched_when_measured" / "forward.py").read_text()
    cand_m, _ = evaluator.compare(Candidate(space.default(), source, "test", "tamper-in-process"), stock, repeats=1)
    assert cand_m.error and cand_m.error.startswith("weights: the candidate changed the engine's weights"), cand_m.error
    assert "model.norm.weight" in cand_m.error
    after = {k: v[1:] for k, v in weights_fingerprint(evaluator._engine("full", {}).weights).items()}
    assert after == {k: v[1:] for k, v in before.items()}  # same contents (a new engine: new addresses)


def test_promotion_draws_gate_prompts_from_the_replay_text(evaluator):
    """The compile loop's verification (EngineEvaluator.verify -> verify_for_promotion) gives the
    gates the replays' text, through the engine's tokenizer."""
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.compile.promotion import _replay_text

    eng = evaluator._engine("full", {})
    text = _replay_text(eng)
    assert text and len(text) > 1000 and all(0 <= t < eng.model_config.vocab_size for t in text[:1000])
    verdict = evaluator.verify(Candidate(evaluator.space().default(), evaluator.stock_source, "test", "stock"))
    assert verdict.passed, verdict.report["failed"]
    assert verdict.report["isolation"]["process"].startswith("the candidate's own")


def test_damage_left_after_verification_without_a_copy_discards_the_engine(evaluator, monkeypatch):
    """Where the candidate's process writes the engine's own tensors (CUDA: they cross by IPC; here
    the in-process path, forced) and the loop's baseline keeps no copy to restore from, the gates
    say discard_engine, the verification fails and the evaluator drops the engine: the next one is
    rebuilt from the checkpoint with the pristine weights."""
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.forward_pass import patch_guard
    from shapeshift.engine.forward_pass.weights_guard import weights_fingerprint
    from shapeshift.engine.verify import gates

    eng = evaluator._engine("full", {})
    before = {k: v[1:] for k, v in weights_fingerprint(eng.weights).items()}
    def forced(device):
        return "forced: the candidate shares this process"

    monkeypatch.setattr(gates, "_isolation_problem", forced)
    # The evaluator puts back what changed in the verifier before it verifies: the stand-in counts as the original.
    monkeypatch.setitem(patch_guard._HARNESS, (f"{gates.__name__}._isolation_problem", gates, "_isolation_problem"),
                        forced)
    source = (CANDIDATES / "weights_swap_keeps_sum" / "forward.py").read_text()
    verdict = evaluator.verify(Candidate(evaluator.space().default(), source, "test", "tamper"))
    assert not verdict.passed and not verdict.gates["anti_cheat.inputs_unchanged"]
    gate = next(g for g in verdict.report["gates"] if g["name"] == "anti_cheat.inputs_unchanged")
    assert gate["evidence"]["discard_engine"] and gate["evidence"]["restored"] == []
    assert gate["evidence"]["not_restored"] == ["model.embed_tokens.weight"]
    assert "the engine is discarded" in verdict.report["discard_engine"] and "patched" not in verdict.report
    assert "full" not in evaluator._engines  # dropped, not measured or served again
    rebuilt = evaluator._engine("full", {})
    assert rebuilt is not eng
    assert {k: v[1:] for k, v in weights_fingerprint(rebuilt.weights).items()} == before


@pytest.mark.parametrize("name", PATCHING)
def test_tampering_with_the_measuring_process_is_caught_and_undone(evaluator, name):
    """Hot-reloaded into the evaluator to be measured, the candidate patches the verifier, the
    measured-output thresholds, the tolerance table or the clocks there: its measurement is no
    result, everything is put back (the incumbent measured after it is timed and judged as
    before), and the real verification then refuses it."""
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.forward_pass import patch_guard
    from shapeshift.engine.verify import measured

    space = evaluator.space()
    stock = Candidate(space.default(), evaluator.stock_source, "test", "stock")
    cand = Candidate(space.default(), (CANDIDATES / name / "forward.py").read_text(), "test", name)
    tolerances = dict(verify_context.TOLERANCES)
    [honest] = evaluator.measure_together([stock], repeats=1)
    cand_m, stock_m = evaluator.compare(cand, stock, repeats=1)
    assert cand_m.error and cand_m.error.startswith("measured.no_patching: the candidate replaced "), cand_m.error
    assert not cand_m.samples  # refused after its warm-up: no measured repeat counts
    if name == "tamper_verify_candidate":
        assert "shapeshift.engine.verify.verify_candidate" in cand_m.error
    else:
        for what in ("measured.MIN_FIRST_TOKEN_AGREEMENT", "TOLERANCES (contents)", "time.perf_counter"):
            assert what in cand_m.error, what
    print(f"{name}: {cand_m.error}")
    assert patch_guard.put_back() == [] and verify_context.TOLERANCES == tolerances
    assert measured.MIN_FIRST_TOKEN_AGREEMENT == 0.9
    # The incumbent, measured after it: judged and timed as before (no error, a like rate).
    assert stock_m.error is None and stock_m.samples, stock_m.error
    assert 0.2 < stock_m.samples[0] / honest.samples[0] < 5, (stock_m.samples, honest.samples)
    verdict = evaluator.verify(cand)
    assert not verdict.passed and not verdict.gates["outputs.agreement"], verdict.gates
    assert "patched" not in verdict.report  # nothing was left to put back before verification


def test_the_evaluator_times_with_the_captured_clocks(evaluator, monkeypatch):
    """A clock a candidate replaced (here a thousand times slow) neither times a replay nor fails
    the next measurement: the evaluator's clock is the one captured first, and the patch is put back
    before the next candidate is activated, no one's fault."""
    import time

    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.compile.evaluator import replay
    from shapeshift.engine.forward_pass import patch_guard

    stock = Candidate(evaluator.space().default(), evaluator.stock_source, "test", "stock")
    eng = evaluator._activate("full", stock)
    prompts = evaluator._fresh_prompts(evaluator._profile(), eng, 4)
    honest = replay(eng, prompts, 4, evaluator._clock()).output_tokens_per_s
    for clock in ("perf_counter", "process_time", "thread_time"):
        monkeypatch.setattr(time, clock, lambda real=getattr(time, clock): real() * 1e-3)
    assert evaluator._clock() in (patch_guard.perf_counter, patch_guard.process_time, patch_guard.thread_time)
    evaluator._fresh_cache(eng)
    timed = replay(eng, evaluator._fresh_prompts(evaluator._profile(), eng, 4), 4, evaluator._clock())
    assert 0.2 < timed.output_tokens_per_s / honest < 5, (timed.output_tokens_per_s, honest)
    [m] = evaluator.measure_together([stock], repeats=1)
    assert m.error is None and m.samples, m.error
    assert time.perf_counter is patch_guard.perf_counter  # put back before the measurement


@pytest.mark.parametrize("name", HIDING)
def test_work_hidden_from_the_measuring_clock_is_no_result(evaluator, name):
    """A candidate that starts a process of its own (work there would escape the CPU clock of the
    process being measured): its measurement is no result, saying why; its measuring process is
    closed; the incumbent measured beside it is judged as before."""
    from shapeshift.engine.compile.candidate import Candidate

    space = evaluator.space()
    stock = Candidate(space.default(), evaluator.stock_source, "test", "stock")
    cand = Candidate(space.default(), (CANDIDATES / name / "forward.py").read_text(), "test", name)
    cand_m, stock_m = evaluator.compare(cand, stock, repeats=1)
    assert cand_m.error and cand_m.error.startswith("measured.no_processes: the candidate started process"), \
        cand_m.error
    assert not cand_m.samples and stock_m.error is None and stock_m.samples
    print(f"{name}: {cand_m.error}")
