"""The stock forward pass's recipe knobs: one declarative table, torch-free.

Data flow: recipe.yaml / a named recipe / a candidate's recipe knobs --validate_recipe-->
problems (unknown knob, wrong type, value not allowed); the stock forward.py reads each
knob's default and allowed values from STOCK_KNOBS, the compile search space
(engine/compile/search_space.py) builds its recipe dimensions from it, and
engine/forward_pass/recipes.py checks its named recipes against it. Rules between knobs
(a fusion that needs a backend) live where they are enforced: the pass's build() and the
search space's constraints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

BACKENDS = ("torch", "triton")  # every *_backend knob: the plain-torch reference first
GEMV_MAX_ROWS = 16  # kernels.gemv.MAX_M, the most rows the weight-streaming GEMV takes


@dataclass(frozen=True)
class RecipeKnob:
    """One knob: its value type, allowed values, the value the pass uses when the recipe leaves
    it out, and for integers the grid the compile search tries (its first value is the search's
    default when the stock recipe.yaml sets none)."""

    name: str
    type: type  # str (one of choices), bool, int, or dict (a table of configs)
    default: Any  # None: the pass derives it (see meaning)
    meaning: str
    choices: tuple[str, ...] = ()  # str knobs
    minimum: int | None = None  # int knobs
    maximum: int | None = None
    grid: tuple[int, ...] = ()  # int knobs: the values the search tries

    @property
    def kind(self) -> str:
        """One of "choice", "bool", "int" or "table"."""
        return {str: "choice", bool: "bool", int: "int", dict: "table"}[self.type]

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed for this knob, or None."""
        if self.type is str:
            return None if value in self.choices else f"{self.name} must be one of {self.choices}, got {value!r}"
        if self.type is bool:
            return None if isinstance(value, bool) else f"{self.name} must be true or false, got {value!r}"
        if self.type is int:
            if (isinstance(value, bool) or not isinstance(value, int)
                    or (self.minimum is not None and value < self.minimum)
                    or (self.maximum is not None and value > self.maximum)):
                bounds = f"from {self.minimum}" + (f" to {self.maximum}" if self.maximum is not None else "")
                return f"{self.name} must be an integer {bounds}, got {value!r}"
            return None
        return None if isinstance(value, dict) else f"{self.name} must be a mapping, got {value!r}"


def _backend(name: str, meaning: str) -> RecipeKnob:
    return RecipeKnob(name, str, "torch", meaning, choices=BACKENDS)


def _switch(name: str, meaning: str) -> RecipeKnob:
    return RecipeKnob(name, bool, False, meaning)


# In the order the compile search sweeps them (recipe knobs before engine knobs).
STOCK_KNOBS: tuple[RecipeKnob, ...] = (
    _backend("attention_backend", "paged decode attention (kernels.decode_attention)"),
    _backend("norm_backend", "RMSNorm fused with the residual add (kernels.rmsnorm)"),
    _backend("rotary_backend", "rotary fused with the KV-cache write (kernels.rotary)"),
    _backend("activation_backend", "SiLU-and-mul (kernels.activation); needs fuse_gate_up; a no-op on MoE experts"),
    _backend("moe_backend", "MoE experts, prefill and decode, through the grouped expert GEMM (kernels.moe: tokens "
                            "sorted by expert, static shapes, no host sync); a no-op on dense models"),
    _backend("linear_backend", "projections and lm_head on <= gemv_max_rows rows through the weight-streaming GEMV "
                               "(kernels.gemv, float32 logits straight from lm_head); F.linear above"),
    RecipeKnob("gemv_max_rows", int, None, "the most decode rows that take the GEMV and its fusions (unset: the "
               "kernel's limit); a no-op with linear_backend: torch", minimum=1, maximum=GEMV_MAX_ROWS,
               grid=(16, 8, 4, 2, 1)),
    RecipeKnob("gemv_configs", dict, None, 'per-shape GEMV configs {"NxK": KernelConfig dict} overriding the '
               "per-shape defaults; needs linear_backend: triton"),
    RecipeKnob("kernel_configs", dict, None, '{"op": KernelConfig dict} per Triton op its backend knob switched on '
               "(rmsnorm, decode_attention, rotary_kv_write, silu_and_mul), replacing the per-GPU default"),
    _switch("fuse_gate_up_activation", "SiLU-and-mul in the gate/up GEMV's epilogue (needs fuse_gate_up and "
                                       "linear_backend: triton)"),
    _switch("fuse_norm_into_linear", "RMSNorm (+ residual add) as the prologue of the qkv and gate/up GEMVs (needs "
                                     "linear_backend: triton, fuse_qkv, fuse_gate_up)"),
    RecipeKnob("fuse_norm_max_rows", int, None, "the most decode rows that take the norm-fused GEMVs (unset: all the "
               "GEMV takes); below 16 it needs fuse_norm_into_linear", minimum=1, maximum=GEMV_MAX_ROWS,
               grid=(16, 8, 4, 2, 1)),
    _switch("fuse_rotary_into_attention", "decode: rotary, KV-cache write and attention in one kernel (needs "
                                          "attention_backend and rotary_backend: triton; no q/k norm)"),
    _switch("fuse_layer_tail", "batch-1 decode: o_proj, MLP and the next layer's qkv in one persistent kernel "
                               "(kernels.decode_layer_tail; needs fuse_norm_into_linear)"),
    _switch("fuse_attention_into_layer", "batch-1 decode: the layer's attention as the first phase of the layer-tail "
                                         "kernel (needs fuse_layer_tail, fuse_rotary_into_attention, head_dim 2^k >= 16)"),
    _switch("fuse_attention_into_tail", "batch-1 decode: the next layer's attention as the last phase of the layer-tail "
                                        "kernel (the same needs as fuse_attention_into_layer, and not with it)"),
    RecipeKnob("attention_l2_prefetch_mb", int, 0, "decode attention prefetches this many MB of the weights read next "
               "into L2; 0 = off (needs attention_backend: triton; CUDA)", minimum=0, grid=(0, 8, 16, 32)),
    _switch("fuse_qkv", "one [q; k; v] GEMM (derived weight copy)"),
    _switch("fuse_gate_up", "one [gate; up] GEMM (derived weight copy)"),
    RecipeKnob("moe_decode_gather_max_rows", int, None, "MoE decode: gather the chosen experts while tokens*top_k <= "
               "this, else run all experts densely (unset: the model's expert count)", minimum=0,
               grid=(0, 4, 8, 16, 64, 256)),
)
STOCK_KNOB_BY_NAME: dict[str, RecipeKnob] = {k.name: k for k in STOCK_KNOBS}


def stock_knob(name: str) -> RecipeKnob:
    try:
        return STOCK_KNOB_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown recipe knob {name!r}; the stock forward pass knows {sorted(STOCK_KNOB_BY_NAME)}") from None


def knob_value(recipe: Mapping[str, Any], name: str) -> Any:
    """recipe[name], else the knob's default."""
    return recipe.get(name, stock_knob(name).default)


def validate_recipe(recipe: Mapping[str, Any]) -> list[str]:
    """Problems with ``recipe`` against the table (empty = every knob known, every value allowed)."""
    problems = []
    for name, value in recipe.items():
        knob = STOCK_KNOB_BY_NAME.get(name)
        if knob is None:
            problems.append(f"unknown recipe knob {name!r}")
        elif (problem := knob.problem(value)) is not None:
            problems.append(problem)
    return problems
