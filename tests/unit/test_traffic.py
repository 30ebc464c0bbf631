"""TrafficProfile: validation, deterministic sampling, quantiles, drift, YAML round trips."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pydantic import ValidationError

from shapeshift.engine.contracts.traffic_profile import (
    BUILTIN_PROFILES,
    LengthDistribution,
    TrafficProfile,
    builtin_profile,
    load_profile,
)


def make(p50=100, p90=400, p99=900, **kw) -> TrafficProfile:
    return TrafficProfile(
        name=kw.pop("name", "t"),
        prompt_length=LengthDistribution(p50=p50, p90=p90, p99=p99),
        output_length=LengthDistribution(p50=20, p90=60, p99=120),
        **kw,
    )


def test_importable_without_torch():
    import subprocess
    import sys

    code = ("import sys; import shapeshift.engine.contracts.traffic_profile; "
            "assert 'torch' not in sys.modules, 'traffic pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_builtins_exist_and_are_valid():
    assert set(BUILTIN_PROFILES) == {"chat", "agentic-long-context", "burst"}
    for name, profile in BUILTIN_PROFILES.items():
        assert profile.name == name
        TrafficProfile.model_validate(profile.to_dict())  # the wire form validates
    assert builtin_profile("burst").arrival_rate == 50.0
    assert builtin_profile("agentic-long-context").prompt_length.p50 > builtin_profile("chat").prompt_length.p99


def test_unknown_builtin_names_the_known_ones():
    with pytest.raises(KeyError, match="chat"):
        builtin_profile("nope")


@pytest.mark.parametrize("bad", [
    dict(p50=500, p90=400, p99=900),           # unordered quantiles
    dict(p50=0, p90=400, p99=900),             # zero length
])
def test_length_distribution_rejects_bad_quantiles(bad):
    with pytest.raises(ValidationError):
        LengthDistribution(**bad)


def test_profile_rejects_out_of_range_and_inconsistent_fields():
    with pytest.raises(ValidationError):
        make(shared_prefix_ratio=1.5, shared_prefix_len=10)
    with pytest.raises(ValidationError, match="shared_prefix_len"):
        make(shared_prefix_ratio=0.5, shared_prefix_len=0)
    with pytest.raises(ValidationError):
        make(prefix_cache_hit_rate=-0.1)
    with pytest.raises(ValidationError):
        make(concurrency=0)
    with pytest.raises(ValidationError):  # unknown keys are refused, not dropped
        TrafficProfile.model_validate({**make().to_dict(), "promptLen": 3})


def test_sampling_is_deterministic_for_every_seed_kind():
    p = builtin_profile("chat")
    assert p.sample_requests(200, 7) == p.sample_requests(200, 7)
    assert p.sample_requests(200, 7) != p.sample_requests(200, 8)
    assert p.sample_requests(50, np.random.default_rng(3)) == p.sample_requests(50, np.random.default_rng(3))
    assert p.sample_requests(50, random.Random(3)) == p.sample_requests(50, random.Random(3))


def test_samples_follow_the_quantiles():
    d = LengthDistribution(p50=100, p90=400, p99=900, min=10, max=1000)
    xs = d.sample(0, 50_000)
    assert xs.dtype == np.int64 and xs.min() >= 10 and xs.max() <= 1000
    for q, want in ((0.5, 100), (0.9, 400), (0.99, 900)):
        assert abs(np.quantile(xs, q) - want) / want < 0.05, (q, np.quantile(xs, q))
    assert d.quantile(0.9) == pytest.approx(400)


def test_histogram_sampling_stays_in_buckets_and_skips_empty_ones():
    d = LengthDistribution.model_validate({
        "p50": 15, "p90": 35, "p99": 39,
        "histogram": [{"le": 10, "weight": 1}, {"le": 20, "weight": 0}, {"le": 40, "weight": 1}],
    })
    xs = d.sample(1, 20_000)
    assert not ((xs > 10) & (xs <= 20)).any(), "a zero-weight bucket got samples"
    assert 0.45 < (xs <= 10).mean() < 0.55
    assert xs.max() <= 40


def test_from_prometheus_cumulative_buckets():
    d = LengthDistribution.from_histogram([(128, 10), (512, 50), (2048, 90), (float("inf"), 100)], cumulative=True)
    assert [b.le for b in d.histogram] == [128, 512, 2048]
    assert [b.weight for b in d.histogram] == [10, 40, 50]  # the +Inf excess folds into the last bucket
    assert d.p50 == 512
    assert 512 < d.p90 <= 2048


def test_shared_prefix_requests_are_longer_than_the_prefix():
    p = make(p50=5, p90=10, p99=20, shared_prefix_ratio=1.0, shared_prefix_len=64)
    reqs = p.sample_requests(100, 0)
    assert all(r.shared_prefix_len == 64 and r.prompt_len > 64 for r in reqs)
    assert all(r.arrival_s is None for r in reqs)


@pytest.mark.parametrize("name", ["chat", "agentic-long-context", "burst"])
def test_sessions_bring_the_cacheable_share_to_the_profiles_hit_rate(name):
    """Later turns of sessions repeat an earlier turn's whole prompt, so that the prompt tokens a
    prefix cache could serve (the common prefix after its first use, and the repeated turns) come
    to the profile's observed hit rate; lengths and arrivals stay as drawn."""
    from shapeshift.engine.contracts.traffic_profile import builtin_profile

    p = builtin_profile(name)
    reqs = p.sample_requests(400, 3)
    plain = p.model_copy(update={"prefix_cache_hit_rate": None}).sample_requests(400, 3)
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in reqs] == \
        [(r.prompt_len, r.output_len, r.arrival_s) for r in plain]
    assert all(r.continues is None for r in plain)
    turns = [r for r in reqs if r.continues is not None]
    assert turns, "a hit rate above the common prefix's share needs sessions"
    for r in turns:  # each continues a turn at least a concurrency's worth of requests earlier, shorter than it
        earlier = reqs[r.continues]
        assert r.continues <= r.index - p.concurrency and r.reused_len == earlier.prompt_len < r.prompt_len
    assert len({r.continues for r in turns}) == len(turns)  # a turn is continued at most once
    prefix_seen, cacheable = False, 0
    for r in reqs:
        cacheable += r.reused_len if r.continues is not None else (r.shared_prefix_len if prefix_seen else 0)
        prefix_seen = prefix_seen or r.shared_prefix_len > 0
    assert cacheable / sum(r.prompt_len for r in reqs) == pytest.approx(p.prefix_cache_hit_rate, abs=0.03)


