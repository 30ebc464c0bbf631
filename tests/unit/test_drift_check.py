"""The pure parts of the drift timer (shapeshift.operator.drift_check): spec ->
policy, baseline and state; decision -> status update; Compile -> a CompileRun
owned by the deployment that the CompileRun model accepts."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Callable

import pytest

from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile, builtin_profile
from shapeshift.operator.builders import Parent
from shapeshift.operator.drift import Compile, DriftPolicy, DriftState, NoData, Observation, decide
from shapeshift.operator.drift_check import (
    CheckResult,
    active_compile_run,
    baseline_for,
    build_drift_compile_run,
    check_drift,
    drift_compile_run_name,
    drift_status_update,
    policy_from_spec,
    run_check,
    selector_for,
    state_from_status,
)
from shapeshift.operator.api import Condition, CompileRunSpec, InferenceDeploymentSpec, InferenceDeploymentStatus
from shapeshift.operator.prometheus import DataQuality, NoTrafficData, ObservedTraffic, PrometheusUnreachable
from shapeshift.operator.settings import OperatorSettings

NOW = datetime(2026, 11, 29, 12, 0, 5, tzinfo=timezone.utc)
PARENT = Parent(kind="InferenceDeployment", name="llama-chat", namespace="team-a", uid="1234-uid")


def make_spec(**compilation) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({
        "model": {"preset": "tiny-llama"},
        "hardware": {"accelerator": "cpu"},
        "compilation": {
            "policy": "OnDrift",
            "drift": {"promptLengthRelativeChange": 0.4, "prefixHitRateAbsoluteChange": 0.2,
                      "consecutiveChecks": 2, "windowSeconds": 300},
            "cooldownSeconds": 600,
            **compilation,
        },
        "trafficProfile": "chat",
    })


def profile(p50: int, hit: float | None = 0.5) -> TrafficProfile:
    return TrafficProfile(name="obs", prompt_length=LengthDistribution(p50=p50, p90=2 * p50, p99=3 * p50),
                          output_length=LengthDistribution(p50=64, p90=128, p99=256), prefix_cache_hit_rate=hit)


def test_policy_selector_baseline_and_state_come_from_the_spec_and_status():
    spec = make_spec()
    policy = policy_from_spec(spec, OperatorSettings(drift_min_requests=7))
    assert policy == DriftPolicy(prompt_length_relative=0.4, prefix_cache_hit_rate_absolute=0.2,
                                 consecutive_checks=2, cooldown=timedelta(seconds=600), min_requests=7)
    selector = selector_for("team-a", "llama-chat", spec, OperatorSettings(prometheus_deployment_label="app"))
    assert selector.matcher() == '{namespace="team-a",app="llama-chat",model="tiny-llama"}'

    empty = InferenceDeploymentStatus()
    assert baseline_for(spec, empty) == builtin_profile("chat")
    compiled = profile(100)
    assert baseline_for(spec, InferenceDeploymentStatus(compiled_for=compiled)) == compiled
    assert baseline_for(spec.model_copy(update={"traffic_profile": None}), empty) is None

    status = InferenceDeploymentStatus.model_validate(
        {"drift": {"consecutiveChecks": 1}, "lastCompileTime": "2026-11-29T11:00:00Z"})
    assert state_from_status(status) == DriftState(consecutive=1,
                                                   last_compile_at=datetime(2026, 11, 29, 11, tzinfo=timezone.utc))


def test_settings_from_the_environment():
    settings = OperatorSettings.from_environ({"SHAPESHIFT_PROMETHEUS_URL": "http://prom:9090",
                                              "SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL": "app",
                                              "SHAPESHIFT_DRIFT_MIN_REQUESTS": "50"})
    assert (settings.prometheus_url, settings.prometheus_deployment_label, settings.prometheus_namespace_label,
            settings.drift_min_requests) == ("http://prom:9090", "app", "namespace", 50)
    assert OperatorSettings.from_environ({}).prometheus_url is None


def compile_decision(observed: TrafficProfile) -> Compile:
    decision, _ = decide(observation=Observation(observed, 500), baseline=profile(100), policy=DriftPolicy(
        consecutive_checks=1), state=DriftState(), active_compile_run=None, now=NOW)
    assert isinstance(decision, Compile)
    return decision


def test_the_drift_compile_run_is_owned_by_the_deployment_and_carries_the_snapshot():
    spec = make_spec()
    observed = profile(400, hit=0.1)
    decision = compile_decision(observed)
    run = build_drift_compile_run(PARENT, spec, decision, NOW)
    assert run["metadata"]["name"] == "llama-chat-drift-261129120005"
    owner = run["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "InferenceDeployment", "llama-chat", "1234-uid", True)
    typed = CompileRunSpec.model_validate(run["spec"])  # what the API server's schema mirrors
    assert typed.deployment_ref.name == "llama-chat"
    assert typed.traffic.inline == observed
    assert typed.trigger.reason == "Drift"
    assert typed.trigger.drift_score == pytest.approx(decision.score)
    assert typed.budget == spec.compilation.budget
    # No template: the run names none of the template's fields, so every CompileRun default applies.
    assert not {"agents", "tiers", "verification", "baseline", "hardware", "image", "backoffLimit"} & set(run["spec"])
    assert typed.agents == CompileRunSpec(deployment_ref={"name": "x"}).agents


def test_the_drift_compile_run_copies_the_fields_set_in_the_template_and_only_those():
    spec = make_spec(
        budget={"trials": 12, "wallClockSeconds": 0},
        template={"agents": [{"kind": "coordinate-sweep"}, {"kind": "model-based", "replicas": 2}],
                  "tiers": {"replayRequests": 24, "repeats": 4},
                  "baseline": {"minSpeedup": 1.1},
                  "backoffLimit": 0})
    run = build_drift_compile_run(PARENT, spec, compile_decision(profile(400, hit=0.1)), NOW)
    wire = run["spec"]
    assert [a["kind"] for a in wire["agents"]] == ["coordinate-sweep", "model-based"]
    assert wire["agents"][1]["replicas"] == 2
    assert (wire["tiers"]["replayRequests"], wire["tiers"]["repeats"]) == (24, 4)
    assert wire["baseline"] == {"minSpeedup": 1.1}
    assert wire["backoffLimit"] == 0  # a falsy value set in the template is still copied
    assert wire["budget"] == {"trials": 12, "wallClockSeconds": 0, "deadlineGraceSeconds": 600}
    assert not {"verification", "hardware", "image"} & set(wire), wire  # not set: the CompileRun defaults apply
    typed = CompileRunSpec.model_validate(wire)
    assert typed.verification == CompileRunSpec(deployment_ref={"name": "x"}).verification
    assert typed.hardware is None and typed.image is None
    assert typed.baseline.min_speedup == 1.1 and typed.backoff_limit == 0
    # The run's own fields are the run's: a template cannot name another deployment or traffic.
    assert typed.deployment_ref.name == "llama-chat" and typed.trigger.reason == "Drift"


def test_the_template_takes_hardware_image_and_verification_too():
    spec = make_spec(template={"hardware": {"accelerator": "nvidia-h200", "count": 2},
                               "image": "registry.example/shapeshift-engine:dev",
                               "verification": {"greedySteps": 32, "freshPrompts": 4}})
    typed = CompileRunSpec.model_validate(
        build_drift_compile_run(PARENT, spec, compile_decision(profile(400, hit=0.1)), NOW)["spec"])
    assert typed.hardware is not None and (typed.hardware.accelerator, typed.hardware.count) == ("nvidia-h200", 2)
    assert typed.image == "registry.example/shapeshift-engine:dev"
    assert (typed.verification.greedy_steps, typed.verification.fresh_prompts) == (32, 4)


def test_a_template_with_unknown_or_run_owned_fields_is_refused():
    with pytest.raises(ValueError, match="traffic"):
        make_spec(template={"traffic": {"builtin": "chat"}})
    with pytest.raises(ValueError, match="at least 1"):
        make_spec(template={"agents": []})


def test_run_names_fit_the_compile_run_limit_and_are_deterministic():
    long_name = "a" * 29 + "-" + "b" * 20
    name = drift_compile_run_name(long_name, NOW)
    assert len(name) <= 52 and "--" not in name
    assert name == drift_compile_run_name(long_name, NOW)
    assert name != drift_compile_run_name(long_name, NOW + timedelta(seconds=1))


def test_active_compile_run_ignores_finished_and_other_deployments():
    def run(name, deployment, phase=None, created="2026-11-29T10:00:00Z"):
        return {"metadata": {"name": name, "creationTimestamp": created},
                "spec": {"deploymentRef": {"name": deployment}}, "status": {"phase": phase} if phase else {}}

    runs = [run("done", "llama-chat", "Succeeded"), run("failed", "llama-chat", "Failed"),
            run("other", "mistral", "Running"), run("newer", "llama-chat", "Running", "2026-11-29T11:00:00Z"),
            run("older", "llama-chat", None, "2026-11-29T10:30:00Z")]
    assert active_compile_run(runs, "llama-chat") == "older"
    assert active_compile_run(runs[:3], "llama-chat") is None


def test_status_update_of_a_compile_and_of_missing_data():
    decision = compile_decision(profile(400, hit=0.1))
    result = CheckResult(decision, DriftState(0, NOW), None)
    update = drift_status_update(result, InferenceDeploymentStatus(), now=NOW, compile_run="llama-chat-drift-1")
    assert update.fields["lastCompileRun"] == "llama-chat-drift-1"
    assert update.fields["drift"]["exceeded"] is True
    assert update.fields["drift"]["promptLengthRelativeChange"] == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert update.fields["drift"]["prefixCacheHitRateChange"] == pytest.approx(-0.4)
    assert update.condition("Drifted")[1:3] == ("True", "CompileRunCreated")
    InferenceDeploymentStatus.model_validate(update.fields)  # the status schema takes it

    manual = drift_status_update(result, InferenceDeploymentStatus(), now=NOW, compile_blocked="policy Manual")
    assert "lastCompileRun" not in manual.fields
    assert manual.condition("Drifted")[2] == "DriftPersisted" and "policy Manual" in manual.condition("Drifted")[3]

    # A later check without data keeps the last score on display, with a counter of 0.
    previous = InferenceDeploymentStatus.model_validate({"drift": update.fields["drift"]})

    def no_traffic():
        raise NoTrafficData("no requests reached the deployment in the last 300s")

    missing = run_check(observe=no_traffic, baseline=profile(100), policy=DriftPolicy(), state=DriftState(2),
                        active_compile_run=None, now=NOW + timedelta(minutes=1))
    assert isinstance(missing.decision, NoData) and missing.decision.reason == "NoTraffic"
    later = drift_status_update(missing, previous, now=NOW + timedelta(minutes=1))
    assert later.fields["drift"]["score"] == update.fields["drift"]["score"]
    assert later.fields["drift"]["consecutiveChecks"] == 0
    assert "exceeded" not in later.fields["drift"]
    assert later.condition("TrafficObserved")[1:3] == ("False", "NoTraffic")
    assert "observedTraffic" not in later.fields


def test_a_check_that_changes_nothing_but_the_time_is_not_written():
    from shapeshift.operator.drift_check import only_check_time_changed
    from shapeshift.operator.api import Condition

    def unreachable():
        from shapeshift.operator.prometheus import PrometheusUnreachable
        raise PrometheusUnreachable("Prometheus at http://prom:9090 cannot be reached (ConnectionError: refused)")

    result = run_check(observe=unreachable, baseline=profile(100), policy=DriftPolicy(), state=DriftState(),
                       active_compile_run=None, now=NOW)
    first = drift_status_update(result, InferenceDeploymentStatus(), now=NOW)
    assert not only_check_time_changed(first, InferenceDeploymentStatus())  # the first one is news
    stored = InferenceDeploymentStatus(
        drift=InferenceDeploymentStatus.model_validate({"drift": first.fields["drift"]}).drift,
        conditions=[Condition(type=t, status=v, reason=r, message=m) for t, v, r, m in first.conditions])
    again = drift_status_update(result, stored, now=NOW + timedelta(minutes=1))
    assert again.fields["drift"]["lastCheckTime"] != first.fields["drift"]["lastCheckTime"]
    assert only_check_time_changed(again, stored)
    # a different error is news again
    other = CheckResult(NoData("NoTraffic", "no requests"), DriftState(), None)
    assert not only_check_time_changed(drift_status_update(other, stored, now=NOW), stored)


# ---- check_drift: one whole check, as the timer applies it ------------------------------------


def observed(p50: int, requests: float = 100) -> Callable[[], ObservedTraffic]:
    quality = DataQuality(requests=requests, targets=2, window_seconds=300, evaluated_at=NOW,
                          prefix_cache_queried_tokens=1000.0)
    return lambda: ObservedTraffic(profile(p50), quality)


def drifting_status() -> InferenceDeploymentStatus:
    """One check over the threshold already behind it; the baseline is 100-token prompts."""
    return InferenceDeploymentStatus.model_validate({"compiledFor": profile(100).to_dict(),
                                                     "drift": {"consecutiveChecks": 1}})


def test_check_drift_under_on_drift_builds_the_compile_run_the_status_names():
    check = check_drift(spec=make_spec(), status=drifting_status(), parent=PARENT, observe=observed(400),
                        active_compile_run=None, settings=OperatorSettings(), now=NOW)
    assert isinstance(check.result.decision, Compile)
    assert check.compile_run is not None
    assert check.compile_run["metadata"]["name"] == drift_compile_run_name("llama-chat", NOW)
    assert check.update.fields["lastCompileRun"] == check.compile_run["metadata"]["name"]
    assert check.update.condition("Drifted")[2] == "CompileRunCreated"
    assert check.warning is None and check.write


def test_check_drift_under_manual_creates_nothing_and_holds_the_counter():
    spec = make_spec(policy="Manual")
    check = check_drift(spec=spec, status=drifting_status(), parent=PARENT, observe=observed(400),
                        active_compile_run=None, settings=OperatorSettings(), now=NOW)
    assert isinstance(check.result.decision, Compile) and check.compile_run is None
    assert check.result.state.consecutive == 2  # the spec's consecutiveChecks: no cooldown starts
    assert "policy Manual" in check.update.condition("Drifted")[3]
    assert "lastCompileRun" not in check.update.fields


def test_check_drift_warns_once_when_the_traffic_becomes_unobservable():
    def unreachable() -> ObservedTraffic:
        raise PrometheusUnreachable("Prometheus at http://prom:9090 cannot be reached")

    first = check_drift(spec=make_spec(), status=InferenceDeploymentStatus(), parent=PARENT, observe=unreachable,
                        active_compile_run=None, settings=OperatorSettings(), now=NOW)
    assert first.warning == ("PrometheusUnreachable", "Prometheus at http://prom:9090 cannot be reached")
    assert first.write and first.compile_run is None
    stored = InferenceDeploymentStatus(
        drift=InferenceDeploymentStatus.model_validate({"drift": first.update.fields["drift"]}).drift,
        conditions=[Condition(type=t, status=v, reason=r, message=m) for t, v, r, m in first.update.conditions])
    again = check_drift(spec=make_spec(), status=stored, parent=PARENT, observe=unreachable,
                        active_compile_run=None, settings=OperatorSettings(), now=NOW + timedelta(minutes=1))
    assert again.warning is None and not again.write  # nothing new: no event, no write
