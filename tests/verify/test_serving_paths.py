"""The serving paths of coverage.padded_batches and coverage.block_pool: which (batch, bucket)
shapes are checked, that a graph-shaped step of the stock pass gives the exact step's logits, and
that a pool too large for memory is capped and said so."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.forward_pass.paged_driver import PagedDriver, Seq
from shapeshift.engine.models.loader import random_weights
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.verify import GateSettings, verify_candidate
from shapeshift.engine.verify.serving_paths import MAX_PADDED_SHAPES, padded_shapes

GOOD = Path(__file__).resolve().parents[1] / "fixtures" / "candidates" / "good_refactored"


@pytest.fixture(scope="module")
def model():
    preset = PRESETS["tiny-llama"]
    cfg = ModelConfig.from_hf(preset.hf_config)
    return cfg, random_weights(cfg, seed=preset.weight_seed, dtype=torch.float32, device="cpu")


def test_padded_shapes_lie_between_the_buckets():
    assert padded_shapes((1, 2, 4, 8)) == [(2, 2), (3, 4), (5, 8), (7, 8)]
    assert padded_shapes(()) == padded_shapes((1, 2, 4, 8))  # a deployment without graphs: the smallest defaults
    wide = padded_shapes((1, 2, 4, 8, 16, 32, 64))
    assert len(wide) == MAX_PADDED_SHAPES and wide[-2:] == [(33, 64), (63, 64)]
    for n, bucket in wide:
        assert n <= bucket and (n == bucket or n not in (1, 2, 4, 8, 16, 32, 64))


def test_a_graph_shaped_step_equals_the_exact_step(model):
    """The stock pass over padded rows, a table max_model_len wide with stale columns and no host
    copies gives the exact step's logits for the real rows, and writes only their slots and the
    null block."""
    from shapeshift.engine.forward_pass.importer import load_stock

    cfg, weights = model
    stock = load_stock()
    try:
        fp = stock.module.build(cfg, weights, dict(stock.recipe))
        prompts = [[random.Random(i).randrange(cfg.vocab_size) for _ in range(5 + 7 * i)] for i in range(3)]
        exact, padded = PagedDriver(cfg, torch.float32, "cpu", seed=1), PagedDriver(cfg, torch.float32, "cpu", seed=2)
        a, b = [Seq(list(p)) for p in prompts], [Seq(list(p)) for p in prompts]
        exact.step(fp, a)
        padded.step(fp, b)
        for s in a + b:
            s.tokens.append(7)
        want = exact.step(fp, a, [1, 1, 1])
        null_before = padded.kv.k[0][padded.kv.null_block].clone()
        got = padded.graph_decode_step(fp, b, bucket=8, width=16, fill=random.Random(3))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.equal(null_before, padded.kv.k[0][padded.kv.null_block])  # the padding wrote there
    finally:
        stock.unload()


def test_a_pool_too_large_for_memory_is_capped_and_says_so(model):
    cfg, weights = model
    settings = GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0, pool_blocks=10 ** 7, pool_bytes_max=2 << 20)
    report = verify_candidate(GOOD, cfg, weights, settings=settings, only=("coverage.block_pool",))
    gate = report.gate("coverage.block_pool")
    per_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert gate.passed, str(gate)
    assert gate.evidence["pool_blocks"] == 10 ** 7 and gate.evidence["capped"] is True
    assert gate.evidence["blocks"] == (2 << 20) // per_block
    assert gate.evidence["highest_block"] == gate.evidence["blocks"] - 1


RAISES_ON_MIXED_GRAPHS = '''from shapeshift.engine.forward_pass.importer import import_stock_module

stock = import_stock_module()
CACHE_FORMAT_VERSION = stock.CACHE_FORMAT_VERSION


class EagerMixedOnly(stock.StockForwardPass):
    def forward(self, input_ids, positions, ctx, kv_cache):
        if ctx.is_prefill and ctx.query_start_loc_cpu is None:
            raise RuntimeError("this pass needs host copies for a mixed step")
        return super().forward(input_ids, positions, ctx, kv_cache)


def build(model_config, weights, recipe):
    return EagerMixedOnly(model_config, weights, recipe)
'''


def test_a_pass_that_raises_on_a_graph_shaped_mixed_step_is_not_judged_on_it(model, tmp_path):
    """The engine runs such a pass's mixed steps eagerly (it tries a static mixed step before it
    captures any): the gate passes it on the rest and says why the mixed step was not judged."""
    cfg, weights = model
    (tmp_path / "forward.py").write_text(RAISES_ON_MIXED_GRAPHS)
    report = verify_candidate(tmp_path, cfg, weights, settings=GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0),
                              only=("coverage.padded_batches",))
    gate = report.gate("coverage.padded_batches")
    assert gate.passed, str(gate)
    assert "needs host copies" in gate.evidence["mixed_step"]["skipped"]
