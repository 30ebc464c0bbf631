"""The sampler's logits processors against their formulas, on small hand-made logits (no model)."""

from __future__ import annotations

import pytest
import torch

from shapeshift.engine.core.sampling import SamplingParams, SequenceHistory, TokenLogprob, apply_processors, sample

V = 8


def _params(prompt: list[int], output: list[int], eos: list[int] = (7,), **kw) -> SamplingParams:
    p = SamplingParams(max_tokens=16, temperature=0.0, **kw)
    p.history = SequenceHistory(list(prompt) + list(output), len(prompt), list(eos))
    return p


def test_neutral_params_have_no_processors_and_stay_greedy():
    p = SamplingParams(temperature=0.0)
    assert p.greedy and not p.has_processors
    assert not SamplingParams(temperature=0.0, presence_penalty=0.5).greedy  # argmax of processed logits
    assert SamplingParams(temperature=0.0, presence_penalty=0.5).argmax


def test_penalties_follow_the_openai_and_ctrl_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0, -2.0, 0.2]])
    prompt, output = [0], [3, 3, 1]
    got = apply_processors(logits, [_params(prompt, output, frequency_penalty=0.5, presence_penalty=0.25)])[0]
    want = logits[0].clone()
    want[3] -= 0.5 * 2 + 0.25
    want[1] -= 0.5 * 1 + 0.25
    assert torch.equal(got, want)
    got = apply_processors(logits, [_params(prompt, output, repetition_penalty=2.0)])[0]
    want = logits[0].clone()
    want[0], want[3], want[1] = 2.0 / 2, 3.0 / 2, -1.0 * 2  # prompt and output tokens; sign-aware
    assert torch.equal(got, want)


def test_counts_follow_the_growing_sequence():
    p = _params([0], [], frequency_penalty=1.0)
    logits = torch.zeros(1, V)
    assert torch.equal(apply_processors(logits, [p])[0], torch.zeros(V))
    p.history.token_ids += [4, 4]
    assert apply_processors(logits, [p])[0][4] == -2.0
    p.history.token_ids.append(4)
    assert apply_processors(logits, [p])[0][4] == -3.0


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    p = _params([0], [1], min_tokens=2, stop_token_ids=[5])
    row = apply_processors(logits, [p])[0]
    assert row[7] == float("-inf") and row[5] == float("-inf") and row[1] == 0.0
    p.history.token_ids.append(2)
    assert torch.equal(apply_processors(logits, [p])[0], torch.zeros(V))


def test_logit_bias_is_added():
    logits = torch.zeros(1, V)
    row = apply_processors(logits, [SamplingParams(logit_bias={2: 5.0, 6: -100.0})])[0]
    assert row[2] == 5.0 and row[6] == -100.0 and row[0] == 0.0


def test_batch_mates_with_neutral_params_are_untouched():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    neutral = SamplingParams(temperature=0.0)
    tokens, lps = sample(logits, [neutral, SamplingParams(temperature=0.0, logit_bias={0: 100.0}), neutral],
                         [None, None, None], want_logprobs=True)
    assert tokens[0] == logits[0].argmax().item() and tokens[2] == logits[2].argmax().item()
    assert tokens[1] == 0
    assert lps[0] == torch.log_softmax(logits[0], -1)[tokens[0]].item()  # under the raw logits


def test_top_logprobs_ride_on_the_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    _, lps = sample(logits, [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)], [None], True)
    assert isinstance(lps[0], TokenLogprob)
    ref = torch.log_softmax(logits[0], -1)
    assert [t for t, _ in lps[0].top] == [1, 3]
    assert lps[0] == pytest.approx(ref[1].item()) and lps[0].top[1][1] == pytest.approx(ref[3].item())


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(top_logprobs=3), dict(top_logprobs=21, logprobs=True),
                                 dict(presence_penalty=3.0), dict(repetition_penalty=0.0),
                                 dict(min_tokens=20), dict(logit_bias={1: 200.0})])
def test_invalid_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=16, **bad)
