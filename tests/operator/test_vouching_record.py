"""The operator's own record of a ForwardPass it accepted (status.verifiedForwardPasses): the pass
stays trusted, with exactly that spec, after the CompileRun that vouched for it is deleted; a pass
no run ever vouched for gets no record, so it is never trusted; deleting the newest run does not
make an older run's champion the target. Pure (operator/provenance.py, operator/rollout_target.py);
tests/operator/test_cluster_rollout.py shows it on the real API server and operator."""

from __future__ import annotations

import copy
from datetime import datetime, timezone

from shapeshift.operator.api import (COMPILE_RUN_UID_ANNOTATION, VERIFIED_FORWARD_PASSES_KEPT, ForwardPassSpec,
                                     InferenceDeploymentSpec, InferenceDeploymentStatus)
from shapeshift.operator.provenance import provenance_problem, remembered, vouching_record
from shapeshift.operator.rollout_target import UNTRUSTED, champion_of, resolve_target

SHA = "d" * 64
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)


def published(name="fp-1", run="run-1", uid="uid-1", **spec_over):
    spec = {"model": {"name": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
            "artifact": {"uri": "/var/lib/shapeshift-artifacts/x.tar.gz", "sha256": SHA}, "recipe": {"block": 64},
            "compileRun": f"team-a/{run}",
            "verification": {"passed": True, "gates": [{"name": "greedy-match", "passed": True}],
                             "artifactSha256": SHA}}
    spec.update(spec_over)
    return {"metadata": {"name": name, "annotations": {COMPILE_RUN_UID_ANNOTATION: uid}}, "spec": spec}


def vouching_run(fp, run="run-1", uid="uid-1", done="2026-12-01T11:00:00Z"):
    return {"metadata": {"name": run, "uid": uid, "creationTimestamp": "2026-12-01T10:00:00Z"},
            "spec": {"deploymentRef": {"name": "llama"}},
            "status": {"phase": "Succeeded", "completionTime": done, "champion": fp["metadata"]["name"],
                       "championSpecSha256": ForwardPassSpec.model_validate(fp["spec"]).digest()}}


def deployment():
    return InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-llama"},
                                                   "hardware": {"accelerator": "cpu"}})


def test_an_accepted_pass_stays_trusted_after_its_run_is_deleted_and_only_with_that_spec():
    fp = published()
    run = vouching_run(fp)
    target = resolve_target("fp-1", fp, deployment(), run, now=NOW)
    assert target.problem is None and target.vouched is not None
    records = remembered([], target.vouched)
    assert [(r.name, r.compile_run, r.compile_run_uid) for r in records] == [("fp-1", "run-1", "uid-1")]
    # through the status subresource and back
    status = InferenceDeploymentStatus.model_validate({"verifiedForwardPasses": [r.to_wire() for r in records]})
    kept = status.verified_forward_passes
    # the run is gone: without the record the pass is refused, with it trusted
    assert "nothing vouches for it" in provenance_problem("fp-1", fp, None)
    assert provenance_problem("fp-1", fp, None, kept) is None
    after = resolve_target("fp-1", fp, deployment(), None, kept, now=NOW)
    assert after.problem is None and after.identity.name == "fp-1" and after.vouched is None
    # recorded again: no change to write
    assert remembered(kept, target.vouched) is None
    # the same name with another spec, another run uid, or another run name: refused
    for other in (published(recipe={"block": 128}), published(uid="uid-2"), published(run="run-9")):
        refused = resolve_target("fp-1", other, deployment(), None, kept, now=NOW)
        assert refused.identity is None and refused.reason == UNTRUSTED, other


def test_a_hand_written_pass_gets_no_record_and_is_never_trusted():
    fp = published()
    run = vouching_run(fp)
    forged = published(name="fp-forged")  # claims run-1, whose status names fp-1
    assert vouching_record("fp-forged", forged, run, NOW) is None
    assert resolve_target("fp-forged", forged, deployment(), run, now=NOW).vouched is None
    no_run = copy.deepcopy(forged)
    no_run["spec"].pop("compileRun")
    record = vouching_record("fp-1", fp, run, NOW)
    assert provenance_problem("fp-forged", no_run, None, [record]) is not None
    # a record of fp-1 does not vouch for a pass of another name with fp-1's spec
    assert provenance_problem("fp-forged", forged, None, [record]) is not None
    # a failed report stays refused whatever the record says
    failed = published(verification={"passed": False, "gates": [{"name": "greedy-match", "passed": False}],
                                     "artifactSha256": SHA})
    assert "did not pass verification" in provenance_problem("fp-1", failed, None, [record])


def test_deleting_the_newest_run_keeps_its_champion_the_target():
    old_fp, new_fp = published("fp-old", "run-old", "uid-old"), published("fp-new", "run-new", "uid-new")
    old_run = vouching_run(old_fp, "run-old", "uid-old", done="2026-12-01T09:00:00Z")
    new_run = vouching_run(new_fp, "run-new", "uid-new", done="2026-12-01T11:00:00Z")
    assert champion_of([old_run, new_run], "llama") == "fp-new"
    record = vouching_record("fp-new", new_fp, new_run, NOW)
    assert champion_of([old_run], "llama") == "fp-old"  # what happened before the record
    assert champion_of([old_run], "llama", [record]) == "fp-new"
    assert champion_of([], "llama", [record]) == "fp-new"
    # a newer run finishing later wins over the record
    newer_fp = published("fp-newer", "run-newer", "uid-newer")
    newer = vouching_run(newer_fp, "run-newer", "uid-newer", done="2026-12-01T13:00:00Z")
    assert champion_of([old_run, newer], "llama", [record]) == "fp-newer"


def test_the_record_is_bounded_and_keeps_what_the_deployment_runs():
    records = []
    for i in range(VERIFIED_FORWARD_PASSES_KEPT + 3):
        fp = published(f"fp-{i}", f"run-{i}", f"uid-{i}")
        records = remembered(records, vouching_record(f"fp-{i}", fp, vouching_run(fp, f"run-{i}", f"uid-{i}"), NOW),
                             keep=["fp-0"])
    names = [r.name for r in records]
    last = VERIFIED_FORWARD_PASSES_KEPT + 2
    assert len(names) == VERIFIED_FORWARD_PASSES_KEPT and names[0] == "fp-0" and names[-1] == f"fp-{last}"
    assert "fp-1" not in names and "fp-3" not in names
