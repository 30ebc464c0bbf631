"""Make `shapeshift.kernels` importable on a machine without the editable install (e.g. a
bare GPU box that only has a copy of the repository), by mapping the repo's kernels/ folder."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types


def ensure_kernels_importable() -> None:
    try:
        import shapeshift.kernels  # noqa: F401

        return
    except ImportError:
        pass
    kernels_dir = pathlib.Path(__file__).resolve().parents[2] / "kernels"
    if "shapeshift" not in sys.modules:
        package = types.ModuleType("shapeshift")
        package.__path__ = []
        sys.modules["shapeshift"] = package
    spec = importlib.util.spec_from_file_location(
        "shapeshift.kernels", kernels_dir / "__init__.py", submodule_search_locations=[str(kernels_dir)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["shapeshift.kernels"] = module
    spec.loader.exec_module(module)
