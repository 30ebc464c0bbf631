"""The pass to beat is what serves (forward_pass/recipes.py serving_default).

    serving_default(model, device) -> the `auto` recipe + EngineConfig's own defaults there
      -> `shapeshift serve` resolves `auto` through the same rule
      -> the compile run's evaluator settings (engine_base, base_recipe) -> the search space's
         default point, the loop's baseline, named in the report
"""

from __future__ import annotations

import dataclasses

import pytest

from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.forward_pass.recipes import (NAMED_RECIPES, SERVING_ENGINE_FIELDS, resolve_recipe,
                                                    serving_default)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_the_serving_default_is_the_auto_recipe_and_the_engine_config_defaults(device):
    serving = serving_default("tiny-llama", device)
    assert serving.recipe == resolve_recipe("auto", device, "tiny-llama")
    assert serving.recipe_name == ("fast" if device.startswith("cuda") else "torch")
    assert serving.is_plain == (not device.startswith("cuda"))
    built = EngineConfig(model="tiny-llama", device=device)
    assert serving.engine == {f: getattr(built, f) for f in SERVING_ENGINE_FIELDS}
    assert serving.describe().startswith(f"the shipped serving default (recipe {serving.recipe_name}; max_num_seqs ")


def test_the_serving_default_reads_engine_config_rather_than_copying_it():
    # Every field it reports has an EngineConfig default of the same value (one home); the
    # device-dependent ones (None there) are what EngineConfig resolves for the device.
    from shapeshift.engine.core.config import CUDA_DECODE_STEPS

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    resolved = {"cpu": {"decode_steps": 1, "overlap_decode": False, "max_num_batched_tokens": 2048},
                "cuda": {"decode_steps": CUDA_DECODE_STEPS, "overlap_decode": True, "max_num_batched_tokens": 4096}}
    for device in ("cpu", "cuda"):
        expected = {f: resolved[device].get(f, defaults[f]) for f in SERVING_ENGINE_FIELDS}
        assert None not in expected.values()
        assert serving_default("tiny-llama", device).engine == expected
    assert serving_default("tiny-llama", "cuda").recipe == NAMED_RECIPES["fast"]
    assert serving_default("tiny-moe", "cuda").recipe == NAMED_RECIPES["triton"]


def test_the_compile_baseline_is_the_serving_default(tmp_path):
    """The real evaluator, set up as `shapeshift compile` sets it up: the space's default point
    (the loop's baseline) runs the serving recipe and engine settings."""
    from shapeshift.engine.compile.cli import plain_pass
    from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
    from shapeshift.engine.compile.loop import CompileLoop, LoopConfig
    from shapeshift.engine.compile.board import Board
    from shapeshift.engine.compile.job import Budget
    from shapeshift.engine.contracts.traffic_profile import builtin_profile

    serving = serving_default("tiny-llama", "cpu")
    ev = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path / "work"), engine_base=dict(serving.engine),
        base_recipe=dict(serving.recipe)))
    space = ev.space()
    default = space.default()
    for field in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        assert default[f"engine.{field}"] == serving.engine[field], field
    for knob, value in serving.recipe.items():
        assert default[knob] == value
    assert plain_pass(space, ev, serving) is None  # on the CPU the serving default is the plain pass
    loop = CompileLoop(ev, space, Board(tmp_path / "board.jsonl"), [], Budget(max_trials=0),
                       LoopConfig(baseline_name=serving.describe()))
    base = loop._baseline_candidate()
    assert base.recipe == default and base.note == serving.describe()
    # Engine settings the evaluator builds the baseline's engine with are serve's.
    eng = ev._engine("full", {})
    for field in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "block_size", "decode_steps"):
        assert getattr(eng.config, field) == serving.engine[field], field


def test_on_cuda_the_plain_pass_is_the_second_figure():
    """On CUDA the serving default runs the triton recipe; the plain-PyTorch pass (the stock
    recipe.yaml at the same engine settings) is what a champion is quoted against second."""
    from types import SimpleNamespace

    from shapeshift.engine.compile.cli import plain_pass
    from shapeshift.engine.compile.search_space import build_search_space
    from shapeshift.engine.forward_pass.bundle import load_recipe, stock_bundle_dir

    serving = serving_default("tiny-llama", "cuda")
    stock = load_recipe(stock_bundle_dir())
    space = build_search_space(device="cuda", stock_recipe={**stock, **serving.recipe}, engine_defaults=serving.engine)
    assert space.default()["attention_backend"] == "triton"
    plain = plain_pass(space, SimpleNamespace(stock_dir=stock_bundle_dir()), serving)
    assert plain is not None and plain.agent == "plain"
    assert plain.recipe["attention_backend"] == stock.get("attention_backend", "torch") == "torch"
    assert {k: v for k, v in plain.recipe.items() if k.startswith("engine.")} == \
        {k: v for k, v in space.default().items() if k.startswith("engine.")}
