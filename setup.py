"""Package discovery for the one-distribution, one-namespace layout.

pyproject.toml maps each code folder to a subpackage of `shapeshift`
([tool.setuptools] package-dir); this reads that mapping and walks those folders
so every nested package ends up in a built wheel without a hand-kept list.
"""
import tomllib
from pathlib import Path

from setuptools import setup


def find_packages() -> list[str]:
    here = Path(__file__).parent
    package_dirs = tomllib.loads((here / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = []
    for name, folder in package_dirs.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(here / folder)
            packages.append(".".join([name, *rel.parts]) if rel.parts else name)
    return packages


setup(packages=find_packages(), package_data={"shapeshift.engine": ["forward_passes/**/*"]})
