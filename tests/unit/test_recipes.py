"""Named recipes for `shapeshift serve --recipe` resolve per device and name real knobs; the
stock pass's knob table is what the forward pass and the search space both read."""

import pytest

from shapeshift.engine.compile.search_space import build_search_space
from shapeshift.engine.forward_pass.bundle import load_recipe, stock_bundle_dir
from shapeshift.engine.forward_pass.knobs import GEMV_MAX_ROWS, STOCK_KNOB_BY_NAME, STOCK_KNOBS, validate_recipe
from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES, is_mixture_of_experts, resolve_recipe


def test_auto_is_fast_on_cuda_for_dense_models_triton_for_experts_and_torch_on_cpu():
    assert resolve_recipe("auto", "cuda:0", "llama-3.2-1b-shape") == NAMED_RECIPES["fast"]
    assert resolve_recipe("auto", "cuda", "tiny-moe") == NAMED_RECIPES["triton"]
    assert resolve_recipe("auto", "cuda", "moe-medium-shape") == NAMED_RECIPES["triton"]
    assert resolve_recipe("auto", "cuda:0") == NAMED_RECIPES["triton"]  # no model named: the one that serves both
    assert resolve_recipe("auto", "cpu", "tiny-llama") == resolve_recipe("auto", "cpu") == {}
    assert not is_mixture_of_experts("tiny-llama") and is_mixture_of_experts("tiny-moe")


def test_unknown_recipe_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown recipe 'turbo'"):
        resolve_recipe("turbo", "cpu")


def test_every_named_recipe_and_the_stock_recipe_yaml_hold_to_the_knob_table():
    for name, knobs in NAMED_RECIPES.items():
        assert validate_recipe(knobs) == [], name
    assert validate_recipe(load_recipe(stock_bundle_dir())) == []


def test_the_table_refuses_unknown_knobs_and_values_off_their_type():
    problems = validate_recipe({"turbo": True, "attention_backend": "cuda", "fuse_qkv": 1, "gemv_max_rows": 17,
                                "attention_l2_prefetch_mb": -1, "kernel_configs": []})
    assert problems == ["unknown recipe knob 'turbo'", "attention_backend must be one of ('torch', 'triton'), got 'cuda'",
                        "fuse_qkv must be true or false, got 1", "gemv_max_rows must be an integer from 1 to 16, got 17",
                        "attention_l2_prefetch_mb must be an integer from 0, got -1",
                        "kernel_configs must be a mapping, got []"]
    for knob in STOCK_KNOBS:  # every default and every searched value is allowed by the knob itself
        assert knob.default is None or knob.problem(knob.default) is None, knob.name
        assert all(knob.problem(v) is None for v in knob.grid), knob.name


def test_the_row_limit_is_the_gemv_kernels():
    """knobs.py is torch-free, so it spells the GEMV's row limit itself; it must be the kernel's."""
    gemv = pytest.importorskip("shapeshift.kernels.gemv")
    assert GEMV_MAX_ROWS == gemv.MAX_M


def test_the_search_space_recipe_knobs_come_from_the_table():
    space = build_search_space(device="cuda", model_family="moe", include_kernels=False)
    recipe_knobs = [k for k in space.knobs if k.target == "recipe"]
    assert recipe_knobs and all(k.name in STOCK_KNOB_BY_NAME for k in recipe_knobs)
    for k in recipe_knobs:
        table = STOCK_KNOB_BY_NAME[k.name]
        assert k.doc == table.meaning
        assert k.values == {"choice": table.choices, "bool": (False, True), "int": table.grid}[table.kind]
