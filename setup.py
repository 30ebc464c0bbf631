"""Package discovery for the one-distribution, one-namespace layout.

pyproject.toml maps each code folder to a subpackage of `shapeshift`
([tool.setuptools] package-dir); this reads that mapping and walks those folders
so every nested package ends up in a built wheel without a hand-kept list.

A folder without `__init__.py` below a package (a forward-pass bundle in
engine/forward_passes/: forward.py, recipe.yaml, manifest.json) is loaded by path,
not imported, but Python can still import it as a namespace package, so setuptools
would warn that it is "absent from the packages configuration". Each such folder is
listed as a package and all of its files are its package data: the wheel carries the
bundle exactly as it is in the checkout.
"""
import tomllib
from pathlib import Path

from setuptools import setup

SKIP_DIRS = {"__pycache__"}


def _folders(root: Path):
    yield root
    for sub in sorted(p for p in root.rglob("*") if p.is_dir()):
        rel = sub.relative_to(root).parts
        if not any(part in SKIP_DIRS or part.startswith(".") for part in rel):
            yield sub


def find_packages() -> tuple[list[str], dict[str, list[str]]]:
    here = Path(__file__).parent
    package_dirs = tomllib.loads((here / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages, data_folders = [], {}
    for name, folder in package_dirs.items():
        root = here / folder
        for sub in _folders(root):
            rel = sub.relative_to(root).parts
            if (sub / "__init__.py").is_file():
                packages.append(".".join([name, *rel]))
            elif any(f.is_file() for f in sub.iterdir()):
                dotted = ".".join([name, *rel])
                packages.append(dotted)
                data_folders[dotted] = ["*"]
    return packages, data_folders


packages, package_data = find_packages()
setup(packages=packages, package_data=package_data)
