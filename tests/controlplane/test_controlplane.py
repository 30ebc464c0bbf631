"""The test control plane is real Kubernetes: controllers, scheduler, RBAC, CRD validation.

Each test drives a real kube-apiserver and watches the real controllers react; kwok
only plays the kubelets of the fake node pools (h200, trn2, cpu).
"""

from __future__ import annotations

import sys
import time

import kubernetes
import pytest

from harness.cluster import wait_until
from harness.controlplane import POOL_LABEL

pytestmark = pytest.mark.cluster

TOLERATE_EVERYTHING = [{"operator": "Exists"}]


def pod_manifest(name: str, *, resources: dict | None = None, tolerations=None, node_selector=None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/shapeshift/placeholder:1",
                    "command": ["sleep", "3600"],
                    "resources": resources or {},
                }
            ],
            "tolerations": tolerations or [],
            "nodeSelector": node_selector or {},
        },
    }


def pool_of(cluster, node_name: str) -> str:
    return cluster.core.read_node(node_name).metadata.labels[POOL_LABEL]


def wait_scheduled(cluster, namespace: str, name: str, timeout_s: float = 30.0):
    def bound():
        pod = cluster.core.read_namespaced_pod(name, namespace)
        return pod if pod.spec.node_name else None

    return wait_until(bound, timeout_s, f"pod {namespace}/{name} to be bound to a node")


def test_version_is_v1_37(cluster):
    version = kubernetes.client.VersionApi(cluster.api_client).get_code()
    assert version.git_version.startswith("v1.37."), version
    assert (version.major, version.minor) == ("1", "37")


def test_deployment_becomes_replicaset_and_running_pods_on_the_right_pool(cluster, namespace):
    cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "nodeSelector": {POOL_LABEL: "cpu"},
                        "containers": [{"name": "web", "image": "registry.invalid/web:1", "command": ["web"]}],
                    },
                },
            },
        },
        namespace=namespace,
    )
    deployment = cluster.apps.read_namespaced_deployment("web", namespace)

    # The deployment controller creates a ReplicaSet owned by the Deployment...
    replica_sets = wait_until(
        lambda: cluster.apps.list_namespaced_replica_set(namespace).items, 30, "a ReplicaSet for deployment web"
    )
    assert len(replica_sets) == 1
    (owner,) = replica_sets[0].metadata.owner_references
    assert (owner.kind, owner.uid) == ("Deployment", deployment.metadata.uid)

    # ...whose controller creates Pods, which the scheduler binds and kwok runs.
    def running_pods():
        pods = cluster.core.list_namespaced_pod(namespace, label_selector="app=web").items
        running = [p for p in pods if p.spec.node_name and p.status.phase == "Running" and p.status.pod_ip]
        return running if len(running) == 3 else None

    pods = wait_until(running_pods, 60, "3 Running pods of deployment web")
    for pod in pods:
        assert pod.metadata.owner_references[0].uid == replica_sets[0].metadata.uid
        assert pool_of(cluster, pod.spec.node_name) == "cpu"

    # The deployment controller saw kwok's Ready conditions come back through the API.
    wait_until(
        lambda: (cluster.apps.read_namespaced_deployment("web", namespace).status.ready_replicas or 0) == 3,
        60,
        "deployment web to report 3 ready replicas",
    )


@pytest.mark.parametrize(
    ("resource", "pool"),
    [("nvidia.com/gpu", "h200"), ("aws.amazon.com/neuron", "trn2")],
)
def test_accelerator_request_lands_only_on_its_pool(cluster, namespace, resource, pool):
    # Tolerating every taint leaves the resource request as the only thing that
    # can steer these pods, so the scheduler's resource fit is what is tested.
    names = [f"accel-{index}" for index in range(4)]
    for name in names:
        cluster.core.create_namespaced_pod(
            namespace,
            pod_manifest(name, resources={"limits": {resource: "1"}}, tolerations=TOLERATE_EVERYTHING),
        )
    pools = {pool_of(cluster, wait_scheduled(cluster, namespace, name).spec.node_name) for name in names}
    assert pools == {pool}


