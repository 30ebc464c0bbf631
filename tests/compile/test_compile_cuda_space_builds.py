"""The CUDA search space's recipes build the stock forward pass (checked on the CPU).

Data flow: build_search_space(device="cuda") (Triton backends, kernel.<op> tile knobs) ->
baseline + sampled + hand-picked candidates -> EngineEvaluator.materialize (split_recipe,
source edits, bundle with recipe.yaml) -> load_bundle_isolated -> module.build() on the
weights of a tiny CPU engine. Only build() runs (no forward), so Triton is imported but no
kernel is launched; this is the stage where a recipe knob the pass does not declare, or a
tile config that never reaches a launcher, shows up.
"""

from __future__ import annotations

import json

import functools
import random

import pytest

pytest.importorskip("triton")

from shapeshift.engine.forward_pass.bundle import load_recipe  # noqa: E402
from shapeshift.engine.compile.candidate import Candidate  # noqa: E402
from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings  # noqa: E402
from shapeshift.engine.compile.search_space import KERNEL_BACKEND_KNOB, build_search_space, split_recipe  # noqa: E402
from shapeshift.engine.forward_pass.knobs import STOCK_KNOB_BY_NAME  # noqa: E402
from shapeshift.engine.core.config import EngineConfig  # noqa: E402
from shapeshift.engine.forward_pass.importer import load_bundle as load_bundle_isolated  # noqa: E402
from shapeshift.engine.core.llm_engine import LLMEngine  # noqa: E402
from shapeshift.engine.contracts.traffic_profile import builtin_profile  # noqa: E402
from shapeshift.kernels.registry import KernelConfig  # noqa: E402

# kernel.<op> knob -> attribute of the stock pass holding that op's launcher
LAUNCHER_ATTRIBUTE = {"kernel.rmsnorm": "_triton_rmsnorm", "kernel.decode_attention": "_decode_attention",
                      "kernel.rotary_kv_write": "_rotary_kv_write", "kernel.silu_and_mul": "_silu_and_mul"}


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory):
    ev = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(work_dir=str(tmp_path_factory.mktemp("work"))))
    yield ev
    ev.close()


@pytest.fixture(scope="module")
def cuda_space(evaluator):
    """The space the compile loop builds on an H200, built here without a GPU (device string only)."""
    return build_search_space(device="cuda:0", model_family="llama", stock_recipe=load_recipe(evaluator.stock_dir),
                              concurrency=32, max_model_len=2048)


@pytest.fixture(scope="module")
def tiny_engine():
    return LLMEngine(EngineConfig(model="tiny-llama", device="cpu", dtype="float32", max_num_seqs=4,
                                  max_model_len=64, block_size=4, max_num_batched_tokens=16))


def _build(evaluator, engine, cand: Candidate):
    loaded = load_bundle_isolated(evaluator.materialize(cand))
    try:
        return dict(loaded.recipe), loaded.module.build(engine.model_config, engine.weights, dict(loaded.recipe))
    finally:
        loaded.unload()


def _all_kernels_tuned(space) -> dict:
    """Every Triton backend on (with what it needs) and every kernel.<op> at a non-default config."""
    recipe = space.default()
    recipe.update({backend: "triton" for backend in KERNEL_BACKEND_KNOB.values() if backend in space.names})
    recipe["fuse_gate_up"] = True
    for name in space.names:
        if name.startswith("kernel."):
            recipe[name] = space.knob(name).values[-1]
    assert space.validate(recipe) == []
    return recipe


def test_cuda_space_has_kernel_knobs_and_declared_recipe_knobs_only(evaluator, cuda_space) -> None:
    kernel_names = sorted(n for n in cuda_space.names if n.startswith("kernel."))
    # every kernel knob but the MoE experts' (a dense model has no moe_backend)
    assert kernel_names == sorted(k for k, b in KERNEL_BACKEND_KNOB.items() if b != "moe_backend"), kernel_names
    declared = set(STOCK_KNOB_BY_NAME)
    assert "kernel_configs" in declared
    for cand_recipe in (cuda_space.default(), _all_kernels_tuned(cuda_space)):
        bundle_recipe, _, _ = split_recipe(cand_recipe)
        assert set(bundle_recipe) <= declared, sorted(set(bundle_recipe) - declared)
    # The baseline is the stock recipe with no overrides: no kernel_configs at all.
    assert "kernel_configs" not in split_recipe(cuda_space.default())[0]


