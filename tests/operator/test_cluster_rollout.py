"""Rollout of a verified ForwardPass on the real control plane, with real engines and a real Prometheus.

    InferenceDeployment (cpu pool, 2-3 replicas) --operator (in-process kopf)--> engine Deployment
      --kube-controller-manager, kube-scheduler, kwok--> Running pods on kwok nodes
      --harness.kubelet (run_pod_locally)--> one real `shapeshift serve --model tiny-llama` process per pod,
         each on its own loopback port, its downwardAPI annotations file emulated and kept current
      --Prometheus (static targets labelled pod/namespace/deployment)--> what each pod runs, latency
    spec.forwardPass -> ForwardPass whose artifact is a real bundle (the stock source with fuse_qkv)
      --rollout timer--> canary pod annotations --engine hot-reloads--> analysis --> all pods

The first test follows a good candidate from the canary (while the other pods still run stock) to
every pod, once with the operator as an admin and once with only the Helm chart's ServiceAccount
token (its RBAC must be enough); the second names a ForwardPass whose sha256 is not its
artifact's: the canary engine refuses it and the operator rolls back, saying why; the third rolls
back a candidate that makes latency worse, on the analysis; the fourth checks the Restart strategy;
the last gives the deployment an artifact store (a claim the local kubelet maps to one folder for
every engine pod), refuses a ForwardPass whose archive stayed in its compile pod, and rolls out one
stored there, which stays trusted and rolled out after its CompileRun is deleted (the operator
recorded its acceptance in status.verifiedForwardPasses). Each ForwardPass's status follows: Active with the deployments that run it, or
Refused with the reason.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from harness import tools
from harness.cluster import wait_until
from harness.engine_pods import DeploymentLoad, forward_pass_info, serve_engine_pods
from harness.pod_environment import service_account_token, token_kubeconfig
from shapeshift.engine.forward_pass.bundle import create_bundle, load_manifest, stock_bundle_dir

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
NAME = "llama"
MODEL = "tiny-llama"
CHART = Path(__file__).resolve().parents[2] / "charts" / "shapeshift"


# ---- helpers ---------------------------------------------------------------------------------


def bundle(tmp_path: Path, recipe: dict, name: str) -> tuple[Path, str]:
    """A real bundle archive: the stock forward pass with a changed recipe."""
    path = tmp_path / "bundles" / f"{name}.tar.gz"
    create_bundle(stock_bundle_dir(), recipe, path, name=name)
    return path, load_manifest(path).digest


def hand_written(name: str, uri: str, sha256: str, annotations: dict | None = None, **spec_over) -> dict:
    """A ForwardPass claiming to be verified, as anyone allowed to create ForwardPasses can write it."""
    spec = {
        "model": {"name": MODEL, "dtype": "float32"},
        "hardware": {"accelerator": "cpu"},
        "artifact": {"uri": uri, "sha256": sha256},
        "recipe": {"fuse_qkv": True},
        "metrics": {"speedup": 1.1},
        "verification": {"passed": True, "gates": [{"name": "greedy-match", "passed": True}],
                         "artifactSha256": sha256},
        **spec_over,
    }
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass",
            "metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}


def forward_pass(cluster, namespace: str, name: str, uri: str, sha256: str, annotations: dict | None = None) -> None:
    """A ForwardPass published as a compile worker publishes it: by a CompileRun (here one whose
    deployment does not exist, so the operator starts no Job for it) that stamps its uid on the
    pass and records the pass's name and spec digest in its own status."""
    from shapeshift.operator.api import COMPILE_RUN_UID_ANNOTATION, ForwardPassSpec

    run = cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": f"{name}-run"},
        "spec": {"deploymentRef": {"name": "compiled-elsewhere"}}})
    body = hand_written(name, uri, sha256, {**(annotations or {}), COMPILE_RUN_UID_ANNOTATION: run["metadata"]["uid"]},
                        compileRun=f"{namespace}/{name}-run")
    stored = cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", body)
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "compileruns", f"{name}-run", {
        "status": {"champion": name, "championSpecSha256": ForwardPassSpec.model_validate(stored["spec"]).digest()}})


