"""The handle tests get from the `cluster` fixture: one Kubernetes cluster and its clients.

    kubeconfig (local ControlPlane, or $SHAPESHIFT_TEST_KUBECONFIG for any cluster)
      -> kubernetes.client.ApiClient -> typed APIs (core/apps/batch/...) and a DynamicClient
      -> apply(): server-side apply of YAML/dicts; CRDs are waited for until discovery
         serves them, so the next call can use the new kind at once
      -> kubectl(): the v1.37 kubectl from the cache, pointed at the same kubeconfig
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import kubernetes
import yaml
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from harness import tools

FIELD_MANAGER = "shapeshift-tests"


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy; return that, or raise TimeoutError(what)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def load_manifests(source: str | Path | dict | Iterable[dict]) -> list[dict]:
    """YAML text, a path to a YAML file, one object or a list of objects -> list of objects."""
    if isinstance(source, dict):
        return [source]
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml"))):
        source = Path(source).read_text()
    if isinstance(source, str):
        return [doc for doc in yaml.safe_load_all(source) if doc]
    return list(source)


class Cluster:
    """A reachable cluster: kubeconfig path, API clients and helpers."""

    def __init__(self, kubeconfig: Path | str, *, control_plane=None):
        self.kubeconfig = Path(kubeconfig)
        self.control_plane = control_plane  # harness.controlplane.ControlPlane when started locally
        self.api_client = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.api_client)
        self.apps = kubernetes.client.AppsV1Api(self.api_client)
        self.batch = kubernetes.client.BatchV1Api(self.api_client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(self.api_client)
        self.apiextensions = kubernetes.client.ApiextensionsV1Api(self.api_client)
        self.custom = kubernetes.client.CustomObjectsApi(self.api_client)
        self._dynamic: DynamicClient | None = None

    @property
    def env(self) -> dict[str, str]:
        """Environment for a process that should talk to this cluster (kopf, kubectl, a workload)."""
        return {"KUBECONFIG": str(self.kubeconfig)}

    @property
    def local(self) -> bool:
        return self.control_plane is not None

    @property
    def dynamic(self) -> DynamicClient:
        if self._dynamic is None:
            self._dynamic = DynamicClient(self.api_client)
        return self._dynamic

    def close(self) -> None:
        self.api_client.close()

    # ---- objects

    def apply(self, source: str | Path | dict | Iterable[dict], namespace: str | None = None) -> list:
        """Server-side apply each object (namespaced ones into `namespace` unless they name one).

        CustomResourceDefinitions are waited for until discovery serves their kind.
        """
        applied = []
        for manifest in load_manifests(source):
            resource = self._resource(manifest["apiVersion"], manifest["kind"])
            target_namespace = None
            if resource.namespaced:
                target_namespace = manifest.get("metadata", {}).get("namespace") or namespace
                if not target_namespace:
                    raise ValueError(f"{manifest['kind']} {manifest['metadata']['name']} needs a namespace")
            applied.append(
                resource.server_side_apply(
                    body=manifest,
                    name=manifest["metadata"]["name"],
                    namespace=target_namespace,
                    field_manager=FIELD_MANAGER,
                    force_conflicts=True,
                )
            )
            if manifest["kind"] == "CustomResourceDefinition":
                self.wait_for_crd(manifest["metadata"]["name"])
        return applied

    def delete(self, source: str | Path | dict | Iterable[dict], namespace: str | None = None) -> None:
        """Delete each object; missing ones are fine."""
        for manifest in load_manifests(source):
            resource = self._resource(manifest["apiVersion"], manifest["kind"])
            target_namespace = (manifest.get("metadata", {}).get("namespace") or namespace) if resource.namespaced else None
            try:
                resource.delete(name=manifest["metadata"]["name"], namespace=target_namespace)
            except kubernetes.client.ApiException as error:
                if error.status != 404:
                    raise

    def _resource(self, api_version: str, kind: str):
        try:
            return self.dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            # A kind created since discovery was cached (a CRD applied by other code).
            self.dynamic.resources.invalidate_cache()
            return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def wait_for_crd(self, name: str, timeout_s: float = 30.0) -> None:
        """Wait until the CRD is Established and discovery lists every served version."""

        def established():
            crd = self.apiextensions.read_custom_resource_definition(name)
            conditions = {c.type: c.status for c in (crd.status.conditions or [])} if crd.status else {}
            return crd if conditions.get("Established") == "True" else None

        crd = wait_until(established, timeout_s, f"CRD {name} to be Established")
        group, plural = crd.spec.group, crd.spec.names.plural
        for version in (v.name for v in crd.spec.versions if v.served):

            def discovered(version=version):
                try:
                    listing = self.custom.get_api_resources(group, version)
                except kubernetes.client.ApiException:
                    return False
                return any(resource.name == plural for resource in listing.resources)

            wait_until(discovered, timeout_s, f"{plural}.{group}/{version} in API discovery")
        if self._dynamic is not None:
            self._dynamic.resources.invalidate_cache()

    # ---- namespaces

    def create_namespace(self, name: str, labels: dict[str, str] | None = None, timeout_s: float = 30.0) -> str:
        """Create a namespace and wait for its default ServiceAccount (pods need it to be admitted)."""
        self.core.create_namespace({"metadata": {"name": name, "labels": labels or {}}})

        def has_default_service_account():
            try:
                return self.core.read_namespaced_service_account("default", name)
            except kubernetes.client.ApiException as error:
                if error.status == 404:
                    return None
                raise

        wait_until(has_default_service_account, timeout_s, f"ServiceAccount {name}/default")
        return name

    def delete_namespace(self, name: str) -> None:
        try:
            self.core.delete_namespace(name, propagation_policy="Background")
        except kubernetes.client.ApiException as error:
            if error.status != 404:
                raise

    # ---- tools

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        """Run the cached v1.37 kubectl against this cluster; output is captured as text."""
        return subprocess.run(
            [str(tools.kubectl()), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
        )
