"""InferenceDeployment on the real control plane, with the operator running in-process.

The engine pods are scheduled by the real kube-scheduler onto kwok nodes and
reported Running/Ready by kwok; their readiness reaches status.readyReplicas
through the real Deployment controller. Deletion goes through the real garbage
collector in kube-controller-manager.
"""

from __future__ import annotations

import time

import pytest
from harness.cluster import wait_until

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "shapeshift.dev", "v1alpha1", "inferencedeployments"


def make(cluster, namespace, name="llama", **spec_over):
    spec = {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "nvidia-h200", "count": 2},
            "replicas": 2, "engine": {"maxModelLen": 4096}}
    spec.update(spec_over)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": name}, "spec": spec}
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def get(cluster, namespace, name="llama"):
    return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def status(cluster, namespace, name="llama"):
    return get(cluster, namespace, name).get("status") or {}


def children(kube, namespace, name="llama"):
    return {
        "Deployment": kube.get("Deployment", namespace, f"{name}-engine"),
        "Service": kube.get("Service", namespace, name),
        "ConfigMap": kube.get("ConfigMap", namespace, f"{name}-engine"),
    }


def versions(kube, namespace, name="llama"):
    return {k: (v["metadata"]["uid"], v["metadata"]["resourceVersion"]) for k, v in children(kube, namespace, name).items()}