def deployment(cluster, namespace: str, replicas: int, **extra_spec) -> dict:
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": NAME},
        "spec": {
            **extra_spec,
            "model": {"preset": MODEL},
            "hardware": {"accelerator": "cpu"},
            "replicas": replicas,
            "engine": {"dtype": "float32", "maxModelLen": 256, "maxBatchSize": 8},
            # Short windows so the test takes about a minute; allowedRegression 1.0: only a canary
            # twice as slow as the stock pods is refused (two busy cores make timings noisy).
            "rollout": {"canaryReplicas": 1, "analysisWindowSeconds": 12, "allowedRegression": 1.0,
                        "loadTimeoutSeconds": 120},
        },
    })


def forward_pass_status(cluster, namespace: str, name: str) -> dict:
    return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses",
                                                       name).get("status") or {}


def status(cluster, namespace: str) -> dict:
    return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments",
                                                       NAME).get("status") or {}


def patch_spec(cluster, namespace: str, spec: dict) -> None:
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", NAME,
                                                  {"spec": spec})


def events(cluster, namespace: str) -> list[tuple[str, str, str]]:
    return [(e.type, e.reason, e.message or "") for e in cluster.core.list_namespaced_event(namespace).items
            if e.involved_object.kind == "InferenceDeployment"]


