"""CompileRun on the real control plane: Job placement, Job fate -> phase, unschedulable runs,
and an operator killed mid-run.

What runs in the Job's pod is not under test here: the real worker (`shapeshift compile`)
in the pod the operator creates is covered end to end by tests/e2e/test_compile_end_to_end.py
and tests/e2e/test_drift_to_rollout.py. The tests here that need the pod to finish
(test_job_fate_becomes_the_phase, test_operator_killed_mid_run_finishes_with_one_job) run the
pod's real command line through the harness's run_pod_locally with a stand-in `shapeshift`
executable first on PATH that records its arguments and environment and exits 0 or 1: the
only way to choose the Job's fate (success, or failure past the backoff limit) within seconds.
That proves the Job's command and env reach the process and that the Job's fate becomes the
CompileRun's phase, once, also across an operator restart; it says nothing about the worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from harness.cluster import wait_until
from harness.controlplane import free_port
from harness.operator_process import operator_healthy, start_operator, stop_operator

pytestmark = pytest.mark.cluster

GROUP, VERSION = "shapeshift.dev", "v1alpha1"


def make_deployment(cluster, namespace, name="llama", accelerator="nvidia-h200"):
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": accelerator}, "replicas": 0}}
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", body)


def make_run(cluster, namespace, name="run-1", deployment="llama", **spec_over):
    spec = {"deploymentRef": {"name": deployment}, "budget": {"wallClockSeconds": 600, "trials": 20}}
    spec.update(spec_over)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": name}, "spec": spec}
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", body)


def run_status(cluster, namespace, name="run-1"):
    obj = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", name)
    return obj.get("status") or {}


def conditions(st):
    return {c["type"]: c for c in st.get("conditions") or []}


def jobs(kube, namespace, run="run-1"):
    return kube.list("Job", namespace, {"shapeshift.dev/compile-run": run})


def bound_pod(kube, namespace, run="run-1"):
    pods = [p for p in kube.list("Pod", namespace, {"shapeshift.dev/compile-run": run}) if p["spec"].get("nodeName")]
    return pods[0] if pods else None


def event_reasons(cluster, namespace, name="run-1") -> list[str]:
    """Reasons of the events about one object; kopf aggregates repeats into one event with a count."""
    events = cluster.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e.reason for e in events]


def stand_in_worker(tmp_path: Path, exit_code: int) -> dict[str, str]:
    """A `shapeshift` executable that records argv and env, then exits with `exit_code`."""
    bin_dir = tmp_path / f"stand-in-{exit_code}"
    bin_dir.mkdir()
    record = bin_dir / "record.json"
    script = bin_dir / "shapeshift"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RECORD": str(record)}


@pytest.mark.parametrize("accelerator, resource, pool_label", [
    ("nvidia-h200", "nvidia.com/gpu", ("nvidia.com/gpu.product", "NVIDIA-H200")),
    ("trainium2", "aws.amazon.com/neuron", ("node.kubernetes.io/instance-type", "trn2.48xlarge")),
])
def test_job_pod_lands_on_the_pool(crds, namespace, operator, kube, accelerator, resource, pool_label):
    make_deployment(crds, namespace, accelerator=accelerator)
    run = make_run(crds, namespace)
    (job,) = wait_until(lambda: jobs(kube, namespace), 30, "the compile Job")
    assert job["metadata"]["name"] == "run-1-compile"
    assert job["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
    assert job["spec"]["activeDeadlineSeconds"] == 600 + 600 and job["spec"]["backoffLimit"] == 1
    pod = wait_until(lambda: bound_pod(kube, namespace), 30, "the compile pod to be bound")
    node = crds.core.read_node(pod["spec"]["nodeName"])
    assert node.metadata.labels[pool_label[0]] == pool_label[1], node.metadata.labels
    assert pod["spec"]["containers"][0]["resources"]["limits"][resource] == "1"
    assert pod["spec"]["serviceAccountName"] == "run-1-compile"
    role = kube.get("Role", namespace, "run-1-compile")
    assert role["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]

    st = wait_until(lambda: (lambda s: s if s.get("phase") in ("Scheduled", "Running") else None)(
        run_status(crds, namespace)), 30, "phase Scheduled or Running")
    assert st["accelerator"] == accelerator and st["nodeName"] == pod["spec"]["nodeName"]
    assert conditions(st)["Scheduled"]["status"] == "True"

    out = crds.kubectl("get", "compileruns", "-n", namespace).stdout
    header, row = out.splitlines()[:2]
    assert header.split()[:4] == ["NAME", "PHASE", "DEPLOYMENT", "ACCELERATOR"], out
    assert row.split()[:4] == ["run-1", st["phase"], "llama", accelerator], out


@pytest.mark.parametrize("exit_code, phase, reason", [(0, "Succeeded", "CompletionsReached"), (1, "Failed", "BackoffLimitExceeded")])
def test_job_fate_becomes_the_phase(crds, namespace, operator, kube, run_pod_locally, tmp_path, exit_code, phase, reason):
    """Stand-in worker (see the module docstring): the Job's outcome, not the worker, is under test."""
    make_deployment(crds, namespace)
    make_run(crds, namespace, backoffLimit=0)
    pod = wait_until(lambda: bound_pod(kube, namespace), 30, "the compile pod to be bound")
    env = stand_in_worker(tmp_path, exit_code)
    run_pod_locally(namespace, pod["metadata"]["name"], extra_env={"PATH": env["PATH"]}, timeout_s=60)
    record = json.loads(Path(env["RECORD"]).read_text())
    assert record["argv"] == ["compile", "--compile-run", f"{namespace}/run-1"]
    assert record["env"]["SHAPESHIFT_COMPILE_RUN"] == "run-1" and record["env"]["SHAPESHIFT_NAMESPACE"] == namespace
    assert record["env"]["SHAPESHIFT_BUDGET_TRIALS"] == "20"

    st = wait_until(lambda: (lambda s: s if s.get("phase") == phase else None)(run_status(crds, namespace)),
                    60, f"phase {phase}")
    key = "Complete" if phase == "Succeeded" else "Failed"
    assert conditions(st)[key]["status"] == "True" and conditions(st)[key]["reason"] == reason
    assert st["completionTime"]
    wait_until(lambda: phase in event_reasons(crds, namespace), 15, f"a {phase} event")
    time.sleep(5)  # finished runs are left alone by later resyncs
    assert len(jobs(kube, namespace)) == 1 and run_status(crds, namespace) == st


