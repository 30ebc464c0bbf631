"""The operator's identity as the Helm chart installs it, for an operator run as a local process.

    charts/shapeshift --`helm template` (namespaced: watch.allNamespaces=false, watch.namespaces=[NS]),
        only templates/serviceaccount.yaml and templates/rbac.yaml--> the ServiceAccount, the
        ClusterRoles <release>-framework and <release>-application, their ClusterRoleBinding and the
        RoleBinding in NS, applied to the cluster
      --TokenRequest API (harness.pod_environment)--> a kubeconfig holding nothing but that
        account's token: every call the operator makes with it is checked against the chart's RBAC

    chart_operator_kubeconfig(cluster, namespace, release, path) -> (kubeconfig, cleanup)
        cleanup() deletes the cluster-scoped objects (the namespaced ones go with the namespace).

    charts/shapeshift --`helm template`, only templates/admission-policy.yaml--> the
        ValidatingAdmissionPolicy that keeps each compile worker to the ForwardPasses of its own
        CompileRun, and its binding --apply_admission_policy--> applied, then waited for until the
        API server enforces it (a dry-run create as a compile worker is refused)

    apply_admission_policy(cluster, release=POLICY_RELEASE) -> the policy's name
        The `crds` fixture (tests/conftest.py) applies it once per session, next to the CRDs.

The chart's Deployment is not applied: kwok would schedule it and nothing would run it; the
test runs `shapeshift operator` itself (harness.operator_process) with this kubeconfig.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import kubernetes
import yaml

from harness import tools
from harness.cluster import wait_until
from harness.pod_environment import service_account_token, token_kubeconfig

CHART = Path(__file__).resolve().parents[2] / "charts" / "shapeshift"
TEMPLATES = ("templates/serviceaccount.yaml", "templates/rbac.yaml")


POLICY_TEMPLATE = "templates/admission-policy.yaml"
POLICY_RELEASE = "shapeshift-tests"  # contains the chart name: objects are named shapeshift-tests-*


def _template(namespace: str, release: str, templates: tuple[str, ...], *args: str) -> list[dict]:
    command = [str(tools.helm()), "template", release, str(CHART), "--namespace", namespace, *args]
    for template in templates:
        command += ["--show-only", template]
    rendered = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if rendered.returncode != 0:
        raise RuntimeError(f"helm template failed ({rendered.returncode}): {rendered.stderr[-2000:]}")
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def chart_rbac(namespace: str, release: str) -> list[dict]:
    """The chart's ServiceAccount and RBAC objects for a release watching `namespace` only."""
    return _template(namespace, release, TEMPLATES, "--set-json", "watch.allNamespaces=false",
                     "--set-json", f"watch.namespaces={json.dumps([namespace])}")


def chart_admission_policy(release: str = POLICY_RELEASE) -> list[dict]:
    """The chart's ValidatingAdmissionPolicy and its binding (both cluster-scoped)."""
    return _template("default", release, (POLICY_TEMPLATE,))


def apply_admission_policy(cluster, release: str = POLICY_RELEASE, timeout_s: float = 30.0) -> str:
    """Apply the chart's admission policy and wait until the API server enforces it.

    The API server loads policies and bindings asynchronously. The probe is a dry-run create of a
    ForwardPass naming another run, by a compile worker's user name impersonated in system:masters
    (so that RBAC lets it through to admission): accepted until the policy is in force.
    """
    objects = chart_admission_policy(release)
    cluster.apply(objects)
    (policy,) = [o["metadata"]["name"] for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    probe = kubernetes.client.ApiClient(cluster.api_client.configuration, header_name="Impersonate-User",
                                        header_value="system:serviceaccount:default:probe-compile")
    probe.set_default_header("Impersonate-Group", "system:masters")
    body = {"apiVersion": "shapeshift.dev/v1alpha1", "kind": "ForwardPass", "metadata": {"name": "policy-probe"},
            "spec": {"model": {"name": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
                     "artifact": {"uri": "/var/lib/shapeshift-artifacts/probe.tar.gz", "sha256": "0" * 64},
                     "verification": {"passed": True, "gates": [{"name": "greedy", "passed": True}]},
                     "compileRun": "default/another-run"}}

    def enforced() -> bool:
        try:
            kubernetes.client.CustomObjectsApi(probe).create_namespaced_custom_object(
                "shapeshift.dev", "v1alpha1", "default", "forwardpasses", body, dry_run="All")
        except kubernetes.client.ApiException as error:
            if error.status == 403 and policy in (error.body or ""):
                return True
            raise
        return False

    with probe:
        wait_until(enforced, timeout_s, f"the API server to enforce ValidatingAdmissionPolicy {policy}", 0.2)
    return policy


def chart_operator_kubeconfig(cluster, namespace: str, release: str, path: Path,
                              expiration_s: int = 3600) -> tuple[Path, Callable[[], None]]:
    """Apply the chart's identity for `release` and return a kubeconfig of its ServiceAccount's token."""
    objects = chart_rbac(namespace, release)
    cluster.apply(objects, namespace=namespace)
    (account,) = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"]
    token = service_account_token(cluster, namespace, account, expiration_s=expiration_s)
    cluster_scoped = [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]

    def cleanup() -> None:
        cluster.delete(cluster_scoped)

    return token_kubeconfig(cluster, namespace, account, token, path), cleanup
