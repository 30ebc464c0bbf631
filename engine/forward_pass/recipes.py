"""Named recipes of the stock forward pass, for `shapeshift serve --recipe` and the
decode benchmark.

A recipe is a set of knob values (the table: engine/forward_pass/knobs.py). The names here
are the ones hack/bench_decode.py measures (it calls `torch` "stock"): `torch` is plain
PyTorch, `triton` fuses the q/k/v and gate/up projections and runs attention, norms, rotary
and SwiGLU through kernels/, `fast` adds the weight-streaming GEMV with SwiGLU in its epilogue
(batches up to 16) and, at batch 1 only, the norms in its prologue and one persistent kernel
per layer for o_proj, the MLP and the next qkv projection. `auto` picks `fast` on CUDA for a
dense model, `triton` on CUDA for a mixture-of-experts model (the GEMV epilogue and norm fusions
are dense-only), and `torch` elsewhere (the Triton kernels need a GPU, or the slow interpreter on
a CPU). `fast` is auto on CUDA because it was the fastest named recipe through the serving path on
every replayed profile measured (docs/serving-performance.md, run J). Their measured speeds:
docs/decode-performance.md and bench/results/README.md. Imports nothing heavy.

`serving_default(model, device)` is what `shapeshift serve` runs with no flags: the `auto`
recipe and EngineConfig's own defaults for that model and device (read from an EngineConfig
built there, never copied here). Serve resolves `auto` through it, and the compile loop
measures it as the pass to beat (engine/compile/cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shapeshift.engine.forward_pass.knobs import validate_recipe

_FUSED = {"fuse_qkv": True, "fuse_gate_up": True}
# moe_backend: a mixture-of-experts model's experts through the grouped expert GEMM (a no-op on a
# dense model): through the HTTP server on the H200, moe-medium-shape's output tokens/s 1.50x
# (chat) and 1.42x (burst) the torch experts' (docs/serving-performance.md, run L).
_TRITON = {**_FUSED, "attention_backend": "triton", "norm_backend": "triton", "rotary_backend": "triton",
           "activation_backend": "triton", "moe_backend": "triton"}
# Weight-streaming Triton GEMV for every projection at <= 16 rows, SiLU-and-mul in the
# gate/up GEMV's epilogue (see docs/decode-performance.md).
_GEMV = {**_TRITON, "linear_backend": "triton", "fuse_gate_up_activation": True}

NAMED_RECIPES: dict[str, dict[str, Any]] = {
    "torch": {},
    "fused": _FUSED,
    "triton": _TRITON,
    "gemv": _GEMV,
    # ... and every RMSNorm inside the GEMV that consumes it; at batch 1, each layer's o_proj,
    # MLP and the next layer's qkv in one persistent kernel (kernels/decode_layer_tail.py).
    # The norm-fused GEMVs only at batch 1: from 2 rows the separate norm kernel and the plain
    # GEMVs were 9-25% faster on the H200 (docs/decode-performance.md, twelfth set).
    "fast": {**_GEMV, "fuse_norm_into_linear": True, "fuse_layer_tail": True, "fuse_norm_max_rows": 1},
}
RECIPE_CHOICES = ("auto", *NAMED_RECIPES)
for _name, _knobs in NAMED_RECIPES.items():  # a knob renamed or dropped in the table fails at import
    if _problems := validate_recipe(_knobs):
        raise ValueError(f"named recipe {_name!r}: {'; '.join(_problems)} (see engine/forward_pass/knobs.py)")


PLAIN_RECIPE = "torch"  # the plain-PyTorch pass: the second figure every speedup is quoted against

# EngineConfig fields that shape serving and that the compile search moves (engine.* knobs);
# the serving default records their values.
SERVING_ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "block_size",
                         "decode_steps", "overlap_decode", "enforce_eager")


def is_mixture_of_experts(model: str) -> bool:
    """Whether `model` (a preset name or a folder with config.json) routes tokens to experts.
    A name that is neither reads as dense here; loading it is where it fails, with the choices."""
    import json

    from shapeshift.engine.models.presets import resolve_model  # torch-free

    try:
        found = resolve_model(model)
    except ValueError:
        return False
    if hasattr(found, "hf_config"):
        config = found.folder() / "config.json" if found.folder_name else None
        hf = json.loads(config.read_text()) if config is not None and config.is_file() else found.hf_config
    else:
        config = found / "config.json"
        hf = json.loads(config.read_text()) if config.is_file() else {}
    return bool(hf.get("num_experts") or hf.get("num_local_experts"))


def auto_recipe_name(device: str, model: str | None = None) -> str:
    """The recipe `auto` stands for on `device` for `model`: on CUDA `fast` for a dense model and
    `triton` for a mixture of experts (or when no model is named: it serves both); the plain pass
    elsewhere."""
    if not device.startswith("cuda"):
        return PLAIN_RECIPE
    return "fast" if model is not None and not is_mixture_of_experts(model) else "triton"


@dataclass(frozen=True)
class ServingDefault:
    """What `shapeshift serve --model MODEL --device DEVICE` runs with no other flags."""

    model: str
    device: str
    recipe_name: str
    recipe: dict[str, Any] = field(default_factory=dict)  # knob overrides of the stock recipe.yaml
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (SERVING_ENGINE_FIELDS)

    @property
    def is_plain(self) -> bool:
        return self.recipe_name == PLAIN_RECIPE

    def describe(self) -> str:
        """One line naming it: 'the shipped serving default (recipe torch; max_num_seqs 64, ...)'."""
        engine = ", ".join(f"{k} {v}" for k, v in self.engine.items())
        return f"the shipped serving default (recipe {self.recipe_name}; {engine})"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, "recipe_name": self.recipe_name,
                "recipe": dict(self.recipe), "engine": dict(self.engine)}


def serving_default(model: str, device: str) -> ServingDefault:
    """The recipe and engine settings `shapeshift serve` runs for `model` on `device` when no
    flag says otherwise. The engine settings are read from an EngineConfig built for that model
    and device, so a default changed there (or made device-dependent) is what this reports."""
    from shapeshift.engine.core.config import EngineConfig  # torch-free

    config = EngineConfig(model=model, device=device)
    name = auto_recipe_name(device, model)
    return ServingDefault(model=model, device=device, recipe_name=name, recipe=dict(NAMED_RECIPES[name]),
                          engine={f: getattr(config, f) for f in SERVING_ENGINE_FIELDS})


def resolve_recipe(name: str, device: str, model: str | None = None) -> dict[str, Any]:
    """Knob overrides for recipe `name` on `device` ("cpu", "cuda", "cuda:1", ...) for `model`."""
    if name == "auto":
        name = auto_recipe_name(device, model)
    if name not in NAMED_RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPE_CHOICES)}")
    return dict(NAMED_RECIPES[name])
