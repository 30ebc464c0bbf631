"""The engine's expert-routing counters against Hugging Face transformers' own router choices.

A random Mixtral and Qwen3-MoE checkpoint (saved by transformers), the engine serving greedy
requests on it: per layer and expert, the tokens the engine's counters say were routed there
equal the top-k choices transformers' router modules make on the same tokens (the prompt and
every generated token but the last, which is never fed back). Then the same counts through
/metrics (EngineMetrics, the Prometheus text format) and across a forward-pass swap.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine_factories import make_engine, make_hf_checkpoint
from shapeshift.engine.contracts import metric_names
from shapeshift.engine.core.expert_routing import counts_of
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.serving.metrics import EngineMetrics

PROMPTS = [[5, 17, 40, 2, 99, 123, 7], [250, 3, 3, 81, 64, 11, 12, 13, 200, 1, 45], [9, 8, 7, 6]]
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def served(request, tmp_path_factory):
    """(HF model, engine, HF router counts {(layer, expert): n}) after serving PROMPTS."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, folder, seed=11)
    engine = make_engine(folder, enable_prefix_caching=False)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    expected: Counter[tuple[int, int]] = Counter()
    routers = [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == hf.config.num_hidden_layers
    hooks = []
    for layer, router in enumerate(routers):
        def hook(_module, _args, out, layer=layer):
            for expert in out[2].reshape(-1).tolist():  # router_indices [T, k]
                expected[(layer, expert)] += 1
        hooks.append(router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for prompt, generated in zip(PROMPTS, outputs):
                assert len(generated) == NEW_TOKENS
                fed = prompt + generated[:-1]
                hf(torch.tensor([fed]))
    finally:
        for h in hooks:
            h.remove()
    return hf, engine, dict(expected)


def _engine_counts(engine) -> dict[tuple[int, int], int]:
    snap = counts_of(engine.forward_pass).snapshot()
    return {(layer, e): v for layer, row in snap.items() for e, v in enumerate(row) if v}


def test_counts_equal_transformers_router_choices(served):
    hf, engine, expected = served
    got = _engine_counts(engine)
    fed = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)
    k = hf.config.num_experts_per_tok
    for layer in range(hf.config.num_hidden_layers):
        assert sum(v for (l_, _), v in got.items() if l_ == layer) == fed * k  # every token, k choices
    assert got == expected


def test_metrics_export_the_counts_and_keep_them_across_a_swap(served):
    _, engine, expected = served
    metrics = EngineMetrics("moe")
    metrics.watch_expert_routing(lambda: counts_of(engine.forward_pass))

    def exported() -> dict[tuple[int, int], float]:
        text = metrics.render()[0].decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == metric_names.EXPERT_ROUTED_TOKENS:
                    assert s.labels["model"] == "moe"
                    out[(int(s.labels["layer"]), int(s.labels["expert"]))] = s.value
        return out

    first = exported()
    assert {k: v for k, v in first.items() if v} == {k: float(v) for k, v in expected.items()}
    old = engine.forward_pass
    engine.set_forward_pass(engine.bundle)  # a new pass over the same weights: its counts start at zero
    assert engine.forward_pass is not old and not any(_engine_counts(engine).values())
    assert exported() == first  # the old pass's totals are kept
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    after = exported()
    k = engine.model_config.num_experts_per_tok
    for layer in {l_ for l_, _ in first}:
        grew = sum(after[(layer, e)] - first[(layer, e)] for (l_, e) in first if l_ == layer)
        assert grew == (3 + 2 - 1) * k  # three prompt tokens and one decode step, k choices each


def test_a_dense_model_has_no_routing_counts():
    engine = make_engine("tiny-llama")
    assert counts_of(engine.forward_pass) is None
