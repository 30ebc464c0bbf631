"""hack/bench_decode.py runs end to end on the CPU (tiny preset): engine rows, the float32
agreement check, every baseline in its own process, the floor, and JSON + PNG on disk."""

from __future__ import annotations

import json

import pytest
from harness.scripts import load_hack_script

pytest.importorskip("transformers")


def load_bench():
    return load_hack_script("bench_decode")


@pytest.mark.slow
def test_bench_decode_cpu_smoke(tmp_path, capsys):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--model", "tiny-llama", "--batch-sizes", "1,2", "--prompt-len", "8",
                       "--new-tokens", "8", "--baseline-new-tokens", "8", "--recipes", "stock,fused", "--repeats", "1",
                       "--decode-steps", "1,2,2o",
                       "--check-prompts", "2", "--check-tokens", "8", "--compile-batch-sizes", "1,2",
                       "--out-dir", str(tmp_path)]) == 0
    files = list(tmp_path.glob("decode-tiny-llama-*.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    assert {"git_commit", "gpu", "command", "results", "ceilings", "floor", "agreement"} <= set(result)
    assert result["status"] == "complete"
    impls = {(r["impl"], r["batch"]) for r in result["results"]}
    # decode_steps 2 rows exist; on the CPU (no graphs) the engine takes single steps for them.
    assert impls == {(i, b) for i in ("shapeshift[stock]", "shapeshift[fused]", "shapeshift[stock+k2]",
                                      "shapeshift[fused+k2]", "shapeshift[stock+k2o]", "shapeshift[fused+k2o]",
                                      "hf[eager]", "hf[static-cache]", "torch.compile[none]") for b in (1, 2)}
    assert not [r for r in result["results"] if "error" in r]  # the overlapped rows gave the same tokens
    assert all(r["decode_tok_s"] > 0 and r["share_of_floor"] > 0 for r in result["results"])
    # Same weights (redrawn and fingerprint-checked in each baseline process), float32: the
    # baselines' greedy tokens equal the engine's.
    for row in result["results"]:
        if not row["impl"].startswith("shapeshift"):
            assert row["greedy_prefix_match_vs_engine_stock"] == row["greedy_compared"] == 8, row["impl"]
    check = result["agreement"]
    assert check["passed"] and check["teacher_forced"]["positions"] == 16
    assert (tmp_path / result["plot"]).is_file()
    out = capsys.readouterr().out
    assert "shapeshift[stock]" in out and "floor:" in out and "PASS" in out


def test_curve_comparison_interpolates_and_bounds():
    bench = load_bench()
    theirs = [{"batch": 1, "p90_per_user_tok_s": 100.0, "decode_tok_s": 100.0},
              {"batch": 4, "p90_per_user_tok_s": 50.0, "decode_tok_s": 200.0},
              {"batch": 16, "p90_per_user_tok_s": 10.0, "decode_tok_s": 160.0}]
    ours = [{"batch": 1, "p90_per_user_tok_s": 400.0, "decode_tok_s": 400.0},
            {"batch": 8, "p90_per_user_tok_s": 50.0, "decode_tok_s": 400.0},
            {"batch": 32, "p90_per_user_tok_s": 20.0, "decode_tok_s": 640.0}]
    by_batch = {c["batch"]: c for c in bench.curve_comparison(ours, theirs)}
    assert by_batch[1]["ratio"] is None and "never reaches" in by_batch[1]["note"]
    assert by_batch[8]["hf_tok_s_at_same_per_user"] == pytest.approx(200.0) and by_batch[8]["ratio"] == pytest.approx(2.0)
    # Between HF's points (50 -> 200 tok/s, 10 -> 160): log-log interpolation at 20.
    assert 160.0 < by_batch[32]["hf_tok_s_at_same_per_user"] < 200.0
    bounds = {c["hf_batch"]: c for c in bench.curve_dominance(ours, theirs)}
    assert bounds[1]["ours_batch"] == 1 and bounds[1]["ratio_lower_bound"] == pytest.approx(4.0)
    assert bounds[16]["ours_batch"] == 32 and bounds[16]["ratio_lower_bound"] == pytest.approx(4.0)


def test_decode_steps_specs():
    bench = load_bench()
    assert bench.parse_decode_steps("1, 8,8o") == [(1, False), (8, False), (8, True)]
    for bad in ("", "0", "1o", "x", "8oo"):
        with pytest.raises(ValueError, match="--decode-steps"):
            bench.parse_decode_steps(bad)


def test_recipe_overrides_parse_and_reject_bad_specs():
    bench = load_bench()
    knobs = bench.recipe_with_overrides("fast+fuse_gate_up_activation=false+linear_backend=torch")
    assert knobs["fuse_gate_up_activation"] is False and knobs["linear_backend"] == "torch"
    assert knobs["fuse_norm_into_linear"] is True  # the rest of the named recipe is kept
    assert bench.RECIPES["fast"]["fuse_gate_up_activation"] is True  # the named recipe is untouched
    # Which recipes need CUDA is read from their knobs, so recipe files and overrides count too.
    assert {n for n, k in bench.RECIPES.items() if bench.needs_triton(k)} == {"triton", "gemv", "fast"}
    assert not bench.needs_triton(bench.recipe_with_overrides("fast+attention_backend=torch+norm_backend=torch"
                                                              "+rotary_backend=torch+activation_backend=torch"
                                                              "+linear_backend=torch+moe_backend=torch"))
    with pytest.raises(ValueError, match="unknown recipe 'fastest'"):
        bench.recipe_with_overrides("fastest+fuse_qkv=true")
    with pytest.raises(ValueError, match="not knob=value"):
        bench.recipe_with_overrides("fast+fuse_qkv")


@pytest.mark.slow
def test_profile_at_a_batch_with_an_overridden_recipe(tmp_path):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--model", "tiny-llama", "--profile", "--profile-batch", "3",
                       "--prompt-len", "8", "--recipes", "stock+fuse_qkv=true", "--out-dir", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("decode-profile-tiny-llama-*.json")).read_text())
    assert result["recipes"] == {"stock+fuse_qkv=true": {"fuse_qkv": True}}
    profile = result["profiles"]["stock+fuse_qkv=true"]
    assert profile["batch"] == 3 and profile["mean_rows_per_step"] == 3 and profile["wall_ms_per_step"] > 0
    assert result["batch_sizes"] == [3]


