"""Greedy and top-k / top-p sampling: exact support, distribution, determinism per seed."""

import pytest
import torch

from shapeshift.kernels.registry import KernelConfig
from shapeshift.kernels.argmax import argmax, argmax_ref
from shapeshift.kernels.sampling import sample, sampling_probs_ref


def _params(B, device, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((B,), temperature, dtype=torch.float32, device=device),
        torch.full((B,), top_k, dtype=torch.int32, device=device),
        torch.full((B,), top_p, dtype=torch.float32, device=device),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,V,config", [(3, 123, KernelConfig.make("split", BLOCK_V=16, NUM_SPLITS=3)),
                                        (5, 40, KernelConfig.make("split", BLOCK_V=64, NUM_SPLITS=1))])
def test_argmax_matches_torch(B, V, config, dtype, device):
    logits = torch.randn(B, V, device=device).to(dtype)
    logits[0, 7] = logits[0, 99 % V] = 50.0  # a tie: the first index wins
    out = torch.full((B,), -1, dtype=torch.int64, device=device)
    argmax(logits, out=out, config=config)
    assert torch.equal(out, argmax_ref(logits))
    assert out[0] == 7


def test_sample_top_k_one_and_tiny_top_p_are_greedy(device):
    B, V = 4, 130
    logits = torch.randn(B, V, device=device)
    seeds = torch.arange(B, dtype=torch.int64, device=device)
    config = KernelConfig.make("row", BLOCK_V=64, NUM_PIVOTS=8)
    t, k, p = _params(B, device, temperature=2.0, top_k=1)
    assert torch.equal(sample(logits, t, k, p, seeds, config=config), logits.argmax(-1))
    t, k, p = _params(B, device, temperature=0.7, top_p=1e-6)
    assert torch.equal(sample(logits, t, k, p, seeds, config=config), logits.argmax(-1))


ON_CPU = not torch.cuda.is_available()


def test_sample_filtered_support_on_random_rows(device):
    B, V = 12, 45
    logits = torch.randn(B, V, device=device) * 2
    temperature = torch.rand(B, device=device) + 0.5
    top_k = torch.randint(0, 12, (B,), device=device, dtype=torch.int32)
    top_p = torch.rand(B, device=device) * 0.9 + 0.1
    seeds = torch.randint(0, 2**40, (B,), device=device)
    tokens = sample(logits, temperature, top_k, top_p, seeds, config=KernelConfig.make("row", BLOCK_V=16, NUM_PIVOTS=16))
    probs = sampling_probs_ref(logits, temperature, top_k, top_p)
    assert (probs[torch.arange(B), tokens] > 0).all(), "sampled a token outside the kept set"


def test_sampling_errors(device):
    logits = torch.randn(2, 10, device=device)
    t, k, p = _params(2, device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="top_k has dtype torch.int64"):
        sample(logits, t, k.long(), p, seeds)
    with pytest.raises(ValueError, match=r"temperature has shape \(3,\) but expected \(2,\)"):
        sample(logits, torch.ones(3, device=device), k, p, seeds)
    with pytest.raises(ValueError, match="empty vocabulary"):
        argmax(torch.randn(2, 0, device=device))
    with pytest.raises(ValueError, match="out has dtype torch.int32"):
        argmax(logits, out=torch.empty(2, dtype=torch.int32, device=device))


# ----------------------------------------------------------------------------- "split" variant
# Candidates complete (every chunk holds <= NUM_CAND tokens) vs. a config whose candidates are
# too few, so stage 2 flags rows with top-k > 1 and stage 3's exact per-row search decides them.
# 32 pivots: fewer bisection passes, which is what the interpreter's time goes to.
SPLIT_COMPLETE = KernelConfig.make("split", BLOCK_V=4, NUM_CAND=4, NUM_PIVOTS=32)
SPLIT_FALLBACK = KernelConfig.make("split", BLOCK_V=4, NUM_CAND=1, NUM_PIVOTS=32)


def _split_with_flags(logits, t, k, p, seeds, config):
    from shapeshift.kernels import sampling

    B, V = logits.shape
    ws = torch.full((B, sampling.split_workspace_ints(V, config)), -7, dtype=torch.int32, device=logits.device)
    out = torch.full((B,), -1, dtype=torch.int64, device=logits.device)
    sampling._sample_split(logits, t, k, p, seeds, out, config, ws_i32=ws)
    return out, ws[:, -1]


