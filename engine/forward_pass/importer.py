"""Loading forward-pass bundles by path.

Data flow: a bundle folder (``forward.py`` + ``recipe.yaml`` [+ ``manifest.json``]) ->
``load_bundle`` imports ``forward.py`` under a unique module name with importlib (not
as a package import, so two versions of a bundle can live side by side and a reload
never returns a stale module) and reads the recipe -> ``build_forward_pass`` calls
``module.build(model_config, weights, recipe)`` -> a ForwardPass whose
``forward(input_ids, positions, ctx, kv_cache)`` returns float32 logits [B, V].
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import yaml

STOCK_BUNDLE_DIR = Path(__file__).resolve().parent.parent / "forward_passes" / "stock"
_counter = itertools.count()


class ForwardPass(Protocol):
    def forward(self, input_ids: Any, positions: Any, ctx: Any, kv_cache: Any) -> Any: ...


@dataclass
class Bundle:
    path: Path
    module: ModuleType
    recipe: dict[str, Any]
    source_sha256: str  # of forward.py: identifies the code in cache tags and reports

    @property
    def name(self) -> str:
        return getattr(self.module, "FORWARD_PASS_NAME", self.path.name)

    @property
    def cache_tag(self) -> str:
        """Prefix-cache tag: blocks written by one pass are served only to compatible ones.

        The stock pass and any pass declaring the same CACHE_FORMAT_VERSION write
        identical KV contents by contract; the verifier checks that before a swap.
        """
        return f"kv-format-{getattr(self.module, 'CACHE_FORMAT_VERSION', self.source_sha256)}"


def load_bundle(path: str | Path | None = None, recipe_override: dict[str, Any] | None = None) -> Bundle:
    """Import ``path/forward.py`` (default: the stock bundle) and read ``path/recipe.yaml``."""
    folder = Path(path) if path is not None else STOCK_BUNDLE_DIR
    source = folder / "forward.py"
    if not source.is_file():
        raise FileNotFoundError(f"forward-pass bundle {folder} has no forward.py")
    recipe: dict[str, Any] = {}
    recipe_file = folder / "recipe.yaml"
    if recipe_file.is_file():
        loaded = yaml.safe_load(recipe_file.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{recipe_file} must hold a mapping of knob: value, got {type(loaded).__name__}")
        recipe = dict(loaded or {})
    recipe.update(recipe_override or {})
    code = source.read_bytes()
    digest = hashlib.sha256(code).hexdigest()
    module_name = f"shapeshift_forward_pass_{digest[:12]}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(module_name, None)
        raise
    if not callable(getattr(module, "build", None)):
        raise ValueError(f"{source} defines no build(model_config, weights, recipe) function")
    return Bundle(path=folder, module=module, recipe=recipe, source_sha256=digest)


def build_forward_pass(bundle: Bundle, model_config: Any, weights: dict[str, Any]) -> ForwardPass:
    fp = bundle.module.build(model_config, weights, bundle.recipe)
    if not callable(getattr(fp, "forward", None)):
        raise ValueError(f"{bundle.path}/forward.py build() returned {type(fp).__name__} without forward()")
    return fp
