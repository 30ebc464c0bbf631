"""Faults during a compile run, on the real parts: the compile pod killed mid-search, the operator
killed while the worker verifies a winner.

    `shapeshift operator` as its own process (harness.operator_process; SIGKILLed and started again)
      --> InferenceDeployment (tiny-llama, cpu pool, no replicas, spec.artifacts.pvc: the claim
          `artifacts`, a local folder) + CompileRun (tiny budget)
      --> ServiceAccount, Role, RoleBinding, Job <run>-compile --Job controller, scheduler, kwok--> pod
      --harness.kubelet--> the pod's own command line (`shapeshift compile --compile-run ns/run`, the
         real worker and compile loop) with the pod's env, its emptyDir and ConfigMap volumes as fresh
         local folders, the claim as the store's folder (the run's output folder, mounted inside the
         emptyDir from the store's compile-runs/<run uid>, reached as in a container), and a token of
         the run's ServiceAccount bound to that pod: the worker acts through its Role, nothing more
      --> the worker's exit becomes the pod's status; the Job controller completes the Job or
          retries it (a new pod); the operator moves the CompileRun to its phase.

1. The compile pod's processes are SIGKILLed (exit 137, as the OOM killer leaves it) once a trial is
   on the board: the Job's retry (backoffLimit 1) starts a second pod, which resumes the board the
   first one left on the store: the trials already on it are not measured again (each trial and the
   baseline has one result, the second attempt's log says how many it found), the run ends Succeeded
   with its whole trial budget counted once, on its one Job, with one ContainerFailed warning.
2. The operator is SIGKILLed while the worker verifies a winner, then started again: the run ends
   Succeeded once, on its one Job and pod, with one JobCreated and one Succeeded event, and its
   champion is published once (one ForwardPass, never rewritten, named by the run's status).
   The phase `Verifying` of the CompileRun schema is not observable: nothing writes it (the worker
   patches trials, leaderboard, message and champion, never the phase; the operator writes Pending,
   Scheduled, Running and the final phase from the Job and its pod, and only keeps a Verifying it
   finds). So the operator is killed in the phase it records then, Running, while the worker is in
   its verification step (its log's "verifying <candidate>" line, the board's verification entry
   not yet written).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from harness.cluster import wait_until
from harness.controlplane import free_port
from harness.kubelet import LocalPod
from harness.operator_process import operator_healthy, start_operator, stop_operator
from harness.pod_environment import pod_token_kubeconfig

from shapeshift.engine.compile.board import Board

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
VENV_BIN = Path(sys.executable).parent
RUN, DEPLOYMENT, CLAIM, SUB_PATH = "run-1", "tiny", "artifacts", "tiny"
LABEL = f"shapeshift.dev/compile-run={RUN}"


class Stage:
    """One test's operator process and the compile pods it runs (stopped at teardown)."""

    def __init__(self, cluster, namespace: str, root: Path, store: Path):
        self.cluster, self.namespace, self.root, self.store = cluster, namespace, root, store
        self.log = root / "operator.log"
        self.port = free_port()
        self.operator = None
        self.pods: list[LocalPod] = []

    def start_operator(self) -> None:
        self.operator = start_operator(self.cluster, self.namespace, self.log, self.port)
        wait_until(lambda: operator_healthy(self.port) or self.operator.poll() is not None, 60,
                   "the operator's health endpoint")
        assert self.operator.poll() is None, self.log.read_text(errors="replace")[-4000:]

    def kill_operator(self) -> None:
        os.killpg(self.operator.pid, signal.SIGKILL)
        self.operator.wait(timeout=10)
        assert not operator_healthy(self.port)

    def run_pod(self, pod: dict) -> LocalPod:
        """Run a bound compile pod as its node's kubelet would (see the module docstring)."""
        name = pod["metadata"]["name"]
        kubeconfig = pod_token_kubeconfig(self.cluster, pod, self.root / f"{name}.kubeconfig")
        local = LocalPod(self.cluster.api_client, self.namespace, name, self.root / "pods",
                         extra_env={"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONSAFEPATH": "1",
                                    "KUBECONFIG": str(kubeconfig)},
                         pvc_dirs={CLAIM: self.store}, volumes_root=self.root / "volumes")
        self.pods.append(local)
        return local.start(timeout_s=60)

    def stop(self) -> None:
        for pod in self.pods:
            pod.stop()
        if self.operator is not None:
            stop_operator(self.operator)


@pytest.fixture
def stage(crds, namespace, artifact_store, tmp_path):
    st = Stage(crds, namespace, tmp_path, artifact_store)
    try:
        st.start_operator()
        yield st
    finally:
        st.stop()
    text = st.log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]


# ---- the cluster ------------------------------------------------------------------------------


