"""The operator's identity as the Helm chart installs it, for an operator run as a local process.

    charts/shapeshift --`helm template` (namespaced: watch.allNamespaces=false, watch.namespaces=[NS]),
        only templates/serviceaccount.yaml and templates/rbac.yaml--> the ServiceAccount, the
        ClusterRoles <release>-framework and <release>-application, their ClusterRoleBinding and the
        RoleBinding in NS, applied to the cluster
      --TokenRequest API (harness.pod_environment)--> a kubeconfig holding nothing but that
        account's token: every call the operator makes with it is checked against the chart's RBAC

    chart_operator_kubeconfig(cluster, namespace, release, path) -> (kubeconfig, cleanup)
        cleanup() deletes the cluster-scoped objects (the namespaced ones go with the namespace).

The chart's Deployment is not applied: kwok would schedule it and nothing would run it; the
test runs `shapeshift operator` itself (harness.operator_process) with this kubeconfig.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import yaml

from harness import tools
from harness.pod_environment import service_account_token, token_kubeconfig

CHART = Path(__file__).resolve().parents[2] / "charts" / "shapeshift"
TEMPLATES = ("templates/serviceaccount.yaml", "templates/rbac.yaml")


def chart_rbac(namespace: str, release: str) -> list[dict]:
    """The chart's ServiceAccount and RBAC objects for a release watching `namespace` only."""
    args = [str(tools.helm()), "template", release, str(CHART), "--namespace", namespace,
            "--set-json", "watch.allNamespaces=false", "--set-json", f"watch.namespaces={json.dumps([namespace])}"]
    for template in TEMPLATES:
        args += ["--show-only", template]
    rendered = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if rendered.returncode != 0:
        raise RuntimeError(f"helm template failed ({rendered.returncode}): {rendered.stderr[-2000:]}")
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


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
