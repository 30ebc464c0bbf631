"""Kernel tests run on CUDA when present, otherwise on the CPU through Triton's interpreter.

The root tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA before any test
module imports triton; the `device` fixture below hands each test the matching device.
"""

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