@pytest.fixture(params=["admin", "chart-service-account"])
def rollout_operator(request, crds, namespace, monkeypatch, tmp_path):
    """The operator in-process (kopf, --standalone) watching the test's namespace, either with the
    admin kubeconfig or with nothing but the token of the ServiceAccount `helm install` created."""
    from kopf.testing import KopfRunner

    import shapeshift.operator.handlers  # noqa: F401  (registers the handlers once per process)

    release = None
    kubeconfig = Path(crds.kubeconfig)
    if request.param == "chart-service-account":
        release = f"ss-{uuid.uuid4().hex[:6]}"
        # --skip-crds: the crds fixture's are installed (with the test session's artifact roots)
        subprocess.run([str(tools.helm()), "install", release, str(CHART), "--namespace", namespace, "--skip-crds",
                        "--set-json", "watch.allNamespaces=false", "--set-json",
                        f"watch.namespaces={json.dumps([namespace])}", f"--kubeconfig={crds.kubeconfig}"],
                       check=True, capture_output=True, text=True, timeout=180)
        account = f"{release}-shapeshift"
        token = service_account_token(crds, namespace, account, expiration_s=1800)
        kubeconfig = token_kubeconfig(crds, namespace, account, token, tmp_path / "sa.kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    try:
        with KopfRunner(["run", "--standalone", "--namespace", namespace, "-m", "shapeshift.operator.handlers"],
                        timeout=60) as runner:
            yield request.param
        assert runner.exception is None, runner.output[-4000:]
        forbidden = [line for line in runner.output.splitlines() if "forbidden" in line.lower()]
        assert not forbidden, "the operator was refused something:\n" + "\n".join(forbidden[:10])
    finally:
        if release is not None:
            subprocess.run([str(tools.helm()), "uninstall", release, "--namespace", namespace,
                            f"--kubeconfig={crds.kubeconfig}"], capture_output=True, timeout=180)


@pytest.fixture
def engines(crds, namespace, run_pod_locally, prometheus, tmp_path, monkeypatch):
    """start(replicas) -> {pod name: base URL}: the deployment's pods running as real engines,
    scraped by a Prometheus that the deployment's spec.prometheusUrl names."""
    monkeypatch.setenv("SHAPESHIFT_ROLLOUT_MIN_REQUESTS", "5")

    def start(replicas: int, pvc_dirs: dict[str, Path] | None = None, **extra_spec) -> dict[str, str]:
        deployment(crds, namespace, replicas, **extra_spec)
        return serve_engine_pods(crds, namespace, NAME, replicas, run_pod_locally=run_pod_locally,
                                 prometheus=prometheus, cache_dir=tmp_path / "engine-cache", pvc_dirs=pvc_dirs)

    return start


# ---- tests -----------------------------------------------------------------------------------


def test_good_candidate_goes_to_the_canary_first_then_to_every_pod(crds, namespace, rollout_operator, engines,
                                                                    tmp_path):
    archive, digest = bundle(tmp_path, {"fuse_qkv": True}, "fused-qkv")
    urls = engines(3)
    stock = forward_pass_info(next(iter(urls.values())))["sha256"]
    assert stock != digest
    forward_pass(crds, namespace, "tiny-fused-qkv", str(archive), digest)

    with DeploymentLoad(list(urls.values()), model=MODEL) as load:
        patch_spec(crds, namespace, {"forwardPass": "tiny-fused-qkv"})
        st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "Analyzing" else None)(
            status(crds, namespace)), 90, "the canary to report the candidate (phase Analyzing)", interval_s=0.5)
        (canary,) = st["rollout"]["canaryPods"]
        # While the canary is analysed, it alone runs the candidate.
        running = {name: forward_pass_info(url) for name, url in urls.items()}
        assert running[canary] == {"model": MODEL, "name": "tiny-fused-qkv", "sha256": digest}
        for name, info in running.items():
            if name != canary:
                assert info == {"model": MODEL, "name": "stock", "sha256": stock}, name
        pods = crds.core.list_namespaced_pod(namespace, label_selector=f"shapeshift.dev/inference-deployment={NAME}")
        asked = {p.metadata.name: (p.metadata.annotations or {}).get("shapeshift.dev/forward-pass") for p in pods.items}
        assert asked == {name: ("tiny-fused-qkv" if name == canary else None) for name in urls}
        by_pod = {p["name"]: p for p in st["pods"]}
        assert by_pod[canary]["canary"] is True and by_pod[canary]["forwardPass"] == "tiny-fused-qkv"

        st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "Complete" else None)(
            status(crds, namespace)), 120, "promotion to every pod (phase Complete)", interval_s=0.5)
    assert load.statuses.count(200) >= 15 and set(load.statuses) == {200}, sorted(set(load.statuses))

    for name, url in urls.items():
        assert forward_pass_info(url)["sha256"] == digest, name
    assert st["activeForwardPass"]["name"] == "tiny-fused-qkv" and st["activeForwardPass"]["sha256"] == digest
    assert st["activeForwardPass"]["speedup"] == 1.1
    assert sorted(p["name"] for p in st["pods"]) == sorted(urls)
    assert all(p["forwardPass"] == "tiny-fused-qkv" and p["sha256"] == digest and p["desired"] == "tiny-fused-qkv"
               for p in st["pods"]), st["pods"]
    condition = {c["type"]: c for c in st["conditions"]}["ForwardPassRolledOut"]
    assert condition["status"] == "True" and condition["reason"] == "RolledOut"
    reasons = {reason for _, reason, _ in events(crds, namespace)}
    assert {"CanaryStarted", "CanaryInSync", "Promoting", "RolledOut"} <= reasons, reasons
    fp_status = wait_until(lambda: (lambda s: s if s.get("phase") == "Active" else None)(
        forward_pass_status(crds, namespace, "tiny-fused-qkv")), 15, "the ForwardPass to be Active")
    assert fp_status["deployments"] == [NAME] and "refusals" not in fp_status, fp_status

    # A pod created later (scale-up) is asked for the promoted pass by the next tick.
    patch_spec(crds, namespace, {"replicas": 4})

    def newcomer():
        pods = crds.core.list_namespaced_pod(namespace, label_selector=f"shapeshift.dev/inference-deployment={NAME}")
        new = [p for p in pods.items if p.metadata.name not in urls]
        return new[0] if new and (new[0].metadata.annotations or {}).get("shapeshift.dev/forward-pass-sha256") \
            == digest else None

    pod = wait_until(newcomer, 60, "the scaled-up pod annotated with the promoted pass", interval_s=0.5)
    assert pod.metadata.annotations["shapeshift.dev/forward-pass"] == "tiny-fused-qkv"
    assert status(crds, namespace)["rollout"]["phase"] == "Complete"


