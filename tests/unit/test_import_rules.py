"""The import rules that keep the layout true (docs/architecture.md, "Import rules").

Each rule is checked over the source with `ast` (every import, also those inside
functions), and the torch-free contracts are also imported in a fresh interpreter
where torch and triton cannot be imported. A failure names the file, the line and the
import, and says what to do.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CODE_FOLDERS = {"engine": "shapeshift.engine", "operator": "shapeshift.operator", "kernels": "shapeshift.kernels"}

# The engine's sub-packages in layers: a package may import its own layer and the ones
# below it, never one above. Contracts sit under everything; the compile loop on top.
ENGINE_LAYERS: dict[str, int] = {
    "contracts": 0, "provenance": 0,
    "core": 1, "models": 1, "forward_pass": 1, "forward_passes": 1, "parallel": 1,
    "serving": 2, "rollout": 2, "replay": 2, "verify": 2,
    "compile": 3,
    "cli": 4,
}
TORCH_FREE_PACKAGES = ("shapeshift.engine.contracts", "shapeshift.operator.api")
TORCH_FREE_THIRD_PARTY = {"pydantic", "yaml", "numpy"}
RULES_DOC = "docs/architecture.md (section 'Import rules')"


@dataclass(frozen=True)
class Import:
    module: str  # importing module, dotted
    target: str  # imported module, dotted (absolute)
    path: str
    line: int


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [CODE_FOLDERS[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path) -> list[Import]:
    found: list[Import] = []
    for folder in CODE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(path, root)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                targets: list[str] = []
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                        stem = ".".join(base + ([node.module] if node.module else []))
                    else:
                        stem = node.module or ""
                    # `from pkg import sub` may name a submodule: count both
                    targets = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
                for target in targets:
                    found.append(Import(module, target, str(path.relative_to(root)), node.lineno))
    return found


def _engine_package(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["shapeshift", "engine"] else None


def violations(root: Path) -> list[str]:
    """Every import in the tree at `root` that breaks a rule, as a readable line."""
    out: list[str] = []
    seen: set[tuple[str, int, str]] = set()

    def report(imp: Import, rule: str) -> None:
        key = (imp.path, imp.line, rule)
        if key not in seen:
            seen.add(key)
            out.append(f"{imp.path}:{imp.line}: `{imp.target}`: {rule}")

    for imp in imports_of(root):
        src, dst = imp.module, imp.target
        top_dst = dst.split(".")[0]
        if src.startswith("shapeshift.kernels") and dst.startswith(("shapeshift.engine", "shapeshift.operator")):
            report(imp, "kernels import nothing of the engine or the operator")
        if src.startswith("shapeshift.operator") and dst.startswith("shapeshift.engine") \
                and not dst.startswith("shapeshift.engine.contracts"):
            report(imp, "the operator reaches the engine only through shapeshift.engine.contracts")
        if src.startswith("shapeshift.engine") and dst.startswith("shapeshift.operator") \
                and not dst.startswith("shapeshift.operator.api") \
                and not (src == "shapeshift.engine.cli" and dst.startswith("shapeshift.operator.main")):
            report(imp, "the engine reaches the operator only through shapeshift.operator.api")
        if src.startswith(TORCH_FREE_PACKAGES):
            if dst.startswith("shapeshift") and not dst.startswith(TORCH_FREE_PACKAGES) and dst != "shapeshift":
                report(imp, "a contract module imports only other contract modules")
            elif not dst.startswith("shapeshift") and top_dst not in sys.stdlib_module_names \
                    and top_dst not in TORCH_FREE_THIRD_PARTY and top_dst != "__future__":
                report(imp, f"a contract module is torch-free: stdlib and {sorted(TORCH_FREE_THIRD_PARTY)} only")
        src_pkg, dst_pkg = _engine_package(src), _engine_package(dst)
        if src_pkg in ENGINE_LAYERS and dst_pkg in ENGINE_LAYERS and ENGINE_LAYERS[dst_pkg] > ENGINE_LAYERS[src_pkg]:
            report(imp, f"engine layers: {src_pkg} (layer {ENGINE_LAYERS[src_pkg]}) must not import "
                        f"{dst_pkg} (layer {ENGINE_LAYERS[dst_pkg]})")
    return out


def test_the_tree_keeps_the_import_rules():
    found = violations(REPO)
    assert not found, (f"{len(found)} import(s) break the layout's rules ({RULES_DOC}):\n  " + "\n  ".join(found)
                       + "\nMove the shared piece into a contract module (shapeshift.engine.contracts or "
                         "shapeshift.operator.api), or import from a lower layer.")


def test_every_engine_package_has_a_layer():
    packages = {p.name for p in (REPO / "engine").iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"}
    packages = {p.removesuffix(".py") for p in packages} - {"__init__", "__pycache__"}
    missing = sorted(packages - set(ENGINE_LAYERS))
    assert not missing, f"engine packages without a layer in {__file__}: {missing}; add each to ENGINE_LAYERS"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for folder in CODE_FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("rel, text, rule", [
    ("kernels/gemv.py", "from shapeshift.engine.core.config import ModelConfig\n", "kernels import nothing"),
    ("operator/rollout.py", "def f():\n    from shapeshift.engine.compile.worker import X\n", "only through shapeshift.engine.contracts"),
    ("engine/compile/loop.py", "import shapeshift.operator.builders\n", "only through shapeshift.operator.api"),
    ("engine/contracts/x.py", "import torch\n", "torch-free"),
    ("operator/api/x.py", "from shapeshift.operator import builders\n", "only other contract modules"),
    ("engine/core/runner.py", "from shapeshift.engine.serving.server import serve\n", "engine layers"),
    ("engine/core/runner.py", "from ..compile import loop\n", "engine layers"),
])
def test_a_forbidden_import_is_caught(tmp_path, rel, text, rule):
    root = _tree(tmp_path, {rel: text})
    found = violations(root)
    assert len(found) >= 1 and all(rel in line for line in found), found
    assert any(rule in line for line in found), found


def test_allowed_imports_pass(tmp_path):
    root = _tree(tmp_path, {
        "operator/drift.py": "from shapeshift.engine.contracts.traffic_profile import TrafficProfile\n",
        "engine/compile/worker.py": "from shapeshift.operator.api import CompileRunSpec\n",
        "engine/cli.py": "def f():\n    from shapeshift.operator.main import main\n",
        "engine/serving/server.py": "from shapeshift.engine.core.config import EngineConfig\n",
        "engine/contracts/x.py": "import json\nimport pydantic\nfrom shapeshift.operator.api import GROUP\n",
    })
    assert violations(root) == []


def test_contracts_import_without_torch():
    """Import every contract module where torch and triton cannot be imported at all."""
    modules = sorted({imp.module for imp in imports_of(REPO) if imp.module.startswith(TORCH_FREE_PACKAGES)}
                     | set(TORCH_FREE_PACKAGES))
    script = (
        "import sys, importlib\n"
        "for blocked in ('torch', 'triton'):\n"
        "    sys.modules[blocked] = None\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print('ok', len(sys.modules))\n"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (
        f"a contract module needs torch or triton (they must stay torch-free, {RULES_DOC}):\n{proc.stderr[-3000:]}")