def test_pod_without_toleration_never_lands_on_a_tainted_pool(cluster, namespace):
    free = [f"plain-{index}" for index in range(6)]
    for name in free:
        cluster.core.create_namespaced_pod(namespace, pod_manifest(name))
    pools = {pool_of(cluster, wait_scheduled(cluster, namespace, name).spec.node_name) for name in free}
    assert pools == {"cpu"}

    # Forced at the GPU pool without a toleration, a pod stays Pending, and the
    # scheduler says a taint keeps it out.
    cluster.core.create_namespaced_pod(namespace, pod_manifest("pinned", node_selector={POOL_LABEL: "h200"}))

    def unschedulable():
        pod = cluster.core.read_namespaced_pod("pinned", namespace)
        for condition in pod.status.conditions or []:
            if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                return pod, condition
        return None

    pod, condition = wait_until(unschedulable, 30, "the scheduler to report pod pinned Unschedulable")
    assert pod.spec.node_name is None
    assert "untolerated taint" in condition.message, condition.message

    # The same pod with the GPU pool's toleration is scheduled there: the taint was the blocker.
    gpu_toleration = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    cluster.core.create_namespaced_pod(
        namespace, pod_manifest("tolerating", node_selector={POOL_LABEL: "h200"}, tolerations=gpu_toleration)
    )
    assert pool_of(cluster, wait_scheduled(cluster, namespace, "tolerating").spec.node_name) == "h200"


def test_service_account_without_role_is_denied(cluster, namespace):
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    token = cluster.core.create_namespaced_service_account_token(
        "nobody", namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token

    admin = cluster.api_client.configuration
    config = kubernetes.client.Configuration()
    config.host = admin.host
    config.ssl_ca_cert = admin.ssl_ca_cert
    config.api_key = {"authorization": f"Bearer {token}"}
    with kubernetes.client.ApiClient(config) as as_nobody:
        core = kubernetes.client.CoreV1Api(as_nobody)
        with pytest.raises(kubernetes.client.ApiException) as denied:
            core.list_namespaced_pod(namespace)
        assert denied.value.status == 403
        assert f"system:serviceaccount:{namespace}:nobody" in denied.value.body
        assert 'cannot list resource \\"pods\\"' in denied.value.body or 'cannot list resource "pods"' in denied.value.body

        # The same token works once a Role grants the verb: the denial above was RBAC
        # deciding, not a broken token.
        cluster.apply(
            [
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "Role",
                    "metadata": {"name": "pod-reader"},
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": "nobody-reads-pods"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
                    "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}],
                },
            ],
            namespace=namespace,
        )

        def allowed():
            try:
                return core.list_namespaced_pod(namespace) is not None
            except kubernetes.client.ApiException as error:
                if error.status == 403:
                    return False
                raise

        wait_until(allowed, 10, "the RoleBinding to take effect")
        with pytest.raises(kubernetes.client.ApiException) as still_denied:
            core.list_namespaced_secret(namespace)
        assert still_denied.value.status == 403


