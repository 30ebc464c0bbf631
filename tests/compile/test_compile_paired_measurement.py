"""Every tier pairs, on the real evaluator (tiny-llama on the CPU):

    screen_paired / compare -> candidate and incumbent in alternation, the order flipped every
      repeat (ABBA), each warmed up first -> equal sample counts, a paired ratio
    every repeat -> the same traffic shapes with fresh prompt tokens (one generator)
    drift_summary -> first/last/low/high of the pass measured most often
"""

from __future__ import annotations

import pytest

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
from shapeshift.engine.compile.measure import drift_summary, paired_gain
from shapeshift.engine.contracts.traffic_profile import builtin_profile
from shapeshift.engine.replay.requests import requests_from_profile


class RecordingEvaluator(EngineEvaluator):
    """The real evaluator, noting which candidate each replay activated and which prompts it drew."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.activations: list[str] = []

    def _activate(self, tier, cand):
        self.activations.append(cand.agent)
        return super()._activate(tier, cand)


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory):
    ev = RecordingEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path_factory.mktemp("work")), screen_requests=8,
        screen_repeats=3, confirm_requests=8, confirm_repeats=2, cpu_threads=1))
    return ev


def test_screens_pair_the_incumbent_in_abba_order_after_a_warm_up(evaluator):
    space = evaluator.space()
    inc = Candidate(space.default(), None, "inc", "the incumbent")
    cand = Candidate({**space.default(), "fuse_qkv": True}, None, "cand", "a candidate")
    evaluator.activations.clear()
    m, inc_m = evaluator.screen_paired(cand, inc)
    assert m.ok and inc_m.ok and len(m.samples) == len(inc_m.samples) == 3
    # warm-up (its own order flipped), then A B, B A, A B: the second slot alternates
    assert evaluator.activations == ["inc", "cand", "cand", "inc", "inc", "cand", "cand", "inc"]
    gain, low, high = paired_gain(m, inc_m)
    assert low <= gain <= high and gain > 0


def test_every_repeat_replays_the_same_shapes_with_fresh_prompts(evaluator):
    eng = evaluator._engine("full", {})
    profile = evaluator._profile()
    a = requests_from_profile(profile, eng, 12, seed=0, token_seed=1)
    b = requests_from_profile(profile, eng, 12, seed=0, token_seed=2)
    assert [(len(r.prompt_token_ids), r.max_tokens, r.shared_prefix_len) for r in a] == \
        [(len(r.prompt_token_ids), r.max_tokens, r.shared_prefix_len) for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in b]
    assert requests_from_profile(profile, eng, 12, seed=0) == requests_from_profile(profile, eng, 12, 0, token_seed=0)
    # the evaluator draws once per repeat (and once for the warm-up)
    before = evaluator._draws
    space = evaluator.space()
    evaluator.compare(Candidate(space.default(), None, "a", ""), Candidate(space.default(), None, "b", ""))
    assert evaluator._draws - before == 1 + evaluator.settings.confirm_repeats


def test_drift_summary_follows_the_pass_measured_most_often():
    series = [{"tier": "fast", "digest": "s", "mean": 100.0, "stock": True, "elapsed_s": 0},
              {"tier": "fast", "digest": "c", "mean": 130.0, "stock": False, "elapsed_s": 5},
              {"tier": "fast", "digest": "s", "mean": 120.0, "stock": True, "elapsed_s": 9},
              {"tier": "fast", "digest": "s", "mean": 90.0, "stock": True, "elapsed_s": 12},
              {"tier": "full", "digest": "s", "mean": 50.0, "stock": True, "elapsed_s": 1}]
    d = drift_summary(series)
    assert d["fast"]["digest"] == "s" and d["fast"]["measurements"] == 3
    assert d["fast"]["last_over_first"] == pytest.approx(0.9) and d["fast"]["high_over_low"] == pytest.approx(120 / 90)
    assert d["full"]["measurements"] == 1 and d["full"]["last_over_first"] == 1.0


def test_a_second_look_at_pooled_pairs_is_held_to_a_stricter_bound():
    """Pairs of a no-op candidate from a loaded run (12 pooled after an undecided first round):
    the uncorrected 95% bound clears the 1% noise floor, the second look's 97.5% bound does not."""
    from shapeshift.engine.compile.measure import Measurement, beats_paired, paired_gain

    cand = Measurement(samples=[10043.6, 9086.2, 9473.1, 6250.4, 7688.5, 9606.0,
                                9002.2, 8592.8, 6818.6, 6749.8, 9604.7, 7357.5])
    inc = Measurement(samples=[8393.7, 8454.8, 6767.9, 8155.6, 7903.0, 7202.2,
                               8158.8, 8212.2, 5717.2, 5949.7, 6296.6, 6078.0])
    _, low_first, _ = paired_gain(cand, inc)
    _, low_second, _ = paired_gain(cand, inc, looks=2)
    assert low_second < 1.01 < low_first
    assert beats_paired(cand, inc) and not beats_paired(cand, inc, looks=2)
