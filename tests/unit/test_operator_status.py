"""Status from observed objects: phases, conditions, and no change when nothing changed."""

from __future__ import annotations

from shapeshift.operator.api import CompileRunStatus
from shapeshift.operator.status import compile_run_status, inference_deployment_status, merged_conditions


def pod(name, node=None, phase="Pending", unschedulable=None, created="2026-01-01T00:00:00Z"):
    conditions = []
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable})
    return {"metadata": {"name": name, "creationTimestamp": created},
            "spec": {"nodeName": node} if node else {}, "status": {"phase": phase, "conditions": conditions}}


def job(*conds, start="2026-01-01T00:00:01Z", completion=None):
    st = {"startTime": start, "conditions": [dict(type=t, status="True", reason=r, message=m,
                                                   lastTransitionTime="2026-01-01T00:05:00Z") for t, r, m in conds]}
    if completion:
        st["completionTime"] = completion
    return {"metadata": {"name": "r-compile"}, "status": st}


def test_run_waits_then_is_scheduled_then_running():
    cur = CompileRunStatus()
    u = compile_run_status(current=cur, job=job(), job_name="r-compile", pods=[])
    assert u.fields["phase"] == "Pending"
    u = compile_run_status(current=cur, job=job(), job_name="r-compile", pods=[pod("p", node="h200-0")])
    assert u.fields["phase"] == "Scheduled" and u.fields["nodeName"] == "h200-0"
    assert u.condition("Scheduled")[1:3] == ("True", "Bound")
    u = compile_run_status(current=cur, job=job(), job_name="r-compile", pods=[pod("p", node="h200-0", phase="Running")])
    assert u.fields["phase"] == "Running"


def test_worker_reported_verifying_and_progress_message_are_left_alone():
    cur = CompileRunStatus(phase="Verifying", message="trial 17: 1.21x")
    u = compile_run_status(current=cur, job=job(), job_name="r-compile", pods=[pod("p", node="n", phase="Running")])
    assert u.fields["phase"] == "Verifying" and "message" not in u.fields


def test_unschedulable_pod_becomes_a_condition():
    u = compile_run_status(current=CompileRunStatus(), job=job(), job_name="r-compile",
                           pods=[pod("p", unschedulable="0/5 nodes are available: 5 node(s) didn't match selector")])
    assert u.fields["phase"] == "Pending"
    t, status, reason, message = u.condition("Scheduled")
    assert (status, reason) == ("False", "Unschedulable") and "didn't match" in message


def test_job_fate_is_final_with_reason():
    ok = compile_run_status(current=CompileRunStatus(phase="Running"), job=job(("Complete", "Completed", ""),
                            completion="2026-01-01T00:09:00Z"), job_name="r-compile", pods=[])
    assert ok.fields["phase"] == "Succeeded" and ok.fields["completionTime"] == "2026-01-01T00:09:00Z"
    bad = compile_run_status(current=CompileRunStatus(phase="Running"),
                             job=job(("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")),
                             job_name="r-compile", pods=[])
    assert bad.fields["phase"] == "Failed"
    assert bad.condition("Failed")[1:3] == ("True", "BackoffLimitExceeded")
    assert "backoff limit" in bad.fields["message"]
    done = compile_run_status(current=CompileRunStatus(phase="Succeeded"), job=None, job_name="r-compile", pods=[])
    assert done.fields == {} and done.conditions == []


def test_deleted_job_fails_the_run_instead_of_recreating_it():
    u = compile_run_status(current=CompileRunStatus(phase="Running", job_name="r-compile"), job=None,
                           job_name="r-compile", pods=[])
    assert u.fields["phase"] == "Failed" and u.condition("Failed")[2] == "JobDeleted"


def deployment(ready, replicas=2, generation=1, observed=1, progressing=None):
    conds = [progressing] if progressing else []
    return {"metadata": {"generation": generation},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas,
                       "observedGeneration": observed, "conditions": conds}}


def idep_status(dep, desired=2, pods=()):
    return inference_deployment_status(generation=3, desired_replicas=desired, deployment=dep, pods=list(pods),
                                       deployment_name="x-engine", service_name="x", selector="a=b")


def test_inference_deployment_phases():
    assert idep_status(None).fields["phase"] == "Pending"
    u = idep_status(deployment(ready=1))
    assert u.fields["phase"] == "Progressing" and u.fields["readyReplicas"] == 1
    u = idep_status(deployment(ready=2))
    assert u.fields["phase"] == "Ready" and u.condition("Ready")[1] == "True"
    assert u.fields["observedGeneration"] == 3 and u.fields["selector"] == "a=b"
    u = idep_status(deployment(ready=2, observed=0))  # controller has not seen the new template yet
    assert u.fields["phase"] == "Progressing"
    u = idep_status(deployment(ready=0, progressing={"type": "Progressing", "reason": "ProgressDeadlineExceeded",
                                                     "message": "too slow"}))
    assert u.fields["phase"] == "Degraded"
    u = idep_status(deployment(ready=0), pods=[pod("e", unschedulable="0/3 nodes: Insufficient nvidia.com/gpu")])
    assert u.fields["phase"] == "Degraded" and u.condition("Scheduled")[2] == "Unschedulable"


