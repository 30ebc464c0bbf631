"""The durable artifact store and what follows from a rollout's outcome, without a cluster.

    spec.artifacts.pvc --builders--> compile Job (read-write mount, $SHAPESHIFT_ARTIFACT_DIR) and
                                     engine Deployment (read-only mount at the same path)
    ForwardPass annotated artifact-durable "false" --resolve_target--> refused, with a reason
    worker's final message --compile_run_status--> kept in status.message, quoted by the condition
    rollout state --forward_pass_relations--> {ForwardPass: relation} --forward_pass_usage--> its status
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from shapeshift.operator import builders
from shapeshift.operator.builders import Parent
from shapeshift.operator.api import (
    ARTIFACT_MOUNT,
    COMPILE_RUN_UID_ANNOTATION,
    CompileRunSpec,
    CompileRunStatus,
    ForwardPassSpec,
    ForwardPassStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)
from shapeshift.operator.rollout import ForwardPassIdentity, RolloutState
from shapeshift.operator.rollout_target import NOT_DURABLE, Target, resolve_target
from shapeshift.operator.rollout_tick import forward_pass_relations, rollout_status_update
from shapeshift.operator.status import compile_run_status, forward_pass_usage

IDEP = Parent("InferenceDeployment", "llama", "prod", "uid-idep")
RUN = Parent("CompileRun", "llama-run", "prod", "uid-run")
T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def spec(**over) -> InferenceDeploymentSpec:
    base = {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 2}
    base.update(over)
    return InferenceDeploymentSpec.model_validate(base)


def with_store(sub_path: str | None = None) -> InferenceDeploymentSpec:
    pvc = {"claimName": "shapeshift-artifacts"}
    if sub_path:
        pvc["subPath"] = sub_path
    return spec(artifacts={"pvc": pvc})


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def volume_and_mount(obj, name="artifacts"):
    pod = pod_spec(obj)
    (container,) = pod["containers"]
    volume = next((v for v in pod["volumes"] if v["name"] == name), None)
    mount = next((m for m in container["volumeMounts"] if m["name"] == name), None)
    return volume, mount, container


# ---- builders ---------------------------------------------------------------------------------


def test_compile_job_writes_and_engines_read_the_store_at_the_same_path():
    deployment = with_store("team-a/llama")
    job = builders.build_compile_job(RUN, CompileRunSpec.model_validate({"deploymentRef": {"name": "llama"}}),
                                     deployment)
    volume, mount, container = volume_and_mount(job)
    assert volume == {"name": "artifacts", "persistentVolumeClaim": {"claimName": "shapeshift-artifacts"}}
    assert mount == {"name": "artifacts", "mountPath": ARTIFACT_MOUNT, "subPath": "team-a/llama"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHAPESHIFT_ARTIFACT_DIR"] == ARTIFACT_MOUNT == "/var/lib/shapeshift-artifacts"
    # The work emptyDir stays; the store is a sibling, not nested in it.
    assert {"name": "work", "emptyDir": {}} in pod_spec(job)["volumes"]
    assert not ARTIFACT_MOUNT.startswith(env["SHAPESHIFT_WORK_DIR"] + "/")

    engine = builders.build_engine_deployment(IDEP, deployment)
    volume, mount, _ = volume_and_mount(engine)
    assert volume == {"name": "artifacts",
                      "persistentVolumeClaim": {"claimName": "shapeshift-artifacts", "readOnly": True}}
    assert mount == {"name": "artifacts", "mountPath": ARTIFACT_MOUNT, "subPath": "team-a/llama", "readOnly": True}


def test_compile_job_keeps_the_run_folder_on_the_store_for_a_retried_pod():
    """The worker's output folder ($SHAPESHIFT_WORK_DIR/<run>: board, report) is the store's
    compile-runs/<run uid>, so a retried pod resumes the board; the rest of the work folder stays
    in the emptyDir. Without a store the folder is the emptyDir's (a retry starts over)."""
    r = CompileRunSpec.model_validate({"deploymentRef": {"name": "llama"}})
    for sub_path, expected in (("team-a/llama", "team-a/llama/compile-runs/uid-run"), (None, "compile-runs/uid-run")):
        job = builders.build_compile_job(RUN, r, with_store(sub_path))
        (container,) = pod_spec(job)["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = [m for m in container["volumeMounts"] if m["name"] == "artifacts"]
        assert mounts[1:] == [{"name": "artifacts", "mountPath": f"{env['SHAPESHIFT_WORK_DIR']}/llama-run",
                               "subPath": expected}], mounts
        assert {"name": "work", "mountPath": env["SHAPESHIFT_WORK_DIR"]} in container["volumeMounts"]
    (container,) = pod_spec(builders.build_compile_job(RUN, r, spec()))["containers"]
    assert [m["name"] for m in container["volumeMounts"]] == ["engine-config", "work"]


def test_without_a_store_nothing_is_mounted_and_the_worker_gets_no_artifact_dir():
    job = builders.build_compile_job(RUN, CompileRunSpec.model_validate({"deploymentRef": {"name": "llama"}}),
                                     spec())
    volume, mount, container = volume_and_mount(job)
    assert volume is None and mount is None
    assert "SHAPESHIFT_ARTIFACT_DIR" not in {e["name"] for e in container["env"]}
    volume, mount, _ = volume_and_mount(builders.build_engine_deployment(IDEP, spec()))
    assert volume is None and mount is None


def test_adding_a_store_changes_the_engine_template_hash():
    before = builders.build_engine_deployment(IDEP, spec())
    after = builders.build_engine_deployment(IDEP, with_store())
    assert before["metadata"]["annotations"][builders.SPEC_HASH] != after["metadata"]["annotations"][builders.SPEC_HASH]
    assert "subPath" not in volume_and_mount(after)[1]


@pytest.mark.parametrize("sub_path", ["../other", "a/../../b", "/abs", "a//b", ".."])
def test_sub_path_must_stay_inside_the_claim(sub_path):
    with pytest.raises(ValidationError, match="subPath"):
        with_store(sub_path)


def test_claim_name_must_be_a_dns_name():
    with pytest.raises(ValidationError, match="claimName"):
        spec(artifacts={"pvc": {"claimName": "Not_A_Name"}})


# ---- refusing a forward pass whose artifact is gone --------------------------------------------


def forward_pass(durable: str | None):
    """A pass as its compile worker publishes it (its run: published_by)."""
    annotations = {COMPILE_RUN_UID_ANNOTATION: "uid-1"}
    if durable is not None:
        annotations["shapeshift.dev/artifact-durable"] = durable
    return {"metadata": {"name": "fp-2", "annotations": annotations}, "spec": {
        "model": {"name": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "compileRun": "run-1",
        "artifact": {"uri": "file:///var/lib/shapeshift/run/fp.tar.gz", "sha256": "b" * 64},
        "metrics": {"speedup": 1.3}, "verification": {"passed": True, "artifactSha256": "b" * 64,
                                                      "gates": [{"name": "greedy-match", "passed": True}]}}}


def published_by(fp):
    return {"metadata": {"name": "run-1", "uid": "uid-1"},
            "status": {"champion": "fp-2", "championSpecSha256": ForwardPassSpec.model_validate(fp["spec"]).digest()}}


def test_a_forward_pass_marked_not_durable_is_refused_with_its_own_reason():
    target = resolve_target("fp-2", forward_pass("false"), spec(), published_by(forward_pass("false")))
    assert target.identity is None and target.reason == NOT_DURABLE and target.refused == "fp-2"
    assert "spec.artifacts.pvc" in target.problem and "emptyDir" in target.problem
    assert "file:///var/lib/shapeshift/run/fp.tar.gz" in target.problem
    update = rollout_status_update(state=RolloutState(), previous_state=RolloutState(),
                                   status=InferenceDeploymentStatus(), target=target, views=[], wanted={})
    condition = update.condition("ForwardPassRolledOut")
    assert condition[1:3] == ("False", "ArtifactNotDurable") and condition[3] == target.problem
    # Durable, or published before the annotation existed: rolled out as before.
    for durable in ("true", None):
        fp = forward_pass(durable)
        assert resolve_target("fp-2", fp, spec(), published_by(fp)).identity is not None


# ---- the worker's last word survives the Job's completion --------------------------------------


def job(condition, reason, message=""):
    return {"metadata": {"name": "r-compile"}, "status": {
        "startTime": "2026-01-01T00:00:01Z", "completionTime": "2026-01-01T00:09:00Z",
        "conditions": [{"type": condition, "status": "True", "reason": reason, "message": message,
                        "lastTransitionTime": "2026-01-01T00:09:00Z"}]}}


def test_completion_keeps_the_workers_message_and_quotes_it_in_the_condition():
    said = "no verified improvement over the shipped serving default (budget: 12 trials)"
    current = CompileRunStatus(phase="Running", message=said, trials={"total": 12})
    update = compile_run_status(current=current, job=job("Complete", "CompletionsReached"), job_name="r-compile",
                                pods=[])
    assert update.fields["phase"] == "Succeeded" and "message" not in update.fields
    condition = update.condition("Complete")
    assert condition[1:3] == ("True", "CompletionsReached") and said in condition[3]
    # No report from a worker (e.g. a Job run by hand): the operator's own summary, as before.
    plain = compile_run_status(current=CompileRunStatus(phase="Running", message="compiling on node cpu-0"),
                               job=job("Complete", "CompletionsReached"), job_name="r-compile", pods=[])
    assert plain.fields["message"] == "Job r-compile completed"


def test_failure_message_carries_the_workers_report():
    current = CompileRunStatus(phase="Running", message="compile worker failed: ValueError: no model")
    update = compile_run_status(current=current, job=job("Failed", "BackoffLimitExceeded", "backoff limit"),
                                job_name="r-compile", pods=[])
    assert update.fields["phase"] == "Failed"
    assert "BackoffLimitExceeded" in update.fields["message"] and "ValueError: no model" in update.fields["message"]
    assert "ValueError: no model" in update.condition("Failed")[3]


def test_a_late_resync_does_not_replace_the_workers_report():
    running = {"metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"},
               "spec": {"nodeName": "cpu-0"}, "status": {"phase": "Running"}}
    current = CompileRunStatus(phase="Scheduled", message="champion fp-1: 1.2x the stock pass", trials={"total": 3})
    update = compile_run_status(current=current, job={"metadata": {}, "status": {}}, job_name="r-compile",
                                pods=[running])
    assert update.fields["phase"] == "Running" and "message" not in update.fields


# ---- ForwardPass status from the rollout -------------------------------------------------------

A = ForwardPassIdentity("fp-a", "a" * 64, "/var/lib/shapeshift-artifacts/a.tar.gz")
B = ForwardPassIdentity("fp-b", "b" * 64, "/var/lib/shapeshift-artifacts/b.tar.gz")


def test_relations_follow_the_rollout_outcome():
    idle = Target(None)
    assert forward_pass_relations(active_before=None, state=RolloutState(), target=idle) == {}
    canary = RolloutState(phase="Canary", desired=B, previous=A)
    assert forward_pass_relations(active_before=A, state=canary, target=Target(B)) == {
        "fp-a": ("runs", "", ""), "fp-b": ("seen", "", "")}
    complete = RolloutState(phase="Complete", desired=B, previous=A)
    assert forward_pass_relations(active_before=A, state=complete, target=Target(B)) == {
        "fp-b": ("runs", "", ""), "fp-a": ("left", "", "")}
    back = RolloutState(phase="RolledBack", desired=B, previous=A, message="rolled back to fp-a: slow")
    assert forward_pass_relations(active_before=A, state=back, target=Target(B)) == {
        "fp-a": ("runs", "", ""), "fp-b": ("refused", "RolledBack", "rolled back to fp-a: slow")}
    rejected = Target(None, problem="not durable", reason=NOT_DURABLE, refused="fp-c")
    assert forward_pass_relations(active_before=None, state=RolloutState(), target=rejected) == {
        "fp-c": ("refused", NOT_DURABLE, "not durable")}
    # The stock forward pass has no ForwardPass object.
    stock = ForwardPassIdentity("stock", None)
    assert forward_pass_relations(active_before=stock, state=RolloutState(phase="Complete", desired=stock),
                                  target=Target(stock)) == {}


def test_usage_phase_deployments_and_refusals():
    empty = ForwardPassStatus()
    seen = forward_pass_usage(empty, "llama", "seen")
    assert seen == {"phase": "Available", "deployments": None, "refusals": None}
    runs = forward_pass_usage(ForwardPassStatus.model_validate(seen), "llama", "runs")
    assert runs == {"phase": "Active", "deployments": ["llama"], "refusals": None}
    current = ForwardPassStatus.model_validate(runs)
    assert forward_pass_usage(current, "llama", "runs") is None  # nothing changes: no write
    both = ForwardPassStatus.model_validate(forward_pass_usage(current, "alpaca", "runs"))
    assert both.deployments == ["alpaca", "llama"] and both.phase == "Active"
    # One deployment refuses it while another runs it: still Active, the refusal is recorded.
    refused = ForwardPassStatus.model_validate(forward_pass_usage(
        both, "alpaca", "refused", reason="RolledBack", message="canary regressed", now="2026-11-29T12:00:00Z"))
    assert refused.phase == "Active" and refused.deployments == ["llama"]
    assert [(r.deployment, r.reason, r.message) for r in refused.refusals] == [
        ("alpaca", "RolledBack", "canary regressed")]
    # The same refusal again keeps its first time and writes nothing.
    assert forward_pass_usage(refused, "alpaca", "refused", reason="RolledBack", message="canary regressed",
                              now="2026-11-29T13:00:00Z") is None
    left = ForwardPassStatus.model_validate(forward_pass_usage(refused, "llama", "left"))
    assert left.phase == "Refused" and left.deployments is None
    # Running it later clears that deployment's refusal; deleting a deployment forgets it.
    again = ForwardPassStatus.model_validate(forward_pass_usage(left, "alpaca", "runs"))
    assert again.phase == "Active" and again.refusals is None
    gone = forward_pass_usage(again, "alpaca", "gone")
    assert gone == {"phase": "Available", "deployments": None, "refusals": None}