def test_candidate_with_a_wrong_digest_is_refused_by_the_canary_and_rolled_back(crds, namespace, operator,
                                                                                engines, tmp_path):
    archive, digest = bundle(tmp_path, {"fuse_qkv": True}, "fused-qkv")
    _, other_digest = bundle(tmp_path, {"fuse_qkv": True, "fuse_gate_up": True}, "other")
    urls = engines(2)
    stock = forward_pass_info(next(iter(urls.values())))["sha256"]
    # The artifact is a real bundle, but the ForwardPass records another bundle's digest.
    forward_pass(crds, namespace, "tiny-mislabelled", str(archive), other_digest)

    patch_spec(crds, namespace, {"forwardPass": "tiny-mislabelled"})
    st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "RolledBack" else None)(
        status(crds, namespace)), 90, "the rollout to be rolled back", interval_s=0.5)
    (canary,) = st["rollout"]["canaryPods"]
    assert "refused tiny-mislabelled" in st["rollout"]["message"] and "digest_mismatch" in st["rollout"]["message"]
    assert canary in st["rollout"]["message"]
    condition = {c["type"]: c for c in st["conditions"]}["ForwardPassRolledOut"]
    assert condition["status"] == "False" and condition["reason"] == "RolledBack"
    assert "digest_mismatch" in condition["message"]
    assert "activeForwardPass" not in st

    # Every pod is (still) on stock and the canary's annotations ask for stock again.
    def all_stock():
        pods = crds.core.list_namespaced_pod(namespace, label_selector=f"shapeshift.dev/inference-deployment={NAME}")
        return all("shapeshift.dev/forward-pass" not in (p.metadata.annotations or {}) for p in pods.items)

    wait_until(all_stock, 15, "the canary's forward-pass annotations removed")
    for name, url in urls.items():
        assert forward_pass_info(url) == {"model": MODEL, "name": "stock", "sha256": stock}, name
    warnings = [(kind, msg) for kind, reason, msg in events(crds, namespace) if reason == "RolledBack"]
    assert warnings and warnings[0][0] == "Warning" and "digest_mismatch" in warnings[0][1]

    fp_status = wait_until(lambda: (lambda s: s if s.get("phase") == "Refused" else None)(
        forward_pass_status(crds, namespace, "tiny-mislabelled")), 15, "the ForwardPass to be Refused")
    (refusal,) = fp_status["refusals"]
    assert refusal["deployment"] == NAME and refusal["reason"] == "RolledBack" and "digest_mismatch" in refusal["message"]
    assert "deployments" not in fp_status

    # The refused target is not retried: a later tick leaves the rollout where it is.
    time.sleep(5)
    assert status(crds, namespace)["rollout"]["phase"] == "RolledBack"


SLOW_FORWARD = '''"""Exact but slow: the stock forward pass plus a pause in every step (a latency regression)."""
import time

from shapeshift.engine.forward_pass.importer import import_stock_module

stock = import_stock_module()
CACHE_FORMAT_VERSION = stock.CACHE_FORMAT_VERSION


class SlowForwardPass(stock.StockForwardPass):
    def forward(self, *args, **kwargs):
        time.sleep(0.06)
        return super().forward(*args, **kwargs)


def build(model_config, weights, recipe):
    return SlowForwardPass(model_config, weights, recipe)
'''


