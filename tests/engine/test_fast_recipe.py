"""The decode recipes "fast" and "gemv" of engine/forward_pass/recipes.py (what hack/bench_decode.py
measures: Triton GEMV projections with float32 lm_head output, SiLU-and-mul in the gate/up
GEMV, the Triton norm/rotary/attention knobs; "fast" also runs RMSNorm in the GEMV
prologues) equal the plain-torch stock pass, through the static-buffer decode path whose
greedy argmax runs inside the (emulated) graph.

Runs in a subprocess: on the CPU, Triton's interpreter must be switched on before triton is
first imported (TRITON_INTERPRET=1), which this test process cannot undo.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

from harness.case_processes import CaseProcesses, selected_cases

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine
    from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES
    from shapeshift.engine.core.sampling import SamplingParams

    preset, device = sys.argv[1], sys.argv[2]
    fuse_norm, fuse_rope, tail, whole, into_tail = (a == "1" for a in sys.argv[3:8])
    fast = dict(NAMED_RECIPES["fast"] if fuse_norm else NAMED_RECIPES["gemv"])  # the measured knob sets
    if fuse_rope:  # and the L2 prefetch of the next weights from the attention kernel (a no-op on the CPU)
        fast.update(fuse_rotary_into_attention=True, attention_l2_prefetch_mb=1)
    if fuse_norm:  # batch-1 decode: o_proj, MLP and the next qkv in one persistent kernel per layer
        fast.update(fuse_layer_tail=tail, fuse_attention_into_layer=whole, fuse_attention_into_tail=into_tail)
    if int(sys.argv[8]):  # the most rows the GEMV takes; larger batches go through F.linear
        fast["gemv_max_rows"] = int(sys.argv[8])
    if int(sys.argv[9]):  # the most decode rows the norm-fused GEMVs take (fast: 1)
        fast["fuse_norm_max_rows"] = int(sys.argv[9])
    base = dict(model=preset, device=device, dtype="float32", max_num_seqs=4, max_model_len=64, block_size=4,
                max_num_batched_tokens=16, cuda_graph_batch_sizes=[1, 2, 4], cuda_graph_context_lens=[16, 64])
    ref = LLMEngine(EngineConfig(**base))
    tri = LLMEngine(EngineConfig(**base, forward_pass_recipe=fast))
    tail_calls, next_attention_calls = [0], [0]
    gemv_rows = set()  # the row counts the GEMV launchers were called with
    for name in ("_gemv", "_gemv_gated"):
        gemv_launcher = getattr(tri.forward_pass, name)

        def gemv_counted(x, *args, _launch=gemv_launcher, **kwargs):
            gemv_rows.add(x.shape[0])
            return _launch(x, *args, **kwargs)
        setattr(tri.forward_pass, name, gemv_counted)
    norm_rows = set()  # the row counts of the norm-fused GEMV calls
    norm_linear = tri.forward_pass.norm_linear

    def norm_counted(h, *args, **kwargs):
        norm_rows.add(h.shape[0])
        return norm_linear(h, *args, **kwargs)
    tri.forward_pass.norm_linear = norm_counted
    if tail:  # the layer kernel in use: attention and tail (whole), or the tail alone
        name = "_whole_layer" if whole else "_layer_tail"
        launcher = getattr(tri.forward_pass, name)

        def counted(*args, **kwargs):
            tail_calls[0] += 1
            next_attention_calls[0] += kwargs.get("next_attention") is not None
            return launcher(*args, **kwargs)
        setattr(tri.forward_pass, name, counted)
    if device == "cuda":  # graphs were captured with the engine: capture again through the counters
        tri.runner.capture_cudagraphs()
    if device == "cpu":
        tri.runner.emulate_graphs = True  # the static-buffer path with the in-graph argmax
        tri.runner.capture_cudagraphs()
    prompts = [[3 + (5 * i + j) % 250 for j in range(n)] for i, n in enumerate([5, 11, 3])]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    diff = (ref.prompt_logits(prompts[1]) - tri.prompt_logits(prompts[1])).abs().max().item()
    # Decode logits through a batch of 2 (<= 16 rows: the GEMV path) against the reference.
    # Three tokens: the prefill's and two decode steps' draws (each step the same host sampling).
    sampled = [SamplingParams(max_tokens=3, temperature=0.8, top_k=20, seed=11 + i, ignore_eos=True, logprobs=True)
               for i in range(3)]
    result = {"ref": ref.generate(prompts, greedy), "fast": tri.generate(prompts, greedy),
              "ref_sampled": ref.generate(prompts, sampled), "fast_sampled": tri.generate(prompts, sampled),
              # one request at a time: batch-1 decode steps (the layer-tail kernel's batch); the
              # 11-token prompt's contexts 12-18 reach both graph widths (16 and 64 tokens), the
              # 3-token one starts at a one-block context
              "ref_single": [ref.generate([p], greedy)[0] for p in prompts[1:]],
              "fast_single": [tri.generate([p], greedy)[0] for p in prompts[1:]], "tail_calls": tail_calls[0],
              "next_attention_calls": next_attention_calls[0], "gemv_rows": sorted(gemv_rows),
              "gemv_max_rows": tri.forward_pass._gemv_max_rows, "norm_rows": sorted(norm_rows),
              "fuse_norm_max_rows": tri.forward_pass._fuse_norm_max_rows,
              "layers": len(tri.forward_pass.layers),
              "max_logit_diff": diff, "graphs": len(tri.runner.graphs), "replays": tri.runner.num_graph_replays,
              "uses_gemv": tri.forward_pass._gemv is not None, "gated": tri.forward_pass._gemv_gated is not None,
              "fused_rope": tri.forward_pass._decode_attention_rope is not None}
    print(json.dumps(result))
''')


# max_rows: gemv_max_rows, norm_rows: fuse_norm_max_rows; 0 = the named recipe's own (fast: the
# GEMV up to 16 rows, the norm fusion at 1). norm_rows 16 keeps the norm-fused GEMVs on the
# multi-row decode batches, so they stay tested.
# On the CPU each case takes 80-140 s in Triton's interpreter, so two run there: the widest fusion
# (norm, rotary, layer tail, attention into the tail) on tiny-llama, and the multi-row norm fusion on
# tiny-qwen3 (q/k norms). The rest run where a GPU is.
ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                            reason="a further recipe case: 80-140 s each in the CPU interpreter; run on CUDA")
CASES = [
    ("tiny-llama", True, True, True, False, True, 0, 0), ("tiny-qwen3", True, False, False, False, False, 0, 16),
    *(pytest.param(*case, marks=ON_GPU) for case in [
        ("tiny-llama", True, False, False, False, False, 0, 16), ("tiny-llama", False, False, False, False, False, 0, 0),
        ("tiny-llama", True, True, False, False, False, 0, 16), ("tiny-llama", True, True, True, False, False, 0, 0),
        ("tiny-qwen3", True, False, True, False, False, 0, 0), ("tiny-llama", True, True, True, True, False, 0, 0),
        ("tiny-llama", True, True, True, False, False, 0, 16), ("tiny-llama", True, False, False, False, False, 2, 16),
        ("tiny-llama", True, True, True, False, False, 1, 0)]),
]


ARGNAMES = ("preset", "fuse_norm", "fuse_rope", "tail", "whole", "into_tail", "max_rows", "norm_rows")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _command(case):
    preset, *flags, max_rows, norm_rows = case
    return [sys.executable, "-c", SCRIPT, preset, DEVICE, *("1" if flag else "0" for flag in flags), str(max_rows),
            str(norm_rows)]


@pytest.fixture(scope="module")
def case_processes(request):
    """The selected cases' subprocesses, side by side (one a core): each is one Python interpreting
    kernels for minutes on the CPU. Each test waits for its own (harness/case_processes.py)."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    runs = CaseProcesses(_command, selected_cases(request, "test_fast_recipe_matches_stock", ARGNAMES), env,
                         timeout=600)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.parametrize(",".join(ARGNAMES), CASES)
