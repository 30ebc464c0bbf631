"""Cost model: the obvious physics, pruning, and calibration against measured steps."""

from __future__ import annotations

import time

import pytest

from shapeshift.engine.compile.cost_model import (CostModel, Efficiency, HardwareSpec, Layout, Measurement,
                                                  Workload, calibrate_from_forward)
from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.models.presets import PRESETS


def cfg(name: str) -> ModelConfig:
    return ModelConfig.from_hf(PRESETS[name].hf_config)


def test_batch1_decode_on_one_gpu_is_weight_bytes_over_bandwidth() -> None:
    cm = CostModel(cfg("llama-3.2-1b-shape"))
    assert 1.2e9 < cm.total_params() < 1.3e9  # Llama-3.2-1B: 1.24B parameters with tied embeddings
    step, bd = cm.step_time(Layout(), Workload("decode", batch=1, context=128))
    ideal = cm.weight_bytes() / HardwareSpec().measured_copy_bandwidth
    assert bd["memory_s"] > bd["compute_s"] * 10  # batch 1 is memory bound
    assert ideal * 0.95 < step < ideal * 1.15, (step, ideal)


def test_tensor_parallel_splits_bytes_and_adds_all_reduce() -> None:
    cm = CostModel(cfg("llama-3.2-1b-shape"))
    work = Workload("decode", batch=8, context=1024)
    one = cm.step_terms(Layout(tp=1), work)
    two = cm.step_terms(Layout(tp=2), work)
    assert two["weight_bytes"] == pytest.approx(one["weight_bytes"] / 2, rel=0.01)
    assert one["comm_s"] == 0 and two["comm_s"] > 0
    t1, _ = cm.step_time(Layout(tp=1), work)
    t2, _ = cm.step_time(Layout(tp=2), work)
    assert t2 < t1  # halving 2.5 GB of reads beats two small all-reduces per layer
    slow_link = CostModel(cfg("llama-3.2-1b-shape"), HardwareSpec(interconnect_bandwidth=1e9, interconnect_latency=2e-4))
    assert slow_link.step_time(Layout(tp=2), work)[0] > slow_link.step_time(Layout(tp=1), work)[0]
    # more ranks than KV heads replicate KV instead of splitting it
    tp16 = cm.step_terms(Layout(tp=16), work)
    tp8 = cm.step_terms(Layout(tp=8), work)
    assert tp16["kv_bytes"] == pytest.approx(tp8["kv_bytes"])


def test_expert_parallel_only_for_moe_and_it_splits_experts() -> None:
    dense = CostModel(cfg("llama-3.2-1b-shape"))
    assert all(l.ep == 1 for l in dense.layouts(8))
    moe = CostModel(cfg("tiny-moe"))
    layouts = moe.layouts(4)
    assert any(l.ep > 1 for l in layouts) and all(l.gpus == 4 for l in layouts)
    assert all(moe.cfg.num_experts % l.ep == 0 and l.tp % l.ep == 0 for l in layouts)
    work = Workload("decode", batch=64, context=256)
    ep1 = moe.step_terms(Layout(tp=4, ep=1), work)
    ep4 = moe.step_terms(Layout(tp=4, ep=4), work)
    assert ep4["comm_s"] > ep1["comm_s"]  # all-to-all dispatch and combine
    # batch 1 touches top_k experts, a big batch touches (almost) all of them
    assert moe._touched_experts(1) == pytest.approx(moe.cfg.num_experts_per_tok)
    assert moe._touched_experts(512) == pytest.approx(moe.cfg.num_experts, rel=1e-3)


def test_infeasible_layouts_are_pruned_and_ranking_is_sorted() -> None:
    small = HardwareSpec(hbm_bytes=2e9)  # a 2 GB card cannot hold 2.5 GB of weights alone
    cm = CostModel(cfg("llama-3.2-1b-shape"), small)
    all_preds = cm.rank(4, batch=8, context=512, include_infeasible=True)
    feasible = cm.rank(4, batch=8, context=512)
    assert any(not p.feasible and "GB" in p.reason for p in all_preds)
    assert all(p.layout.tp * p.layout.pp >= 2 for p in feasible)
    assert [p.decode_tokens_per_s for p in feasible] == sorted((p.decode_tokens_per_s for p in feasible), reverse=True)