def test_merged_conditions_unchanged_when_nothing_changed():
    u = idep_status(deployment(ready=2))
    first = merged_conditions([], u, 3)
    again = merged_conditions(first, idep_status(deployment(ready=2)), 3)
    assert again == first


def test_status_writes_are_checked_against_the_model():
    import pytest
    from pydantic import ValidationError

    from shapeshift.operator.kube import _check_against_model
    from shapeshift.operator.api import COMPILE_RUN
    from shapeshift.operator.status import StatusUpdate

    _check_against_model(COMPILE_RUN, StatusUpdate({"phase": "Running", "jobName": "r-compile", "nodeName": None}))
    with pytest.raises(ValueError, match="phaze"):
        _check_against_model(COMPILE_RUN, StatusUpdate({"phaze": "Running"}))
    with pytest.raises(ValidationError):
        _check_against_model(COMPILE_RUN, StatusUpdate({"phase": "Done"}))


# ---- failures made visible: pods that cannot be created or keep failing, failed compile attempts ----


def _engine_deployment(conditions):
    return {"metadata": {"name": "llama-engine", "generation": 1},
            "status": {"observedGeneration": 1, "replicas": 1, "conditions": conditions}}


def _failing_pod(name, **container):
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:0" + name[-1] + "Z"},
            "spec": {"nodeName": "gpu-0"},
            "status": {"phase": "Running", "containerStatuses": [{"name": "engine", **container}]}}


def test_a_replicaset_that_cannot_create_pods_and_a_crashing_engine_are_in_status():
    from shapeshift.operator.status import inference_deployment_status

    def status_of(deployment, pods):
        return inference_deployment_status(generation=1, desired_replicas=1, deployment=deployment, pods=pods,
                                           deployment_name="llama-engine", service_name="llama", selector="x=y")

    quota = _engine_deployment([{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                 "message": 'pods "llama-engine-1" is forbidden: exceeded quota: gpus'}])
    update = status_of(quota, [])
    assert update.fields["phase"] == "Degraded" and "exceeded quota" in update.fields["message"]
    assert update.condition("Ready")[1:3] == ("False", "ReplicaFailure")
    assert update.condition("PodsCreated")[1:3] == ("False", "ReplicaFailure")

    crashing = _failing_pod("p1", state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                            lastState={"terminated": {"exitCode": 3, "reason": "Error",
                                                      "message": "CUDA error: no kernel image"}})
    update = status_of(_engine_deployment([]), [crashing])
    ready, healthy = update.condition("Ready"), update.condition("PodsHealthy")
    assert ready[1:3] == ("False", "PodsFailing") and healthy[1:3] == ("False", "PodsFailing")
    for fragment in ("pod p1 container engine on node gpu-0", "CrashLoopBackOff", "exit code 3 (Error)",
                     "termination message: CUDA error: no kernel image"):
        assert fragment in healthy[3], healthy
    # recovered: the conditions turn back on the next resync
    fine = _failing_pod("p1", state={"running": {}})
    assert status_of(_engine_deployment([]), [fine]).condition("PodsHealthy")[1] == "True"


def test_a_failed_compile_attempt_names_exit_code_message_and_node_and_stays_current():
    from shapeshift.operator.api import CompileRunStatus
    from shapeshift.operator.status import compile_run_status

    first = _failing_pod("p1", state={"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                                      "message": "worker out of memory"}})
    first["status"]["phase"] = "Failed"
    retry = _failing_pod("p2", state={"running": {}})
    job = {"metadata": {"name": "run-compile"}, "status": {"startTime": "2026-01-01T00:00:00Z", "active": 1}}
    running = compile_run_status(current=CompileRunStatus(phase="Running"), job=job, job_name="run-compile",
                                 pods=[first, retry])
    failed = running.condition("PodFailed")
    assert failed[1:3] == ("True", "ContainerFailed")
    assert "pod p1 container engine on node gpu-0: exit code 137 (OOMKilled)" in failed[3]
    assert "worker out of memory" in failed[3]
    job["status"]["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                    "message": "Job has reached the specified backoff limit",
                                    "lastTransitionTime": "2026-01-01T00:10:00Z"}]
    second = _failing_pod("p2", state={"terminated": {"exitCode": 2, "message": "bad recipe"}})
    done = compile_run_status(current=CompileRunStatus(phase="Running"), job=job, job_name="run-compile",
                              pods=[first, second])
    assert done.fields["phase"] == "Failed"
    assert "BackoffLimitExceeded" in done.fields["message"] and "pod p2" in done.fields["message"]
    assert "exit code 2, termination message: bad recipe" in done.fields["message"]
