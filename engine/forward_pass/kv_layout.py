"""The KV layout a forward pass writes, and the cache tag derived from it.

Two passes may share KV blocks across a hot swap only when they write the same bytes for the
same tokens: the same cache dtype, block size and slot order, the same number of KV heads and
head dim per layer, keys rotated the same way (style, base, scaling), and the same scales. A
pass declares the part it chooses; the rest is the model's or the engine's and is filled in
when the pass is loaded into an engine:

    forward.py: CACHE_FORMAT_VERSION = <v>, optional KV_LAYOUT = {field: value, ...}
      --declared_layout / layout_from_source--> declared layout (STOCK_KV_LAYOUT under the
      pass's overrides; "model"/"engine" mark what the model config or the engine decides)
      --resolve(declared, KVContext.of(model config, block size, dtype))--> resolved layout
      --kv_cache_tag--> "kv-format-<v>-<sha256 of the resolved layout, 12 hex>"

The manifest records the declared layout (read from forward.py without importing it; a pass
derived from the stock pass by ``stock = import_stock_module()`` and ``X = stock.X`` gets the
stock pass's), the engine tags its KV blocks with the resolved one. A pass that declares no
``CACHE_FORMAT_VERSION`` has no layout: its tag is its bundle's digest, its cache never shared.

No torch here (bundle.py and the operator use it): dtypes are names ("bfloat16").
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = "model"  # the value comes from the model config
ENGINE = "engine"  # the value comes from the engine's settings

# What the stock pass writes (engine/core/kv_cache.py, attention.write_kv, stock forward.py):
# per layer k[l], v[l] of [num_blocks + 1, block_size, num_kv_heads, head_dim] in the model's
# dtype, slot s at (s // block_size, s % block_size); keys rotated rotate-half style (HF Llama)
# by the model's rope_theta and rope_scaling before they are written; K and V unscaled.
STOCK_KV_LAYOUT: dict[str, Any] = {
    "cache_dtype": MODEL,
    "block_size": ENGINE,
    "slot_order": "block-token",
    "num_layers": MODEL,
    "num_kv_heads": MODEL,
    "head_dim": MODEL,
    "rotary_style": "rotate-half",
    "rotary_base": MODEL,
    "rotary_scaling": MODEL,
    "k_scale": 1.0,
    "v_scale": 1.0,
}
STOCK_MODULE_LOADER = "import_stock_module"  # ``stock = import_stock_module()`` in a derived pass


@dataclass(frozen=True)
class KVContext:
    """What an engine decides of every pass's layout: the model's KV geometry, rotary and dtype."""

    cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_base: float
    rotary_scaling: Any = None

    @classmethod
    def of(cls, model_config: Any, block_size: int, dtype: Any) -> KVContext:
        """``model_config``: the config whose KV heads and layers the cache holds (per rank)."""
        return cls(cache_dtype=str(dtype).removeprefix("torch."), block_size=int(block_size),
                   num_layers=int(model_config.num_hidden_layers), num_kv_heads=int(model_config.num_key_value_heads),
                   head_dim=int(model_config.head_dim), rotary_base=float(model_config.rope_theta),
                   rotary_scaling=_plain(getattr(model_config, "rope_scaling", None)))


def declared_layout(version: Any, overrides: Any = None) -> dict[str, Any] | None:
    """The layout a pass declares: its version over STOCK_KV_LAYOUT and its KV_LAYOUT overrides."""
    if version is None:
        return None
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"KV_LAYOUT must be a mapping of layout field -> value, got {type(overrides).__name__}")
    return {"version": _plain(version), **STOCK_KV_LAYOUT, **{str(k): _plain(v) for k, v in (overrides or {}).items()}}


def layout_of_module(module: Any) -> dict[str, Any] | None:
    """The declared layout of an imported forward.py (its CACHE_FORMAT_VERSION and KV_LAYOUT)."""
    return declared_layout(getattr(module, "CACHE_FORMAT_VERSION", None), getattr(module, "KV_LAYOUT", None))


def resolve(declared: dict[str, Any] | None, ctx: KVContext) -> dict[str, Any] | None:
    """Every "model"/"engine" field of a declared layout replaced by the engine's value."""
    if declared is None:
        return None
    values = {"cache_dtype": ctx.cache_dtype, "block_size": ctx.block_size, "num_layers": ctx.num_layers,
              "num_kv_heads": ctx.num_kv_heads, "head_dim": ctx.head_dim, "rotary_base": ctx.rotary_base,
              "rotary_scaling": ctx.rotary_scaling}
    return {k: (values[k] if v in (MODEL, ENGINE) and k in values else v) for k, v in declared.items()}


