"""Every cross-field rule of the custom resources' models exists twice: a pydantic validator and a
CEL rule the API server enforces (x-kubernetes-validations in the generated CRDs), or this file says
why the API server has another counterpart. Messages name fields in their wire (camelCase) form."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pydantic
import yaml

from shapeshift.operator.api import KINDS

ROOT = Path(__file__).resolve().parents[2]

# Validators whose API-server counterpart is not a CEL rule on the same model, and why.
COUNTERPART_ELSEWHERE = {
    # duplicate env names: spec.engine.env is a list of type map keyed by name
    # (x-kubernetes-list-map-keys), which the API server refuses as "Duplicate value"
    ("EngineSettings", "duplicate names"): "x-kubernetes-list-type: map",
}


def _models() -> set[type[pydantic.BaseModel]]:
    seen: set[type[pydantic.BaseModel]] = set()

    def types(annotation):
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            yield annotation
        for arg in typing.get_args(annotation):
            yield from types(arg)

    def walk(model):
        if model in seen:
            return
        seen.add(model)
        for f in model.model_fields.values():
            for t in types(f.annotation):
                walk(t)

    for kind in KINDS:
        walk(kind.spec)
        walk(kind.status)
    return seen


def _cel(model) -> list[dict]:
    extra = model.model_config.get("json_schema_extra") or {}
    return list(extra.get("x-kubernetes-validations") or []) if isinstance(extra, dict) else []


def test_every_model_with_a_cross_field_validator_has_cel_rules_in_the_generated_crds():
    rules_in_crds = {v["rule"] for path in (ROOT / "crds").glob("*.yaml")
                     for doc in yaml.safe_load_all(path.read_text()) for v in _all_validations(doc)}
    missing, stale = [], []
    for model in sorted(_models(), key=lambda m: m.__name__):
        decorators = model.__pydantic_decorators__
        if not (decorators.model_validators or decorators.field_validators):
            continue
        rules = _cel(model)
        if not rules:
            missing.append(f"{model.__module__}.{model.__name__}")
        stale.extend(f"{model.__name__}: {r['rule']}" for r in rules if r["rule"] not in rules_in_crds)
    assert not missing, ("models with a pydantic cross-field validator and no CEL rule (add "
                         "x-kubernetes-validations next to the validator, or say in COUNTERPART_ELSEWHERE why the API "
                         f"server enforces it otherwise): {missing}")
    assert not stale, f"CEL rules missing from crds/ (run python hack/gen_crds.py): {stale}"


def _all_validations(node):
    if isinstance(node, dict):
        yield from node.get("x-kubernetes-validations") or []
        for value in node.values():
            yield from _all_validations(value)
    elif isinstance(node, list):
        for value in node:
            yield from _all_validations(value)


def test_the_counterparts_elsewhere_exist():
    crd = (ROOT / "crds" / "shapeshift.dev_inferencedeployments.yaml").read_text()
    assert "x-kubernetes-list-type: map" in crd and "x-kubernetes-list-map-keys" in crd
    from shapeshift.operator.api import EngineSettings
    import inspect

    assert "duplicate names" in inspect.getsource(EngineSettings)
    assert set(COUNTERPART_ELSEWHERE.values()) == {"x-kubernetes-list-type: map"}


def test_messages_use_wire_names():
    """No CEL message names a field by its Python (snake_case) name."""
    snake = {name for model in _models() for name in model.model_fields if "_" in name}
    offenders = []
    for model in _models():
        for rule in _cel(model):
            words = set(re.findall(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", rule["message"]))
            if words & snake:
                offenders.append(f"{model.__name__}: {rule['message']}")
    assert not offenders, offenders
