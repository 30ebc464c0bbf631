"""The operator's few cluster operations, on the official kubernetes client.

    desired child (builders) --ensure()--> created | updated | unchanged
    StatusUpdate (status.py) --write_status()--> status subresource (only on change)

`ensure` is get-or-create-then-update keyed by the `shapeshift.dev/spec-hash`
annotation: an existing child whose hash matches is left alone (no write, no
new resourceVersion); one whose hash differs is replaced by the desired body
(with the read resourceVersion, so a concurrent change makes it retry), keeping
labels and annotations others added. `create_only=True` (Jobs, whose pod
template is immutable) never updates.

`write_status` reads the object (or takes the copy the caller read in the same
reconciliation), merges the owned fields and conditions, and patches only when
something changed, with the read resourceVersion as a precondition so
concurrent writers (the compile worker, other timers) are not overwritten: a
conflict re-reads and retries. `update_status` does the same
for fields computed from the stored status (a ForwardPass's list of deployments).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import kubernetes
from kubernetes.client import ApiException

from shapeshift.operator.builders import SPEC_HASH
from shapeshift.operator.api import COMPILE_RUN, GROUP, TERMINAL_PHASES, VERSION, Condition, Kind
from shapeshift.operator.status import StatusUpdate, merged_conditions

MERGE_PATCH = "application/merge-patch+json"

# kind -> (API class, method suffix)
_TYPED = {
    "ConfigMap": (kubernetes.client.CoreV1Api, "namespaced_config_map"),
    "Service": (kubernetes.client.CoreV1Api, "namespaced_service"),
    "ServiceAccount": (kubernetes.client.CoreV1Api, "namespaced_service_account"),
    "Pod": (kubernetes.client.CoreV1Api, "namespaced_pod"),
    "Deployment": (kubernetes.client.AppsV1Api, "namespaced_deployment"),
    "Job": (kubernetes.client.BatchV1Api, "namespaced_job"),
    "Role": (kubernetes.client.RbacAuthorizationV1Api, "namespaced_role"),
    "RoleBinding": (kubernetes.client.RbacAuthorizationV1Api, "namespaced_role_binding"),
}


def new_api_client() -> kubernetes.client.ApiClient:
    """In a pod: the ServiceAccount; elsewhere: $KUBECONFIG or ~/.kube/config."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=cfg)
        return kubernetes.client.ApiClient(cfg)
    return kubernetes.config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))


def kube_of(memo: Any) -> "Kube":
    """The operator's one Kube, kept in kopf's memo (shared by every handler and timer).

    Created on first use, not at startup: a missing kubeconfig then shows up as a retried
    handler error instead of a startup activity that blocks the operator."""
    kube = getattr(memo, "kube", None)
    if kube is None:
        kube = memo.kube = Kube(new_api_client())
    return kube


def _json(resp: Any) -> dict[str, Any]:
    return json.loads(resp.data)