def test_unplaceable_run_reports_unschedulable_within_a_minute(crds, namespace, operator, kube):
    make_deployment(crds, namespace)
    make_run(crds, namespace, hardware={"accelerator": "nvidia-h100"})  # the test cluster has no H100 pool
    started = time.monotonic()

    def unschedulable():
        c = conditions(run_status(crds, namespace)).get("Scheduled")
        return c if c and c["status"] == "False" else None

    cond = wait_until(unschedulable, 60, "Scheduled=False within a minute")
    assert time.monotonic() - started < 60
    assert cond["reason"] == "Unschedulable" and "node" in cond["message"], cond
    assert run_status(crds, namespace)["phase"] == "Pending"
    # kopf posts events asynchronously, after the status write
    wait_until(lambda: any(e.reason == "Unschedulable" and e.type == "Warning" for e in
                           crds.core.list_namespaced_event(namespace, field_selector="involvedObject.name=run-1").items),
               15, "an Unschedulable warning event")


def test_run_for_a_missing_deployment_waits_for_it(crds, namespace, operator, kube):
    make_run(crds, namespace, deployment="not-yet")
    cond = wait_until(lambda: conditions(run_status(crds, namespace)).get("DeploymentFound"), 30, "DeploymentFound")
    assert cond["status"] == "False" and "not-yet" in cond["message"]
    assert not jobs(kube, namespace, "run-1")
    make_deployment(crds, namespace, name="not-yet")
    wait_until(lambda: jobs(kube, namespace), 45, "the Job once the deployment exists")