TEST_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.shapeshift.dev"},
    "spec": {
        "group": "test.shapeshift.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["replicas"],
                                "properties": {
                                    "replicas": {"type": "integer", "minimum": 1},
                                    "accelerator": {"type": "string", "enum": ["h200", "trn2"]},
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_object_violating_crd_schema_is_rejected_by_the_api_server(cluster, namespace):
    cluster.apply(TEST_CRD)
    try:
        widget = {"apiVersion": "test.shapeshift.dev/v1", "kind": "Widget", "metadata": {"name": "ok"}}
        cluster.custom.create_namespaced_custom_object(
            "test.shapeshift.dev", "v1", namespace, "widgets", {**widget, "spec": {"replicas": 2, "accelerator": "h200"}}
        )

        with pytest.raises(kubernetes.client.ApiException) as rejected:
            cluster.custom.create_namespaced_custom_object(
                "test.shapeshift.dev",
                "v1",
                namespace,
                "widgets",
                {**widget, "metadata": {"name": "bad"}, "spec": {"replicas": 0, "accelerator": "tpu"}},
            )
        assert rejected.value.status == 422
        message = rejected.value.body
        assert "spec.replicas: Invalid value: 0: spec.replicas in body should be greater than or equal to 1" in message
        assert 'spec.accelerator: Unsupported value: \\"tpu\\"' in message
        assert cluster.custom.list_namespaced_custom_object("test.shapeshift.dev", "v1", namespace, "widgets")[
            "items"
        ][0]["metadata"]["name"] == "ok"
    finally:
        cluster.delete(TEST_CRD)


def job_manifest(name: str, script: str) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {POOL_LABEL: "cpu"},
                    "containers": [
                        {
                            "name": "work",
                            "image": "registry.invalid/worker:1",
                            "command": [sys.executable, "-c", script],
                            "env": [
                                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                                {
                                    "name": "MODEL",
                                    "valueFrom": {"configMapKeyRef": {"name": "job-settings", "key": "model"}},
                                },
                                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "job-secret", "key": "token"}}},
                                {"name": "GREETING", "value": "model=$(MODEL)"},
                            ],
                        }
                    ],
                }
            },
        },
    }


def job_condition(cluster, namespace: str, name: str):
    job = cluster.batch.read_namespaced_job_status(name, namespace)
    for condition in job.status.conditions or []:
        if condition.type in ("Complete", "Failed") and condition.status == "True":
            return job, condition
    return None


def job_pod_name(cluster, namespace: str, job: str) -> str:
    pods = wait_until(
        lambda: cluster.core.list_namespaced_pod(namespace, label_selector=f"job-name={job}").items,
        30,
        f"the pod of job {job}",
    )
    return pods[0].metadata.name


@pytest.fixture
def job_inputs(cluster, namespace):
    cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": "job-settings"}, "data": {"model": "smollm2"}})
    cluster.core.create_namespaced_secret(namespace, {"metadata": {"name": "job-secret"}, "stringData": {"token": "s3cret"}})


def test_job_completes_when_its_locally_run_pod_exits_zero(cluster, namespace, job_inputs, run_pod_locally):
    script = "import os; print(os.environ['POD_NAME'], os.environ['NODE'], os.environ['GREETING'], os.environ['TOKEN'])"
    cluster.apply(job_manifest("ok", script), namespace=namespace)
    pod_name = job_pod_name(cluster, namespace, "ok")
    wait_until(
        lambda: cluster.core.read_namespaced_pod(pod_name, namespace).status.phase == "Running", 30, "kwok to run the pod"
    )
    # kwok's stages stop at Running (kwokctl's defaults would mark a Job's pod Succeeded
    # right away): watched for a while, nothing finishes the Job before its workload runs.
    time.sleep(1.0)
    assert cluster.core.read_namespaced_pod(pod_name, namespace).status.phase == "Running"
    assert job_condition(cluster, namespace, "ok") is None

    pod = run_pod_locally(namespace, pod_name)
    assert pod.exit_codes == {"work": 0}
    node = cluster.core.read_namespaced_pod(pod_name, namespace).spec.node_name
    assert pod.output().split() == [pod_name, node, "model=smollm2", "s3cret"]

    job, condition = wait_until(lambda: job_condition(cluster, namespace, "ok"), 30, "job ok to finish")
    assert condition.type == "Complete"
    assert job.status.succeeded == 1


def test_job_fails_when_its_locally_run_pod_exits_one(cluster, namespace, job_inputs, run_pod_locally):
    cluster.apply(job_manifest("broken", "import sys; print('boom'); sys.exit(1)"), namespace=namespace)
    pod = run_pod_locally(namespace, job_pod_name(cluster, namespace, "broken"))
    assert pod.exit_codes == {"work": 1}
    assert pod.output().strip() == "boom"

    job, condition = wait_until(lambda: job_condition(cluster, namespace, "broken"), 30, "job broken to finish")
    assert (condition.type, condition.reason) == ("Failed", "BackoffLimitExceeded")
    assert job.status.failed == 1 and not job.status.succeeded
