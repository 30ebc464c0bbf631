"""Sampler: top-k / top-p masks against a plain reference, sampling frequencies, greedy."""

from __future__ import annotations

import numpy as np
import torch

from shapeshift.engine.core.sampling import SamplingParams, apply_top_k_top_p, sample


def reference_keep_mask(logits: np.ndarray, k: int, p: float) -> np.ndarray:
    """Which tokens survive top-k then top-p (on the renormalized top-k distribution)."""
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros_like(logits, dtype=bool)
    kept = order[: k if k > 0 else len(logits)]
    probs = np.exp(logits[kept] - logits[kept].max())
    probs /= probs.sum()
    mass = 0.0
    for tok, pr in zip(kept, probs):
        keep[tok] = True
        mass += pr
        if mass >= p:
            break
    return keep


def test_top_k_top_p_masks_match_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=gen) * 2.5
    ks = torch.tensor([0, 1, 3, 10, 40, 50] * 10 + [0, 5, 0, 7])
    ps = torch.tensor([1.0, 0.5, 0.9, 0.3, 0.75, 0.99] * 10 + [0.1, 1.0, 0.6, 0.95])
    masked = apply_top_k_top_p(logits, ks, ps)
    for i in range(logits.shape[0]):
        expected = reference_keep_mask(logits[i].numpy(), int(ks[i]), float(ps[i]))
        np.testing.assert_array_equal(torch.isfinite(masked[i]).numpy(), expected, err_msg=f"row {i}")
        np.testing.assert_array_equal(masked[i][expected].numpy(), logits[i][expected].numpy())


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    rows = 4000
    draws = []
    for _ in range(5):
        tokens, _ = sample(logits.repeat(rows, 1), [params] * rows, [None] * rows)
        draws += tokens
    counts = np.bincount(draws, minlength=6) / len(draws)
    scaled = logits[0] / 0.7
    keep = torch.from_numpy(reference_keep_mask(scaled.numpy(), 4, 0.9))
    expected = torch.softmax(scaled.masked_fill(~keep, float("-inf")), -1).numpy()
    assert counts[~keep.numpy()].sum() == 0
    np.testing.assert_allclose(counts, expected, atol=0.015)


def test_greedy_rows_take_the_argmax_and_logprobs_are_raw():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=0.0)]
    gens = [None, torch.Generator().manual_seed(1), None, None, None]
    tokens, logprobs = sample(logits, params, gens, want_logprobs=True)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 3, 4)] == [argmax[i] for i in (0, 2, 3, 4)]  # top_k=1 is greedy too
    expected = torch.log_softmax(logits, -1)[torch.arange(5), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(logprobs), expected)


def test_seeded_rows_are_reproducible_whatever_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0, seed=5)

    def draw(batch_mates: int) -> list[int]:
        g = torch.Generator().manual_seed(5)
        out = []
        for _ in range(20):
            batch = torch.cat([torch.randn(batch_mates, 50), logits])
            tokens, _ = sample(batch, [SamplingParams(temperature=1.0)] * batch_mates + [p],
                               [None] * batch_mates + [g])
            out.append(tokens[-1])
        return out

    assert draw(0) == draw(3) == draw(7)
