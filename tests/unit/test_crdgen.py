"""CRD generation: structural-schema rewrite, envelope, and crds/ staleness."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from shapeshift.operator.crdgen import SchemaError, build_crd, render_all, structural
from shapeshift.operator.api import KINDS, WireModel

REPO = Path(__file__).resolve().parents[2]


def walk(node, path="$"):
    """Yield (path, schema node) for every schema node."""
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}[*]")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_schema_is_structural(kind):
    schema = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert "type" in node, f"{path} has no type"
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs", "const"):
            assert banned not in node, f"{path} still has {banned}"
        assert node.get("additionalProperties") is not False, path
        assert not isinstance(node.get("exclusiveMinimum"), (int, float)) or isinstance(node["exclusiveMinimum"], bool), path
        if node["type"] == "object" and path != "$.metadata":
            assert "properties" in node or "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
    # every field a user writes is documented (list items and map values take their field's text)
    undocumented = [p for p, n in walk(schema["properties"]["spec"], "spec")
                    if not p.endswith(("[]", "[*]")) and not n.get("description")]
    assert not undocumented


def test_preserve_unknown_fields_only_where_intended():
    found = []
    for kind in KINDS:
        schema = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        found += [f"{kind.kind}{p[1:]}" for p, n in walk(schema) if n.get("x-kubernetes-preserve-unknown-fields")]
    assert found == ["ForwardPass.spec.recipe"]


def test_optional_becomes_nullable_and_bounds_are_openapi_v3():
    spec = structural(KINDS[0].spec)
    drift = spec["properties"]["compilation"]["properties"]["drift"]
    assert drift["nullable"] is True and drift["type"] == "object" and "default" not in drift
    rel = drift["properties"]["promptLengthRelativeChange"]
    assert rel["minimum"] == 0 and rel["exclusiveMinimum"] is True and rel["maximum"] == 10
    assert spec["properties"]["hardware"]["properties"]["accelerator"]["enum"] == [
        "nvidia-h200", "nvidia-h100", "trainium2", "cpu"]
    assert set(spec["required"]) == {"model", "hardware"}
    # nested objects whose fields all default carry the full default object, so the API server fills them in
    assert spec["properties"]["engine"]["default"]["kvBlockSize"] == 16
    assert spec["properties"]["compilation"]["default"]["budget"]["wallClockSeconds"] == 3600


def test_cel_rules_sit_on_the_objects_they_relate():
    spec = structural(KINDS[0].spec)
    rules = lambda node: [r["rule"] for r in node.get("x-kubernetes-validations", [])]  # noqa: E731
    assert any("canaryReplicas <= self.replicas" in r for r in rules(spec))
    assert any("OnDrift" in r for r in rules(spec["properties"]["compilation"]))
    assert any("has(self.preset) != has(self.pvc)" in r for r in rules(spec["properties"]["model"]))
    budget = spec["properties"]["compilation"]["properties"]["budget"]
    assert any("wallClockSeconds > 0 || self.trials > 0" in r for r in rules(budget))


def test_envelope_columns_subresources_and_names():
    by_kind = {k.kind: build_crd(k) for k in KINDS}
    for kind, crd in by_kind.items():
        version = crd["spec"]["versions"][0]
        assert version["subresources"]["status"] == {}
        columns = [c["name"] for c in version["additionalPrinterColumns"]]
        assert "Age" in columns and ("Phase" in columns)
        assert "Speedup" in columns
        assert crd["spec"]["scope"] == "Namespaced" and crd["spec"]["group"] == "shapeshift.dev"
    assert by_kind["InferenceDeployment"]["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def test_free_form_fields_must_be_marked():
    class Loose(WireModel):
        anything: dict[str, object]

    with pytest.raises(SchemaError, match="free-form"):
        structural(Loose)

    class Union_(BaseModel):
        x: int | str

    with pytest.raises(SchemaError, match="Optional"):
        structural(Union_)


def test_committed_crds_match_the_generator():
    """Fails when crds/ is stale: run `hack/gen_crds.py` and commit the result."""
    wanted = render_all()
    on_disk = {p.name: p.read_text() for p in (REPO / "crds").glob("shapeshift.dev_*.yaml")}
    assert set(on_disk) == set(wanted), "crds/ holds other files than the generator writes"
    stale = [name for name, text in wanted.items() if on_disk[name] != text]
    assert not stale, f"stale CRDs {stale}: run hack/gen_crds.py"
    for text in wanted.values():
        assert yaml.safe_load(text)["kind"] == "CustomResourceDefinition"


def test_gen_crds_check_mode_detects_staleness(tmp_path):
    script = REPO / "hack" / "gen_crds.py"
    env_cmd = [sys.executable, str(script), "--out", str(tmp_path)]
    assert subprocess.run([*env_cmd, "--check"], capture_output=True).returncode == 1  # empty folder
    subprocess.run(env_cmd, check=True, capture_output=True)
    assert subprocess.run([*env_cmd, "--check"], capture_output=True).returncode == 0
    victim = next(tmp_path.glob("*.yaml"))
    victim.write_text(victim.read_text().replace("Phase", "Fase", 1))
    result = subprocess.run([*env_cmd, "--check"], capture_output=True, text=True)
    assert result.returncode == 1 and victim.name in result.stderr