def test_cuda_baseline_and_candidates_build_the_stock_pass(evaluator, cuda_space, tiny_engine) -> None:
    rng = random.Random(0)
    candidates = [Candidate(cuda_space.default(), None, "baseline", "stock")]
    candidates += [Candidate(cuda_space.sample(rng), None, "sample") for _ in range(4)]
    tuned = _all_kernels_tuned(cuda_space)
    candidates.append(Candidate(tuned, None, "kernels"))
    for cand in candidates:
        recipe, fp = _build(evaluator, tiny_engine, cand)
        assert fp.recipe == recipe
        for knob, attribute in LAUNCHER_ATTRIBUTE.items():
            value = cand.recipe.get(knob, "default")
            launcher = getattr(fp, attribute)
            if value == "default":
                # The registry's per-GPU default: the plain launcher (or torch when the backend is off).
                assert not isinstance(launcher, functools.partial), (knob, cand.recipe)
            else:
                # The searched tile config reaches the launcher as its config= argument.
                assert isinstance(launcher, functools.partial), (knob, cand.recipe)
                assert launcher.keywords["config"] == KernelConfig.from_dict(value)
    # The hand-picked candidate really tuned every op (so the loop above checked each launcher).
    recipe, fp = _build(evaluator, tiny_engine, candidates[-1])
    assert sorted(recipe["kernel_configs"]) == sorted(k.split(".", 1)[1] for k in LAUNCHER_ATTRIBUTE)
    assert all(isinstance(getattr(fp, a), functools.partial) for a in LAUNCHER_ATTRIBUTE.values())


def test_stock_pass_refuses_kernel_configs_without_their_backend(evaluator, cuda_space, tiny_engine) -> None:
    from shapeshift.engine.forward_passes.stock import forward

    config = cuda_space.knob("kernel.rmsnorm").values[-1]
    with pytest.raises(ValueError, match="norm_backend: triton"):
        forward.build(tiny_engine.model_config, tiny_engine.weights, {"kernel_configs": {"rmsnorm": config}})
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        forward.build(tiny_engine.model_config, tiny_engine.weights, {"kernel_configs": {"nope": config}})


