"""The API group and version are spelled once, in shapeshift.operator.api.group; code everywhere
else takes them from there (labels and annotations under the group, "shapeshift.dev/...", are
their own constants and are not checked here)."""

from __future__ import annotations

import ast
from pathlib import Path

from shapeshift.operator.api import API_VERSION, GROUP, KINDS, VERSION

REPO = Path(__file__).resolve().parents[2]
HOME = REPO / "operator" / "api" / "group.py"


def test_group_and_version_literals_live_only_in_the_group_module():
    spelled = {GROUP, VERSION, API_VERSION}
    found = []
    for folder in ("engine", "operator", "kernels", "hack"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == HOME:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Constant) and node.value in spelled:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, ("the API group/version spelled outside operator/api/group.py; import GROUP, VERSION or "
                       "API_VERSION from shapeshift.operator.api instead:\n  " + "\n  ".join(found))


def test_each_kind_has_its_own_plural_and_crd_name():
    assert len({k.plural for k in KINDS}) == len({k.kind for k in KINDS}) == len(KINDS)
    for kind in KINDS:
        assert kind.crd_name == f"{kind.plural}.{GROUP}" and kind.singular == kind.kind.lower()