def test_operator_killed_mid_run_finishes_with_one_job(crds, namespace, kube, run_pod_locally, tmp_path):
    """`shapeshift operator` as a real process, SIGKILLed while the compile pod runs, then
    restarted: the run finishes once, on the one Job it started with (stand-in worker)."""
    log = tmp_path / "operator.log"
    port = free_port()
    make_deployment(crds, namespace)
    first = start_operator(crds, namespace, log, port)
    try:
        wait_until(lambda: operator_healthy(port), 30, "the operator's health endpoint")
        make_run(crds, namespace)
        (job,) = wait_until(lambda: jobs(kube, namespace), 30, "the compile Job")
        pod = wait_until(lambda: bound_pod(kube, namespace), 30, "the compile pod to be bound")
        wait_until(lambda: run_status(crds, namespace).get("phase") in ("Scheduled", "Running"), 30, "run scheduled")
        rbac_before = {k: kube.get(k, namespace, "run-1-compile")["metadata"]["resourceVersion"]
                       for k in ("ServiceAccount", "Role", "RoleBinding")}
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
    assert not operator_healthy(port)

    # While no operator runs, the worker finishes and the Job controller completes the Job.
    env = stand_in_worker(tmp_path, 0)
    run_pod_locally(namespace, pod["metadata"]["name"], extra_env={"PATH": env["PATH"]}, timeout_s=60)
    wait_until(lambda: any(c["type"] == "Complete" and c["status"] == "True"
                           for c in (kube.get("Job", namespace, "run-1-compile")["status"].get("conditions") or [])),
               60, "the Job to complete")
    assert run_status(crds, namespace)["phase"] != "Succeeded"  # nobody has observed it yet

    second = start_operator(crds, namespace, log, port)
    try:
        st = wait_until(lambda: (lambda s: s if s.get("phase") == "Succeeded" else None)(run_status(crds, namespace)),
                        60, "phase Succeeded after the restart")
        time.sleep(5)
        (after,) = jobs(kube, namespace)
        assert after["metadata"]["uid"] == job["metadata"]["uid"], "the Job was recreated"
        assert len(kube.list("Pod", namespace, {"shapeshift.dev/compile-run": "run-1"})) == 1
        assert run_status(crds, namespace) == st
        assert {k: kube.get(k, namespace, "run-1-compile")["metadata"]["resourceVersion"]
                for k in ("ServiceAccount", "Role", "RoleBinding")} == rbac_before, "resume rewrote the RBAC"
        reasons = event_reasons(crds, namespace)
        assert reasons.count("JobCreated") == 1 and reasons.count("Succeeded") == 1, reasons
    finally:
        stop_operator(second)
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-4000:]


def test_deleting_the_deployment_stops_its_manual_compile_run(crds, namespace, operator, kube):
    """A CompileRun created by hand becomes a dependent of its InferenceDeployment: deleting the
    deployment deletes the run, its Job and its pod (garbage collector), freeing the accelerator."""
    make_deployment(crds, namespace)
    make_run(crds, namespace)
    wait_until(lambda: jobs(kube, namespace) or None, 60, "the run's Job")
    run = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run-1")
    (ref,) = [r for r in run["metadata"].get("ownerReferences") or [] if r["kind"] == "InferenceDeployment"]
    assert ref["name"] == "llama" and not ref.get("controller")
    crds.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", "llama")

    def gone():
        runs = crds.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns")["items"]
        pods = kube.list("Pod", namespace, {"shapeshift.dev/compile-run": "run-1"})
        return not runs and not jobs(kube, namespace) and not pods
    wait_until(gone, 60, "the CompileRun, its Job and its pod deleted with the deployment")