def test_named_recipes_seed_the_search_and_build(evaluator, cuda_space, tiny_engine) -> None:
    """The engine's named recipes become first candidates: on CUDA each one as declared (they are
    all valid points of the space, and they build); on the CPU only what the space can express."""
    from shapeshift.engine.compile.cli import recipe_seeds
    from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES

    seeds = recipe_seeds(cuda_space)
    assert [s.note.split('"')[1] for s in seeds] == [n for n in NAMED_RECIPES if n != "torch"]
    for seed in seeds:
        name = seed.note.split('"')[1]
        assert cuda_space.validate(seed.recipe) == [], (name, seed.recipe)
        # every knob of the recipe that a dense model's space has (moe_backend is a MoE model's)
        declared = {k: v for k, v in NAMED_RECIPES[name].items() if k != "moe_backend"}
        assert {k: seed.recipe[k] for k in declared} == declared
        assert seed.agent == "recipes" and seed.recipe != cuda_space.default()
        recipe, fp = _build(evaluator, tiny_engine, seed)
        assert fp.recipe == recipe
    # Multi-step decode, overlapped: serve's measured default on CUDA (EngineConfig.decode_steps).
    from shapeshift.engine.core.config import CUDA_DECODE_STEPS

    assert "engine.decode_steps" in cuda_space.names
    assert cuda_space.default()["engine.decode_steps"] == CUDA_DECODE_STEPS
    assert cuda_space.default()["engine.overlap_decode"] is True
    # The rotary fusion is searched, constrained to the Triton attention and rotary backends,
    # and absent for models with q/k norm.
    assert "fuse_rotary_into_attention" in cuda_space.names
    bad = {**cuda_space.default(), "fuse_rotary_into_attention": True, "attention_backend": "torch"}
    assert any("fuse_rotary_into_attention" in problem for problem in cuda_space.validate(bad))
    qk_space = build_search_space(device="cuda", model_family="llama", stock_recipe=load_recipe(evaluator.stock_dir),
                                  concurrency=32, max_model_len=2048,
                                  qk_norm=True)
    assert "fuse_rotary_into_attention" not in qk_space.names
    # The whole-layer kernel: searched with the rotary fusion and a power-of-two head_dim >= 16 only.
    assert "fuse_attention_into_layer" in cuda_space.names
    assert "fuse_attention_into_layer" not in qk_space.names
    odd_space = build_search_space(device="cuda", model_family="llama", stock_recipe=load_recipe(evaluator.stock_dir),
                                   concurrency=32, max_model_len=2048,
                                   head_dim=24)
    assert "fuse_attention_into_layer" not in odd_space.names and "fuse_rotary_into_attention" in odd_space.names
    bad = {**cuda_space.default(), "fuse_attention_into_layer": True, "fuse_rotary_into_attention": False}
    assert any("fuse_attention_into_layer" in problem for problem in cuda_space.validate(bad))
    # The tail ending in the next layer's attention: the same needs, and not with the whole-layer kernel.
    assert "fuse_attention_into_tail" in cuda_space.names
    assert "fuse_attention_into_tail" not in qk_space.names and "fuse_attention_into_tail" not in odd_space.names
    both = {**cuda_space.default(), "linear_backend": "triton", "fuse_qkv": True, "fuse_gate_up": True,
            "fuse_norm_into_linear": True, "fuse_layer_tail": True, "attention_backend": "triton",
            "rotary_backend": "triton", "fuse_rotary_into_attention": True, "fuse_attention_into_layer": True,
            "fuse_attention_into_tail": True}
    assert any("at most one of them" in problem for problem in cuda_space.validate(both))
    assert not any("at most one" in problem
                   for problem in cuda_space.validate({**both, "fuse_attention_into_layer": False}))
    # The attention kernel's L2 prefetch is searched on CUDA only, with the Triton attention.
    assert cuda_space.default()["attention_l2_prefetch_mb"] == 0
    bad = {**cuda_space.default(), "attention_l2_prefetch_mb": 16, "attention_backend": "torch"}
    assert any("attention_l2_prefetch_mb" in problem for problem in cuda_space.validate(bad))
    # The GEMV's row limit: searched with the GEMV, its default the kernel's 16 rows (no change).
    from shapeshift.kernels.gemv import MAX_M

    assert cuda_space.knob("gemv_max_rows").values == (16, 8, 4, 2, 1) == (MAX_M, 8, 4, 2, 1)
    assert cuda_space.default()["gemv_max_rows"] == 16
    bad = {**cuda_space.default(), "gemv_max_rows": 1, "linear_backend": "torch"}
    assert any("gemv_max_rows=1 needs linear_backend=triton" in problem for problem in cuda_space.validate(bad))
    assert not any("gemv_max_rows" in problem
                   for problem in cuda_space.validate({**bad, "linear_backend": "triton"}))
    # The norm fusion's row limit: the same grid, constrained to fuse_norm_into_linear.
    assert cuda_space.knob("fuse_norm_max_rows").values == (16, 8, 4, 2, 1)
    assert cuda_space.default()["fuse_norm_max_rows"] == 16
    bad = {**cuda_space.default(), "fuse_norm_max_rows": 1, "fuse_norm_into_linear": False}
    assert any("fuse_norm_max_rows=1 needs fuse_norm_into_linear=true" in problem
               for problem in cuda_space.validate(bad))

    cpu_space = build_search_space(device="cpu", model_family="llama", stock_recipe=load_recipe(evaluator.stock_dir),
                                   concurrency=32, max_model_len=2048)
    cpu_seeds = recipe_seeds(cpu_space)
    assert [s.recipe for s in cpu_seeds] == [{**cpu_space.default(), "fuse_qkv": True, "fuse_gate_up": True}]
    assert "engine.decode_steps" not in cpu_space.names  # multi-step decode needs graph replays
    assert "engine.overlap_decode" not in cpu_space.names
    assert "attention_l2_prefetch_mb" not in cpu_space.names
    assert "gemv_max_rows" not in cpu_space.names  # no Triton GEMV on the CPU
    assert "fuse_norm_max_rows" not in cpu_space.names
    # MoE: the GEMV (and its row limit) without the norm fusion (dense models only).
    moe_space = build_search_space(device="cuda", model_family="moe", stock_recipe=load_recipe(evaluator.stock_dir),
                                   concurrency=32, max_model_len=2048)
    assert "gemv_max_rows" in moe_space.names and "fuse_norm_max_rows" not in moe_space.names


