"""CustomResourceDefinitions from the pydantic models.

    shapeshift.operator.api.KINDS --pydantic JSON Schema--> structural rewrite --> CRD dict --> crds/<plural>.yaml

Pydantic writes JSON Schema 2020-12; the API server wants a *structural*
OpenAPI v3 schema. The rewrite:

- inlines every `$ref` (structural schemas have no references), merging the
  field's description and default over the referenced model's;
- turns `anyOf: [X, {type: null}]` (an Optional) into `X` plus `nullable: true`
  and drops the pointless `default: null`;
- turns a numeric `exclusiveMinimum: n` into `minimum: n, exclusiveMinimum: true`
  (OpenAPI v3.0 form), `const` into a one-value `enum`;
- drops `title` and `additionalProperties: false` (the API server prunes
  unknown fields anyway, and structural schemas forbid the pair);
- checks that every node has a `type`, and that `x-kubernetes-preserve-unknown-fields`
  appears only where a field asked for it (free-form recipes), nowhere by accident.

`build_crd(kind)` adds the envelope: status subresource (and scale for
InferenceDeployment), printer columns, short names, categories, and the
root-level CEL rules. `hack/gen_crds.py` writes the files; a unit test fails
when the committed files differ from `render_all()`.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from shapeshift.operator.api import GROUP, KINDS, VERSION, Kind
from shapeshift.operator.api.forward_pass import DEFAULT_ARTIFACT_ROOTS, artifact_root_rule, parse_artifact_roots

_DROP = ("title",)


class SchemaError(ValueError):
    """The models produced something a structural schema cannot express."""


def structural(model: type) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    defs = raw.pop("$defs", {})
    return _rewrite(raw, defs, path=model.__name__)


def _resolve(ref: str, defs: dict[str, Any]) -> dict[str, Any]:
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix):] not in defs:
        raise SchemaError(f"cannot resolve $ref {ref!r}")
    return copy.deepcopy(defs[ref[len(prefix):]])


def _rewrite(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    node = dict(node)
    if "$ref" in node:
        target = _resolve(node.pop("$ref"), defs)
        # Sibling keys (the field's description, default, extras) win over the model's.
        target.update(node)
        node = target
    if "anyOf" in node:
        options = node.pop("anyOf")
        non_null = [o for o in options if o.get("type") != "null"]
        if len(non_null) != 1 or len(options) != 2:
            raise SchemaError(f"{path}: only Optional[X] unions are supported, got anyOf {options}")
        inner = _rewrite(non_null[0], defs, path)
        # Keep the field's own keys (description, default) over the inner type's.
        inner.update({k: v for k, v in node.items()})
        node = inner
        node["nullable"] = True
        if "default" in node and node["default"] is None:
            del node["default"]
    for key in _DROP:
        node.pop(key, None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]

    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in node:
        node["properties"] = {k: _rewrite(v, defs, f"{path}.{k}") for k, v in node["properties"].items()}
        node.setdefault("type", "object")
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _rewrite(node["additionalProperties"], defs, f"{path}[*]")
    elif node.get("additionalProperties") is True:
        if not preserve:
            raise SchemaError(
                f"{path}: free-form object; mark the field with "
                "json_schema_extra={'x-kubernetes-preserve-unknown-fields': True} if that is intended"
            )
        del node["additionalProperties"]
    if "items" in node:
        node["items"] = _rewrite(node["items"], defs, f"{path}[]")
    if "type" not in node:
        if preserve:
            node["type"] = "object"
        else:
            raise SchemaError(f"{path}: schema node without a type: {node}")
    if isinstance(node["type"], list):
        raise SchemaError(f"{path}: multiple types {node['type']} are not structural")
    if node["type"] == "object" and "properties" not in node and "additionalProperties" not in node and not preserve:
        raise SchemaError(f"{path}: object with neither properties nor additionalProperties")
    return node


def openapi_schema(kind: Kind) -> dict[str, Any]:
    spec = structural(kind.spec)
    status = structural(kind.status)
    spec.setdefault("description", kind.spec.__doc__ or "")
    root: dict[str, Any] = {
        "type": "object",
        "description": kind.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    if kind.root_rules:
        root["x-kubernetes-validations"] = list(kind.root_rules)
    return root


def build_crd(kind: Kind) -> dict[str, Any]:
    subresources: dict[str, Any] = {"status": {}}
    if kind.scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": kind.crd_name,
            "labels": {"app.kubernetes.io/part-of": "shapeshift"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": list(kind.short_names),
                "categories": ["shapeshift"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "additionalPrinterColumns": list(kind.columns),
                    "schema": {"openAPIV3Schema": openapi_schema(kind)},
                }
            ],
        },
    }


HEADER = "# Generated by hack/gen_crds.py from the models in operator/api/. Do not edit.\n"


def _swap_rule(node: Any, old: dict[str, str], new: dict[str, str]) -> None:
    if isinstance(node, dict):
        rules = node.get("x-kubernetes-validations")
        if rules:
            node["x-kubernetes-validations"] = [new if r == old else r for r in rules]
        for value in node.values():
            _swap_rule(value, old, new)
    elif isinstance(node, list):
        for value in node:
            _swap_rule(value, old, new)


def render(kind: Kind, artifact_roots: tuple[str, ...] = ()) -> str:
    crd = build_crd(kind)
    if artifact_roots:  # the API server's twin of SHAPESHIFT_ARTIFACT_ROOTS (operator/api/forward_pass.py)
        roots = tuple(dict.fromkeys(DEFAULT_ARTIFACT_ROOTS + parse_artifact_roots(",".join(artifact_roots))))
        _swap_rule(crd, artifact_root_rule(), artifact_root_rule(roots))
    return HEADER + yaml.safe_dump(crd, sort_keys=False, width=120)


def render_all(artifact_roots: tuple[str, ...] = ()) -> dict[str, str]:
    """File name -> YAML text for every kind. `artifact_roots`: folders, besides the artifact store and a
    compile pod's work folder, where a ForwardPass's local artifact path may lie (a control plane whose
    pods run as local processes); the committed CRDs have none."""
    return {f"{GROUP}_{kind.plural}.yaml": render(kind, artifact_roots) for kind in KINDS}
