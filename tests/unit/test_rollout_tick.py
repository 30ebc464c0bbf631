"""The rollout timer's pure pieces (shapeshift.operator.rollout_tick, rollout_target, rollout_metrics):
target resolution, status <-> state, which pods to patch, refusals, the status it writes,
PromQL selectors; and the local kubelet's path and flag rewriting."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from shapeshift.engine.contracts.traffic_profile import builtin_profile
from shapeshift.operator.api import COMPILE_RUN_UID_ANNOTATION, ForwardPassSpec, InferenceDeploymentSpec, InferenceDeploymentStatus
from shapeshift.operator.prometheus import SeriesSelector
from shapeshift.operator.rollout import ForwardPassIdentity, PodView, RolloutState
from shapeshift.operator.rollout_metrics import PodReport, pod_regex
from shapeshift.operator.rollout_target import Target, champion_of, resolve_target
from shapeshift.operator.rollout_tick import (
    annotation_patch,
    plan_rollout_tick,
    pod_views,
    policy_from_spec,
    rollout_status_update,
    state_from_status,
    template_annotations,
    template_annotations_for,
)
from shapeshift.operator.settings import OperatorSettings

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
FAST = ForwardPassIdentity("fp-2", "b" * 64, "/var/lib/shapeshift-artifacts/fp-2.tar.gz")
CHAT = builtin_profile("chat").to_dict()


def spec(**over) -> InferenceDeploymentSpec:
    base = {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 3}
    base.update(over)
    return InferenceDeploymentSpec.model_validate(base)


def forward_pass(passed=True, accelerator="cpu", sha="b" * 64):
    """A ForwardPass as a compile worker publishes it (see run_of for the run that vouches for it)."""
    return {"metadata": {"name": "fp-2", "annotations": {COMPILE_RUN_UID_ANNOTATION: "uid-run-1"}}, "spec": {
        "model": {"name": "tiny-llama"}, "hardware": {"accelerator": accelerator},
        "artifact": {"uri": "/var/lib/shapeshift-artifacts/fp-2.tar.gz", "sha256": sha}, "metrics": {"speedup": 1.3},
        "traffic": CHAT, "compileRun": "default/run-1",
        "verification": {"passed": passed, "gates": [{"name": "greedy-match", "passed": passed}],
                         "artifactSha256": sha}}}


def run_of(fp):
    """The CompileRun whose worker published `fp`: its status names the pass and its spec digest."""
    if fp is None:
        return None
    return {"metadata": {"name": "run-1", "uid": "uid-run-1"},
            "status": {"champion": fp["metadata"]["name"],
                       "championSpecSha256": ForwardPassSpec.model_validate(fp["spec"]).digest()}}


def resolve(name, fp, deployment):
    return resolve_target(name, fp, deployment, run_of(fp))


def measured_under(env):
    fp = forward_pass()
    fp["spec"]["engine"] = {"env": env}
    return fp


def pod(name, ready=True, annotations=None):
    return {"metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"nodeName": "cpu-0"},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_target_measured_under_another_engine_env_is_refused():
    pdl_off = [{"name": "SHAPESHIFT_PDL", "value": "0"}]
    # recorded and equal (order and the empty-value default do not matter)
    same = resolve("fp-2", measured_under(pdl_off), spec(engine={"env": pdl_off}))
    assert same.identity == FAST and same.problem is None
    assert resolve("fp-2", measured_under([]), spec()).identity == FAST
    # not recorded (published outside a cluster): no refusal on that ground
    assert resolve("fp-2", forward_pass(), spec(engine={"env": pdl_off})).identity == FAST
    changed = resolve("fp-2", measured_under(pdl_off), spec(engine={"env": [{"name": "SHAPESHIFT_PDL",
                                                                                    "value": "layer_tail"}]}))
    assert changed.identity is None and changed.refused == "fp-2" and changed.reason == "TargetRejected"
    assert "SHAPESHIFT_PDL='0' then, 'layer_tail' now" in changed.problem and "CompileRun" in changed.problem
    dropped = resolve("fp-2", measured_under(pdl_off), spec())
    assert "SHAPESHIFT_PDL='0' then, unset now" in dropped.problem
    added = resolve("fp-2", measured_under([]), spec(engine={"env": [{"name": "SHAPESHIFT_GEMV_PREFETCH",
                                                                       "value": "0"}]}))
    assert "SHAPESHIFT_GEMV_PREFETCH unset then, '0' now" in added.problem
    # only the engine's performance switches count (the only names a compile worker records)
    other = resolve("fp-2", measured_under([]), spec(engine={"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]}))
    assert other.problem is None


def test_policy_comes_from_the_spec():
    s = policy_from_spec(spec(rollout={"strategy": "Restart", "canaryReplicas": 2, "analysisWindowSeconds": 30,
                                         "allowedRegression": 0.1, "loadTimeoutSeconds": 45}))
    assert (s.strategy, s.canary_replicas, s.analysis_window, s.allowed_regression, s.load_timeout) == (
        "Restart", 2, timedelta(seconds=30), 0.1, timedelta(seconds=45))


def test_target_is_a_verified_forward_pass_for_the_deployments_accelerator():
    target = resolve("fp-2", forward_pass(), spec())
    assert target.identity == FAST and target.identity.artifact == "/var/lib/shapeshift-artifacts/fp-2.tar.gz"
    assert target.speedup == 1.3 and target.traffic == CHAT and target.problem is None
    assert resolve(None, None, spec()) == Target(None)
    assert "not found" in resolve("fp-9", None, spec()).problem
    assert "verification" in resolve("fp-2", forward_pass(passed=False), spec()).problem
    wrong = resolve("fp-2", forward_pass(accelerator="nvidia-h200"), spec())
    assert wrong.identity is None and "nvidia-h200" in wrong.problem and "cpu" in wrong.problem
    # `stock` needs no ForwardPass object: it is the engine's own
    assert resolve("stock", None, spec()).identity == ForwardPassIdentity("stock", None)


def test_champion_is_the_newest_successful_run_of_this_deployment():
    def run(name, deployment, phase, champion, done):
        return {"metadata": {"name": name, "creationTimestamp": "2026-11-29T10:00:00Z"},
                "spec": {"deploymentRef": {"name": deployment}},
                "status": {"phase": phase, "champion": champion, "completionTime": done}}

    runs = [run("a", "llama", "Succeeded", "fp-1", "2026-11-29T11:00:00Z"),
            run("b", "llama", "Succeeded", "fp-2", "2026-11-29T12:00:00Z"),
            run("c", "llama", "Failed", "fp-3", "2026-11-29T13:00:00Z"),
            run("d", "other", "Succeeded", "fp-4", "2026-11-29T14:00:00Z")]
    assert champion_of(runs, "llama") == "fp-2"
    assert champion_of(runs, "nobody") is None


def test_state_round_trips_through_status():
    state = RolloutState(phase="Analyzing", desired=FAST, previous=None, canary_pods=("e-0",), started_at=T0,
                         phase_since=T0 + timedelta(seconds=40), message="canary runs fp-2")
    update = rollout_status_update(state=state, previous_state=state, status=InferenceDeploymentStatus(),
                                   target=Target(FAST, speedup=1.3), views=[], wanted={})
    status = InferenceDeploymentStatus.model_validate({"rollout": update.fields["rollout"]})
    back = state_from_status(status.rollout)
    assert back == state and back.desired.artifact == FAST.artifact
    assert update.fields["rollout"]["desired"]["speedup"] == 1.3


def test_merge_patch_removes_keys_the_new_rollout_lacks():
    stored = InferenceDeploymentStatus.model_validate({"rollout": {
        "phase": "Analyzing", "canaryPods": ["e-0"], "desired": {"name": "fp-2"}}})
    settled = RolloutState(phase="Idle")
    update = rollout_status_update(state=settled, previous_state=settled, status=stored, target=Target(None),
                                   views=[], wanted={})
    assert update.fields["rollout"] == {"phase": "Idle", "canaryPods": None, "desired": None}


def test_completion_records_the_active_pass_and_what_it_was_compiled_for():
    before = RolloutState(phase="Promoting", desired=FAST, canary_pods=("e-0",), phase_since=T0)
    done = RolloutState(phase="Complete", desired=FAST, canary_pods=("e-0",), phase_since=T0, message="all 2")
    views = [PodView("e-1", True, FAST), PodView("e-0", True, FAST)]
    update = rollout_status_update(state=done, previous_state=before, status=InferenceDeploymentStatus(),
                                   target=Target(FAST, speedup=1.3, traffic={"name": "chat"}), views=views,
                                   wanted={"e-0": FAST, "e-1": FAST})
    assert update.fields["activeForwardPass"] == {"name": "fp-2", "sha256": "b" * 64,
                                                  "artifact": "/var/lib/shapeshift-artifacts/fp-2.tar.gz", "speedup": 1.3}
    assert update.fields["compiledFor"] == {"name": "chat"}
    assert [p["name"] for p in update.fields["pods"]] == ["e-0", "e-1"]
    assert update.fields["pods"][0] == {"name": "e-0", "forwardPass": "fp-2", "sha256": "b" * 64,
                                        "desired": "fp-2", "canary": False, "ready": True}
    assert update.condition("ForwardPassRolledOut")[1:3] == ("True", "RolledOut")
    # the next tick (still Complete) does not rewrite the active pass
    again = rollout_status_update(state=done, previous_state=done, status=InferenceDeploymentStatus(),
                                  target=Target(FAST), views=views, wanted={})
    assert "activeForwardPass" not in again.fields


def test_held_rollout_and_rejected_target_are_conditions():
    state = RolloutState(phase="Canary", desired=FAST, canary_pods=("e-0",), phase_since=T0)
    held = rollout_status_update(state=state, previous_state=state, status=InferenceDeploymentStatus(),
                                 target=Target(FAST), views=[], wanted={}, prometheus_problem="connection refused")
    assert held.condition("ForwardPassRolledOut")[1:3] == ("Unknown", "PrometheusUnavailable")
    assert "held in phase Canary" in held.condition("ForwardPassRolledOut")[3]
    rejected = rollout_status_update(state=RolloutState(), previous_state=RolloutState(),
                                     status=InferenceDeploymentStatus(), target=Target(None, problem="not verified"),
                                     views=[], wanted={})
    assert rejected.condition("ForwardPassRolledOut") == ("ForwardPassRolledOut", "False", "TargetRejected",
                                                          "not verified")


def test_refusals_count_only_for_the_current_target_and_phase():
    state = RolloutState(phase="Canary", desired=FAST, canary_pods=("e-0",), phase_since=T0)
    asking = {"shapeshift.dev/forward-pass": "fp-2", "shapeshift.dev/forward-pass-sha256": "b" * 64,
              "shapeshift.dev/forward-pass-artifact": FAST.artifact}
    fresh = PodReport(running=ForwardPassIdentity("stock", "a" * 64), in_sync=False,
                      last_reload_result="digest_mismatch", last_reload_at=T0.timestamp() + 3)
    (view,) = pod_views([pod("e-0", annotations=asking)], {"e-0": fresh}, state)
    assert view == PodView("e-0", True, ForwardPassIdentity("stock", "a" * 64), "digest_mismatch")
    stale = PodReport(**{**fresh.__dict__, "last_reload_at": T0.timestamp() - 60})  # before this phase
    assert pod_views([pod("e-0", annotations=asking)], {"e-0": stale}, state)[0].load_refused is None
    # the annotations still ask for something else: the refusal is about that, not the target
    assert pod_views([pod("e-0")], {"e-0": fresh}, state)[0].load_refused is None
    fetch = PodReport(**{**fresh.__dict__, "last_reload_result": "fetch_error"})  # may pass: not a refusal
    assert pod_views([pod("e-0", annotations=asking)], {"e-0": fetch}, state)[0].load_refused is None
    unreadable = PodReport(**{**fresh.__dict__, "last_reload_result": "unreadable"})  # file modes: final
    assert pod_views([pod("e-0", annotations=asking)], {"e-0": unreadable}, state)[0].load_refused == "unreadable"
    # no report at all: not running anything known, not ready when the pod is not
    assert pod_views([pod("e-1", ready=False)], {}, state) == [PodView("e-1", False, None, None)]


def test_pods_are_patched_only_when_their_annotations_differ():
    asking = {"shapeshift.dev/forward-pass": "fp-2", "shapeshift.dev/forward-pass-sha256": "b" * 64,
              "shapeshift.dev/forward-pass-artifact": FAST.artifact, "other": "kept"}
    assert annotation_patch(pod("e-0", annotations=asking), FAST) is None
    assert annotation_patch(pod("e-0"), FAST) == {
        "shapeshift.dev/forward-pass": "fp-2", "shapeshift.dev/forward-pass-sha256": "b" * 64,
        "shapeshift.dev/forward-pass-artifact": FAST.artifact}
    # back to stock: a merge patch removing the three keys, and nothing to do once they are gone
    assert annotation_patch(pod("e-0", annotations=asking), None) == {
        "shapeshift.dev/forward-pass": None, "shapeshift.dev/forward-pass-sha256": None,
        "shapeshift.dev/forward-pass-artifact": None}
    assert annotation_patch(pod("e-0", annotations={"other": "kept"}), None) is None


def test_only_restart_puts_the_forward_pass_in_the_pod_template():
    status = InferenceDeploymentStatus.model_validate({"rollout": {
        "phase": "Promoting", "desired": {"name": "fp-2", "sha256": "b" * 64, "artifact": FAST.artifact}}})
    assert template_annotations_for(spec(), status) == {}
    restart = spec(rollout={"strategy": "Restart"})
    assert template_annotations_for(restart, status) == {
        "shapeshift.dev/forward-pass": "fp-2", "shapeshift.dev/forward-pass-sha256": "b" * 64,
        "shapeshift.dev/forward-pass-artifact": FAST.artifact}
    assert template_annotations_for(restart, InferenceDeploymentStatus()) == {}  # stock: nothing pinned


def test_environment_settings():
    env = OperatorSettings.from_environ({"SHAPESHIFT_PROMETHEUS_URL": "http://prom:9090",
                                         "SHAPESHIFT_PROMETHEUS_POD_LABEL": "kubernetes_pod_name",
                                         "SHAPESHIFT_ROLLOUT_MIN_REQUESTS": "5"})
    assert (env.prometheus_url, env.prometheus_pod_label, env.rollout_min_requests,
            env.rollout_latency_resolution_seconds) == ("http://prom:9090", "kubernetes_pod_name", 5.0, 0.002)


def test_pod_groups_are_exact_anchored_regexes():
    assert pod_regex(["e-1", "e-0"]) == "e-0|e-1"
    assert pod_regex(["a.b"]) == "a\\\\.b"  # PromQL string escaping of the regex escape
    selector = SeriesSelector(namespace="prod", deployment="llama", model="tiny-llama")
    assert selector.matcher(regex={"pod": "e-0|e-1"}) == \
        '{namespace="prod",deployment="llama",model="tiny-llama",pod=~"e-0|e-1"}'
    assert SeriesSelector().matcher(regex={"pod": "e-0"}) == '{pod=~"e-0"}'
    assert selector.matcher() == '{namespace="prod",deployment="llama",model="tiny-llama"}'
    assert SeriesSelector(namespace='a"b').matcher() == '{namespace="a\\"b"}'


@pytest.mark.parametrize("text, expected", [
    ("/etc/shapeshift/podinfo/annotations", "/tmp/pod/podinfo/annotations"),
    ("/etc/shapeshift/podinfo", "/tmp/pod/podinfo"),
    ("--desired-forward-pass-file=/etc/shapeshift/podinfo/annotations",
     "--desired-forward-pass-file=/tmp/pod/podinfo/annotations"),
    ("/etc/shapeshift/podinfo-other/x", "/etc/shapeshift/podinfo-other/x"),  # a sibling, not under the mount
    ("prefix/etc/shapeshift/podinfo/x", "prefix/etc/shapeshift/podinfo/x"),
])
def test_local_kubelet_rewrites_paths_under_a_mount(text, expected):
    from pathlib import Path

    from harness.kubelet import rewrite_paths

    assert rewrite_paths(text, {"/etc/shapeshift/podinfo": Path("/tmp/pod/podinfo")}) == expected


def test_local_kubelet_overrides_flags():
    from harness.kubelet import override_flags

    argv = ["shapeshift", "serve", "--port", "8000", "--host=0.0.0.0"]
    assert override_flags(argv, {"--port": "18001", "--host": "127.0.0.1", "--num-kv-blocks": "64"}) == [
        "shapeshift", "serve", "--port", "18001", "--host=127.0.0.1", "--num-kv-blocks", "64"]


# ---- plan_rollout_tick: one whole tick, as the timer applies it --------------------------------


def tick(status=None, *, target=Target(FAST, speedup=1.3), pods=None, reports=None, problem=None, analyze=None,
         now=T0, **spec_over):
    pods = pods if pods is not None else [pod("e-0"), pod("e-1"), pod("e-2")]
    return plan_rollout_tick(spec=spec(**spec_over), status=status or InferenceDeploymentStatus(), target=target,
                             pods=pods, reports=reports or {}, prometheus_problem=problem, analyze=analyze,
                             settings=OperatorSettings(rollout_min_requests=5), now=now)


def test_a_new_target_starts_the_canary_and_asks_only_the_canary_pod_for_it():
    planned = tick()
    assert planned.next_state.phase == "Canary" and planned.next_state.canary_pods == ("e-0",)
    assert list(planned.pod_patches) == ["e-0"]  # the others already run what they should (stock)
    assert planned.pod_patches["e-0"]["shapeshift.dev/forward-pass"] == "fp-2"
    assert planned.event[:2] == ("Normal", "CanaryStarted")
    assert planned.update.fields["rollout"]["phase"] == "Canary"
    assert planned.relations == {"fp-2": ("seen", "", "")}
    assert planned.warning is None


def test_restart_patches_no_pod_and_the_template_names_the_target():
    planned = tick(rollout={"strategy": "Restart"})
    assert planned.next_state.phase == "Promoting" and planned.pod_patches == {}
    assert template_annotations(spec(rollout={"strategy": "Restart"}), planned.next_state, planned.active) == {
        "shapeshift.dev/forward-pass": "fp-2", "shapeshift.dev/forward-pass-sha256": "b" * 64,
        "shapeshift.dev/forward-pass-artifact": FAST.artifact}
    # what the reconcile writes from the stored status is the same template
    stored = InferenceDeploymentStatus.model_validate({"rollout": planned.update.fields["rollout"]})
    assert template_annotations_for(spec(rollout={"strategy": "Restart"}), stored) == template_annotations(
        spec(rollout={"strategy": "Restart"}), planned.next_state, planned.active)


def test_an_analysis_prometheus_cannot_answer_holds_the_rollout():
    from shapeshift.operator.prometheus import PrometheusUnreachable

    analysing = InferenceDeploymentStatus.model_validate({"rollout": {
        "phase": "Analyzing", "desired": {"name": "fp-2", "sha256": "b" * 64, "artifact": FAST.artifact},
        "canaryPods": ["e-0"], "phaseSince": "2026-11-29T12:00:00Z"}})
    asked = []

    def analyze(canary, baseline, window, **kwargs):
        asked.append((tuple(canary), tuple(baseline), window, kwargs["min_requests"]))
        raise PrometheusUnreachable("Prometheus at http://prom:9090 cannot be reached")

    reports = {name: PodReport(running=FAST if name == "e-0" else None) for name in ("e-0", "e-1", "e-2")}
    planned = tick(analysing, reports=reports, analyze=analyze, now=T0 + timedelta(minutes=6))
    assert asked == [(("e-0",), ("e-1", "e-2"), timedelta(minutes=5), 5)]
    assert planned.next_state == planned.state and planned.event is None
    assert planned.update.condition("ForwardPassRolledOut")[1:3] == ("Unknown", "PrometheusUnavailable")
    # before the window is over nothing is asked
    asked.clear()
    tick(analysing, reports=reports, analyze=analyze, now=T0 + timedelta(minutes=1))
    assert asked == []


def test_idle_without_prometheus_writes_only_the_phase():
    planned = tick(target=Target(None), problem="no Prometheus address")
    assert planned.next_state.phase == "Idle" and planned.event is None
    assert set(planned.update.fields) == {"rollout"} and planned.update.conditions == []


def test_a_refused_target_warns_once():
    refused = Target(None, problem="ForwardPass fp-2 did not pass verification", refused="fp-2")
    first = tick(target=refused)
    assert first.warning == ("TargetRejected", "ForwardPass fp-2 did not pass verification")
    assert first.relations == {"fp-2": ("refused", "TargetRejected", refused.problem)}
    stored = InferenceDeploymentStatus.model_validate({"conditions": [
        {"type": "ForwardPassRolledOut", "status": "False", "reason": "TargetRejected", "message": refused.problem,
         "lastTransitionTime": "2026-11-29T12:00:00Z"}]})
    assert tick(stored, target=refused).warning is None
