"""A CompileRun from spec to verified result: operator, Job, scheduler, the real worker, the real loop.

Data flow under test:
    test: InferenceDeployment (tiny-llama, CPU pool, small engine) + CompileRun (tiny budget)
      -> `shapeshift operator` (a separate process, admin kubeconfig) -> ServiceAccount, Role,
         RoleBinding, Job <run>-compile
      -> Job controller -> pod -> kube-scheduler binds it to a kwok CPU node
      -> harness.kubelet runs the pod's own command line (`shapeshift compile --compile-run ns/run`,
         the venv's `shapeshift` on PATH) with the pod's env; harness.pod_environment emulates
         its volumes as local folders (configMap: the engine ConfigMap's keys as files; emptyDir: a fresh folder) and
         its ServiceAccount token is minted through the TokenRequest API, bound to the pod, and
         handed over in a kubeconfig (the local kubelet cannot project token files into a
         process, and in-cluster config reads fixed paths) -- so every API call the worker makes
         is checked against the Role the operator wrote, nothing more
      -> the worker reads its run and deployment, runs the compile loop on tiny-llama on this CPU,
         patches the run's status (trials, leaderboard, bestSpeedup, champion) and publishes a
         ForwardPass when a candidate beat the stock pass beyond the noise and passed verification
      -> the process exits; its exit reaches the pod status; the Job controller completes the Job
      -> the operator moves the CompileRun to Succeeded with conditions.

Either search outcome is accepted (on two shared cores a tiny budget may find nothing that
clears the noise), but the status must agree with the ForwardPass objects either way, and the
run's final message is the worker's own ("champion ..." or "no verified improvement (...)"),
quoted by the Complete condition.

The deployment names an artifact store (spec.artifacts.pvc): a claim bound to a PersistentVolume
whose hostPath is a local folder. The Job mounts it read-write at /var/lib/shapeshift-artifacts;
the local kubelet maps the claim to that folder (pvc_dirs), so a published champion's archive
lands there, outside the pod's emptyDir, and the ForwardPass says it is durable. (Without a
store the archive stays in the emptyDir and the ForwardPass says "false": see
tests/compile/test_compile_worker_publish.py; the rollout refuses such a pass.)
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
from harness.cluster import wait_until
from harness.controlplane import POOL_LABEL, free_port
from harness.operator_process import operator_healthy, start_operator, stop_operator
from harness.pod_environment import emulate_volumes, pod_token_kubeconfig

from shapeshift.engine.compile.board import Board
from shapeshift.engine.forward_pass.bundle import verify_bundle

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
VENV_BIN = Path(sys.executable).parent
RUN, DEPLOYMENT = "tiny-run", "tiny"
CLAIM, SUB_PATH, ARTIFACT_MOUNT = "artifacts", "tiny", "/var/lib/shapeshift-artifacts"
TRIALS = 10
# A deployment that batches narrowly for its chat traffic (32 requests in flight): the stock
# candidate must be measured at 4, and the traffic's first seed is a batch of 32.
DEPLOYED_BATCH = 4


@pytest.fixture
def operator_process(crds, namespace, tmp_path):
    """`shapeshift operator` watching the test's namespace; its log is checked for tracebacks."""
    log = tmp_path / "operator.log"
    port = free_port()
    process = start_operator(crds, namespace, log, port)
    try:
        wait_until(lambda: operator_healthy(port) or process.poll() is not None, 60, "the operator's health endpoint")
        assert process.poll() is None, log.read_text(errors="replace")[-4000:]
        yield log
    finally:
        stop_operator(process)


# ---- reading the cluster ---------------------------------------------------------------------


def run_status(cluster, namespace) -> dict:
    obj = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", RUN)
    return obj.get("status") or {}


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status.get("conditions") or []}


def bound_pod(cluster, namespace) -> dict | None:
    pods = cluster.core.list_namespaced_pod(namespace, label_selector=f"shapeshift.dev/compile-run={RUN}").items
    bound = [p for p in pods if p.spec.node_name]
    return cluster.api_client.sanitize_for_serialization(bound[0]) if bound else None


def forward_passes(cluster, namespace) -> list[dict]:
    return cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses")["items"]


# ---- the test --------------------------------------------------------------------------------