def test_sample_greedy_rows_and_mixed_params(device):
    B, V = 7, 77
    logits = torch.randn(B, V, device=device) * 3
    logits[0, 3] = logits[0, 60] = 40.0  # a tie in a greedy row: the first index wins
    temperature, top_k, top_p = _params(B, device)
    temperature[::2] = 0.0  # greedy rows
    top_k[1] = 5
    top_p[3] = 0.5
    top_k[5], top_p[5] = 10, 0.7
    seeds = torch.arange(B, dtype=torch.int64, device=device) + 11
    probs = sampling_probs_ref(logits, temperature, top_k, top_p)
    for config in (KernelConfig.make("row", BLOCK_V=32, NUM_PIVOTS=4),
                   KernelConfig.make("split", BLOCK_V=16, NUM_CAND=4, NUM_PIVOTS=4), SPLIT_FALLBACK):
        out = torch.full((B,), -1, dtype=torch.int64, device=device)
        sample(logits, temperature, top_k, top_p, seeds, out=out, config=config)
        assert torch.equal(out[::2], logits[::2].argmax(-1)), config
        assert out[0] == 3
        assert (probs[torch.arange(B), out] > 0).all(), f"{config}: sampled a token outside the kept set"


@pytest.fixture(params=["sort", "bisect"])
def merge(request, monkeypatch):
    """Stage 2's two ways to find the thresholds on the candidates: one sort, or bisection."""
    from shapeshift.kernels import sampling

    if request.param == "bisect":
        monkeypatch.setattr(sampling, "MERGE_SORT_MAX_CANDIDATES", 0)
    return request.param


def test_split_candidate_and_exact_paths_draw_the_same_tokens(device, merge):
    """Both paths are exact and share the race's uniforms, so a seed draws the same token."""
    B, V = 16 if ON_CPU else 256, 61
    logits = torch.randn(B, V, device=device) * 2
    temperature = torch.rand(B, device=device) + 0.5
    top_k = torch.randint(2, 9, (B,), device=device, dtype=torch.int32)
    top_p = torch.rand(B, device=device) * 0.5 + 0.5
    top_p[::3] = 1.0
    seeds = torch.randint(0, 2**40, (B,), device=device)
    complete, complete_flags = _split_with_flags(logits, temperature, top_k, top_p, seeds,
                                                 KernelConfig.make("split", BLOCK_V=64, NUM_CAND=64, NUM_PIVOTS=8))
    fallback, fallback_flags = _split_with_flags(logits, temperature, top_k, top_p, seeds, SPLIT_FALLBACK)
    assert (complete_flags == 0).all(), "complete candidates must never need the exact search"
    assert (fallback_flags == 1).all(), "one candidate per 4-token chunk cannot decide top-k >= 2"
    assert torch.equal(complete, fallback)
    probs = sampling_probs_ref(logits, temperature, top_k, top_p)
    assert (probs[torch.arange(B), complete] > 0).all()


# The interpreter runs ~1e4 Triton ops per second: on the CPU only the plain-temperature cases
# (no threshold search) get many draws; the filtered cases get fewer draws, looser bounds.
ROW = KernelConfig.make("row", BLOCK_V=8, NUM_PIVOTS=32)
DISTRIBUTION_CASES = [
    (0, 1.0, ROW, 600 if ON_CPU else 20000),
    pytest.param(3, 1.0, ROW, 20000, marks=pytest.mark.skipif(ON_CPU, reason="slow in the interpreter; run on CUDA")),
    pytest.param(0, 0.6, ROW, 20000, marks=pytest.mark.skipif(ON_CPU, reason="slow in the interpreter; run on CUDA")),
    (4, 0.8, ROW, 160 if ON_CPU else 20000),
    (0, 1.0, SPLIT_COMPLETE, 300 if ON_CPU else 20000),  # race winners merged across chunks
    (4, 0.8, SPLIT_COMPLETE, 150 if ON_CPU else 20000),  # thresholds on the candidates
    (4, 0.8, SPLIT_FALLBACK, 100 if ON_CPU else 20000),  # thresholds by the exact per-row search
    pytest.param(0, 0.6, SPLIT_COMPLETE, 20000, marks=pytest.mark.skipif(ON_CPU, reason="slow in the interpreter")),
    pytest.param(3, 1.0, SPLIT_FALLBACK, 20000, marks=pytest.mark.skipif(ON_CPU, reason="slow in the interpreter")),
]