def test_candidate_that_makes_latency_worse_is_rolled_back_after_the_analysis(crds, namespace, operator, engines,
                                                                              tmp_path):
    source = tmp_path / "slow-source"
    source.mkdir()
    (source / "forward.py").write_text(SLOW_FORWARD)
    archive = tmp_path / "bundles" / "slow.tar.gz"
    create_bundle(source, {}, archive, name="slow")
    digest = load_manifest(archive).digest
    urls = engines(2)
    stock = forward_pass_info(next(iter(urls.values())))["sha256"]
    forward_pass(crds, namespace, "tiny-slow", str(archive), digest)
    patch_spec(crds, namespace, {"rollout": {"allowedRegression": 0.5}})

    with DeploymentLoad(list(urls.values()), model=MODEL):
        patch_spec(crds, namespace, {"forwardPass": "tiny-slow"})
        st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "Analyzing" else None)(
            status(crds, namespace)), 90, "the canary to report the slow candidate", interval_s=0.5)
        (canary,) = st["rollout"]["canaryPods"]
        assert forward_pass_info(urls[canary])["sha256"] == digest
        st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "RolledBack" else None)(
            status(crds, namespace)), 90, "the analysis to roll the slow candidate back", interval_s=0.5)
    message = st["rollout"]["message"]
    assert "canary regressed" in message and "p90 latency" in message, message
    print(f"rollback reason: {message}")
    # Back on stock: the engine re-activates the pass it still holds.
    for name, url in urls.items():
        wait_until(lambda url=url: forward_pass_info(url)["sha256"] == stock, 30, f"{name} back on stock")
    assert "activeForwardPass" not in status(crds, namespace)


def test_restart_strategy_rolls_the_pod_template_and_the_resync_keeps_it(crds, namespace, operator, prometheus,
                                                                         tmp_path):
    """Restart: no canary; the engine Deployment's pod template names the pass and the real
    Deployment controller replaces the pods (kwok runs them; no engines, so no pod reports it
    and the rollout stays Promoting). The resync must not undo the template."""
    archive, digest = bundle(tmp_path, {"fuse_qkv": True}, "fused-qkv")
    forward_pass(crds, namespace, "tiny-fused-qkv", str(archive), digest)
    server = prometheus([])  # reachable, and no pod reports anything
    deployment(crds, namespace, 2)
    patch_spec(crds, namespace, {"rollout": {"strategy": "Restart"}, "prometheusUrl": server.url})
    selector = f"shapeshift.dev/inference-deployment={NAME}"

    def pods_running():
        pods = crds.core.list_namespaced_pod(namespace, label_selector=selector).items
        return pods if len(pods) == 2 and all(p.status.phase == "Running" for p in pods) else None

    before = {p.metadata.name for p in wait_until(pods_running, 60, "2 engine pods Running")}
    patch_spec(crds, namespace, {"forwardPass": "tiny-fused-qkv"})
    wanted = {"shapeshift.dev/forward-pass": "tiny-fused-qkv", "shapeshift.dev/forward-pass-sha256": digest,
              "shapeshift.dev/forward-pass-artifact": str(archive)}

    def rolled():
        pods = pods_running()
        if not pods or {p.metadata.name for p in pods} & before:
            return None
        return pods if all(wanted.items() <= (p.metadata.annotations or {}).items() for p in pods) else None

    wait_until(rolled, 90, "every engine pod replaced by one whose annotations name the pass", interval_s=0.5)
    st = status(crds, namespace)
    assert st["rollout"]["phase"] == "Promoting" and "Restart" in st["rollout"]["message"]
    assert "canaryPods" not in st["rollout"]
    engine = crds.apps.read_namespaced_deployment(f"{NAME}-engine", namespace)
    assert wanted.items() <= engine.spec.template.metadata.annotations.items()
    generation = engine.metadata.generation
    time.sleep(6)  # three resyncs and rollout ticks: nobody rolls the template back
    assert crds.apps.read_namespaced_deployment(f"{NAME}-engine", namespace).metadata.generation == generation


