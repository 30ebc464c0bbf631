"""The repository's hack/ scripts as modules, for tests that call their functions or main()."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

HACK = Path(__file__).resolve().parents[2] / "hack"


def load_hack_script(name: str) -> ModuleType:
    """hack/<name>.py imported under its own name (a fresh module on each call)."""
    spec = importlib.util.spec_from_file_location(name, HACK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