def kv_cache_tag(layout: dict[str, Any] | int | str | None, digest: str) -> str:
    """The tag of the KV blocks a pass writes: blocks are served only to passes with the same tag.

    ``layout``: a declared or resolved layout, or a bare CACHE_FORMAT_VERSION (the stock layout
    under that version). None (no version declared): the bundle's digest, a tag of its own.
    """
    if layout is None:
        return f"kv-format-{digest}"
    if not isinstance(layout, dict):
        layout = declared_layout(layout)
    canonical = json.dumps(layout, sort_keys=True, separators=(",", ":"), default=str)
    return f"kv-format-{layout.get('version')}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


def layout_diff(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """``field: old -> new`` for every field that differs (a missing layout: "undeclared")."""
    if old is None or new is None:
        return [] if old is new else [f"layout: {'undeclared' if old is None else 'declared'} -> "
                                      f"{'undeclared' if new is None else 'declared'}"]
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def layout_from_source(bundle_dir: str | Path) -> dict[str, Any] | None:
    """The declared layout of ``bundle_dir``/forward.py, read without importing it.

    Literal ``CACHE_FORMAT_VERSION`` and ``KV_LAYOUT``, or ``stock.CACHE_FORMAT_VERSION`` /
    ``stock.KV_LAYOUT`` where ``stock = import_stock_module()`` (the stock pass's own
    declaration). None when forward.py declares no version this way.
    """
    from shapeshift.engine.forward_pass.bundle import ENTRY_NAME, STOCK_BUNDLE_DIR

    values = _module_constants(Path(bundle_dir) / ENTRY_NAME, STOCK_BUNDLE_DIR / ENTRY_NAME)
    if "CACHE_FORMAT_VERSION" not in values:
        return None
    try:
        return declared_layout(values["CACHE_FORMAT_VERSION"], values.get("KV_LAYOUT"))
    except ValueError:
        return None


def _module_constants(path: Path, stock_entry: Path | None) -> dict[str, Any]:
    """Literal module-level CACHE_FORMAT_VERSION / KV_LAYOUT of ``path``; ``stock.<name>`` values
    are read from ``stock_entry`` (parsed once, when first needed; None: not followed)."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError):
        return {}
    stock_names: set[str] = set()
    stock: dict[str, Any] | None = None
    found: dict[str, Any] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        value = getattr(node, "value", None)
        if value is None or not names:
            continue
        if (isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))
                and getattr(value.func, "id", getattr(value.func, "attr", None)) == STOCK_MODULE_LOADER):
            stock_names.update(names)
            continue
        for name in (n for n in names if n in ("CACHE_FORMAT_VERSION", "KV_LAYOUT")):
            if (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                    and value.value.id in stock_names and stock_entry is not None):
                if stock is None:
                    stock = _module_constants(stock_entry, None)
                if value.attr in stock:
                    found[name] = stock[value.attr]
                continue
            try:
                found[name] = ast.literal_eval(value)
            except ValueError:
                pass
    return found


def _plain(value: Any) -> Any:
    """JSON-able: tuples to lists, mappings with string keys (rope_scaling dicts)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
