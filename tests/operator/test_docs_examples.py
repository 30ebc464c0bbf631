"""The example manifests the README points to are accepted by the real API server
(CRD schema and CEL rules) and by the operator's pydantic models, with the same meaning."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shapeshift.operator import api as models

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
SPEC_MODELS = {"InferenceDeployment": models.InferenceDeploymentSpec, "CompileRun": models.CompileRunSpec}


def _examples() -> list[Path]:
    found = sorted(EXAMPLES.glob("*.yaml"))
    assert found, f"no example manifests in {EXAMPLES}"
    return found


@pytest.mark.parametrize("path", _examples(), ids=lambda p: p.name)
def test_example_validates_against_the_models(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    spec = SPEC_MODELS[doc["kind"]].model_validate(doc["spec"])
    assert spec.model_dump(by_alias=True, exclude_none=True)


@pytest.mark.cluster
@pytest.mark.parametrize("path", _examples(), ids=lambda p: p.name)
def test_example_accepted_by_the_api_server(crds, cluster, namespace, path: Path) -> None:
    out = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path), check=True)
    assert "created (server dry run)" in out.stdout, out.stdout + out.stderr
