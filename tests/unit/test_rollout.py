"""The rollout state machine (shapeshift.operator.rollout), pure: canary first, analysis
window, promote or roll back, Restart strategy, a new champion mid-rollout."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from shapeshift.operator.rollout import (
    CanaryAnalysis,
    ForwardPassIdentity,
    PodView,
    RolloutPolicy,
    RolloutState,
    ServingMetrics,
    desired_per_pod,
    judge,
    pod_annotations,
    step,
    template_forward_pass,
)

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
STOCK = ForwardPassIdentity("stock", "a" * 64)
FAST = ForwardPassIdentity("llama-fp-2", "b" * 64)
FASTER = ForwardPassIdentity("llama-fp-3", "c" * 64)
POLICY = RolloutPolicy(canary_replicas=1, analysis_window=timedelta(minutes=5), allowed_regression=0.05)


def pods(running: dict[str, ForwardPassIdentity | None], ready: bool = True) -> list[PodView]:
    return [PodView(name, ready, fp) for name, fp in running.items()]


def metrics(p90: float = 0.050, errors: float = 0.0, tps: float = 100.0, requests: float = 200) -> ServingMetrics:
    return ServingMetrics(requests=requests, p90_latency_seconds=p90, error_rate=errors, tokens_per_second=tps)


def advance(state, *, now, running, analysis=None, target=FAST, active=STOCK, policy=POLICY):
    return step(policy=policy, state=state, target=target, active=active, pods=pods(running),
                analysis=analysis, now=now)


def test_canary_first_then_analysis_then_promotion():
    all_stock = {"e-0": STOCK, "e-1": STOCK, "e-2": STOCK}
    state = advance(RolloutState(), now=T0, running=all_stock)
    assert state.phase == "Canary" and state.canary_pods == ("e-0",)
    assert desired_per_pod(state, pods(all_stock), STOCK) == {"e-0": FAST, "e-1": STOCK, "e-2": STOCK}

    # the canary has not reported the new sha256 yet: nothing moves
    assert advance(state, now=T0 + timedelta(seconds=30), running=all_stock) == state
    canary_on_fast = {**all_stock, "e-0": FAST}
    state = advance(state, now=T0 + timedelta(minutes=1), running=canary_on_fast)
    assert state.phase == "Analyzing" and state.phase_since == T0 + timedelta(minutes=1)

    better = CanaryAnalysis(canary=metrics(p90=0.040, tps=130), baseline=metrics())
    # the window is not over yet
    assert advance(state, now=T0 + timedelta(minutes=5), running=canary_on_fast, analysis=better) == state
    state = advance(state, now=T0 + timedelta(minutes=6), running=canary_on_fast, analysis=better)
    assert state.phase == "Promoting"
    assert set(desired_per_pod(state, pods(canary_on_fast), STOCK).values()) == {FAST}
    assert template_forward_pass(state, STOCK) == FAST

    # one pod still on the old pass: not complete
    assert advance(state, now=T0 + timedelta(minutes=7), running={**canary_on_fast, "e-1": FAST}).phase == "Promoting"
    state = advance(state, now=T0 + timedelta(minutes=8), running={"e-0": FAST, "e-1": FAST, "e-2": FAST})
    assert state.phase == "Complete" and state.desired == FAST and state.previous == STOCK
    # settled with the target active: no new rollout, even before status names it active
    assert advance(state, now=T0 + timedelta(minutes=9), running={"e-0": FAST}, active=FAST) == state
    assert advance(state, now=T0 + timedelta(minutes=9), running={"e-0": FAST}, active=STOCK) == state


def test_a_regressing_canary_is_rolled_back():
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK, "e-1": STOCK})
    state = advance(state, now=T0 + timedelta(minutes=1), running={"e-0": FAST, "e-1": STOCK})
    slower = CanaryAnalysis(canary=metrics(p90=0.080, tps=90), baseline=metrics(p90=0.050, tps=100))
    state = advance(state, now=T0 + timedelta(minutes=7), running={"e-0": FAST, "e-1": STOCK}, analysis=slower)
    assert state.phase == "RolledBack"
    assert "p90 latency 50.0 ms -> 80.0 ms (+60%)" in state.message and "tokens/s" in state.message
    assert desired_per_pod(state, pods({"e-0": FAST, "e-1": STOCK}), STOCK) == {"e-0": STOCK, "e-1": STOCK}
    # the same target is not retried
    assert advance(state, now=T0 + timedelta(minutes=8), running={"e-0": STOCK, "e-1": STOCK}) == state
    # a newer champion is
    fresh = advance(state, now=T0 + timedelta(minutes=9), running={"e-0": STOCK, "e-1": STOCK}, target=FASTER)
    assert fresh.phase == "Canary" and fresh.desired == FASTER and fresh.previous == STOCK


def test_canary_that_never_loads_is_rolled_back_after_the_timeout():
    policy = RolloutPolicy(canary_replicas=1, load_timeout=timedelta(minutes=2))
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK}, policy=policy)
    state = advance(state, now=T0 + timedelta(minutes=1), running={"e-0": STOCK}, policy=policy)
    assert state.phase == "Canary"
    state = advance(state, now=T0 + timedelta(minutes=2), running={"e-0": STOCK}, policy=policy)
    assert state.phase == "RolledBack" and "e-0 did not report llama-fp-2" in state.message


def test_no_canary_traffic_waits_then_gives_up_rather_than_promoting():
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK, "e-1": STOCK})
    state = advance(state, now=T0, running={"e-0": FAST, "e-1": STOCK})
    idle = CanaryAnalysis(canary=metrics(requests=3), baseline=metrics())
    waiting = advance(state, now=T0 + timedelta(minutes=6), running={"e-0": FAST, "e-1": STOCK}, analysis=idle)
    assert waiting.phase == "Analyzing" and "waits for traffic" in waiting.message
    given_up = advance(waiting, now=T0 + timedelta(minutes=15), running={"e-0": FAST, "e-1": STOCK}, analysis=idle)
    assert given_up.phase == "RolledBack" and "no evidence" in given_up.message


def test_restart_strategy_rolls_the_template_without_canary():
    policy = RolloutPolicy(strategy="Restart")
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK, "e-1": STOCK}, policy=policy)
    assert state.phase == "Promoting" and state.canary_pods == ()
    assert template_forward_pass(state, STOCK) == FAST
    # new pods come up with the target; an unready old pod does not hold completion back
    done = step(policy=policy, state=state, target=FAST, active=STOCK, now=T0 + timedelta(minutes=3),
                pods=[PodView("e-2", True, FAST), PodView("e-3", True, FAST), PodView("e-0", False, STOCK)],
                analysis=None)
    assert done.phase == "Complete"


def test_a_newer_champion_mid_rollout_restarts_from_the_active_pass():
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK, "e-1": STOCK})
    state = advance(state, now=T0 + timedelta(minutes=1), running={"e-0": FAST, "e-1": STOCK})
    assert state.phase == "Analyzing"
    state = advance(state, now=T0 + timedelta(minutes=2), running={"e-0": FAST, "e-1": STOCK}, target=FASTER)
    assert state.phase == "Canary" and state.desired == FASTER and state.previous == STOCK


def test_waits_for_a_ready_pod_before_choosing_the_canary():
    state = step(policy=POLICY, state=RolloutState(), target=FAST, active=STOCK,
                 pods=pods({"e-0": None}, ready=False), analysis=None, now=T0)
    assert state.phase == "Idle" and "waiting for a ready pod" in state.message


def test_sha256_mismatch_is_not_the_target():
    impostor = ForwardPassIdentity("llama-fp-2", "f" * 64)
    assert not FAST.matches(impostor)
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK})
    assert advance(state, now=T0 + timedelta(seconds=10), running={"e-0": impostor}).phase == "Canary"


@pytest.mark.parametrize("canary, promote", [
    (metrics(p90=0.052), True),  # +4% latency: within 5%
    (metrics(p90=0.054), False),  # +8%
    (metrics(errors=0.04), True),
    (metrics(errors=0.07), False),
    (metrics(tps=96), True),
    (metrics(tps=90), False),
])
def test_judge_thresholds(canary, promote):
    assert judge(CanaryAnalysis(canary=canary, baseline=metrics()), 0.05).promote is promote


def test_pod_annotations_follow_the_engine_rollout_protocol():
    from shapeshift.engine.contracts.pod_annotations import DesiredForwardPass

    fast = ForwardPassIdentity("llama-fp-2", "b" * 64, artifact="/var/lib/shapeshift/registry/llama-fp-2.tar.gz")
    assert fast == FAST  # the artifact is where it lives, not what it is
    annotations = pod_annotations(fast)
    back = DesiredForwardPass.from_annotations(annotations)
    assert (back.name, back.sha256, back.artifact) == (fast.name, fast.sha256, fast.artifact)
    assert back.problems() == []
    # stock (rolling back to it) removes the annotations
    assert set(pod_annotations(ForwardPassIdentity("stock", None)).values()) == {None}
    assert set(pod_annotations(None).values()) == {None}
    with pytest.raises(ValueError, match="llama-fp-2"):
        pod_annotations(ForwardPassIdentity("llama-fp-2", "not-a-digest", artifact="/x.tar.gz"))


def test_a_canary_that_refuses_the_target_is_rolled_back_at_once():
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK, "e-1": STOCK})
    refused = [PodView("e-0", True, STOCK, load_refused="digest_mismatch"), PodView("e-1", True, STOCK)]
    after = step(policy=POLICY, state=state, target=FAST, active=STOCK, pods=refused, analysis=None,
                 now=T0 + timedelta(seconds=5))
    assert after.phase == "RolledBack" and after.phase_since == T0 + timedelta(seconds=5)
    assert "canary e-0 (digest_mismatch) refused llama-fp-2" in after.message
    # A refusal reported by a pod outside the canary, or by a canary already on the target, is not one.
    outside = [PodView("e-0", True, STOCK), PodView("e-1", True, STOCK, load_refused="refused")]
    assert step(policy=POLICY, state=state, target=FAST, active=STOCK, pods=outside, analysis=None,
                now=T0 + timedelta(seconds=5)) == state
    loaded = [PodView("e-0", True, FAST, load_refused="digest_mismatch"), PodView("e-1", True, STOCK)]
    assert step(policy=POLICY, state=state, target=FAST, active=STOCK, pods=loaded, analysis=None,
                now=T0 + timedelta(seconds=5)).phase == "Analyzing"


def test_latency_differences_below_the_resolution_are_not_regressions():
    # 0.9 ms -> 1.9 ms is +111 %, but within the millisecond buckets the p90 is interpolated from.
    noisy = CanaryAnalysis(canary=metrics(p90=0.0019), baseline=metrics(p90=0.0009), latency_resolution_seconds=0.002)
    assert judge(noisy, allowed_regression=1.0).promote is True
    real = CanaryAnalysis(canary=metrics(p90=0.0735), baseline=metrics(p90=0.001), latency_resolution_seconds=0.002)
    verdict = judge(real, allowed_regression=0.5)
    assert verdict.promote is False and "p90 latency 1.0 ms -> 73.5 ms" in verdict.reasons[0]


def test_a_canary_that_stops_serving_is_rolled_back_not_judged_on_its_earlier_traffic():
    state = advance(RolloutState(), now=T0, running={"e-0": STOCK, "e-1": STOCK})
    analyzing = advance(state, now=T0 + timedelta(minutes=1), running={"e-0": FAST, "e-1": STOCK})
    good = CanaryAnalysis(canary=metrics(p90=0.040, tps=130), baseline=metrics())
    later = T0 + timedelta(minutes=7)  # the window is over and its traffic would promote
    for before in (state, analyzing):
        for pods_now in ([PodView("e-0", False, FAST), PodView("e-1", True, STOCK)],  # its engine died
                         [PodView("e-1", True, STOCK)]):  # its pod is gone
            after = step(policy=POLICY, state=before, target=FAST, active=STOCK, pods=pods_now, analysis=good,
                         now=later)
            assert after.phase == "RolledBack" and after.phase_since == later, (before.phase, pods_now)
            assert "canary e-0 stopped serving llama-fp-2 (pod gone or not ready)" in after.message
            assert desired_per_pod(after, pods_now, STOCK) == {p.name: STOCK for p in pods_now}
    # Its canary still ready: the analysis decides.
    assert advance(analyzing, now=later, running={"e-0": FAST, "e-1": STOCK}, analysis=good).phase == "Promoting"