@pytest.mark.slow
def test_recipes_from_a_file(tmp_path):
    bench = load_bench()
    recipes = tmp_path / "recipes.json"
    recipes.write_text(json.dumps({"qkv-fused": {"fuse_qkv": True}}))
    assert bench.main(["--device", "cpu", "--model", "tiny-llama", "--profile", "--prompt-len", "8",
                       "--recipe-file", str(recipes), "--recipes", "qkv-fused+fuse_gate_up=true",
                       "--out-dir", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("decode-profile-tiny-llama-*.json")).read_text())
    assert result["recipes"] == {"qkv-fused+fuse_gate_up=true": {"fuse_qkv": True, "fuse_gate_up": True}}
    recipes.write_text(json.dumps({"fast": {"fuse_qkv": True}}))
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--model", "tiny-llama", "--profile", "--recipe-file", str(recipes),
                    "--out-dir", str(tmp_path)])


def test_result_names_of_runs_started_in_the_same_second_differ(tmp_path):
    """Two benchmark processes (one per GPU of a host) starting in the same second must not
    write the same results file."""
    bench = load_bench()
    first = bench.claim_result_name(tmp_path, "decode-x-nvidia-h200-20261130T032720Z")
    second = bench.claim_result_name(tmp_path, "decode-x-nvidia-h200-20261130T032720Z")
    assert first == "decode-x-nvidia-h200-20261130T032720Z" and second == "decode-x-nvidia-h200-20261130T032720Z-2"
    assert (tmp_path / f"{first}.json").exists() and (tmp_path / f"{second}.json").exists()


def test_gpu_timeline_charges_each_idle_gap_to_its_kernel_pair():
    """Busy is the union of the GPU spans (overlaps counted once); a gap is charged to the kernel
    that ended last and the one that starts after it; figures are per token."""
    timeline = load_bench().gpu_timeline
    spans = [(0.0, 10.0, "a"), (2.0, 12.0, "b"),  # overlapping: busy 0-12
             (15.0, 20.0, "c"),  # 3 us idle after b (ended last), before c
             (21.0, 22.0, "a"), (26.0, 30.0, "c")]  # 1 us after c before a; 4 us after a before c
    t = timeline(spans, tokens=2)
    assert t["window_us_per_token"] == 15.0
    assert t["busy_us_per_token"] == (12 + 5 + 1 + 4) / 2
    assert t["idle_us_per_token"] == (3 + 1 + 4) / 2
    pairs = {(g["after"], g["before"]): (g["gaps_per_token"], g["us_per_token"]) for g in t["idle_by_pair"]}
    assert pairs == {("b", "c"): (0.5, 1.5), ("c", "a"): (0.5, 0.5), ("a", "c"): (0.5, 2.0)}
    assert [g["us_per_token"] for g in t["idle_by_pair"]] == [2.0, 1.5, 0.5]  # largest first
    assert timeline([], tokens=3) == {"tokens": 3}
