"""Drift decisions (shapeshift.operator.drift), pure: thresholds, consecutive
checks, cooldown, one CompileRun at a time, and never compiling on missing data."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile
from shapeshift.operator.drift import (
    Compile,
    CompileInProgress,
    CoolingDown,
    Drifting,
    DriftPolicy,
    DriftState,
    NoData,
    Observation,
    Stable,
    compare,
    decide,
)

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def make_profile(p50: int = 1000, p90: int = 4000, p99: int = 8000, *, hit_rate: float | None = 0.5,
                 out: tuple[int, int, int] = (200, 600, 1200), name: str = "p") -> TrafficProfile:
    return TrafficProfile(
        name=name,
        prompt_length=LengthDistribution(p50=p50, p90=p90, p99=p99),
        output_length=LengthDistribution(p50=out[0], p90=out[1], p99=out[2]),
        prefix_cache_hit_rate=hit_rate,
    )


def observe(profile: TrafficProfile, requests: float = 500) -> Observation:
    return Observation(profile=profile, requests=requests)


def check(observed: TrafficProfile | None, *, state: DriftState = DriftState(), policy: DriftPolicy = DriftPolicy(),
          baseline: TrafficProfile | None = None, active: str | None = None, now: datetime = T0,
          requests: float = 500, no_data: NoData | None = None):
    return decide(
        observation=None if observed is None else observe(observed, requests),
        baseline=make_profile() if baseline is None else baseline,
        policy=policy, state=state, active_compile_run=active, now=now, no_data=no_data,
    )


def test_within_thresholds_is_stable_and_resets_the_counter():
    decision, state = check(make_profile(1100, 4300, 8400, hit_rate=0.45), state=DriftState(consecutive=1))
    assert isinstance(decision, Stable)
    assert state.consecutive == 0
    # 8400/8000 = +5%, 4300/4000 = +7.5%, 1100/1000 = +10%: the largest is p50 at 10% of a 25% threshold.
    assert decision.score == pytest.approx(0.10)
    assert decision.severity == pytest.approx(0.10 / 0.25)


def test_prompt_length_drift_needs_consecutive_checks_then_compiles():
    long_prompts = make_profile(1800, 9000, 20000)
    policy = DriftPolicy(consecutive_checks=3)
    first, state = check(long_prompts, policy=policy)
    assert isinstance(first, Drifting) and (first.consecutive, first.required) == (1, 3)
    second, state = check(long_prompts, policy=policy, state=state, now=T0 + timedelta(minutes=1))
    assert isinstance(second, Drifting) and second.consecutive == 2
    third, state = check(long_prompts, policy=policy, state=state, now=T0 + timedelta(minutes=2))
    assert isinstance(third, Compile)
    assert third.snapshot == long_prompts
    assert "promptLength.p99" in third.reason and "promptLength.p90" in third.reason
    # the largest relative change is named first: p99 +150%, p90 +125%, p50 +80%
    assert third.reason.startswith("promptLength.p99")
    assert state == DriftState(consecutive=0, last_compile_at=T0 + timedelta(minutes=2))


def test_a_stable_check_in_between_restarts_the_count():
    long_prompts = make_profile(3000, 9000, 20000)
    d1, state = check(long_prompts)
    assert isinstance(d1, Drifting)
    d2, state = check(make_profile(), state=state)
    assert isinstance(d2, Stable)
    d3, state = check(long_prompts, state=state)
    assert isinstance(d3, Drifting) and d3.consecutive == 1


def test_shrinking_prompts_drift_too():
    decision, _ = check(make_profile(300, 1000, 2000), policy=DriftPolicy(consecutive_checks=1))
    assert isinstance(decision, Compile)
    assert "-70%" in decision.reason


def test_hit_rate_drop_alone_triggers():
    policy = DriftPolicy(consecutive_checks=1, prefix_cache_hit_rate_absolute=0.2)
    decision, _ = check(make_profile(hit_rate=0.25), policy=policy)
    assert isinstance(decision, Compile)
    assert decision.reason.startswith("prefixCacheHitRate 0.50 -> 0.25 (-0.25")
    # just inside the threshold: stable
    decision, _ = check(make_profile(hit_rate=0.35), policy=policy)
    assert isinstance(decision, Stable)
    assert decision.severity == pytest.approx(0.15 / 0.2)
    assert decision.score == pytest.approx(0.15)


def test_switched_off_dimensions_are_reported_not_acted_on():
    policy = DriftPolicy(consecutive_checks=1, prefix_cache_hit_rate_absolute=None, output_length_relative=None)
    decision, _ = check(make_profile(hit_rate=0.0, out=(2000, 6000, 12000)), policy=policy)
    assert isinstance(decision, Stable)
    by_name = {d.name: d for d in decision.dimensions}
    assert by_name["outputLength.p50"].change == pytest.approx(9.0)
    assert by_name["prefixCacheHitRate"].change == pytest.approx(-0.5)
    assert not any(d.exceeded for d in decision.dimensions)
    # switched on, the same output drift compiles
    decision, _ = check(make_profile(out=(2000, 6000, 12000)),
                        policy=DriftPolicy(consecutive_checks=1, output_length_relative=0.5))
    assert isinstance(decision, Compile) and "outputLength" in decision.reason


def test_missing_hit_rate_on_either_side_is_not_compared():
    comparison = compare(make_profile(), make_profile(hit_rate=None), DriftPolicy())
    assert "prefixCacheHitRate" not in {d.name for d in comparison.dimensions}


def test_cooldown_holds_a_persisting_drift_back_until_it_ends():
    policy = DriftPolicy(consecutive_checks=1, cooldown=timedelta(minutes=30))
    long_prompts = make_profile(3000, 9000, 20000)
    state = DriftState(consecutive=0, last_compile_at=T0)
    during, state = check(long_prompts, policy=policy, state=state, now=T0 + timedelta(minutes=29))
    assert isinstance(during, CoolingDown)
    assert during.until == T0 + timedelta(minutes=30)
    assert state.last_compile_at == T0  # the cooldown does not restart
    after, state = check(long_prompts, policy=policy, state=state, now=T0 + timedelta(minutes=30))
    assert isinstance(after, Compile)
    assert state.last_compile_at == T0 + timedelta(minutes=30)


def test_one_compile_run_at_a_time():
    policy = DriftPolicy(consecutive_checks=2)
    long_prompts = make_profile(3000, 9000, 20000)
    state = DriftState()
    for minute in range(4):
        decision, state = check(long_prompts, policy=policy, state=state, active="llama-drift-1",
                                now=T0 + timedelta(minutes=minute))
        if minute == 0:
            assert isinstance(decision, Drifting)
        else:
            assert isinstance(decision, CompileInProgress)
            assert decision.compile_run == "llama-drift-1"
    assert state.consecutive == 2  # capped at the required count, not growing without bound
    # the run finished: the drift has already persisted, so the next check compiles at once
    decision, state = check(long_prompts, policy=policy, state=state, now=T0 + timedelta(minutes=5))
    assert isinstance(decision, Compile)


def test_prometheus_unreachable_never_compiles_and_restarts_the_count():
    unreachable = NoData("PrometheusUnreachable", "http://prometheus:9090: connection refused")
    decision, state = check(None, state=DriftState(consecutive=1), policy=DriftPolicy(consecutive_checks=2),
                            no_data=unreachable)
    assert decision is unreachable
    assert state.consecutive == 0


def test_no_observation_defaults_to_no_traffic():
    decision, _ = check(None)
    assert isinstance(decision, NoData) and decision.reason == "NoTraffic"


def test_too_few_requests_is_no_data_even_when_lengths_moved():
    decision, state = check(make_profile(9000, 20000, 40000), requests=5,
                            policy=DriftPolicy(consecutive_checks=1, min_requests=20),
                            state=DriftState(consecutive=3))
    assert isinstance(decision, NoData) and decision.reason == "TooFewRequests"
    assert "5 requests" in decision.message
    assert state.consecutive == 0


def test_no_baseline_is_no_data():
    decision, _ = decide(observation=observe(make_profile()), baseline=None, policy=DriftPolicy(),
                         state=DriftState(), active_compile_run=None, now=T0)
    assert isinstance(decision, NoData) and decision.reason == "NoBaseline"


@pytest.mark.parametrize("kwargs", [
    {"prompt_length_relative": 0},
    {"prompt_length_relative": -0.1},
    {"prefix_cache_hit_rate_absolute": 1.5},
    {"consecutive_checks": 0},
    {"cooldown": timedelta(seconds=-1)},
    {"min_requests": 0},
])
def test_bad_policies_are_rejected(kwargs):
    with pytest.raises(ValueError):
        DriftPolicy(**kwargs)
