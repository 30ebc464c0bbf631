"""Named recipes for `shapeshift serve --recipe` resolve per device and name real knobs."""

import re
from pathlib import Path

import pytest

from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES, resolve_recipe

STOCK = Path(__file__).resolve().parents[2] / "engine" / "forward_passes" / "stock" / "forward.py"


def test_auto_is_triton_on_cuda_and_torch_on_cpu():
    assert resolve_recipe("auto", "cuda:0") == NAMED_RECIPES["triton"]
    assert resolve_recipe("auto", "cpu") == {}


def test_unknown_recipe_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown recipe 'turbo'"):
        resolve_recipe("turbo", "cpu")


def test_every_knob_is_declared_by_the_stock_forward_pass():
    doc = STOCK.read_text()
    for name, knobs in NAMED_RECIPES.items():
        for knob in knobs:
            assert re.search(rf"\b{knob}\b", doc), f"recipe {name}: knob {knob} unknown to the stock pass"
