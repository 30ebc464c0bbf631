"""The verifier's CUDA path: each candidate in a process of its own, its weights and KV cache
mapped from this process through CUDA IPC (engine/verify/isolated.py, candidate_process.py,
wire.py). The CPU suite covers the same gates over memfd mappings; these run on a GPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.models.loader import random_weights
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.verify import GATE_NAMES, GateSettings, verify_candidate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA IPC between processes)")

CANDIDATES = Path(__file__).resolve().parents[1] / "fixtures" / "candidates"
SETTINGS = GateSettings(gate_timeout_s=60.0, build_timeout_s=120.0)


@pytest.fixture(scope="module")
def model():
    preset = PRESETS["tiny-llama"]
    cfg = ModelConfig.from_hf(preset.hf_config)
    return cfg, random_weights(cfg, seed=preset.weight_seed, dtype=torch.float32, device="cuda")


def test_a_child_maps_and_writes_this_process_cuda_tensors():
    from shapeshift.engine.verify.isolated import cuda_ipc_problem

    assert cuda_ipc_problem(torch.device("cuda")) is None


def test_a_good_candidate_passes_every_gate_in_its_own_process(model):
    cfg, weights = model
    report = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, settings=SETTINGS)
    assert [g.name for g in report.gates] == list(GATE_NAMES)
    assert report.passed, "\n".join(str(g) for g in report.gates if not g.passed)
    assert report.isolation["process"].startswith("the candidate's own") and report.isolation["forward_calls"] > 0


def test_a_device_named_without_an_index_is_the_current_one(model):
    """The compile loop's engines name their device "cuda": the candidate's process must resolve
    it (torch.cuda.set_device refuses a device without an index), or nothing is ever verified."""
    cfg, weights = model
    report = verify_candidate(CANDIDATES / "good_fused_mlp", cfg, weights, device=torch.device("cuda"),
                              settings=SETTINGS, only=("smoke", "outputs.agreement"))
    assert report.gate("smoke").passed, report.gate("smoke")
    assert report.gate("outputs.agreement").passed, report.gate("outputs.agreement")


@pytest.mark.parametrize("name,gate", [("wrong_math", "outputs.agreement"), ("stale_kv", "kv.canary_isolation"),
                                       ("mutates_inputs", "anti_cheat.inputs_unchanged"),
                                       ("output_alias", "anti_cheat.poisoned_outputs")])
def test_bad_candidates_are_refused_across_cuda_ipc(model, name, gate):
    """Logits back over the wire, the shared KV cache the verifier poisons and reads, inputs the
    candidate changed mirrored back, the output alias mirrored both ways: each on the GPU."""
    cfg, weights = model
    report = verify_candidate(CANDIDATES / name, cfg, weights, settings=SETTINGS)
    assert report.isolation["process"].startswith("the candidate's own"), report.isolation
    target = report.gate(gate)
    assert not report.passed and not target.passed and not target.skipped, f"{gate} did not refuse {name}: {target}"
    assert report.gate("smoke").passed


def test_weights_written_across_cuda_ipc_without_a_copy_say_discard_the_engine(model):
    """The child maps this process's tensors: a sum-keeping swap through .data is found by the device
    digest, and with the compile loop's baseline (no copy to restore from) the gate says discard_engine."""
    from shapeshift.engine.forward_pass.weights_guard import WeightsBaseline

    cfg, weights = model
    weights = {k: w.clone() for k, w in weights.items()}
    report = verify_candidate(CANDIDATES / "weights_swap_keeps_sum", cfg, weights, settings=SETTINGS,
                              weights_baseline=WeightsBaseline(weights),
                              only=("smoke", "anti_cheat.inputs_unchanged"))
    assert report.isolation["process"].startswith("the candidate's own"), report.isolation
    gate = report.gate("anti_cheat.inputs_unchanged")
    assert not gate.passed and "model.embed_tokens.weight" in gate.evidence["weights"], gate
    assert gate.evidence["discard_engine"] and gate.evidence["not_restored"] == ["model.embed_tokens.weight"]