def test_artifact_store_rolls_out_stored_passes_and_refuses_one_left_in_its_compile_pod(
        crds, namespace, operator, engines, artifact_store, tmp_path):
    # Two archives as the compile worker writes them: <sha256>.tar.gz in the store (durable),
    # and one left in a compile pod's work folder (annotated "false": gone with that pod).
    staged, digest = bundle(tmp_path, {"fuse_qkv": True}, "fused-qkv")
    stored = artifact_store / f"{digest}.tar.gz"
    staged.rename(stored)
    lost, lost_digest = bundle(tmp_path / "compile-pod-emptydir", {"fuse_gate_up": True}, "fused-gate-up")
    forward_pass(crds, namespace, "tiny-stored", str(stored), digest, {"shapeshift.dev/artifact-durable": "true"})
    forward_pass(crds, namespace, "tiny-lost", str(lost), lost_digest, {"shapeshift.dev/artifact-durable": "false"})

    urls = engines(2, pvc_dirs={"artifacts": artifact_store}, artifacts={"pvc": {"claimName": "artifacts"}})
    template = crds.apps.read_namespaced_deployment(f"{NAME}-engine", namespace).spec.template.spec
    (volume,) = [v for v in template.volumes if v.name == "artifacts"]
    assert volume.persistent_volume_claim.claim_name == "artifacts" and volume.persistent_volume_claim.read_only
    (mount,) = [m for m in template.containers[0].volume_mounts if m.name == "artifacts"]
    assert mount.mount_path == "/var/lib/shapeshift-artifacts" and mount.read_only
    stock = forward_pass_info(next(iter(urls.values())))["sha256"]

    # Not durable: refused before any pod is asked for it, with a condition and a Warning event.
    patch_spec(crds, namespace, {"forwardPass": "tiny-lost"})

    def refused():
        conds = {c["type"]: c for c in status(crds, namespace).get("conditions") or []}
        cond = conds.get("ForwardPassRolledOut")
        return cond if cond and cond["reason"] == "ArtifactNotDurable" else None

    condition = wait_until(refused, 30, "the non-durable ForwardPass to be refused", interval_s=0.5)
    assert condition["status"] == "False" and "spec.artifacts.pvc" in condition["message"], condition
    assert str(lost) in condition["message"]
    warnings = [(kind, msg) for kind, reason, msg in events(crds, namespace) if reason == "ArtifactNotDurable"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning" and "tiny-lost" in warnings[0][1], warnings
    fp_status = wait_until(lambda: (lambda s: s if s.get("phase") == "Refused" else None)(
        forward_pass_status(crds, namespace, "tiny-lost")), 15, "tiny-lost to be Refused")
    assert [(r["deployment"], r["reason"]) for r in fp_status["refusals"]] == [(NAME, "ArtifactNotDurable")]
    assert status(crds, namespace)["rollout"]["phase"] == "Idle"
    pods = crds.core.list_namespaced_pod(namespace, label_selector=f"shapeshift.dev/inference-deployment={NAME}")
    assert all("shapeshift.dev/forward-pass" not in (p.metadata.annotations or {}) for p in pods.items)
    for name, url in urls.items():
        assert forward_pass_info(url)["sha256"] == stock, name
    time.sleep(4)  # later ticks post no second event for the same refusal
    assert len([1 for _, reason, _ in events(crds, namespace) if reason == "ArtifactNotDurable"]) == 1

    # Written by hand, and a copy of a published pass with another recipe under the same run: both
    # claim to be verified, neither is vouched for by its CompileRun, neither reaches a pod.
    forged = hand_written("tiny-forged", str(stored), digest)
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", forged)
    published = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", "tiny-stored")
    copied = hand_written("tiny-copied", str(stored), digest, published["metadata"]["annotations"],
                          compileRun=published["spec"]["compileRun"], recipe={"fuse_gate_up": True})
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", copied)
    for name, fragment in [("tiny-forged", "names no CompileRun (spec.compileRun)"),
                           ("tiny-copied", "does not record this ForwardPass with this spec")]:
        patch_spec(crds, namespace, {"forwardPass": name})

        def untrusted(name=name):
            cond = {c["type"]: c for c in status(crds, namespace).get("conditions") or []}.get("ForwardPassRolledOut")
            return cond if cond and cond["reason"] == "NotVerifiedByCompileRun" and name in cond["message"] else None

        condition = wait_until(untrusted, 30, f"{name} to be refused as not verified by a CompileRun", interval_s=0.5)
        assert condition["status"] == "False" and fragment in condition["message"], condition
        assert status(crds, namespace)["rollout"]["phase"] == "Idle"
    assert {"tiny-forged", "tiny-copied"} <= {msg.split()[1].rstrip(":") for kind, reason, msg in events(crds, namespace)
                                              if reason == "NotVerifiedByCompileRun" and kind == "Warning"}
    pods = crds.core.list_namespaced_pod(namespace, label_selector=f"shapeshift.dev/inference-deployment={NAME}")
    assert all("shapeshift.dev/forward-pass" not in (p.metadata.annotations or {}) for p in pods.items)

    # Stored in the shared store: every engine pod loads it from there.
    with DeploymentLoad(list(urls.values()), model=MODEL):
        patch_spec(crds, namespace, {"forwardPass": "tiny-stored"})
        st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "Complete" else None)(
            status(crds, namespace)), 150, "the stored pass on every pod (phase Complete)", interval_s=0.5)
    assert st["activeForwardPass"]["name"] == "tiny-stored" and st["activeForwardPass"]["artifact"] == str(stored)
    for name, url in urls.items():
        assert forward_pass_info(url) == {"model": MODEL, "name": "tiny-stored", "sha256": digest}, name
    fp_status = wait_until(lambda: (lambda s: s if s.get("phase") == "Active" else None)(
        forward_pass_status(crds, namespace, "tiny-stored")), 15, "tiny-stored to be Active")
    assert fp_status["deployments"] == [NAME]
    assert forward_pass_status(crds, namespace, "tiny-lost")["phase"] == "Refused"
    assert "tiny-stored" in [r["name"] for r in status(crds, namespace)["verifiedForwardPasses"]]
    assert not {"tiny-forged", "tiny-copied", "tiny-lost"} & {r["name"] for r in
                                                               status(crds, namespace)["verifiedForwardPasses"]}

    # Its CompileRun is cleaned up: the operator recorded that it vouched, so the rolled-out pass
    # stays trusted and rolled out; a hand-written pass is still refused.
    crds.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "tiny-stored-run")
    time.sleep(6)  # three rollout ticks
    st = status(crds, namespace)
    condition = {c["type"]: c for c in st["conditions"]}["ForwardPassRolledOut"]
    assert (condition["status"], condition["reason"]) == ("True", "RolledOut"), condition
    assert st["rollout"]["phase"] == "Complete" and st["activeForwardPass"]["name"] == "tiny-stored"
    assert forward_pass_status(crds, namespace, "tiny-stored")["phase"] == "Active"
    for name, url in urls.items():
        assert forward_pass_info(url)["name"] == "tiny-stored", name
    patch_spec(crds, namespace, {"forwardPass": "tiny-forged"})
    condition = wait_until(lambda: (lambda c: c if c and c["reason"] == "NotVerifiedByCompileRun" else None)(
        {c["type"]: c for c in status(crds, namespace).get("conditions") or []}.get("ForwardPassRolledOut")),
        30, "the hand-written pass refused after the run's deletion", interval_s=0.5)
    assert "tiny-forged" in condition["message"] and status(crds, namespace)["rollout"]["phase"] == "Complete"
