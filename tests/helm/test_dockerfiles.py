"""What can be checked of docker/*.Dockerfile without Docker (no image is built here):
the operator image's premise (the operator never imports torch, so its short
dependency list is enough), that list being declared in pyproject.toml, and the
entrypoint and user agreeing with what the operator and the chart run."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from chart_helpers import CHART, one, render

REPO = CHART.parents[1]
DOCKER = REPO / "docker"


def pip_requirements(dockerfile: Path) -> list[str]:
    text = dockerfile.read_text()
    return re.findall(r'"([A-Za-z0-9_.\-\[\]]+[<>=!~][^"]*)"', text)


def normalized(requirement: str) -> str:
    return re.split(r"[<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_operator_image_dependencies_are_declared_in_pyproject():
    declared = {normalized(r): r for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    wanted = pip_requirements(DOCKER / "operator.Dockerfile")
    assert wanted, "no pip requirements found in operator.Dockerfile"
    for requirement in wanted:
        assert normalized(requirement) in declared, f"{requirement} is not a dependency in pyproject.toml"
        assert requirement == declared[normalized(requirement)], (
            f"operator.Dockerfile pins {requirement}, pyproject.toml {declared[normalized(requirement)]}")


def test_operator_runs_without_torch_or_the_engine_server():
    """Import what `shapeshift operator` imports and check nothing heavy came along."""
    code = (
        "import sys\n"
        "from shapeshift.engine.cli import build_parser\n"
        "from shapeshift.operator import handlers, main\n"
        "main.build_parser().parse_args(['--all-namespaces', '--standalone'])\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'transformers', 'fastapi', 'uvicorn', 'pandas') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    imported = set(filter(None, result.stdout.strip().split(",")))
    # Only modules installed in the operator image may be imported.
    image_modules = {normalized(r).replace("-", "_") for r in pip_requirements(DOCKER / "operator.Dockerfile")}
    assert not imported, f"the operator imports {imported}; the operator image ({sorted(image_modules)}) lacks them"


def test_entrypoints_match_what_the_operator_and_chart_run():
    from shapeshift.operator.builders import build_engine_deployment, Parent
    from shapeshift.operator.api import InferenceDeploymentSpec

    for name in ("operator.Dockerfile", "engine.Dockerfile"):
        text = (DOCKER / name).read_text()
        assert 'ENTRYPOINT ["shapeshift"]' in text, name
        assert re.search(r"^USER 10001:10001$", text, re.M), f"{name} must run as the non-root user 10001"
        assert (DOCKER / f"{name}.dockerignore").exists()

    spec = InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}})
    engine = build_engine_deployment(Parent("InferenceDeployment", "x", "ns", "uid"), spec)
    container = engine["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["shapeshift"]  # the engine image's ENTRYPOINT
    port = container["ports"][0]["containerPort"]
    assert f"EXPOSE {port}" in (DOCKER / "engine.Dockerfile").read_text()

    operator = one(render(), "Deployment")["spec"]["template"]["spec"]
    assert operator["securityContext"]["runAsUser"] == 10001
    assert operator["containers"][0]["args"][0] == "operator"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert f"EXPOSE {values['operator']['healthPort']}" in (DOCKER / "operator.Dockerfile").read_text()