def test_fast_recipe_matches_stock(preset, fuse_norm, fuse_rope, tail, whole, into_tail, max_rows, norm_rows,
                                   case_processes):
    proc = case_processes.result((preset, fuse_norm, fuse_rope, tail, whole, into_tail, max_rows, norm_rows))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["uses_gemv"] and result["gated"] and result["fused_rope"] == fuse_rope
    assert result["graphs"] > 0 and result["replays"] > 0  # decode went through the static path
    assert result["fast"] == result["ref"]
    assert result["fast_single"] == result["ref_single"]
    # Batch-1 decode steps went through the layer-tail kernel: one call per layer and step.
    assert (result["tail_calls"] > 0) == tail
    assert result["tail_calls"] % result["layers"] == 0
    # fuse_attention_into_tail: every layer's tail but the last ends in the next layer's attention.
    layers = result["layers"]
    assert result["next_attention_calls"] == (result["tail_calls"] // layers * (layers - 1) if into_tail else 0)
    assert len({tuple(t) for t in result["ref"]}) == 3  # distinct continuations: a real comparison
    assert result["fast_sampled"] == result["ref_sampled"]  # seeded sampling falls back to the logits
    # gemv_max_rows: more rows than it took F.linear; at 16 the GEMV also took the 3-sequence
    # decode batch and the prefill chunks (<= 16 tokens).
    limit = max_rows or 16
    rows = result["gemv_rows"]
    assert result["gemv_max_rows"] == limit
    assert 1 in rows and max(rows) <= limit and (max(rows) >= 3 or limit < 3), rows
    # fuse_norm_max_rows: the norm-fused GEMVs took decode batches up to it (and the GEMV's limit).
    norm_limit = min(limit, norm_rows or 1) if fuse_norm else 0
    assert result["fuse_norm_max_rows"] == norm_limit
    seen = result["norm_rows"]
    assert (1 in seen and max(seen) <= norm_limit and (max(seen) >= 3 or norm_limit < 3)) if fuse_norm \
        else seen == [], seen
    assert result["max_logit_diff"] < 1e-4


def test_fast_recipe_knob_errors():
    """Misconfigured knobs name the knob and the fix."""
    pytest.importorskip("torch")
    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.forward_pass.importer import load_bundle, build_forward_pass
    from shapeshift.engine.models.loader import random_weights
    from shapeshift.engine.models.presets import PRESETS
    from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES
    import torch

    cfg = ModelConfig.from_hf(PRESETS["tiny-llama"].hf_config)
    weights = random_weights(cfg, seed=1, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="fuse_gate_up_activation needs linear_backend: triton"):
        build_forward_pass(load_bundle(None, {"fuse_gate_up_activation": True, "fuse_gate_up": True}), cfg, weights)
    with pytest.raises(ValueError, match="fuse_norm_into_linear needs linear_backend: triton"):
        build_forward_pass(load_bundle(None, {"fuse_norm_into_linear": True}), cfg, weights)
    with pytest.raises(ValueError, match="fuse_rotary_into_attention needs attention_backend: triton"):
        build_forward_pass(load_bundle(None, {"fuse_rotary_into_attention": True, "attention_backend": "triton"}),
                           cfg, weights)
    with pytest.raises(ValueError, match="attention_l2_prefetch_mb needs attention_backend: triton"):
        build_forward_pass(load_bundle(None, {"attention_l2_prefetch_mb": 8}), cfg, weights)
    with pytest.raises(ValueError, match="fuse_layer_tail needs fuse_norm_into_linear"):
        build_forward_pass(load_bundle(None, {"fuse_layer_tail": True, "linear_backend": "triton"}), cfg, weights)
    with pytest.raises(ValueError, match="fuse_attention_into_layer needs fuse_layer_tail: true and "
                                         "fuse_rotary_into_attention: true"):
        build_forward_pass(load_bundle(None, {**NAMED_RECIPES["fast"], "fuse_attention_into_layer": True}), cfg,
                           weights)
    with pytest.raises(ValueError, match="fuse_attention_into_tail needs fuse_layer_tail: true and "
                                         "fuse_rotary_into_attention: true, and fuse_attention_into_layer off"):
        build_forward_pass(load_bundle(None, {**NAMED_RECIPES["fast"], "fuse_attention_into_tail": True}), cfg,
                           weights)
    with pytest.raises(ValueError, match="fuse_attention_into_tail needs"):
        build_forward_pass(load_bundle(None, {**NAMED_RECIPES["fast"], "fuse_rotary_into_attention": True,
                                              "fuse_attention_into_layer": True, "fuse_attention_into_tail": True}),
                           cfg, weights)
    odd = ModelConfig.from_hf({**PRESETS["tiny-llama"].hf_config, "head_dim": 24})
    with pytest.raises(ValueError, match="fuse_attention_into_tail: the model's head_dim must be a power of two"):
        build_forward_pass(load_bundle(None, {**NAMED_RECIPES["fast"], "fuse_rotary_into_attention": True,
                                              "fuse_attention_into_tail": True}), odd,
                           random_weights(odd, seed=1, dtype=torch.float32, device="cpu"))
    with pytest.raises(ValueError, match="fuse_attention_into_layer: the model's head_dim must be a power of two"):
        build_forward_pass(load_bundle(None, {**NAMED_RECIPES["fast"], "fuse_rotary_into_attention": True,
                                              "fuse_attention_into_layer": True}), odd,
                           random_weights(odd, seed=1, dtype=torch.float32, device="cpu"))
    # The regions: o_proj whole, then the fused gate/up weight up to the budget.
    fp = build_forward_pass(load_bundle(None, {"attention_backend": "triton", "fuse_gate_up": True,
                                               "attention_l2_prefetch_mb": 1}), cfg, weights)
    layer = fp.layers[0]
    o_bytes = layer.o_proj.numel() * layer.o_proj.element_size()
    assert [(t is layer.o_proj, t is layer.gate_up_proj, n) for t, n in fp._attention_prefetch[0]] == \
        [(True, False, 1 << 20), (False, True, (1 << 20) - o_bytes)]
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="fuse_norm_max_rows must be an integer from 1 to 16"):
            build_forward_pass(load_bundle(None, {**NAMED_RECIPES["fast"], "fuse_norm_max_rows": bad}), cfg, weights)
    with pytest.raises(ValueError, match="fuse_norm_max_rows needs fuse_norm_into_linear: true"):
        build_forward_pass(load_bundle(None, {**NAMED_RECIPES["gemv"], "fuse_norm_max_rows": 4}), cfg, weights)
    fp = build_forward_pass(load_bundle(None, {**NAMED_RECIPES["fast"], "gemv_max_rows": 4, "fuse_norm_max_rows": 8}),
                            cfg, weights)
    assert (fp._gemv_max_rows, fp._fuse_norm_max_rows) == (4, 4)  # never more rows than the GEMV takes
    for bad in (0, 17, True, "4"):  # 17: above the kernel's 16 rows
        with pytest.raises(ValueError, match="gemv_max_rows must be an integer from 1 to 16"):
            build_forward_pass(load_bundle(None, {**NAMED_RECIPES["gemv"], "gemv_max_rows": bad}), cfg, weights)
    with pytest.raises(ValueError, match="gemv_max_rows must be an integer from 1"):
        build_forward_pass(load_bundle(None, {"gemv_max_rows": -1}), cfg, weights)
    assert build_forward_pass(load_bundle(None, {"gemv_max_rows": 32}), cfg, weights)._gemv_max_rows == 0
    assert build_forward_pass(load_bundle(None, {**NAMED_RECIPES["gemv"], "gemv_max_rows": 4}), cfg,
                              weights)._gemv_max_rows == 4
    with pytest.raises(ValueError, match="gemv_configs needs linear_backend: triton"):
        build_forward_pass(load_bundle(None, {"gemv_configs": {"64x64": {"variant": "dot"}}}), cfg, weights)
    with pytest.raises(ValueError, match="gemv_configs needs linear_backend: triton"):  # with a row limit too
        build_forward_pass(load_bundle(None, {"gemv_max_rows": 4, "gemv_configs": {"64x64": {"variant": "dot"}}}),
                           cfg, weights)
    # With the GEMV, per-shape configs are taken whether or not a row limit is set.
    from shapeshift.kernels.registry import KernelConfig

    tuned = {"64x64": {"variant": "dot", "num_warps": 4, "num_stages": 1, "BLOCK_N": 32}}
    for extra in ({}, {"gemv_max_rows": 2}):
        fp = build_forward_pass(load_bundle(None, {**NAMED_RECIPES["gemv"], "gemv_configs": tuned, **extra}), cfg,
                                weights)
        assert fp._gemv_overrides == {(64, 64): KernelConfig.from_dict(tuned["64x64"])}, extra