def test_children_status_and_columns(crds, namespace, operator, kube):
    parent = make(crds, namespace)
    kids = wait_until(lambda: (lambda c: c if all(c.values()) else None)(children(kube, namespace)), 30,
                      "Deployment, Service and ConfigMap")
    for obj in kids.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceDeployment", "llama", parent["metadata"]["uid"], True)

    pod_spec = kids["Deployment"]["spec"]["template"]["spec"]
    (engine,) = pod_spec["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec["tolerations"])
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    annotations = kids["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"
    assert kids["Service"]["spec"]["selector"] == kids["Deployment"]["spec"]["selector"]["matchLabels"]
    assert "max_model_len: 4096" in kids["ConfigMap"]["data"]["engine.yaml"]

    # The real scheduler puts the engine pods on the H200 pool; kwok makes them ready.
    def ready():
        st = status(crds, namespace)
        return st if st.get("readyReplicas") == 2 and st.get("phase") == "Ready" else None

    st = wait_until(ready, 60, "status.readyReplicas == 2 and phase Ready")
    assert st["observedGeneration"] == parent["metadata"]["generation"]
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"
    pods = kube.list("Pod", namespace, {"shapeshift.dev/inference-deployment": "llama"})
    assert len(pods) == 2
    for pod in pods:
        node = crds.core.read_node(pod["spec"]["nodeName"])
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H200"

    out = crds.kubectl("get", "inferencedeployments", "-n", namespace).stdout
    header, row = out.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "PHASE", "READY", "REPLICAS", "ACCELERATOR"], out
    assert row.split()[:5] == ["llama", "Ready", "2", "2", "nvidia-h200"], out
    wide = crds.kubectl("get", "infd", "-n", namespace, "-o", "wide").stdout
    assert "POLICY" in wide.splitlines()[0] and "Manual" in wide


def test_resync_and_restart_change_nothing(crds, namespace, kube, run_operator):
    """Idempotency: timers firing and an operator restart (resume handlers) leave children untouched."""
    make(crds, namespace)
    with run_operator():
        wait_until(lambda: status(crds, namespace).get("phase") == "Ready", 60, "phase Ready")
        before = versions(kube, namespace)
        status_rv = get(crds, namespace)["metadata"]["resourceVersion"]
        time.sleep(7)  # three resync intervals of 2 s
        assert versions(kube, namespace) == before
        assert get(crds, namespace)["metadata"]["resourceVersion"] == status_rv, "a resync rewrote the status"
    with run_operator():  # a restarted operator resumes every object
        time.sleep(5)
        assert versions(kube, namespace) == before


def test_spec_update_patches_in_place_and_deleted_child_is_recreated(crds, namespace, operator, kube):
    make(crds, namespace)
    wait_until(lambda: all(children(kube, namespace).values()), 30, "children")
    before = versions(kube, namespace)
    crds.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama", {"spec": {"replicas": 3}})
    wait_until(lambda: (kube.get("Deployment", namespace, "llama-engine") or {}).get("spec", {}).get("replicas") == 3,
               30, "Deployment scaled to 3")
    after = versions(kube, namespace)
    assert after["Deployment"][0] == before["Deployment"][0], "the Deployment was recreated, not patched"
    assert after["ConfigMap"] == before["ConfigMap"] and after["Service"] == before["Service"]
    wait_until(lambda: status(crds, namespace).get("readyReplicas") == 3, 60, "3 ready replicas in status")

    # Moving to another pool removes the old pool's selector and tolerations (replace, not merge),
    # and the real scheduler then puts the new pods on the CPU pool.
    crds.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama",
                                               {"spec": {"hardware": {"accelerator": "cpu", "count": 1}}})

    def on_cpu_pool():
        dep = kube.get("Deployment", namespace, "llama-engine")
        pod_spec = dep["spec"]["template"]["spec"]
        return dep if "nodeSelector" not in pod_spec and not pod_spec.get("tolerations") else None

    dep = wait_until(on_cpu_pool, 30, "the Deployment to drop the GPU pool's selector")
    assert "nvidia.com/gpu" not in dep["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})

    def cpu_pods_ready():
        if status(crds, namespace).get("phase") != "Ready":
            return None
        pods = kube.list("Pod", namespace, {"shapeshift.dev/inference-deployment": "llama"})
        nodes = [p["spec"].get("nodeName") or "" for p in pods if not p["metadata"].get("deletionTimestamp")]
        return nodes if len(nodes) == 3 and all(n.startswith("cpu-") for n in nodes) else None

    wait_until(cpu_pods_ready, 90, "3 ready engine pods on the CPU pool")
    assert kube.get("Service", namespace, "llama")["metadata"]["resourceVersion"] == before["Service"][1]

    crds.core.delete_namespaced_service("llama", namespace)
    recreated = wait_until(lambda: kube.get("Service", namespace, "llama"), 30, "the Service to be recreated")
    assert recreated["metadata"]["uid"] != before["Service"][0]


def test_deleting_the_parent_removes_children(crds, namespace, operator, kube):
    make(crds, namespace)
    wait_until(lambda: all(children(kube, namespace).values()), 30, "children")
    crds.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama")
    # The garbage collector in kube-controller-manager follows the owner references. It pauses while
    # it resyncs its informers (every 30 s, longer after a CRD comes or goes) and its retries back
    # off, so on a loaded 2-core machine one deletion has taken over 60 s.
    wait_until(lambda: not any(children(kube, namespace).values()), 150, "children garbage-collected")
    wait_until(lambda: not kube.list("Pod", namespace, {"shapeshift.dev/inference-deployment": "llama"}), 60,
               "engine pods gone")


def test_unplaceable_deployment_reports_unschedulable(crds, namespace, operator):
    make(crds, namespace, hardware={"accelerator": "nvidia-h100"}, replicas=1)

    def unschedulable():
        conds = {c["type"]: c for c in status(crds, namespace).get("conditions") or []}
        c = conds.get("Scheduled")
        return c if c and c["status"] == "False" else None

    cond = wait_until(unschedulable, 60, "Scheduled=False on the InferenceDeployment")
    assert cond["reason"] == "Unschedulable" and "node" in cond["message"]
    assert status(crds, namespace)["phase"] == "Degraded"


def test_scale_subresource_drives_the_engine_deployment(crds, namespace, operator, kube):
    """`kubectl scale` (and so an HPA) works on the InferenceDeployment itself."""
    make(crds, namespace, replicas=1)
    wait_until(lambda: status(crds, namespace).get("phase") == "Ready", 60, "phase Ready")
    assert status(crds, namespace)["selector"] == (
        "app.kubernetes.io/component=engine,shapeshift.dev/inference-deployment=llama")
    crds.kubectl("scale", "inferencedeployment/llama", "-n", namespace, "--replicas=2")
    wait_until(lambda: (kube.get("Deployment", namespace, "llama-engine") or {}).get("spec", {}).get("replicas") == 2,
               30, "the engine Deployment to follow the scale")
    wait_until(lambda: status(crds, namespace).get("readyReplicas") == 2, 60, "2 ready replicas")


def test_a_child_the_api_server_refuses_is_reported_and_cleared_once_fixed(crds, namespace, operator, kube):
    """Two bad inputs only the API server's own validation of the children catches (a memory
    value that is not a quantity, a node selector key that is not a label): a Failed phase, ChildrenApplied=False quoting the API server, a Warning; kept
    current, and back to True once the spec is fixed."""
    make(crds, namespace, hardware={"accelerator": "cpu", "memory": "lots"}, replicas=1)

    def refused(fragment):
        def check():
            st = status(crds, namespace)
            c = {c["type"]: c for c in st.get("conditions") or []}.get("ChildrenApplied")
            return c if c and c["status"] == "False" and fragment in c["message"] else None
        return check

    cond = wait_until(refused("quantities must match"), 60,
                      "ChildrenApplied=False for a memory value that is not a quantity")
    assert cond["reason"] == "ChildRefused" and "Deployment" in cond["message"], cond
    assert status(crds, namespace)["phase"] == "Failed"
    crds.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama",
                                               {"spec": {"hardware": {"memory": "1Gi",
                                                                      "nodeSelector": {"not a label!": "x"}}}})
    cond = wait_until(refused("nodeSelector"), 60, "ChildrenApplied=False for a node selector key no node can have")
    assert "not a label!" in cond["message"], cond
    # the event follows the status write: wait for the second refusal's, not only its condition
    events = wait_until(lambda: (lambda es: es if len(es) >= 2 else None)(
        [e for e in crds.core.list_namespaced_event(namespace).items if e.reason == "ChildRefused"]),
        20, "a Warning event per refusal", interval_s=0.5)
    assert {e.type for e in events} == {"Warning"} and len(events) >= 2
    crds.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama",
                                               {"spec": {"hardware": {"nodeSelector": None}}})

    def applied():
        c = {c["type"]: c for c in status(crds, namespace).get("conditions") or []}.get("ChildrenApplied")
        return c if c and c["status"] == "True" else None

    wait_until(applied, 60, "ChildrenApplied=True once the spec is fixed")
    assert kube.get("Deployment", namespace, "llama-engine") is not None