def test_random_points_of_the_cuda_space_are_valid_and_move(cuda_space) -> None:
    """The agents' random draws: on CUDA few uniform draws pass the kernel, fusion, row-limit and
    graph-bucket rules, so `sample` walks from the default instead of giving up; every point it
    returns is valid, and the points differ from the default and from each other."""
    import random

    rng = random.Random(7)
    default = cuda_space.default()
    points = [cuda_space.sample(rng, max_tries=20) for _ in range(4)]
    for point in points:
        assert cuda_space.validate(point) == [], point
        assert point != default
    assert len({json.dumps(p, sort_keys=True, default=str) for p in points}) == len(points)


def test_moe_space_searches_the_grouped_expert_gemm_and_it_reaches_the_pass(evaluator) -> None:
    """On a mixture-of-experts model the CUDA space has moe_backend and its tile knob; a tuned tile
    reaches the pass's expert launcher as config=; a dense space has neither; the CPU space no triton."""
    engine = LLMEngine(EngineConfig(model="tiny-moe", device="cpu", dtype="float32", max_num_seqs=4,
                                    max_model_len=64, block_size=4, max_num_batched_tokens=16))
    stock = load_recipe(evaluator.stock_dir)
    space = build_search_space(device="cuda:0", model_family="moe", stock_recipe=stock, concurrency=32,
                               max_model_len=2048)
    assert space.knob("moe_backend").values == ("torch", "triton")
    tiles = space.knob("kernel.moe_grouped_gemm").values
    assert tiles[0] == "default" and len(tiles) > 2
    # the experts keep their torch SiLU (activation_backend is a no-op there): no tile of it to search
    assert "kernel.silu_and_mul" not in space.names and "kernel.rmsnorm" in space.names
    # every searched tile fits an SM's shared memory at bf16 (pipelined A and W tiles)
    assert all(t["num_stages"] * (t["BLOCK_M"] + t["BLOCK_N"]) * t["BLOCK_K"] * 2 <= 227 * 1024 for t in tiles[1:])
    tuned = {**space.default(), "moe_backend": "triton", "kernel.moe_grouped_gemm": tiles[-1]}
    assert space.validate(tuned) == []
    assert any("kernel.moe_grouped_gemm" in p
               for p in space.validate({**tuned, "moe_backend": "torch"}))
    recipe, fp = _build(evaluator, engine, Candidate(tuned, None, "kernels"))
    assert recipe["moe_backend"] == "triton" and "moe_grouped_gemm" in recipe["kernel_configs"]
    assert isinstance(fp._fused_moe, functools.partial)
    assert fp._fused_moe.keywords["config"] == KernelConfig.from_dict(tiles[-1])
    _, fp = _build(evaluator, engine, Candidate(space.default(), None, "baseline", "stock"))
    assert fp._fused_moe is None  # the torch experts: the default
    dense = build_search_space(device="cuda:0", model_family="llama", stock_recipe=stock, concurrency=32,
                               max_model_len=2048)
    assert "moe_backend" not in dense.names and "kernel.moe_grouped_gemm" not in dense.names
    cpu = build_search_space(device="cpu", model_family="moe", stock_recipe=stock, concurrency=32, max_model_len=2048)
    assert cpu.knob("moe_backend").values == ("torch",) and "kernel.moe_grouped_gemm" not in cpu.names
