"""The one importer of forward-pass bundles, used by the engine at start, hot reload, the
verifier and the compile loop.

Data flow: bundle folder / archive --bundle.open_bundle (manifest checked, private copy)-->
Bundle --import_bundle (own package ``shapeshift_fp_<digest>_<n>``)--> LoadedBundle
--build_forward_pass: ``module.build(model_config, weights, recipe)``--> a ForwardPass whose
``forward(input_ids, positions, ctx, kv_cache)`` returns float32 logits [B, V].

Every load gets its own synthetic package whose ``__path__`` is the bundle's private folder,
so ``forward.py`` may import its helpers relatively (``from . import fused``), two versions
of a bundle live side by side, and nothing is shared between two candidates, or between a
candidate and the incumbent, through ``sys.modules``. Absolute imports of other packages
(torch, shapeshift.*) work as usual.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from shapeshift.engine.forward_pass.bundle import STOCK_BUNDLE_DIR, Bundle, BundleError, Manifest, open_bundle
from shapeshift.engine.forward_pass.kv_layout import kv_cache_tag, layout_of_module

logger = logging.getLogger("shapeshift.engine.forward_pass")

_load_counter = itertools.count()


class ReloadError(RuntimeError):
    """A candidate was refused; ``stage`` says where (open, import, build, smoke, swap, rollback)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage


class ForwardPass(Protocol):
    def forward(self, input_ids: Any, positions: Any, ctx: Any, kv_cache: Any) -> Any: ...


@dataclass
class LoadedBundle:
    """A bundle whose entry module is imported under its own package name."""

    bundle: Bundle
    package: str  # sys.modules key of the synthetic package
    module: ModuleType  # the entry module (forward.py)

    @property
    def manifest(self) -> Manifest:
        return self.bundle.manifest

    @property
    def recipe(self) -> dict[str, Any]:
        return self.bundle.recipe

    @property
    def name(self) -> str:
        return str(getattr(self.module, "FORWARD_PASS_NAME", None) or self.manifest.name)

    @property
    def kv_layout(self) -> dict[str, Any] | None:
        """The KV layout the module declares (kv_layout.layout_of_module); None: none declared."""
        return layout_of_module(self.module)

    @property
    def cache_format(self) -> str:
        """What the KV contents mean (the declared layout's tag); passes with equal formats may read
        each other's cache. An engine tags blocks with the layout resolved against its model
        (``ActiveForwardPass.of(..., kv=...)``)."""
        return kv_cache_tag(self.kv_layout, self.manifest.digest)

    def unload(self) -> None:
        """Drop the package and its submodules from sys.modules and delete the private copy."""
        _drop_package(self.package)
        self.bundle.close()


def import_bundle(bundle: Bundle) -> LoadedBundle:
    """Import an opened bundle's entry module under a package name used by nothing else."""
    # Capture the clocks and functions a candidate could patch before its top-level code
    # runs: every bundle is imported here, so this is the one place that sees them all.
    from shapeshift.engine.forward_pass import patch_guard  # noqa: F401

    package = f"shapeshift_fp_{bundle.manifest.digest[:12]}_{next(_load_counter)}"
    pkg = ModuleType(package)
    pkg.__path__ = [str(bundle.folder)]  # type: ignore[attr-defined]  # relative imports resolve here
    pkg.__package__ = package
    pkg.__file__ = None
    sys.modules[package] = pkg
    entry = bundle.entry_path
    modname = f"{package}.{entry.stem}"
    try:
        spec = importlib.util.spec_from_file_location(modname, entry)
        if spec is None or spec.loader is None:
            raise ReloadError("import", f"cannot import {entry}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    except ReloadError:
        _drop_package(package)
        raise
    except BaseException as exc:
        _drop_package(package)
        raise ReloadError("import", f"{bundle.source}: importing {entry.name} failed: "
                                    f"{type(exc).__name__}: {exc}") from exc
    if not callable(getattr(module, "build", None)):
        _drop_package(package)
        raise ReloadError("import", f"{bundle.source}: {entry.name} defines no "
                                    "build(model_config, weights, recipe) function")
    return LoadedBundle(bundle=bundle, package=package, module=module)


def _drop_package(package: str) -> None:
    for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
        sys.modules.pop(key, None)


def load_bundle(path: str | Path | None, recipe_override: dict[str, Any] | None = None, *,
                expected_digest: str | None = None, allow_unmanifested: bool = False,
                ignore_manifest: bool = False) -> LoadedBundle:
    """open_bundle + import_bundle, with errors as ReloadError(stage="open"/"import").

    ``path=None`` is the stock pass (``load_stock``). ``recipe_override`` is laid over the
    bundle's recipe.yaml. The manifest flags are open_bundle's.
    """
    if path is None:
        return load_stock(recipe_override)
    try:
        bundle = open_bundle(path, expected_digest, allow_unmanifested=allow_unmanifested,
                             ignore_manifest=ignore_manifest)
    except BundleError as exc:
        raise ReloadError("open", str(exc)) from exc
    bundle.recipe.update(recipe_override or {})
    try:
        return import_bundle(bundle)
    except BaseException:
        bundle.close()
        raise


def load_stock(recipe_override: dict[str, Any] | None = None) -> LoadedBundle:
    """The stock pass as a bundle.

    Its committed manifest is verified when present; a stale one (the stock source was
    edited without running hack/gen_stock_manifest.py) is logged and the files are hashed
    as they are: the stock pass is part of the engine package, as trusted as the engine.
    """
    try:
        return load_bundle(STOCK_BUNDLE_DIR, recipe_override, allow_unmanifested=True)
    except ReloadError as exc:
        if exc.stage != "open":
            raise
        logger.warning("stock forward pass: %s; run python hack/gen_stock_manifest.py", exc)
        return load_bundle(STOCK_BUNDLE_DIR, recipe_override, ignore_manifest=True)


def import_stock_module() -> ModuleType:
    """A private, isolated import of the stock forward.py (for passes derived from it)."""
    return load_stock().module


def build_forward_pass(loaded: LoadedBundle, model_config: Any, weights: dict[str, Any]) -> ForwardPass:
    """``module.build(model_config, weights, recipe)``, checked to return a pass with forward()."""
    fp = loaded.module.build(model_config, weights, dict(loaded.recipe))
    if not callable(getattr(fp, "forward", None)):
        raise ValueError(f"{loaded.bundle.source}/forward.py build() returned {type(fp).__name__} without forward()")
    return fp