def test_each_turn_continues_the_longest_shorter_open_session():
    """The docstring's rule, checked by scanning every open session (what the sorted index
    replaces): a later turn continues the session whose latest turn has the longest prompt shorter
    than its own and longer than the common prefix, the earliest such turn among equals, and only
    turns at least `gap` requests back; a turn that continues nothing starts a session."""
    from shapeshift.engine.contracts.traffic_profile import RequestShape, _sessions

    rng = random.Random(7)
    continued = 0
    for _ in range(60):
        gap = rng.randint(0, 8)
        shapes = [RequestShape(index=i, prompt_len=rng.randint(1, 50), output_len=4,
                               shared_prefix_len=rng.choice([0, 0, 6]), arrival_s=None) for i in range(150)]
        hit_rate = rng.random()
        out = _sessions(shapes, hit_rate, gap)
        assert [(r.index, r.prompt_len) for r in out] == [(r.index, r.prompt_len) for r in shapes]
        latest: dict[int, RequestShape] = {}  # session -> its latest turn
        prefix_seen = False
        total = cached = 0
        for r, drawn in zip(out, shapes):
            total += r.prompt_len
            system = drawn.shared_prefix_len if (drawn.shared_prefix_len and prefix_seen) else 0
            prefix_seen = prefix_seen or drawn.shared_prefix_len > 0
            open_turns = [t for t in latest.values()
                          if t.index <= r.index - gap and system < t.prompt_len < r.prompt_len]
            behind = cached + system < hit_rate * total
            if r.continues is None:  # only when no session could go on, or the cache share is on target
                assert not (behind and open_turns), (r.index, [t.index for t in open_turns])
                cached += system
                latest[r.index] = r
                continue
            assert behind and open_turns, (r.index, r.continues)  # at least `gap` back, shorter
            best = max(open_turns, key=lambda t: (t.prompt_len, -t.index))
            assert r.continues == best.index and r.reused_len == best.prompt_len
            cached += r.reused_len
            session = next(k for k, t in latest.items() if t.index == best.index)
            latest[session] = r
        continued += sum(r.continues is not None for r in out)
    assert continued > 100  # the draws exercised the choice, not only its absence


def test_open_loop_arrivals_follow_the_rate():
    p = make(arrival_rate=20.0)
    reqs = p.sample_requests(4000, 0)
    times = [r.arrival_s for r in reqs]
    assert times[0] == 0.0 and times == sorted(times)
    assert abs(len(times) / times[-1] - 20.0) / 20.0 < 0.05


def test_drift_relative_quantiles_and_absolute_hit_rate():
    base = make(p50=100, p90=400, p99=900, prefix_cache_hit_rate=0.5, name="base")
    now = make(p50=180, p90=400, p99=450, prefix_cache_hit_rate=0.3, name="now")
    report = base.drift(now)
    assert report.prompt_length_relative_change == pytest.approx({"p50": 0.8, "p90": 0.0, "p99": -0.5})
    assert report.prefix_cache_hit_rate_change == pytest.approx(-0.2)
    assert report.prompt_score == pytest.approx(0.8)
    assert report.score == pytest.approx(0.8)
    assert report.exceeds(0.5)
    assert not report.exceeds(0.9, 0.25)
    assert report.exceeds(0.9, 0.1)
    assert base.drift(base).score == 0.0
    assert base.drift(make(prefix_cache_hit_rate=None)).prefix_cache_hit_rate_change is None


def test_yaml_round_trip_and_load(tmp_path):
    p = builtin_profile("agentic-long-context")
    text = p.to_yaml()
    assert "promptLength:" in text and "sharedPrefixRatio:" in text  # camelCase on the wire
    assert TrafficProfile.from_yaml(text) == p
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert load_profile(path) == p
    assert load_profile(str(path)) == p
    assert load_profile("chat") == builtin_profile("chat")
    with pytest.raises(FileNotFoundError, match="built-in"):
        load_profile(tmp_path / "missing.yaml")


def test_scaled_keeps_shape_for_small_models():
    p = builtin_profile("agentic-long-context").scaled(1 / 64)
    assert p.prompt_length.p99 == round(122880 / 64)
    assert p.shared_prefix_len == 16384 // 64
    assert p.prompt_length.p50 <= p.prompt_length.p90 <= p.prompt_length.p99
