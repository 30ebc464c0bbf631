"""hack/bench_serving.py runs end to end on the CPU (tiny preset): a real server process per
configuration, streaming replays of two saved profiles, pure decode and batch-1 greedy and
sampled runs, JSON with every run and the paired ratios, and a PNG."""

from __future__ import annotations

import json

import pytest
from harness.scripts import load_hack_script

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


@pytest.mark.slow
def test_bench_serving_cpu_smoke(tmp_path):
    bench = load_hack_script("bench_serving")
    assert bench.main(["--device", "cpu", "--model", "tiny-llama", "--profiles", "chat-small,burst-small",
                       "--configs", "before,mixed-graphs", "--max-model-len", "256", "--max-num-seqs", "32",
                       "--max-num-batched-tokens", "256", "--num-requests", "6", "--repeats", "2",
                       "--decode-tokens", "8", "--out-dir", str(tmp_path)]) == 0
    files = list(tmp_path.glob("serving-tiny-llama-cpu-*.json"))
    assert len(files) == 1 and files[0].with_suffix(".png").exists()
    report = json.loads(files[0].read_text())
    assert {"commit", "gpu", "command", "utc"} <= set(report["provenance"])
    assert list(report["configs"]) == ["before", "mixed-graphs"]
    for name, entry in report["configs"].items():
        assert "error" not in entry, entry.get("error")
        assert entry["settings"]["device"] == "cpu"
        for profile in ("chat-small", "burst-small"):
            res = entry["profiles"][profile]
            assert len(res["runs"]) == 2 and res["summary"]["failed"] == 0
            # Every request streamed all its tokens (ignore_eos): the runs' totals agree.
            assert len({r["output_tokens"] for r in res["runs"]}) == 1
            assert res["summary"]["output_tokens_per_s"] > 0 and res["summary"]["ttft_s_p90"] > 0
            # The engine's decode-chain counters over the runs: on the CPU (decode_steps 1) no chains.
            assert res["decode_chains"]["chains"] == 0 and "end.admission" in res["decode_chains"]
        assert entry["pure_decode"]["batch"] == 32
        assert all(r["output_tokens"] == 32 * 8 for r in entry["pure_decode"]["runs"])
        assert entry["batch1"]["greedy"]["per_user_tokens_per_s_p50"] > 0
        assert entry["batch1"]["sampled"]["per_user_tokens_per_s_p50"] > 0
        assert entry["goal"]["target"] == 0.5 and entry["goal"]["ratio"] > 0
        # The server process's counters: on the CPU no graphs, and every mixed step counted.
        assert entry["server"]["mixed_graphs"] == 0 and entry["server"]["mixed_step_shapes"]
    assert report["configs"]["mixed-graphs"]["settings"]["mixed_cuda_graphs"] is True
    ratios = report["paired_ratios"]["output_tokens_per_s"]["mixed-graphs"]
    assert set(ratios) == {"chat-small", "burst-small"} and all(r["pairs"] == 2 for r in ratios.values())
