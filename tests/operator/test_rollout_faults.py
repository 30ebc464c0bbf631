"""Faults during a rollout, on the real parts: the operator SIGKILLed mid-canary, the canary's engine
killed mid-canary, the artifact store unreadable when a rollout starts.

    `shapeshift operator` as its own process (harness.operator_process; SIGKILLed and started again)
      --> InferenceDeployment (cpu pool, 2 replicas, spec.artifacts.pvc: the claim `artifacts`)
      --> engine Deployment --kube-controller-manager, kube-scheduler, kwok--> 2 Running pods
      --harness.kubelet--> one real `shapeshift serve` per pod, both mounting the store folder, each
         run without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (setpriv): file modes bind the engine as
         they bind the engine image's non-root user, so a store made unreadable is unreadable to it
      --> a real Prometheus scraping every engine (a pod started later is added to its targets)
    ForwardPasses published as a compile worker publishes them (vouched for by a CompileRun), their
    archives <sha256>.tar.gz in the store.

One operator, one store and one set of engines serve the whole module (module-scoped: starting
them costs most of the time); each test starts from whatever every pod serves then:

1. The operator is SIGKILLed while the canary runs the candidate (phase Analyzing) and started
   again: the rollout resumes from status.rollout (same canary, same start, the analysis window
   kept) and completes once: every pod on the candidate, each pod reloaded once, one event per
   phase.
2. The canary's engine is SIGKILLed while it runs the candidate (phase Analyzing), its pod reported
   Failed: the rollout is rolled back at once (a canary that stops serving is never promoted on the
   traffic it served before), the other pod never leaves the pass it serves, and the pod the
   ReplicaSet starts in the dead one's place is kept on that pass.
3. The stored archive and its folder are made unreadable (chmod 000) before a rollout starts: the
   canary's engine reports it `unreadable` (Permission denied, in its log), the rollout is rolled
   back at once (not after the load timeout) with a condition naming that, and every pod keeps
   serving its pass, none reloading.
4. The API server is restarted (harness.controlplane.ControlPlane.restart_apiserver) while the
   canary runs the candidate: the operator, never restarted, completes the rollout once after it.
5. Two peered replicas replace the standalone operator and the leader is SIGKILLed mid-canary: the
   follower resumes within the peering lifetime plus a slack and completes the rollout once.

Each ends with one ForwardPass per archive, status.rollout consistent with status.pods and with
what each pod's /metrics reports (shapeshift_forward_pass_info's sha256), and every request to a
pod that was not killed answered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from harness.cluster import wait_until
from harness.controlplane import free_port
from harness.engine_pods import VENV_BIN, DeploymentLoad, forward_pass_info, healthy, serve_engine_pods
from harness.engine_server import scrape
from harness.kubelet import LocalPod, local_claim
from harness.operator_process import operator_healthy, start_operator, stop_operator
from harness.prometheus import Prometheus
from test_cluster_rollout import GROUP, MODEL, NAME, VERSION, bundle, deployment, forward_pass, patch_spec, status

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SELECTOR = f"shapeshift.dev/inference-deployment={NAME}"
RELOADS = "shapeshift_forward_pass_reloads_total"
SETTLED = ("Idle", "Complete", "RolledBack")
# The engine image runs as a non-root user; these tests run as root, whose DAC capabilities would
# read a file whatever its mode. The engines run without them.
NO_DAC = "setpriv --bounding-set=-dac_override,-dac_read_search --inh-caps=-all --"


@dataclass
class Stage:
    """The module's operator, store, Prometheus and engines; `urls` and `pods` by pod name."""

    cluster: object
    namespace: str
    root: Path
    store: Path
    urls: dict[str, str] = field(default_factory=dict)
    pods: dict[str, LocalPod] = field(default_factory=dict)
    server: Prometheus | None = None
    operator: subprocess.Popen | None = None
    operator_port: int = 0
    published: list[str] = field(default_factory=list)  # the ForwardPasses the tests created
    stock: str = ""  # the stock pass's sha256, which the engines serve at the start

    @property
    def log(self) -> Path:
        return self.root / "operator.log"

    def start_operator(self) -> None:
        self.operator = start_operator(self.cluster, self.namespace, self.log, self.operator_port,
                                       env={"SHAPESHIFT_ROLLOUT_MIN_REQUESTS": "5",
                                            # the faults, not the analysis, decide here: a canary at
                                            # the stock pass's speed is never judged slower on noise
                                            "SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS": "0.05"})
        wait_until(lambda: operator_healthy(self.operator_port), 60, "the operator's health endpoint")

    def kill_operator(self) -> None:
        os.killpg(self.operator.pid, signal.SIGKILL)
        self.operator.wait(timeout=10)

    def run_pod(self, namespace: str, pod_name: str, *, background: bool = False, timeout_s: float = 120.0,
                extra_env=None, flag_overrides=None, pvc_dirs=None) -> LocalPod:
        """run_pod_locally (tests/conftest.py), each engine started through setpriv (NO_DAC)."""
        wrapper = self.root / "no-dac-bin"
        if not wrapper.exists():
            wrapper.mkdir()
            (wrapper / "shapeshift").write_text(f'#!/bin/sh\nexec {NO_DAC} {VENV_BIN / "shapeshift"} "$@"\n')
            (wrapper / "shapeshift").chmod(0o755)
        env = {**(extra_env or {})}
        env["PATH"] = f"{wrapper}{os.pathsep}{env.get('PATH') or os.environ['PATH']}"
        pod = LocalPod(self.cluster.api_client, namespace, pod_name, self.root / "pods", extra_env=env,
                       flag_overrides=flag_overrides, pvc_dirs=pvc_dirs)
        self.pods[pod_name] = pod
        pod.start(timeout_s=timeout_s)
        if not background:
            pod.wait(timeout_s=timeout_s)
        return pod

    def prometheus(self, scrape_configs: list[dict]) -> Prometheus:
        self.server = Prometheus(self.root / "prometheus", scrape_configs).start()
        return self.server

    def serve_new_pod(self, pod_name: str) -> str:
        """Run the engine of a pod created after the start (as its node's kubelet would) and add it
        to Prometheus's targets (its configuration reloaded)."""
        port = free_port()
        self.run_pod(self.namespace, pod_name, background=True, pvc_dirs={"artifacts": self.store}, extra_env={
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONSAFEPATH": "1",
            "SHAPESHIFT_CACHE": str(self.root / "engine-cache")},
            flag_overrides={"--host": "127.0.0.1", "--port": str(port), "--num-kv-blocks": "64"})
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url), 120, f"engine of {pod_name} healthy", interval_s=0.5)
        job = self.server.config["scrape_configs"][0]
        job["static_configs"].append({"targets": [f"127.0.0.1:{port}"],
                                      "labels": {"pod": pod_name, "namespace": self.namespace, "deployment": NAME}})
        (self.server.workdir / "prometheus.yml").write_text(yaml.safe_dump(self.server.config, sort_keys=False))
        urllib.request.urlopen(urllib.request.Request(f"{self.server.url}/-/reload", method="POST"), timeout=10)
        self.server.wait_for(f'count(shapeshift_forward_pass_info{{pod="{pod_name}"}})', timeout_s=30)
        self.urls[pod_name] = url
        return url