def test_calibration_recovers_known_factors() -> None:
    truth = CostModel(cfg("llama-3.2-1b-shape"), efficiency=Efficiency(bandwidth=0.7, flops=0.45,
                                                                        interconnect=0.5, step_overhead_s=80e-6))
    shots = [(Layout(tp=t), Workload("decode", batch=b, context=c)) for t in (1, 2, 4) for b, c in
             ((1, 128), (16, 1024), (64, 4096))] + [(Layout(tp=t), Workload("prefill", batch=4, context=2048, tokens=8192))
                                                   for t in (1, 2)]
    measured = [Measurement(layout, work, truth.step_time(layout, work)[0]) for layout, work in shots]
    model = CostModel(cfg("llama-3.2-1b-shape"))
    before = [abs(model.step_time(m.layout, m.workload)[0] / m.seconds - 1) for m in measured]
    eff = model.calibrate(measured)
    after = [abs(model.step_time(m.layout, m.workload)[0] / m.seconds - 1) for m in measured]
    assert max(before) > 0.2 and max(after) < 0.05, (before, after)
    assert eff.bandwidth == pytest.approx(0.7, rel=0.1)


def test_calibration_recovers_host_dominated_steps() -> None:
    """Steps where host time (1.2 ms fixed, 40 us a sequence) dwarfs the weight stream, as on a
    CPU: the fit must find both host terms, not explain everything with a low bandwidth."""
    cpu = HardwareSpec(name="cpu", hbm_bandwidth=20e9, measured_copy_bandwidth=10e9, peak_flops=50e9,
                       hbm_bytes=24e9, interconnect_bandwidth=1e9)
    truth = CostModel(cfg("tiny-llama"), cpu, "float32",
                      Efficiency(bandwidth=0.3, flops=0.5, step_overhead_s=1.2e-3, per_sequence_s=40e-6))
    measured = [Measurement(Layout(), w, truth.step_time(Layout(), w)[0])
                for w in (Workload("decode", batch=b, context=14) for b in (1, 4, 16))]
    model = CostModel(cfg("tiny-llama"), cpu, "float32")
    eff = model.calibrate(measured)
    for m in measured:
        assert model.step_time(m.layout, m.workload)[0] == pytest.approx(m.seconds, rel=0.01)
    assert eff.step_overhead_s == pytest.approx(1.2e-3, rel=0.1)
    assert eff.per_sequence_s == pytest.approx(40e-6, rel=0.25)


def test_calibration_on_measured_cpu_forward_passes() -> None:
    """Measured eager steps of tiny-llama on this CPU (no GPU here): after calibration the
    model predicts the measured step times it was fitted to within 25%."""
    import torch

    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine
    from shapeshift.engine.core.sampling import SamplingParams

    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(model="tiny-llama", device="cpu", max_model_len=256, max_num_seqs=16))
    timed = []
    for batch in (1, 4, 16):
        ids = [f"r{batch}-{i}" for i in range(batch)]
        for rid in ids:
            eng.add_request(rid, list(range(1, 9)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        eng.step()  # prefill
        t0 = time.thread_time()
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        timed.append((Workload("decode", batch=batch, context=14), (time.thread_time() - t0) / steps))
    cpu = HardwareSpec(name="cpu", hbm_bandwidth=20e9, measured_copy_bandwidth=10e9, peak_flops=50e9,
                       hbm_bytes=24e9, interconnect_bandwidth=1e9)
    model = calibrate_from_forward(eng.model_config, cpu, "float32", timed)
    for work, seconds in timed:
        assert model.step_time(Layout(), work)[0] == pytest.approx(seconds, rel=0.25)