def create(stage: Stage, engine: dict, run_spec: dict) -> dict:
    custom = stage.cluster.custom
    custom.create_namespaced_custom_object(GROUP, VERSION, stage.namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": DEPLOYMENT},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0,
                 "engine": {"dtype": "float32", "maxModelLen": 256, "kvBlockSize": 16, **engine},
                 "artifacts": {"pvc": {"claimName": CLAIM, "subPath": SUB_PATH}}}})
    spec = {"deploymentRef": {"name": DEPLOYMENT}, "traffic": {"builtin": "chat"},
            "agents": [{"kind": "coordinate-sweep"}],
            "tiers": {"fastLayers": 1, "replayRequests": 8, "repeats": 2},
            "verification": {"greedySteps": 4, "freshPrompts": 1}, "baseline": {"minSpeedup": 1.0}, **run_spec}
    run = custom.create_namespaced_custom_object(GROUP, VERSION, stage.namespace, "compileruns", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": RUN}, "spec": spec})
    # the pod mounts the deployment's engine ConfigMap: the kubelet starts it once it exists
    wait_until(lambda: stage.cluster.core.list_namespaced_config_map(
        stage.namespace, field_selector=f"metadata.name={DEPLOYMENT}-engine").items, 30, "the engine ConfigMap")
    return run


def run_status(stage: Stage) -> dict:
    obj = stage.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, stage.namespace, "compileruns", RUN)
    return obj.get("status") or {}


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status.get("conditions") or []}


def finished(stage: Stage, timeout_s: float) -> dict:
    return wait_until(lambda: (lambda s: s if s.get("phase") in ("Succeeded", "Failed") else None)(run_status(stage)),
                      timeout_s, "the run to finish")


def pods(stage: Stage) -> list[dict]:
    items = stage.cluster.core.list_namespaced_pod(stage.namespace, label_selector=LABEL).items
    return [stage.cluster.api_client.sanitize_for_serialization(p) for p in items]


def bound_pod(stage: Stage, *, besides: tuple[str, ...] = ()) -> dict | None:
    ready = [p for p in pods(stage) if p["spec"].get("nodeName") and p["metadata"]["name"] not in besides]
    return ready[0] if ready else None


def jobs(stage: Stage) -> list[dict]:
    return stage.cluster.api_client.sanitize_for_serialization(
        stage.cluster.batch.list_namespaced_job(stage.namespace, label_selector=LABEL).items)


def events(stage: Stage, name: str = RUN) -> list:
    return stage.cluster.core.list_namespaced_event(stage.namespace, field_selector=f"involvedObject.name={name}").items


def forward_passes(stage: Stage) -> list[dict]:
    return stage.cluster.custom.list_namespaced_custom_object(GROUP, VERSION, stage.namespace, "forwardpasses")["items"]


def board_of(stage: Stage, run: dict) -> Board:
    """The run's board where the Job keeps it: on the store, compile-runs/<run uid> (operator/builders.py)."""
    return Board(stage.store / SUB_PATH / "compile-runs" / run["metadata"]["uid"] / "board.jsonl")


def screened(board: Board) -> dict[str, dict]:
    """trial_id -> its fast-tier result, for the candidates' screens (what counts as a trial)."""
    return {r["trial_id"]: r for r in board.entries("result") if r.get("tier") == "fast" and not r.get("role")}


# ---- the tests --------------------------------------------------------------------------------


