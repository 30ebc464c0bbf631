"""The API group Shapeshift serves, and what the operator and crdgen need to know of each kind.

    GROUP/VERSION --> crdgen.py (CRD names), kopf handlers, kube clients of the operator
                      and of the compile pod (engine/compile/champions.py, worker.py)
    Kind          --> one per custom resource, defined beside its models
                      (inference_deployment.py, compile_run.py, forward_pass.py)

The group, the version and each kind's plural are spelled here and in the kinds'
`Kind` objects only; every client takes them from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shapeshift.operator.api.common import StatusModel, WireModel

GROUP = "shapeshift.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class Kind:
    """What crdgen and the handlers need to know about one custom resource."""

    def __init__(self, kind: str, plural: str, short_names: list[str], spec: type[WireModel],
                 status: type[StatusModel], columns: list[dict[str, Any]], root_rules: list[dict[str, str]],
                 description: str, scale: bool = False):
        self.kind, self.plural, self.short_names = kind, plural, short_names
        self.singular = kind.lower()
        self.spec, self.status, self.columns = spec, status, columns
        self.root_rules, self.description, self.scale = root_rules, description, scale

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


def printer_column(name: str, path: str, type: str = "string", priority: int = 0,
                   description: str = "") -> dict[str, Any]:
    """One `additionalPrinterColumns` entry of a kind (what `kubectl get` shows)."""
    c: dict[str, Any] = {"name": name, "type": type, "jsonPath": path}
    if priority:
        c["priority"] = priority
    if description:
        c["description"] = description
    return c


AGE_COLUMN = printer_column("Age", ".metadata.creationTimestamp", "date")
