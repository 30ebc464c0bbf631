"""The built wheel: every package and every shipped bundle file, and no packaging warnings.

The forward-pass bundles in engine/forward_passes/ are folders without __init__.py
(forward.py, recipe.yaml, manifest.json) that the engine loads by path; setup.py lists
them as packages whose files are all package data. The wheel is built from a copy of
the tracked files (not in the checkout, which others may be building in) without build
isolation, so no index is needed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CODE_FOLDERS = ("engine", "kernels", "operator")
BUNDLES = REPO / "engine" / "forward_passes"


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--", *paths], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [line for line in out.splitlines() if line and (REPO / line).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know the tracked files")
    src = tmp_path_factory.mktemp("src")
    for rel in _tracked("pyproject.toml", "setup.py", "README.md", *CODE_FOLDERS):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "-w", str(out), str(src)],
                          capture_output=True, text=True, cwd="/", timeout=300,
                          env={**os.environ, "PIP_NO_INPUT": "1", "PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("shapeshift-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], proc.stdout + proc.stderr


def test_the_build_prints_no_package_discovery_warning(built):
    _, log = built
    noisy = [line for line in log.splitlines()
             if "absent from the `packages` configuration" in line or "BuildBackendWarning" in line]
    assert not noisy, "\n".join(noisy[:5])


def test_the_wheel_carries_every_tracked_module_and_bundle_file(built):
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"shapeshift/{rel}" for rel in _tracked(*CODE_FOLDERS)
                if rel.endswith(".py") or rel.startswith("engine/forward_passes/")}
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing[:10]}"
    bundle_files = {n for n in names if n.startswith("shapeshift/engine/forward_passes/") and "/__pycache__/" not in n}
    assert bundle_files == {f"shapeshift/{rel}" for rel in _tracked("engine/forward_passes")}


def test_the_installed_stock_bundle_verifies_against_its_manifest(built, tmp_path):
    """An install from the wheel (not the checkout) finds the stock bundle and its files match the manifest."""
    wheel, _ = built
    zipfile.ZipFile(wheel).extractall(tmp_path)
    script = ("import shapeshift.engine.forward_pass.bundle as b; "
              "d = b.stock_bundle_dir(); m = b.verify_bundle(d); "
              "print(d); print(m.name, sorted(m.files))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=120,
                          env={**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, summary = proc.stdout.split("\n")[:2]
    assert Path(where) == tmp_path / "shapeshift" / "engine" / "forward_passes" / "stock"
    assert summary == "stock ['forward.py', 'recipe.yaml']"
