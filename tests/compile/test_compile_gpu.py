"""The real evaluator on a CUDA GPU (skipped without one): both tiers on one device, a candidate
with Triton kernels and CUDA-graph buckets screened, confirmed in alternation with the stock
pass, and verified."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
from shapeshift.engine.compile.measure import paired_gain
from shapeshift.engine.contracts.traffic_profile import builtin_profile

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_evaluator_on_cuda(tmp_path: Path) -> None:
    ev = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="llama-3.2-1b-shape", device="cuda", max_model_len=4096, fast_layers=2, screen_requests=32,
        confirm_requests=64, screen_repeats=2, confirm_repeats=2, work_dir=str(tmp_path / "work")))
    space = ev.space()
    assert "engine.cuda_graph_max_batch" in space.names and "triton" in space.knob("attention_backend").values
    stock = Candidate(space.default(), agent="baseline")
    tuned = Candidate({**space.default(), "attention_backend": "triton", "norm_backend": "triton", "fuse_qkv": True,
                       "fuse_gate_up": True, "activation_backend": "triton", "edit.index_select_gather": True,
                       "engine.cuda_graph_max_batch": 32, "engine.max_num_seqs": 32}, agent="test")
    assert space.is_valid(tuned.recipe), space.validate(tuned.recipe)
    base = ev.screen(stock)
    cand = ev.screen(tuned)
    assert base.ok and cand.ok, (base.error, cand.error)
    paired, inc = ev.compare(tuned, stock)
    assert paired.ok and inc.ok, (paired.error, inc.error)
    # each candidate measured in a process of its own, its engine over the worker's weights (CUDA IPC)
    assert ev.describe()["measurement"] == "in the candidate's own process"
    print(f"measuring-process starts (s): {[round(t, 2) for t in ev._processes.starts]}")
    gain, low, high = paired_gain(paired, inc)
    print(f"fast tier: stock {base.mean:.0f} tok/s, tuned {cand.mean:.0f} tok/s; "
          f"full tier paired gain {gain:.3f} [{low:.3f}, {high:.3f}]")
    verdict = ev.verify(tuned)
    reasons = {g["name"]: (g.get("reason"), str(g.get("evidence"))[:400]) for g in verdict.report.get("gates", [])
               if not g.get("passed")}
    assert verdict.passed, reasons
    exported = ev.export(tuned, tmp_path / "champion")
    assert len(exported["digest"]) == 64
