"""Speed of light on measured results: a decode rate faster than the model's bytes a step allow
at the device's measured bandwidth is a measurement fault."""

from __future__ import annotations

import torch

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.models.loader import expected_weight_shapes
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.verify.measured import measure_bandwidth, measured_speed_possible


def _shapes(preset: str, dtype: torch.dtype):
    cfg = ModelConfig.from_hf(PRESETS[preset].hf_config)
    # Shapes only: meta tensors carry sizes and dtypes without memory.
    return cfg, {n: torch.empty(s, dtype=dtype, device="meta") for n, s in expected_weight_shapes(cfg).items()}


def test_a_rate_faster_than_the_bandwidth_allows_is_a_fault():
    cfg, weights = _shapes("llama-3.2-1b-shape", torch.bfloat16)
    h200 = 4.8e12 * 0.8  # about what a copy reaches there
    # ~2.5 GB a step at 2 x the measured bandwidth: about 1,500 steps/s at most, 8 tokens each.
    honest = measured_speed_possible(2_000.0, cfg, weights, torch.bfloat16, 8, 512, h200)
    assert honest["ok"] and 8_000 < honest["max_tokens_per_s"] < 20_000, honest
    fault = measured_speed_possible(50_000.0, cfg, weights, torch.bfloat16, 8, 512, h200)
    assert not fault["ok"] and "a measurement fault" in fault["reason"], fault
    print(fault["reason"])
    # A tenth of the bandwidth lowers the ceiling (to the FLOPs bound at most).
    slow = measured_speed_possible(5_000.0, cfg, weights, torch.bfloat16, 8, 512, h200 / 10)
    assert slow["max_tokens_per_s"] < honest["max_tokens_per_s"] / 5 and not slow["ok"]


def test_the_host_bandwidth_is_measured_and_honest_decode_passes():
    bandwidth = measure_bandwidth("cpu", nbytes=32 << 20, repeats=3)
    assert 1e8 < bandwidth < 1e13, bandwidth
    cfg, weights = _shapes("llama-3.2-1b-shape", torch.float32)
    # A host decode step of a 1B float32 model moves ~5 GB: a step in three seconds is honest.
    assert measured_speed_possible(0.3, cfg, weights, torch.float32, 1, 128, bandwidth)["ok"]
    # A million tokens/s would move 5 PB/s.
    assert not measured_speed_possible(1e6, cfg, weights, torch.float32, 1, 128, bandwidth)["ok"]


def test_a_measured_replay_faster_than_light_is_not_a_result(tmp_path, monkeypatch):
    """Through the evaluator's measuring path (EngineEvaluator._interleaved): a clock that runs a
    million times slow (what a patched clock gave before the evaluator timed with the captured
    ones) makes the replay read faster than the device's measured bandwidth and peak allow, and
    the measurement is refused as a fault, not counted as a speedup."""
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
    from shapeshift.engine.contracts.traffic_profile import builtin_profile
    from shapeshift.engine.forward_pass import patch_guard

    evaluator = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", max_model_len=256, confirm_requests=4, confirm_repeats=1, cpu_threads=1,
        work_dir=str(tmp_path)))
    stock = Candidate(evaluator.space().default(), evaluator.stock_source, "test", "stock")
    [honest] = evaluator.measure_together([stock], repeats=1)
    assert honest.error is None and honest.samples, honest.error
    start = patch_guard.perf_counter()
    monkeypatch.setattr(evaluator, "_clock", lambda eng=None: lambda: start + (patch_guard.perf_counter() - start) * 1e-6)
    [faked] = evaluator.measure_together([stock], repeats=1)
    assert faked.error and faked.error.startswith("speed of light: measured "), faked.error
    assert "a measurement fault" in faked.error
    print(faked.error)
