"""charts/shapeshift against the real control plane (tests/conftest.py `cluster`):
server-side dry-run of the rendered chart, `helm install`, and the operator's
ServiceAccount token (not an admin) doing what the drift timer does while being
refused what it has no reason to do."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import kubernetes
import pytest
import yaml

from chart_helpers import CHART, helm, render

pytestmark = pytest.mark.cluster

CRD_NAMES = ("compileruns.shapeshift.dev", "forwardpasses.shapeshift.dev", "inferencedeployments.shapeshift.dev")


def namespaced_values(namespace: str) -> dict[str, str]:
    return {"watch.allNamespaces": "false", "watch.namespaces": json.dumps([namespace])}


@pytest.mark.parametrize("mode", ["clusterwide", "namespaced"])
def test_rendered_chart_passes_server_side_dry_run(cluster, namespace, mode):
    values = namespaced_values(namespace) if mode == "namespaced" else None
    objects = render(values, release=f"dry-{mode[:4]}", namespace=namespace, include_crds=True)
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(objects), check=False)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == len(objects), result.stdout
    assert all("(server dry run)" in line for line in lines)


def sa_client(cluster, namespace: str, account: str) -> kubernetes.client.ApiClient:
    """An API client authenticated only by the ServiceAccount's token (TokenRequest API)."""
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=10m").stdout.strip()
    admin = cluster.api_client.configuration
    config = kubernetes.client.Configuration()
    config.host = admin.host
    config.ssl_ca_cert = admin.ssl_ca_cert
    config.verify_ssl = True
    config.api_key = {"authorization": token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return kubernetes.client.ApiClient(config)


def can_i(cluster, account: str, verb: str, resource: str, namespace: str) -> bool:
    result = cluster.kubectl("auth", "can-i", verb, resource, "-n", namespace, f"--as={account}", check=False)
    return result.stdout.strip() == "yes"


def test_helm_install_and_the_service_account_is_enough_but_no_more(cluster, namespace):
    from shapeshift.operator.builders import Parent
    from shapeshift.operator.drift import Compile, DriftPolicy, DriftState, Observation, decide
    from shapeshift.operator.drift_check import (
        CheckResult,
        active_compile_run,
        build_drift_compile_run,
        drift_status_update,
    )
    from shapeshift.operator.kube import Kube
    from shapeshift.operator.api import INFERENCE_DEPLOYMENT, InferenceDeploymentSpec, InferenceDeploymentStatus
    from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile

    release = f"ss-{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-shapeshift"
    args = ["install", release, str(CHART), "--namespace", namespace]
    installed = {c.metadata.name for c in cluster.apiextensions.list_custom_resource_definition().items}
    if set(CRD_NAMES) <= installed:
        # the crds fixture's, generated with the test session's artifact roots: Helm's server-side
        # apply of the chart's copy would conflict with them
        args.append("--skip-crds")
    for key, value in namespaced_values(namespace).items():
        args += ["--set-json", f"{key}={value}"]
    helm(*args, kubeconfig=cluster.kubeconfig)
    try:
        for crd in CRD_NAMES:
            cluster.wait_for_crd(crd)
        assert cluster.apps.read_namespaced_deployment(fullname, namespace).spec.template.spec.service_account_name \
            == fullname
        cluster.core.read_namespaced_service_account(fullname, namespace)
        cluster.rbac.read_cluster_role(f"{fullname}-framework")
        cluster.rbac.read_cluster_role(f"{fullname}-application")
        cluster.rbac.read_namespaced_role_binding(f"{fullname}-application", namespace)

        account = f"system:serviceaccount:{namespace}:{fullname}"
        allowed = [("create", "compileruns.shapeshift.dev"), ("patch", "inferencedeployments.shapeshift.dev/status"),
                   ("watch", "inferencedeployments.shapeshift.dev"), ("create", "deployments.apps"),
                   ("create", "jobs.batch"), ("create", "roles.rbac.authorization.k8s.io"), ("list", "pods"),
                   ("create", "events"), ("update", "deployments.apps"), ("update", "configmaps"),
                   ("patch", "pods"), ("get", "forwardpasses.shapeshift.dev")]
        denied = [("get", "secrets"), ("list", "secrets"), ("delete", "deployments.apps"), ("create", "pods"),
                  ("delete", "inferencedeployments.shapeshift.dev"), ("create", "inferencedeployments.shapeshift.dev"),
                  ("escalate", "roles.rbac.authorization.k8s.io"), ("patch", "nodes")]
        assert [a for a in allowed if not can_i(cluster, account, *a, namespace)] == []
        assert [d for d in denied if can_i(cluster, account, *d, namespace)] == []
        # namespaced install: nothing in a namespace it does not watch
        assert not can_i(cluster, account, "create", "compileruns.shapeshift.dev", "default")

        # The drift timer's calls, made with the ServiceAccount's own token.
        spec = InferenceDeploymentSpec.model_validate({
            "model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
            "compilation": {"policy": "OnDrift", "drift": {}}, "trafficProfile": "chat"})
        body = cluster.custom.create_namespaced_custom_object(
            "shapeshift.dev", "v1alpha1", namespace, "inferencedeployments",
            {"apiVersion": "shapeshift.dev/v1alpha1", "kind": "InferenceDeployment",
             "metadata": {"name": "llama"}, "spec": spec.to_wire()})
        now = datetime.now(timezone.utc).replace(microsecond=0)
        observed = TrafficProfile(name="observed", prompt_length=LengthDistribution(p50=4000, p90=9000, p99=12000),
                                  output_length=LengthDistribution(p50=200, p90=600, p99=900),
                                  prefix_cache_hit_rate=0.1)
        decision, state = decide(observation=Observation(observed, 500), baseline=observed.scaled(0.2),
                                 policy=DriftPolicy(consecutive_checks=1), state=DriftState(),
                                 active_compile_run=None, now=now)
        assert isinstance(decision, Compile)

        with sa_client(cluster, namespace, fullname) as client:
            kube = Kube(client)
            runs = kube.custom.list_namespaced_custom_object("shapeshift.dev", "v1alpha1", namespace,
                                                             "compileruns")["items"]
            assert active_compile_run(runs, "llama") is None
            run = build_drift_compile_run(Parent.from_body(body), spec, decision, now)
            created = kube.custom.create_namespaced_custom_object("shapeshift.dev", "v1alpha1", namespace,
                                                                  "compileruns", run)
            assert created["spec"]["trigger"]["reason"] == "Drift"
            assert created["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
            update = drift_status_update(CheckResult(decision, state, None), InferenceDeploymentStatus(), now=now,
                                         compile_run=run["metadata"]["name"])
            changed, status = kube.write_status(INFERENCE_DEPLOYMENT, namespace, "llama", update)
            assert changed and status["lastCompileRun"] == run["metadata"]["name"]
            assert status["drift"]["exceeded"] is True

            core = kubernetes.client.CoreV1Api(client)
            with pytest.raises(kubernetes.client.ApiException) as denied_read:
                core.list_namespaced_secret(namespace)
            assert denied_read.value.status == 403
            with pytest.raises(kubernetes.client.ApiException) as denied_elsewhere:
                kube.custom.list_namespaced_custom_object("shapeshift.dev", "v1alpha1", "default", "compileruns")
            assert denied_elsewhere.value.status == 403
    finally:
        helm("uninstall", release, "--namespace", namespace, kubeconfig=cluster.kubeconfig, check=False)