def test_compile_run_end_to_end_on_the_cpu_pool(crds, namespace, operator_process, run_pod_locally, artifact_store,
                                               tmp_path):
    cluster = crds
    started = time.monotonic()
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": DEPLOYMENT},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0,
                 "engine": {"dtype": "float32", "maxModelLen": 256, "maxBatchSize": DEPLOYED_BATCH, "kvBlockSize": 16},
                 "artifacts": {"pvc": {"claimName": CLAIM, "subPath": SUB_PATH}}}})
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": RUN},
        "spec": {"deploymentRef": {"name": DEPLOYMENT}, "traffic": {"builtin": "chat"},
                 "budget": {"trials": TRIALS, "wallClockSeconds": 150, "deadlineGraceSeconds": 120},
                 "agents": [{"kind": "coordinate-sweep"}, {"kind": "model-based"}],
                 "tiers": {"fastLayers": 1, "replayRequests": 32, "repeats": 3},
                 "verification": {"greedySteps": 8, "freshPrompts": 2},
                 "baseline": {"minSpeedup": 1.0}, "backoffLimit": 0}})

    # operator -> Job -> scheduler: the pod lands on the CPU pool, as the run's ServiceAccount
    pod = wait_until(lambda: bound_pod(cluster, namespace), 45, "the compile pod to be bound to a node")
    node = cluster.core.read_node(pod["spec"]["nodeName"])
    assert node.metadata.labels[POOL_LABEL] == "cpu", node.metadata.labels
    assert pod["spec"]["serviceAccountName"] == f"{RUN}-compile"
    (container,) = pod["spec"]["containers"]
    assert [*container["command"], *container["args"]] == ["shapeshift", "compile", "--compile-run", f"{namespace}/{RUN}"]
    # The artifact store: the claim, read-write at the path the worker is told to write to.
    assert {"name": "artifacts", "persistentVolumeClaim": {"claimName": CLAIM}} in pod["spec"]["volumes"]
    assert {"name": "artifacts", "mountPath": ARTIFACT_MOUNT, "subPath": SUB_PATH} in container["volumeMounts"]
    assert {"name": "SHAPESHIFT_ARTIFACT_DIR", "value": ARTIFACT_MOUNT} in container["env"]
    wait_until(lambda: run_status(cluster, namespace).get("phase") in ("Scheduled", "Running"), 30, "phase Scheduled")

    env, _mounts = emulate_volumes(cluster, pod, tmp_path / "volumes")
    work_dir = Path(env["SHAPESHIFT_WORK_DIR"])  # the emptyDir
    assert Path(env["SHAPESHIFT_ENGINE_CONFIG"]).is_file(), env
    kubeconfig = pod_token_kubeconfig(cluster, pod, tmp_path / "pod-token-kubeconfig")
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", KUBECONFIG=str(kubeconfig),
               PYTHONSAFEPATH="1")

    # The worker, as the pod runs it. Its exit becomes the pod's status; the Job controller acts on it.
    local = run_pod_locally(namespace, pod["metadata"]["name"], timeout_s=170, extra_env=env,
                            pvc_dirs={CLAIM: artifact_store})
    output = local.output()
    assert local.exit_codes == {"compile": 0}, output[-6000:]
    assert "Traceback" not in output, output[-6000:]

    status = wait_until(lambda: (lambda s: s if s.get("phase") in ("Succeeded", "Failed") else None)(
        run_status(cluster, namespace)), 60, "the run to finish")
    assert status["phase"] == "Succeeded", status
    conds = conditions(status)
    assert conds["Complete"]["status"] == "True" and conds["Complete"]["reason"] == "CompletionsReached", conds
    assert conds["Failed"]["status"] == "False" and conds["Scheduled"]["status"] == "True", conds
    assert status["completionTime"] and status["nodeName"] == pod["spec"]["nodeName"]
    # The worker's final word survives the Job's completion, and the condition quotes it.
    final_word = "champion " if status.get("champion") else "no verified improvement over the shipped serving default ("
    assert status["message"].startswith(final_word), status["message"]
    assert status["message"] in conds["Complete"]["message"], conds["Complete"]

    # What the worker wrote: the run's own settings took effect (engine config from the mounted
    # ConfigMap, agents, tiers, trial budget), and the leaderboard is the run's.
    out_dir = work_dir / RUN
    report = json.loads((out_dir / "report.json").read_text())
    assert report["model"] == "tiny-llama" and report["profile"] == "chat" and report["device"] == "cpu"
    assert report["evaluator"]["dtype"] == "torch.float32" and report["evaluator"]["fast_layers"] == 1, report["evaluator"]
    assert report["evaluator"]["confirm"] == {"requests": 32, "repeats": 3}, report["evaluator"]
    assert report["evaluator"]["verify"] == {"prompts": 2, "steps": 8}, report["evaluator"]
    # The engine settings every candidate starts from: what `serve` runs here with no flags (the
    # pass to beat), with the deployment's engine.yaml over it.
    from shapeshift.engine.forward_pass.recipes import serving_default

    deployed = {"max_num_seqs": DEPLOYED_BATCH, "block_size": 16, "enable_prefix_caching": True}
    assert report["evaluator"]["engine_base"] == {**serving_default("tiny-llama", "cpu").engine, **deployed}, \
        report["evaluator"]
    assert report["trials"] == TRIALS, report
    assert status["trials"]["total"] == TRIALS, status["trials"]
    # Every candidate the space offers on this CPU builds: no trial is spent on a recipe the
    # forward pass refuses (Triton-only fusions are not in a CPU search space).
    assert status["trials"]["failed"] == 0, (status["trials"], output[-3000:])
    board = status["leaderboard"]
    assert board and all(row["candidate"] and row.get("tokensPerSecond", 0) > 0 for row in board), board
    # the agents asked for, the named recipes, and the traffic's seed: the deployment's batch of 4
    # admits fewer than chat's 32 requests in flight, so a batch of 32 is measured first
    assert {row["agent"] for row in board} <= {"baseline", "traffic", "recipes", "sweep", "bayes"}, board
    [seed] = [row for row in Board(out_dir / "board.jsonl").entries("candidate") if row["agent"] == "traffic"]
    assert seed["recipe"]["engine.max_num_seqs"] == 32 and "the batch takes 4" in seed["note"], seed

    fps = forward_passes(cluster, namespace)
    if status.get("champion"):
        # A champion named in the status is a ForwardPass pinning the exported bundle's digest.
        (fp,) = fps
        assert fp["metadata"]["name"] == status["champion"]
        spec = fp["spec"]
        champion_manifest = json.loads((out_dir / "champion" / "manifest.json").read_text())
        assert spec["artifact"]["sha256"] == champion_manifest["digest"] == report["champion_bundle"]["digest"]
        assert spec["verification"]["passed"] is True and spec["compileRun"] == f"{namespace}/{RUN}"
        assert spec["metrics"]["speedup"] == pytest.approx(status["bestSpeedup"]) and status["bestSpeedup"] > 1.0
        assert status["champion"] in status["message"]
        # The artifact: in the shared store (the claim's folder, under its subPath), not in the
        # pod's emptyDir, and the ForwardPass says it is durable. Its content is the bundle the
        # ForwardPass pins. (The local kubelet stands the folder in for the mount path, so the
        # recorded path is the folder; in a pod it is /var/lib/shapeshift-artifacts/<sha256>.tar.gz,
        # where engine pods mount the same claim.)
        artifact = urllib.parse.urlparse(spec["artifact"]["uri"])
        local_path = Path(urllib.parse.unquote(artifact.path))
        assert artifact.scheme == "file" and local_path.is_file(), spec["artifact"]
        assert local_path == (artifact_store / SUB_PATH / f"{spec['artifact']['sha256']}.tar.gz").resolve()
        assert not local_path.is_relative_to(work_dir), (local_path, work_dir)
        assert fp["metadata"]["annotations"]["shapeshift.dev/artifact-durable"] == "true"
        assert verify_bundle(local_path).digest == spec["artifact"]["sha256"]
        assert spec["artifact"]["sizeBytes"] == local_path.stat().st_size
    else:
        assert fps == [], [f["metadata"]["name"] for f in fps]
        assert not list(artifact_store.rglob("*.tar.gz"))
        assert report["champion_recipe"] is None and "bestSpeedup" not in status, status

    # The worker acted only through its own token: that token is the pod's ServiceAccount and
    # cannot reach beyond the Role (no Secrets, no other run).
    import kubernetes

    worker_api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    review = kubernetes.client.AuthenticationV1Api(worker_api).create_self_subject_review(
        kubernetes.client.V1SelfSubjectReview())
    assert review.status.user_info.username == f"system:serviceaccount:{namespace}:{RUN}-compile"
    with pytest.raises(kubernetes.client.ApiException) as denied:
        kubernetes.client.CoreV1Api(worker_api).list_namespaced_secret(namespace)
    assert denied.value.status == 403

    assert "Traceback" not in operator_process.read_text(errors="replace")
    assert time.monotonic() - started < 180, f"took {time.monotonic() - started:.0f}s"