class Kube:
    """Thin, dict-based access for the handlers (thread-safe like the ApiClient it wraps)."""

    def __init__(self, api_client: kubernetes.client.ApiClient):
        self.api_client = api_client
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.core = kubernetes.client.CoreV1Api(api_client)

    def _typed(self, kind: str):
        cls, suffix = _TYPED[kind]
        return cls(self.api_client), suffix

    # ---- built-in kinds

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        api, suffix = self._typed(kind)
        try:
            return _json(getattr(api, f"read_{suffix}")(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        api, suffix = self._typed(kind)
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = _json(getattr(api, f"list_{suffix}")(namespace, label_selector=selector, _preload_content=False))
        return data.get("items") or []

    def ensure(self, desired: dict[str, Any], *, create_only: bool = False) -> tuple[str, dict[str, Any]]:
        """Make the child exist as built; returns (action, object as stored)."""
        kind, meta = desired["kind"], desired["metadata"]
        api, suffix = self._typed(kind)
        existing = self.get(kind, meta["namespace"], meta["name"])
        if existing is None:
            try:
                created = _json(getattr(api, f"create_{suffix}")(meta["namespace"], desired, _preload_content=False))
                return "created", created
            except ApiException as error:
                if error.status != 409:
                    raise
                existing = self.get(kind, meta["namespace"], meta["name"])
                if existing is None:
                    raise
        have = ((existing.get("metadata") or {}).get("annotations") or {}).get(SPEC_HASH)
        if have == meta["annotations"][SPEC_HASH] or create_only:
            return "unchanged", existing
        # Replace, not merge: a key the new desired object dropped (a nodeSelector entry after
        # the accelerator changed) must disappear. Other writers' labels and annotations are
        # kept; the API server keeps what it allocated (a Service's clusterIP) on update.
        old_meta = existing["metadata"]
        body = dict(desired)
        body["metadata"] = {
            **{k: v for k, v in old_meta.items() if k not in ("managedFields",)},
            "labels": {**(old_meta.get("labels") or {}), **(meta.get("labels") or {})},
            "annotations": {**(old_meta.get("annotations") or {}), **(meta.get("annotations") or {})},
            "ownerReferences": meta.get("ownerReferences") or [],
        }
        replaced = _json(getattr(api, f"replace_{suffix}")(
            meta["name"], meta["namespace"], body, _preload_content=False))
        return "updated", replaced

    # ---- custom resources

    def get_custom(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, kind.plural, name, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def write_status(self, kind: Kind, namespace: str, name: str, update: StatusUpdate,
                     generation: int | None = None, attempts: int = 5, *,
                     read: dict[str, Any] | None = None) -> tuple[bool, dict[str, Any]]:
        """Merge `update` into the stored status; patch only on change. Returns (changed, status).

        `read`: the object as the caller already read it in this reconciliation; the first
        attempt merges into it instead of reading it again (its resourceVersion is the
        precondition, so if it is stale the patch conflicts and the next attempt re-reads;
        a change the stale copy already shows is left to the next reconciliation)."""
        _check_against_model(kind, update)
        for _ in range(attempts):
            obj = read if read is not None else self.get_custom(kind, namespace, name)
            read = None  # after a conflict, read afresh
            if obj is None:
                return False, {}
            current = obj.get("status") or {}
            patch: dict[str, Any] = {}
            fields = update.fields
            if kind == COMPILE_RUN and current.get("phase") in TERMINAL_PHASES:
                # A finished run's phase is final: a writer whose update was made from a copy read
                # before the worker finished (the start handler, a resync) does not move it back.
                fields = {k: v for k, v in fields.items() if k != "phase"}
            for key, value in fields.items():
                if value is None:
                    if key in current:
                        patch[key] = None
                elif _normal(current.get(key)) != _normal(value):
                    patch[key] = value
            if update.conditions:
                existing = [Condition.model_validate(c) for c in current.get("conditions") or []]
                merged = merged_conditions(existing, update, generation)
                merged_wire = [c.to_wire() for c in merged]
                if merged_wire != [c.to_wire() for c in existing]:
                    patch["conditions"] = merged_wire
            if not patch:
                return False, current
            body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": patch}
            try:
                stored = _json(self.custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, kind.plural, name, body,
                    _content_type=MERGE_PATCH, _preload_content=False))
                return True, stored.get("status") or {}
            except ApiException as error:
                if error.status == 409:
                    continue  # someone else wrote in between: re-read and merge again
                if error.status == 404:
                    return False, {}
                raise
        raise kubernetes.client.ApiException(status=409, reason=f"status of {kind.kind} {namespace}/{name} kept changing")


    def update_status(self, kind: Kind, namespace: str, name: str,
                      compute: Callable[[dict[str, Any]], dict[str, Any] | None],
                      attempts: int = 5) -> bool:
        """Read-compute-patch for status shared by several writers (a ForwardPass that many
        deployments run): ``compute`` gets the stored status and returns the fields to merge
        (None: nothing to change); on a conflict it runs again on the fresh status."""
        for _ in range(attempts):
            obj = self.get_custom(kind, namespace, name)
            if obj is None:
                return False
            fields = compute(obj.get("status") or {})
            if fields is None:
                return False
            _check_against_model(kind, StatusUpdate(fields))
            body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": fields}
            try:
                self.custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, kind.plural, name, body,
                    _content_type=MERGE_PATCH, _preload_content=False)
                return True
            except ApiException as error:
                if error.status == 409:
                    continue
                if error.status == 404:
                    return False
                raise
        raise kubernetes.client.ApiException(status=409, reason=f"status of {kind.kind} {namespace}/{name} kept changing")


def _check_against_model(kind: Kind, update: StatusUpdate) -> None:
    """Every written field must be one the status model (and so the CRD schema) has, with a
    value it accepts: the API server would otherwise prune or reject it silently or late."""
    known = {f.alias or name for name, f in kind.status.model_fields.items()}
    unknown = sorted(set(update.fields) - known)
    if unknown:
        raise ValueError(f"{kind.kind} status has no field(s) {unknown}; known: {sorted(known)}")
    kind.status.model_validate({k: v for k, v in update.fields.items() if v is not None})


def _normal(value: Any) -> Any:
    """Compare JSON the way the API server stores it (ints and floats, key order)."""
    return json.loads(json.dumps(value, sort_keys=True)) if value is not None else None
