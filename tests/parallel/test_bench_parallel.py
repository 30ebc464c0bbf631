"""hack/bench_parallel.py without GPUs: the plan, the refusal, the ranking arithmetic."""

from __future__ import annotations

import pytest
from harness.scripts import load_hack_script


@pytest.fixture(scope="module")
def bench():
    return load_hack_script("bench_parallel")


def test_refuses_when_fewer_gpus_than_requested(bench, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine has none; make it explicit
    assert bench.main(["--gpus", "2", "--out-dir", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "refusing to run: 2 GPUs requested, 0 visible" in err and "--dry-run" in err


def test_dry_run_plans_every_layout_with_predictions(bench, capsys):
    assert bench.main(["--dry-run", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "== llama-3.2-1b-shape" in out and "== moe-medium-shape" in out
    lines = [line for line in out.splitlines() if line.startswith("tp4-ep1-dp1-pp1 | yes")]
    assert len(lines) == 2  # both models; predicted tok/s are numbers
    assert lines[0].split(" | ")[3].replace(",", "").isdigit()
    assert "pipeline stages are not executed" in out


def test_plan_marks_cost_model_layouts_the_engine_cannot_run(bench):
    from shapeshift.engine.compile.cost_model import CostModel

    cfg = bench.model_config("moe-medium-shape")
    rows = {r["name"]: r for r in bench.plan_layouts(cfg, 4, CostModel(cfg))}
    assert rows["tp4-ep4-dp1-pp1"]["executable"] and rows["tp4-ep4-dp1-pp1"]["cost_layout"] is not None
    assert rows["tp1-ep4-dp1-pp1"]["executable"] and rows["tp1-ep4-dp1-pp1"]["cost_layout"] is None
    assert not rows["tp2-ep1-dp1-pp2"]["executable"]


def test_rankings_and_aggregation(bench):
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    replicas = [{"decode": {"1": {"seqs": 1, "steps": 4, "tokens": 4, "seconds": 2.0}},
                 "prefill": {"prompts": 2, "tokens": 100, "seconds": 1.0}, "build_s": 3, "kv_blocks": 9,
                 "cuda_graphs": 0},
                {"decode": {"1": {"seqs": 0, "steps": 0, "tokens": 0, "seconds": 0.0}},
                 "prefill": {"prompts": 2, "tokens": 100, "seconds": 4.0}, "build_s": 5, "kv_blocks": 9,
                 "cuda_graphs": 0}]
    m = bench.aggregate(replicas, [1])
    assert m["decode"]["1"]["tokens_per_s"] == 2.0 and m["decode"]["1"]["step_s"] == 0.5
    assert m["prefill"]["tokens_per_s"] == 50.0  # all replicas' tokens over the slowest replica
