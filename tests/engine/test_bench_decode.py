"""hack/bench_decode.py runs end to end on the CPU (tiny preset) and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
BENCH = Path(__file__).resolve().parents[2] / "hack" / "bench_decode.py"


@pytest.mark.slow
def test_bench_decode_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--model", "tiny-llama", "--batch-sizes", "1,2", "--prompt-len", "8",
                       "--new-tokens", "8", "--recipes", "stock,fused", "--repeats", "1",
                       "--out-dir", str(tmp_path)]) == 0
    files = list(tmp_path.glob("decode-tiny-llama-*.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    assert {"git_commit", "gpu", "command", "results"} <= set(result)
    impls = {(r["impl"], r["batch"]) for r in result["results"]}
    assert impls == {(i, b) for i in ("shapeshift[stock]", "shapeshift[fused]", "hf[eager]", "hf[static-cache]")
                     for b in (1, 2)}
    assert all(r["decode_tok_s"] and r["decode_tok_s"] > 0 for r in result["results"])
    # Same weights, float32: HF's greedy tokens equal the engine's.
    eager_b1 = next(r for r in result["results"] if r["impl"] == "hf[eager]" and r["batch"] == 1)
    assert eager_b1["greedy_prefix_match"] == eager_b1["greedy_compared"] == 8
    assert "shapeshift[stock]" in capsys.readouterr().out
