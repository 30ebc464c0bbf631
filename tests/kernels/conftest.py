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



from kernels_import_shim import ensure_kernels_importable  # noqa: E402

ensure_kernels_importable()