def test_compile_pod_killed_mid_search_resumes_its_board_in_the_retried_pod(stage):
    trials = 6
    run = create(stage, {}, {"budget": {"trials": trials, "wallClockSeconds": 300, "deadlineGraceSeconds": 120},
                             "backoffLimit": 1})
    (job,) = wait_until(lambda: jobs(stage), 30, "the compile Job")
    assert job["spec"]["backoffLimit"] == 1
    first = wait_until(lambda: bound_pod(stage), 45, "the compile pod to be bound")
    board = board_of(stage, run)
    local = stage.run_pod(first)

    # Searching: a candidate's screen is on the board (the baseline is measured before any).
    wait_until(lambda: screened(board) or local.containers[0].process.poll() is not None, 90,
               "a trial on the board", interval_s=0.1)
    assert local.containers[0].process.poll() is None, local.output()[-4000:]
    assert local.kill() == {"compile": 137}
    done_before = screened(board)
    results_before = {(r["trial_id"], r["tier"]) for r in board.entries("result")}
    assert 1 <= len(done_before) < trials, (len(done_before), local.output()[-3000:])

    # The Job retries: a second pod, whose kubelet runs it on a fresh emptyDir and the same store.
    second = wait_until(lambda: bound_pod(stage, besides=(first["metadata"]["name"],)), 60, "the retried pod")
    failing = wait_until(lambda: (lambda c: c if c and c["status"] == "True" else None)(
        conditions(run_status(stage)).get("PodFailed")), 30, "PodFailed on the run")
    assert failing["reason"] == "ContainerFailed" and "137" in failing["message"], failing
    retried = stage.run_pod(second)
    assert retried.wait(timeout_s=120) == {"compile": 0}, retried.output()[-6000:]
    output = retried.output()
    assert "Traceback" not in output, output[-6000:]

    status = finished(stage, 60)
    assert status["phase"] == "Succeeded", status
    assert conditions(status)["Complete"]["status"] == "True", conditions(status)
    assert status["trials"]["total"] == trials, status["trials"]

    # Resumed, not started over: the second attempt found the first one's trials and measured none
    # of them (nor the baseline) again; every trial and tier has one result; the budget is counted once.
    runs = board.entries("run")
    assert [r.get("resumed") for r in runs] == [False, True], runs
    assert re.search(rf"resuming from \S+/board\.jsonl: {len(done_before)} trials done", output), output[-6000:]
    results = board.entries("result")
    keys = [(r["trial_id"], r["tier"]) for r in results]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    second_pid = runs[1]["pid"]
    assert not {(r["trial_id"], r["tier"]) for r in results if r["pid"] == second_pid} & results_before
    baseline = [r for r in results if r.get("role") == "baseline"]
    assert sorted(r["tier"] for r in baseline) == ["fast", "full"] and {r["pid"] for r in baseline} == {runs[0]["pid"]}
    after = screened(board)
    assert len(after) == trials and len({r["digest"] for r in after.values()}) == trials, after
    assert all(after[t]["pid"] == runs[0]["pid"] for t in done_before)
    # the report beside the board, on the store (not in either pod's emptyDir)
    assert (board.path.parent / "report.json").is_file()

    # One Job, the one it started with, two pods, one warning for the one failure.
    (after_job,) = jobs(stage)
    assert after_job["metadata"]["uid"] == job["metadata"]["uid"]
    assert len(pods(stage)) == 2
    time.sleep(3)  # kopf posts events asynchronously; a finished run is left alone by resyncs
    reasons = [e.reason for e in events(stage)]
    assert reasons.count("JobCreated") == 1 and reasons.count("Succeeded") == 1, reasons
    assert reasons.count("ContainerFailed") == 1, reasons
    assert run_status(stage) == status


def test_operator_killed_while_the_worker_verifies_completes_the_run_once(stage):
    # A batch of one for chat traffic (32 requests in flight): the traffic's seed, a batch of 32, is
    # measured first and wins by far, so a winner reaches verification within the first trials.
    run = create(stage, {"maxBatchSize": 1}, {"budget": {"trials": 4, "wallClockSeconds": 300,
                                                         "deadlineGraceSeconds": 120}, "backoffLimit": 0})
    (job,) = wait_until(lambda: jobs(stage), 30, "the compile Job")
    pod = wait_until(lambda: bound_pod(stage), 45, "the compile pod to be bound")
    board = board_of(stage, run)
    local = stage.run_pod(pod)
    wait_until(lambda: run_status(stage).get("phase") == "Running", 30, "phase Running")

    wait_until(lambda: "verifying " in local.output() or local.containers[0].process.poll() is not None, 90,
               "the worker to verify a winner", interval_s=0.05)
    assert local.containers[0].process.poll() is None, local.output()[-4000:]
    stage.kill_operator()
    assert not board.entries("verification"), "the verification ended before the operator was killed"
    assert run_status(stage)["phase"] == "Running"
    # The whole verification passes with no operator; it is started again once the verdict is in.
    (verdict, *_) = wait_until(lambda: board.entries("verification"), 60, "the verification's verdict")
    assert verdict["passed"], verdict
    assert run_status(stage)["phase"] == "Running"

    stage.start_operator()
    assert local.wait(timeout_s=120) == {"compile": 0}, local.output()[-6000:]
    status = finished(stage, 60)
    assert status["phase"] == "Succeeded", status
    assert conditions(status)["Complete"]["status"] == "True", conditions(status)

    time.sleep(5)  # resyncs of the finished run change nothing; kopf's events have been posted
    assert run_status(stage) == status
    (after_job,) = jobs(stage)
    assert after_job["metadata"]["uid"] == job["metadata"]["uid"], "the Job was recreated"
    assert len(pods(stage)) == 1
    reasons = [e.reason for e in events(stage)]
    assert reasons.count("JobCreated") == 1 and reasons.count("Succeeded") == 1, reasons
    fps = forward_passes(stage)
    if status.get("champion"):
        (fp,) = fps
        assert fp["metadata"]["name"] == status["champion"] and fp["metadata"]["generation"] == 1, fp["metadata"]
        assert fp["spec"]["compileRun"] == f"{stage.namespace}/{RUN}"
        assert fp["metadata"]["annotations"]["shapeshift.dev/artifact-durable"] == "true"
        assert (stage.store / SUB_PATH / f"{fp['spec']['artifact']['sha256']}.tar.gz").is_file()
        assert status["message"].startswith(f"champion {status['champion']}"), status["message"]
    else:
        assert fps == [], [f["metadata"]["name"] for f in fps]
        assert status["message"].startswith("no verified improvement"), status["message"]
