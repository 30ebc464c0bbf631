"""Kernel tests run on CUDA when present, otherwise on the CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at conftest
import time, before any test module imports shapeshift.kernels.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch missing entirely
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> "torch.device":
    return torch.device("cuda" if _HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def _ensure_kernels_importable() -> None:
    """On a machine without the editable install (e.g. a bare GPU box), map the repo's
    kernels/ folder to shapeshift.kernels so the same tests run unmodified."""
    try:
        import shapeshift.kernels  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.util
    import pathlib
    import sys
    import types

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


_ensure_kernels_importable()