@pytest.mark.parametrize("top_k,top_p,config,draws", DISTRIBUTION_CASES)
def test_sample_distribution_matches_reference(top_k, top_p, config, draws, device):
    V = 8
    base = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.3, 0.0, -0.5, -1.0], device=device)
    logits = base[torch.randperm(V, device=device)].expand(draws, V).contiguous()
    temperature, k, p = _params(draws, device, temperature=0.9, top_k=top_k, top_p=top_p)
    seeds = torch.arange(draws, dtype=torch.int64, device=device) * 7919 + 3
    tokens = sample(logits, temperature, k, p, seeds, config=config)
    probs = sampling_probs_ref(logits[:1], temperature[:1], k[:1], p[:1])[0]
    freq = torch.bincount(tokens, minlength=V).double() / draws
    assert (freq[probs == 0] == 0).all(), f"tokens outside the kept set were drawn: {freq.tolist()}"
    assert (freq[probs > 0] > 0).all(), f"a kept token was never drawn: {freq.tolist()} vs {probs.tolist()}"
    # Each frequency's standard error is <= sqrt(0.25 / draws); allow 4.5 sigma.
    bound = 4.5 * (0.25 / draws) ** 0.5 + 0.005
    assert (freq - probs).abs().max() < bound, (freq.tolist(), probs.tolist())


def test_split_ties_at_the_top_k_threshold_are_all_kept(device, merge):
    """Six tokens tie at the 2nd-largest value: top_k=2 keeps all seven (Hugging Face's rule),
    which the one-candidate config can only get right through the exact search."""
    # Each tied token has probability ~0.13: 60 draws miss one with probability ~1e-3.
    V, draws = 12, 60 if ON_CPU else 5000
    row = torch.full((V,), -3.0, device=device)
    row[5] = 1.0
    row[[0, 2, 7, 8, 10, 11]] = 0.5
    logits = row.expand(draws, V).contiguous()
    t, k, p = _params(draws, device, temperature=1.0, top_k=2)
    seeds = torch.arange(draws, dtype=torch.int64, device=device)
    probs = sampling_probs_ref(logits[:1], t[:1], k[:1], p[:1])[0]
    assert int((probs > 0).sum()) == 7
    for config in (SPLIT_COMPLETE, SPLIT_FALLBACK):
        tokens = sample(logits, t, k, p, seeds, config=config)
        drawn = torch.bincount(tokens, minlength=V)
        assert set(torch.nonzero(drawn).flatten().tolist()) == set(torch.nonzero(probs).flatten().tolist()), config


@pytest.mark.parametrize("config", [KernelConfig.make("row", BLOCK_V=32, NUM_PIVOTS=8),
                                    KernelConfig.make("split", BLOCK_V=16, NUM_CAND=4, NUM_PIVOTS=8)])
def test_sample_is_deterministic_per_seed_and_batch_invariant(config, device):
    V = 50
    logits = torch.randn(4, V, device=device)
    t, k, p = _params(4, device, temperature=1.3, top_p=0.9)
    k[1] = 3
    seeds = torch.tensor([5, 6, 7, 8], dtype=torch.int64, device=device)
    first = sample(logits, t, k, p, seeds, config=config)
    assert torch.equal(first, sample(logits, t, k, p, seeds, config=config))
    for row in range(4):
        alone = sample(logits[row : row + 1], t[row : row + 1], k[row : row + 1], p[row : row + 1],
                       seeds[row : row + 1], config=config)
        assert alone.item() == first[row].item(), "a row's draw must not depend on its batch mates"
    many = sample(logits[:1].expand(64, V).contiguous(), *_params(64, device, temperature=1.3),
                  torch.arange(64, dtype=torch.int64, device=device), config=config)
    assert len(set(many.tolist())) > 1, "different seeds must give different draws"


def test_split_handles_minus_inf_logits(device):
    """Masked vocabulary entries (-inf) are never drawn, whatever the filters."""
    B, V = 6, 40
    logits = torch.randn(B, V, device=device)
    logits[:, 20:] = float("-inf")
    t, k, p = _params(B, device, temperature=1.0)
    k[1], p[2], k[3], p[3] = 3, 0.5, 30, 0.95  # k[3] = 30 reaches into the masked tail
    seeds = torch.arange(B, dtype=torch.int64, device=device)
    for config in (KernelConfig.make("split", BLOCK_V=8, NUM_CAND=2, NUM_PIVOTS=8), SPLIT_COMPLETE):
        tokens = sample(logits, t, k, p, seeds, config=config)
        assert (tokens < 20).all(), (config, tokens.tolist())