@pytest.fixture(scope="module")
def stage(crds, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-faults")
    namespace = crds.create_namespace(f"t-rollout-faults-{uuid.uuid4().hex[:6]}", labels={"shapeshift.dev/test": "true"})
    store = root / "artifact-store"
    volume = local_claim(crds.api_client, namespace, "artifacts", store)
    st = Stage(crds, namespace, root, store, operator_port=free_port())
    try:
        st.start_operator()
        deployment(crds, namespace, 2, artifacts={"pvc": {"claimName": "artifacts"}})
        patch_spec(crds, namespace, {"rollout": {"analysisWindowSeconds": 10, "allowedRegression": 1.0}})
        st.urls = serve_engine_pods(crds, namespace, NAME, 2, run_pod_locally=st.run_pod, prometheus=st.prometheus,
                                    cache_dir=root / "engine-cache", pvc_dirs={"artifacts": store})
        (st.stock,) = set(served(st).values())
        yield st
    finally:
        if st.operator is not None:
            stop_operator(st.operator)
        for pod in st.pods.values():
            pod.stop()
        if st.server is not None:
            st.server.stop()
        crds.delete_namespace(namespace)
        crds.core.delete_persistent_volume(volume)
    text = st.log.read_text(errors="replace") if st.log.exists() else ""
    assert "Traceback" not in text, text[-4000:]


# ---- helpers ---------------------------------------------------------------------------------


def stored_pass(stage: Stage, tmp_path: Path, recipe: dict, name: str) -> tuple[Path, str]:
    """A real bundle stored as the compile worker stores it (<sha256>.tar.gz in the store) and its
    ForwardPass, published by a CompileRun."""
    staged, digest = bundle(tmp_path, recipe, name)
    stored = stage.store / f"{digest}.tar.gz"
    staged.rename(stored)
    forward_pass(stage.cluster, stage.namespace, name, str(stored), digest, {"shapeshift.dev/artifact-durable": "true"})
    stage.published.append(name)
    return stored, digest


def rollout(stage: Stage) -> dict:
    return status(stage.cluster, stage.namespace).get("rollout") or {}


def in_phase(stage: Stage, *phases: str, target: str | None = None):
    """A wait_until predicate: the deployment's status once its rollout (of `target`) is in a phase."""
    def check():
        st = status(stage.cluster, stage.namespace)
        rollout = st.get("rollout") or {}
        wanted = target is None or (rollout.get("desired") or {}).get("name") == target
        return st if wanted and rollout.get("phase") in phases else None
    return check


def served(stage: Stage) -> dict[str, str]:
    """{pod: sha256} as each live engine's /metrics reports it."""
    return {pod: forward_pass_info(url)["sha256"] for pod, url in stage.urls.items()}


def reloads(stage: Stage) -> dict[str, float]:
    """{pod: forward-pass reloads that succeeded} from each live engine's /metrics."""
    return {pod: scrape(url).get((RELOADS, (("model", MODEL), ("result", "success"))), 0.0)
            for pod, url in stage.urls.items()}


def live_pods(stage: Stage) -> list:
    return [p for p in stage.cluster.core.list_namespaced_pod(stage.namespace, label_selector=SELECTOR).items
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def event_counts(stage: Stage, since: float) -> dict[str, int]:
    """{reason: how many times} of the deployment's events after `since` (unix time); kopf posts
    repeats of one event as one with a count."""
    out: dict[str, int] = {}
    for e in stage.cluster.core.list_namespaced_event(stage.namespace).items:
        when = e.last_timestamp or e.event_time or e.first_timestamp
        if e.involved_object.kind == "InferenceDeployment" and when and when.timestamp() >= since:
            out[e.reason] = out.get(e.reason, 0) + (e.count or 1)
    return out


def status_of_pass(stage: Stage, name: str) -> dict:
    return stage.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, stage.namespace, "forwardpasses",
                                                             name).get("status") or {}


def names(stage: Stage, plural: str) -> list[str]:
    items = stage.cluster.custom.list_namespaced_custom_object(GROUP, VERSION, stage.namespace, plural)["items"]
    return sorted(item["metadata"]["name"] for item in items)


def settled(stage: Stage) -> dict[str, str]:
    """Wait until the rollout is settled and every live engine serves one pass; {pod: sha256}."""
    wait_until(in_phase(stage, *SETTLED), 60, "a settled rollout", interval_s=0.5)
    return wait_until(lambda: (lambda s: s if len(set(s.values())) == 1 else None)(served(stage)), 60,
                      "every engine on one forward pass", interval_s=0.5)


def assert_consistent(stage: Stage, phase: str, sha256: str) -> dict:
    """status.rollout in `phase`; status.pods, the pods' annotations and every live engine's /metrics
    agreeing that each live pod serves `sha256`; no object made twice: one ForwardPass and one
    CompileRun per published archive, one engine Deployment, one ReplicaSet."""
    st = status(stage.cluster, stage.namespace)
    assert st["rollout"]["phase"] == phase, st["rollout"]
    assert served(stage) == {pod: sha256 for pod in stage.urls}
    pods = live_pods(stage)
    assert sorted(p.metadata.name for p in pods) == sorted(stage.urls)
    listed = {p["name"]: p for p in st["pods"]}
    for pod in pods:
        name = pod.metadata.name
        assert listed[name]["sha256"] == sha256 and listed[name]["ready"], listed[name]
        asked = (pod.metadata.annotations or {}).get("shapeshift.dev/forward-pass-sha256")
        assert asked == (None if sha256 == stage.stock else sha256), (name, asked)  # stock: no annotation
    assert names(stage, "forwardpasses") == sorted(stage.published)
    assert names(stage, "compileruns") == sorted(f"{name}-run" for name in stage.published)
    apps = stage.cluster.apps
    assert [d.metadata.name for d in apps.list_namespaced_deployment(stage.namespace).items] == [f"{NAME}-engine"]
    assert len(apps.list_namespaced_replica_set(stage.namespace, label_selector=SELECTOR).items) == 1
    return st


def assert_completed_once(stage: Stage, analyzing: dict, done: dict, digest: str, reloaded: dict[str, float],
                          since: float) -> None:
    """The rollout resumed, not started again (the same target, canary and start), completed on
    every pod with one reload each and one event per phase."""
    kept = {key: analyzing["rollout"].get(key) for key in ("desired", "previous", "canaryPods", "startTime")}
    assert {key: done["rollout"].get(key) for key in kept} == kept
    assert_consistent(stage, "Complete", digest)
    assert {pod: n - reloaded[pod] for pod, n in reloads(stage).items()} == {pod: 1 for pod in stage.urls}
    counts = event_counts(stage, since)
    assert {reason: counts.get(reason) for reason in ("CanaryStarted", "CanaryInSync", "Promoting", "RolledOut")} \
        == {"CanaryStarted": 1, "CanaryInSync": 1, "Promoting": 1, "RolledOut": 1}, counts


# ---- tests -----------------------------------------------------------------------------------


def test_operator_killed_mid_canary_resumes_from_status_and_completes_once(stage, tmp_path):
    before = settled(stage)
    _, digest = stored_pass(stage, tmp_path, {"fuse_qkv": True}, "fp-killed-operator")
    assert digest not in before.values()
    reloaded = reloads(stage)
    since = time.time() - 1

    with DeploymentLoad(list(stage.urls.values()), model=MODEL) as load:
        patch_spec(stage.cluster, stage.namespace, {"forwardPass": "fp-killed-operator"})
        analyzing = wait_until(in_phase(stage, "Analyzing", target="fp-killed-operator"), 90,
                               "the canary on the candidate", interval_s=0.5)
        # The transition's event follows its status write: killed between the two, the operator
        # loses that one event (the status, which the resume reads, is written). Killed after it here,
        # so the counts below can say that nothing is posted twice.
        wait_until(lambda: event_counts(stage, since).get("CanaryInSync"), 15, "the CanaryInSync event",
                   interval_s=0.2)
        stage.kill_operator()
        assert not operator_healthy(stage.operator_port)
        (canary,) = analyzing["rollout"]["canaryPods"]
        assert served(stage) == {pod: digest if pod == canary else before[pod] for pod in stage.urls}
        time.sleep(4)  # two rollout ticks: nobody moves the rollout
        assert rollout(stage) == analyzing["rollout"]

        stage.start_operator()
        done = wait_until(in_phase(stage, "Complete", target="fp-killed-operator"), 120,
                          "the resumed rollout to complete", interval_s=0.5)
    assert load.statuses.count(200) >= 10 and set(load.statuses) == {200}, load.errors[:5]

    assert done["activeForwardPass"]["name"] == "fp-killed-operator" and done["activeForwardPass"]["sha256"] == digest
    # resumed, not started again; each engine loaded the candidate once (the canary kept it through the promotion)
    assert_completed_once(stage, analyzing, done, digest, reloaded, since)

def test_canary_engine_killed_mid_canary_rolls_back_and_the_other_pod_keeps_its_pass(stage, tmp_path):
    before = settled(stage)
    (serving,) = set(before.values())
    active = status(stage.cluster, stage.namespace).get("activeForwardPass")
    _, digest = stored_pass(stage, tmp_path, {"fuse_gate_up": True}, "fp-killed-canary")
    engine_deployment = stage.cluster.apps.read_namespaced_deployment(f"{NAME}-engine", stage.namespace)
    since = time.time() - 1

    patch_spec(stage.cluster, stage.namespace, {"forwardPass": "fp-killed-canary"})
    analyzing = wait_until(in_phase(stage, "Canary", "Analyzing", target="fp-killed-canary"), 60,
                           "the canary chosen", interval_s=0.5)
    (canary,) = analyzing["rollout"]["canaryPods"]
    (other,) = [pod for pod in stage.urls if pod != canary]
    reloaded = reloads(stage)[other]
    with DeploymentLoad([stage.urls[other]], model=MODEL) as load, DeploymentLoad([stage.urls[canary]], model=MODEL):
        analyzing = wait_until(in_phase(stage, "Analyzing", target="fp-killed-canary"), 90,
                               "the canary on the candidate", interval_s=0.5)
        assert served(stage) == {canary: digest, other: serving}
        # Killed 6 s into the 10 s window: enough canary traffic for a verdict, were it judged on it.
        window_start = datetime.fromisoformat(analyzing["rollout"]["phaseSince"].replace("Z", "+00:00"))
        time.sleep(max(0.0, window_start.timestamp() + 6 - time.time()))
        os.killpg(stage.pods[canary].containers[0].process.pid, signal.SIGKILL)
        assert stage.pods[canary].stop()["engine"] == 137  # the pod reported Failed, as a kubelet reports it
        del stage.urls[canary]
        rolled_back = wait_until(in_phase(stage, "RolledBack", "Promoting", "Complete", target="fp-killed-canary"),
                                 30, "the rollout to react to the dead canary", interval_s=0.5)
        assert rolled_back["rollout"]["phase"] == "RolledBack", rolled_back["rollout"]
        assert f"canary {canary} stopped serving fp-killed-canary" in rolled_back["rollout"]["message"]
        assert served(stage) == {other: serving}

        # The ReplicaSet replaces the failed pod; its engine starts (as its node's kubelet starts it) on
        # stock, and is asked for the pass the deployment serves.
        replacement = wait_until(lambda: [p.metadata.name for p in live_pods(stage) if p.metadata.name != other],
                                 60, "the replacement pod Running")[0]
        stage.serve_new_pod(replacement)
        wait_until(lambda: served(stage) == {other: serving, replacement: serving}, 60,
                   "the replacement on the serving pass", interval_s=0.5)
        time.sleep(4)  # two more ticks: nothing moves
    assert load.statuses.count(200) >= 10 and set(load.statuses) == {200}, load.errors[:5]
    assert reloads(stage)[other] == reloaded, "the pod that was not the canary reloaded"

    st = assert_consistent(stage, "RolledBack", serving)
    assert st["rollout"]["desired"]["name"] == "fp-killed-canary" and st.get("activeForwardPass") == active
    dead = [p for p in st["pods"] if p["name"] == canary]
    assert all(not p["ready"] and "sha256" not in p for p in dead), dead
    condition = {c["type"]: c for c in st["conditions"]}["ForwardPassRolledOut"]
    assert (condition["status"], condition["reason"]) == ("False", "RolledBack")
    assert f"canary {canary} stopped serving" in condition["message"]
    counts = event_counts(stage, since)
    assert (counts.get("CanaryStarted"), counts.get("RolledBack"), counts.get("Promoting")) == (1, 1, None), counts
    # The pod template was left alone: the dead pod was replaced by its ReplicaSet, not rolled.
    after = stage.cluster.apps.read_namespaced_deployment(f"{NAME}-engine", stage.namespace)
    assert after.metadata.generation == engine_deployment.metadata.generation


def test_unreadable_artifact_store_refuses_the_rollout_and_the_serving_pass_stays(stage, tmp_path):
    before = settled(stage)
    (serving,) = set(before.values())
    active = status(stage.cluster, stage.namespace).get("activeForwardPass")
    stored, _ = stored_pass(stage, tmp_path, {"fuse_qkv": True, "fuse_gate_up": True}, "fp-unreadable")
    reloaded = reloads(stage)
    since = time.time() - 1
    stored.chmod(0o000)
    stage.store.chmod(0o000)
    try:
        with DeploymentLoad(list(stage.urls.values()), model=MODEL) as load:
            patch_spec(stage.cluster, stage.namespace, {"forwardPass": "fp-unreadable"})
            st = wait_until(in_phase(stage, *SETTLED, target="fp-unreadable"), 60, "the rollout to settle",
                            interval_s=0.5)
            (canary,) = st["rollout"]["canaryPods"]
            time.sleep(4)  # two more ticks, and the canary's engine told to go back
    finally:
        stage.store.chmod(0o755)
        stored.chmod(0o644)
    assert load.statuses.count(200) >= 10 and set(load.statuses) == {200}, load.errors[:5]

    # Refused by the canary's engine as unreadable, which the condition names; rolled back at once,
    # not after the load timeout.
    assert st["rollout"]["phase"] == "RolledBack", st["rollout"]
    assert f"canary {canary} (unreadable) refused fp-unreadable" in st["rollout"]["message"], st["rollout"]
    condition = {c["type"]: c for c in st["conditions"]}["ForwardPassRolledOut"]
    assert (condition["status"], condition["reason"]) == ("False", "RolledBack")
    assert "(unreadable)" in condition["message"], condition
    assert "Permission denied" in stage.pods[canary].output() and str(stage.store) in stage.pods[canary].output()
    # The serving pass stayed on every pod; no pod loaded anything.
    st = assert_consistent(stage, "RolledBack", serving)
    assert st.get("activeForwardPass") == active
    assert reloads(stage) == reloaded
    counts = event_counts(stage, since)
    assert (counts.get("CanaryStarted"), counts.get("RolledBack"), counts.get("CanaryInSync")) == (1, 1, None), counts
    refusal = wait_until(lambda: (status_of_pass(stage, "fp-unreadable").get("refusals") or [None])[0], 15,
                         "fp-unreadable's refusal")
    assert refusal["reason"] == "RolledBack" and "(unreadable)" in refusal["message"]


def test_apiserver_restarted_mid_canary_the_rollout_completes_once(stage, tmp_path):
    """The API server restarts while the canary runs the candidate (phase Analyzing): the operator,
    never restarted, carries on once it is back: the rollout completes on its one canary, each pod
    reloads once, one event per phase, and every request is answered (the engines never talk to
    the API server)."""
    plane = stage.cluster.control_plane
    if plane is None:
        pytest.skip("restarting the API server needs the local control plane (not $SHAPESHIFT_TEST_KUBECONFIG)")
    from harness.chart_operator import apply_admission_policy

    before = settled(stage)
    _, digest = stored_pass(stage, tmp_path, {"gemv_max_rows": 8}, "fp-apiserver-restart")
    assert digest not in before.values()
    reloaded = reloads(stage)
    since = time.time() - 1
    with DeploymentLoad(list(stage.urls.values()), model=MODEL) as load:
        patch_spec(stage.cluster, stage.namespace, {"forwardPass": "fp-apiserver-restart"})
        analyzing = wait_until(in_phase(stage, "Analyzing", target="fp-apiserver-restart"), 90,
                               "the canary on the candidate", interval_s=0.5)
        wait_until(lambda: event_counts(stage, since).get("CanaryInSync"), 15, "the CanaryInSync event",
                   interval_s=0.2)
        outage = plane.restart_apiserver()
        apply_admission_policy(stage.cluster)
        assert stage.operator.poll() is None, stage.log.read_text(errors="replace")[-4000:]
        done = wait_until(in_phase(stage, "Complete", "RolledBack", target="fp-apiserver-restart"), 120,
                          "the rollout to finish after the restart", interval_s=0.5)
    print(f"API server down and back in {outage:.1f} s")
    assert done["rollout"]["phase"] == "Complete", done["rollout"]
    assert load.statuses.count(200) >= 10 and set(load.statuses) == {200}, load.errors[:5]
    assert_completed_once(stage, analyzing, done, digest, reloaded, since)
    assert "will try again in 60" not in stage.log.read_text(errors="replace")


PEERING = "shapeshift"
LIFETIME_S = 10
TAKEOVER_SLACK_S = 10
RESUMED = "Resuming operations after the pause"


def test_leader_killed_mid_canary_the_other_replica_completes_the_rollout_once(stage, tmp_path):
    """Two peered replicas (kopf peering, priorities 200 and 100, keep-alives valid LIFETIME_S) in
    place of the module's standalone operator; the leader is SIGKILLed while the canary runs the
    candidate: the follower resumes within LIFETIME_S + TAKEOVER_SLACK_S and completes the rollout
    from status.rollout, once (same canary and start, one reload per pod, one event per phase)."""
    before = settled(stage)
    stop_operator(stage.operator)
    stage.cluster.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}},
                        stage.namespace)
    env = {"SHAPESHIFT_ROLLOUT_MIN_REQUESTS": "5", "SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS": "0.05"}
    replicas = {}
    try:
        for name, priority in (("replica-a", 200), ("replica-b", 100)):
            port, log = free_port(), tmp_path / f"{name}.log"
            replicas[name] = (start_operator(stage.cluster, stage.namespace, log, port, env={**env, "POD_ID": name},
                                             peering=["--peering", PEERING, "--priority", str(priority),
                                                      "--peering-lifetime", str(LIFETIME_S)]), port, log)
            wait_until(lambda: operator_healthy(port), 60, f"{name}'s health endpoint")
        (leader, _, leader_log), (follower, _, follower_log) = replicas["replica-a"], replicas["replica-b"]
        wait_until(lambda: RESUMED in leader_log.read_text(errors="replace"), 30, "the leader to resume")
        assert RESUMED not in follower_log.read_text(errors="replace")

        _, digest = stored_pass(stage, tmp_path, {"fuse_qkv": True, "gemv_max_rows": 8}, "fp-leader-killed")
        assert digest not in before.values()
        reloaded = reloads(stage)
        since = time.time() - 1
        with DeploymentLoad(list(stage.urls.values()), model=MODEL) as load:
            patch_spec(stage.cluster, stage.namespace, {"forwardPass": "fp-leader-killed"})
            analyzing = wait_until(in_phase(stage, "Analyzing", target="fp-leader-killed"), 90,
                                   "the canary on the candidate", interval_s=0.5)
            wait_until(lambda: event_counts(stage, since).get("CanaryInSync"), 15, "the CanaryInSync event",
                       interval_s=0.2)
            os.killpg(leader.pid, signal.SIGKILL)
            killed = time.monotonic()
            leader.wait(timeout=10)
            wait_until(lambda: RESUMED in follower_log.read_text(errors="replace"),
                       LIFETIME_S + TAKEOVER_SLACK_S + 10, "the follower to resume")
            takeover_s = time.monotonic() - killed
            done = wait_until(in_phase(stage, "Complete", "RolledBack", target="fp-leader-killed"), 120,
                              "the follower to finish the rollout", interval_s=0.5)
        print(f"takeover {takeover_s:.1f} s after the SIGKILL (lifetime {LIFETIME_S} s)")
        assert takeover_s <= LIFETIME_S + TAKEOVER_SLACK_S, takeover_s
        assert done["rollout"]["phase"] == "Complete", done["rollout"]
        assert load.statuses.count(200) >= 10 and set(load.statuses) == {200}, load.errors[:5]
        assert_completed_once(stage, analyzing, done, digest, reloaded, since)
        # the follower acted only after it resumed
        assert "kopf.objects" not in follower_log.read_text(errors="replace").split(RESUMED)[0], "acted while paused"
    finally:
        for process, _, _ in replicas.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        stage.start_operator()  # the module's standalone operator again, for whatever runs after
    for _, _, log in replicas.values():
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text[-4000:]
