"""Running the real helm binary on charts/shapeshift and reading what it renders."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from harness import tools

CHART = Path(__file__).resolve().parents[2] / "charts" / "shapeshift"


def helm(*args: str, check: bool = True, kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [str(tools.helm()), *args]
    if kubeconfig is not None:
        cmd.append(f"--kubeconfig={kubeconfig}")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def set_args(values: dict[str, str] | None) -> list[str]:
    out: list[str] = []
    for key, value in (values or {}).items():
        out += ["--set-json" if value.startswith(("[", "{", '"')) or value in ("true", "false") or
                value.lstrip("-").isdigit() else "--set-string", f"{key}={value}"]
    return out


def render(values: dict[str, str] | None = None, *, release: str = "ss", namespace: str = "shapeshift-system",
           include_crds: bool = False) -> list[dict]:
    """`helm template` with `--set` style values; returns the rendered objects."""
    args = ["template", release, str(CHART), "--namespace", namespace, *set_args(values)]
    if include_crds:
        args.append("--include-crds")
    text = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def rule_triples(rules: list[dict]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every combination a rule list grants."""
    return {(group, resource, verb)
            for rule in rules
            for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", [])
            for verb in rule.get("verbs", [])}
