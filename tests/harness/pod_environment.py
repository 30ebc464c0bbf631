"""What the kubelet would hand a pod's process, for workloads run outside a container.

    ServiceAccount --TokenRequest API (optionally bound to the pod, as the kubelet asks for the
        projected token volume)--> token --token_kubeconfig--> a kubeconfig with nothing but that
        token, for the cluster the admin kubeconfig names: every API call made with it is checked
        against the account's RBAC, nothing more
    pod spec --emulate_volumes--> its configMap and emptyDir volumes as local folders, and the
        container's literal env values that name a path under a mount rewritten to those folders

harness.kubelet emulates downwardAPI volumes and claims itself; the projected token cannot be
handed to a process as a file at its fixed in-cluster path, so it travels as a kubeconfig.
"""

from __future__ import annotations

import base64
from pathlib import Path

import kubernetes
import yaml

from harness.cluster import wait_until
from harness.kubelet import rewrite_paths


def service_account_token(cluster, namespace: str, account: str, *, pod: dict | None = None,
                          expiration_s: int = 3600) -> str:
    """A token of `account` from the TokenRequest API; bound to `pod` (a dict) when given."""
    bound = None
    if pod is not None:
        bound = kubernetes.client.V1BoundObjectReference(api_version="v1", kind="Pod", name=pod["metadata"]["name"],
                                                         uid=pod["metadata"]["uid"])
    request = kubernetes.client.AuthenticationV1TokenRequest(spec=kubernetes.client.V1TokenRequestSpec(
        audiences=[], expiration_seconds=expiration_s, bound_object_ref=bound))
    return cluster.core.create_namespaced_service_account_token(account, namespace, request).status.token


def token_kubeconfig(cluster, namespace: str, account: str, token: str, path: Path) -> Path:
    """Write a kubeconfig that authenticates with `token` only, to the admin kubeconfig's cluster."""
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    server = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [server],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": server["name"], "user": account, "namespace": namespace}}],
        "current-context": account}))
    return path


def pod_token_kubeconfig(cluster, pod: dict, path: Path) -> Path:
    """A kubeconfig holding a token of the pod's ServiceAccount, bound to the pod."""
    account, namespace = pod["spec"]["serviceAccountName"], pod["metadata"]["namespace"]
    return token_kubeconfig(cluster, namespace, account, service_account_token(cluster, namespace, account, pod=pod),
                            path)


def _config_map(cluster, namespace: str, name: str):
    try:
        return cluster.core.read_namespaced_config_map(name, namespace)
    except kubernetes.client.ApiException as error:
        if error.status == 404:
            return None
        raise


def emulate_volumes(cluster, pod: dict, root: Path) -> tuple[dict[str, str], dict[str, Path]]:
    """The pod's configMap and emptyDir volumes as local folders under `root`.

    Returns (env overrides, {mountPath: folder}): every literal env value of the container that
    names a path under a mount is rewritten to the folder standing in for it, the same rule
    harness.kubelet applies to downwardAPI volumes."""
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        folder = root / mount["name"]
        if "configMap" in volume:
            # The kubelet keeps a pod in ContainerCreating until a (non-optional) ConfigMap it
            # mounts exists; the operator may bind the compile pod before the deployment's
            # engine ConfigMap is written, so wait for it the same way.
            cm = wait_until(lambda: _config_map(cluster, pod["metadata"]["namespace"], volume["configMap"]["name"]),
                            30, f"ConfigMap {volume['configMap']['name']} for the pod's volume {mount['name']}")
            folder.mkdir(parents=True)
            for key, value in (cm.data or {}).items():
                (folder / key).write_text(value)
            for key, value in (cm.binary_data or {}).items():
                (folder / key).write_bytes(base64.b64decode(value))
        elif "emptyDir" in volume:
            folder.mkdir(parents=True)
        else:
            continue  # the projected ServiceAccount token: handed over as a kubeconfig instead
        mounts[mount["mountPath"]] = folder
    env = {}
    for variable in container.get("env") or []:
        if "value" in variable and rewrite_paths(variable["value"], mounts) != variable["value"]:
            env[variable["name"]] = rewrite_paths(variable["value"], mounts)
    return env, mounts
