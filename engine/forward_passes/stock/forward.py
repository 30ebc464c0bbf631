"""Stock forward pass: Llama-family dense (Llama 3.x, SmolLM2, Qwen2 qkv bias, Qwen3 q/k
norm) and top-k routed MoE (Mixtral, Qwen3-MoE), as code over the flat weights dict.

Data flow per step: token ids [T] -> embedding [T, H] -> per layer (RMSNorm -> q/k/v
projections -> optional q/k RMSNorm -> rotary -> KV written to the paged cache ->
paged attention -> o_proj -> residual -> RMSNorm -> MLP or MoE -> residual) -> rows of
each sequence's last new token [B, H] -> final RMSNorm -> lm_head -> float32 logits [B, V].

The pass never owns weights: ``build`` only keeps references into the engine's dict
(plus small derived tables such as the rotary cos/sin), so a new pass can be built and
swapped without reloading the model. Each op sits behind a small function or method
(``norm``, ``attention``, ``mlp``) whose implementation the recipe picks, so a compiled
variant can replace one op by a kernel without touching the rest. Decode batches use
only static shapes (no host syncs), so the runner can capture them in CUDA graphs.

Recipe knobs (recipe.yaml): the table in shapeshift.engine.forward_pass.knobs (name, type,
allowed values, default, meaning); every one defaults to the plain-torch reference.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from shapeshift.engine.core.attention import AttentionContext, decode_attention_bias, paged_attention, write_kv
from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.core.expert_routing import ExpertRoutingCounts
from shapeshift.engine.forward_pass.knobs import STOCK_KNOB_BY_NAME, knob_value

FORWARD_PASS_NAME = "stock"
CACHE_FORMAT_VERSION = 1  # bump when the KV layout or its contents' meaning changes
MAX_ROPE_POSITIONS = 1 << 17


# ----------------------------------------------------------------------------- ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] -> [..., N]; normalized in float32 and rounded, then scaled in the input
    dtype (HF's rounding points). torch.rms_norm is one fused kernel on CUDA."""
    return weight * torch.rms_norm(x, (x.shape[-1],), eps=eps)


def rope_tables(cfg: ModelConfig, num_positions: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_positions, head_dim // 2] in ``dtype`` (angles computed in float32)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1+: stretch low frequencies by `factor`, keep high ones, blend between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    positions = torch.arange(num_positions, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [P, D/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, D/2] cos/sin -> [P, D] (cos, cos) and (-sin, sin) for ``apply_rotary``."""
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin_signed: [T, D] from ``rotary_tables``; rotate-half (HF Llama).

    rotate_half(x) * sin == roll(x, D/2) * (-sin, sin), so one roll and one fused
    multiply-add replace the slice/negate/concatenate sequence.
    """
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos[:, None, :], rolled, sin_signed[:, None, :])


def dense_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x [T, H] -> [T, H]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] -> routing weights [T, k] float32, expert ids [T, k] int64."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_sparse(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """Loop over experts that got tokens (data-dependent shapes: eager prefill only).

    x: [T, H]; weights, ids: [T, k]; gate_up: [E, 2I, H]; down: [E, H, I] -> [T, H].
    Choices with id E (experts held elsewhere: the parallel pass's shards) are skipped.
    """
    num_experts = gate_up.shape[0]
    out = torch.zeros_like(x)
    flat_ids = ids.flatten()  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # id E sorts last, after every expert's rows
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()[:num_experts]  # one sync per layer
    token_of = order // ids.shape[1]
    weight_of = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start:start + count]
        g, u = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[expert]) * weight_of[start:start + count, None]
        out.index_add_(0, rows, y.to(x.dtype))
        start += count
    return out


def moe_gather(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """Gather each token's chosen experts (static shapes; cheap when T*k is small)."""
    w_gu = gate_up[ids]  # [T, k, 2I, H]
    h = torch.matmul(w_gu, x[:, None, :, None]).squeeze(-1)  # [T, k, 2I]
    g, u = h.chunk(2, dim=-1)
    y = torch.matmul(down[ids], (F.silu(g) * u)[..., None]).squeeze(-1)  # [T, k, H]
    return (y * weights[..., None]).sum(dim=1).to(x.dtype)


def moe_dense(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by a mostly-zero [T, E] matrix (static shapes;
    reads each expert once, so it beats gathering once T*k exceeds E). Choices with id E
    (experts held elsewhere) land in an extra column that is dropped: a scatter with
    duplicate indices could let one of them overwrite a real weight."""
    num_experts = gate_up.shape[0]
    dense_weights = torch.zeros(x.shape[0], num_experts + 1, device=x.device, dtype=torch.float32)
    dense_weights.scatter_(1, ids, weights)
    dense_weights = dense_weights[:, :num_experts]  # [T, E]
    h = torch.matmul(x[None], gate_up.transpose(1, 2))  # [E, T, 2I]
    g, u = h.chunk(2, dim=-1)
    y = torch.matmul(F.silu(g) * u, down.transpose(1, 2))  # [E, T, H]
    return (y.float() * dense_weights.t()[..., None]).sum(dim=0).to(x.dtype)


def _kernel(module: str, name: str, knob: str) -> Callable[..., Any]:
    """A Triton kernel launcher from shapeshift.kernels, imported only when a knob asks."""
    try:
        mod = __import__(f"shapeshift.kernels.{module}", fromlist=[name])
        return getattr(mod, name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"recipe {knob}=triton needs shapeshift.kernels.{module}.{name} (Triton) importable ({exc}); "
            f"set {knob}: torch") from exc


def _choice(recipe: dict[str, Any], knob: str) -> str:
    """recipe[knob] (else its default), refused unless one of the knob's choices."""
    value, choices = knob_value(recipe, knob), STOCK_KNOB_BY_NAME[knob].choices
    if value not in choices:
        raise ValueError(f"recipe {knob} must be one of {choices}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- model
@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    o_proj: torch.Tensor
    # Either separate projections or one fused [q; k; v] matrix (recipe fuse_qkv).
    q_proj: torch.Tensor | None = None
    k_proj: torch.Tensor | None = None
    v_proj: torch.Tensor | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    qkv_proj: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Dense MLP: separate gate/up, or one fused [gate; up] matrix (recipe fuse_gate_up).
    gate_proj: torch.Tensor | None = None
    up_proj: torch.Tensor | None = None
    gate_up_proj: torch.Tensor | None = None
    down_proj: torch.Tensor | None = None
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    moe_row: int = -1  # this layer's row of the expert routing counts


class StockForwardPass:
    name = FORWARD_PASS_NAME
    cache_format_version = CACHE_FORMAT_VERSION

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], recipe: dict[str, Any]) -> None:
        self.cfg = cfg
        self.recipe = dict(recipe)
        known = set(STOCK_KNOB_BY_NAME)
        unknown = set(self.recipe) - known
        if unknown:
            raise ValueError(f"unknown recipe knobs {sorted(unknown)}; the stock forward pass knows {sorted(known)}")
        self.fuse_qkv = bool(knob_value(self.recipe, "fuse_qkv"))
        self.fuse_gate_up = bool(knob_value(self.recipe, "fuse_gate_up"))
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.layers = [self._layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.scale = cfg.head_dim ** -0.5
        self.q_dim = cfg.num_attention_heads * cfg.head_dim
        self.kv_dim = cfg.num_key_value_heads * cfg.head_dim
        num_positions = min(cfg.max_position_embeddings, MAX_ROPE_POSITIONS)
        self.cos, self.sin = rotary_tables(*rope_tables(cfg, num_positions, self.embed.device, self.embed.dtype))
        # q and k share one rotary call when they are adjacent columns of the fused projection.
        self.joint_rotary = self.fuse_qkv and not cfg.qk_norm

        self._decode_attention = None
        if _choice(self.recipe, "attention_backend") == "triton":
            self._decode_attention = _kernel("decode_attention", "decode_attention", "attention_backend")
        self._triton_rmsnorm = None
        if _choice(self.recipe, "norm_backend") == "triton":
            self._triton_rmsnorm = _kernel("rmsnorm", "rmsnorm", "norm_backend")
        self._rotary_kv_write = None
        if _choice(self.recipe, "rotary_backend") == "triton":
            self._rotary_kv_write = _kernel("rotary", "rotary_kv_write", "rotary_backend")
            # Kernel table: float32 [P, D], cos in the first half, sin in the second.
            self.cos_sin = torch.cat(rope_tables(cfg, num_positions, self.embed.device, torch.float32), dim=-1)
        self._silu_and_mul = None
        # MoE experts keep their torch SiLU: like fuse_gate_up, the knob is a no-op there, so one
        # named recipe (serve --recipe triton, the CUDA default) serves dense and MoE models.
        if _choice(self.recipe, "activation_backend") == "triton" and cfg.family != "moe":
            if not self.fuse_gate_up:
                raise ValueError("recipe activation_backend=triton needs fuse_gate_up: true")
            self._silu_and_mul = _kernel("activation", "silu_and_mul", "activation_backend")
        prefetch_bytes = int(knob_value(self.recipe, "attention_l2_prefetch_mb") or 0) << 20
        if prefetch_bytes < 0 or (prefetch_bytes and self._decode_attention is None):
            raise ValueError("recipe attention_l2_prefetch_mb needs attention_backend: triton and a size >= 0 (MB)")
        # Per layer: what its decode attention prefetches (fixed by the weights, so built once).
        self._attention_prefetch = [_prefetch_regions(layer, prefetch_bytes) for layer in self.layers]
        self._decode_attention_rope = None
        if knob_value(self.recipe, "fuse_rotary_into_attention"):
            if self._decode_attention is None or self._rotary_kv_write is None or cfg.qk_norm:
                raise ValueError("recipe fuse_rotary_into_attention needs attention_backend: triton and "
                                 "rotary_backend: triton on a model without q/k norm")
            self._decode_attention_rope = _kernel("decode_attention", "decode_attention_rope",
                                                  "fuse_rotary_into_attention")
        # MoE experts through the grouped GEMM (routing stays in torch: count_routing reads its ids);
        # like activation_backend on MoE experts, a no-op on a dense model.
        self._fused_moe = None
        if _choice(self.recipe, "moe_backend") == "triton" and cfg.family == "moe":
            self._fused_moe = _kernel("moe", "fused_moe_routed", "moe_backend")
        self._apply_kernel_configs(self.recipe.get("kernel_configs") or {})
        self.moe_gather_max_rows = int(self.recipe.get("moe_decode_gather_max_rows", cfg.num_experts))
        # Per-call state of forward() read by attention(); thread-local because the hot-reload
        # smoke test runs the serving pass off the serving thread at the same time.
        self._call = threading.local()
        # Tokens routed to each expert per layer (MoE): device-side counters, read on a scrape.
        self.routing_counts = ExpertRoutingCounts.for_model(cfg, self.embed.device)
        self._gemv = self._gemv_gated = None
        self._gemv_max_rows = 0
        self._gemv_overrides: dict[tuple[int, int], Any] = {}
        self._gemv_config_cache: dict[tuple[int, int, int, bool], Any] = {}
        if _choice(self.recipe, "linear_backend") == "triton":
            self._gemv = _kernel("gemv", "gemv", "linear_backend")
            self._gemv_max_rows = _kernel("gemv", "MAX_M", "linear_backend")
            self._gemv_overrides = _gemv_overrides(self.recipe.get("gemv_configs") or {})
        elif self.recipe.get("gemv_configs"):
            raise ValueError("recipe gemv_configs needs linear_backend: triton")
        gemv_limit = self._gemv_max_rows  # the kernel's MAX_M with the GEMV, else 0
        max_rows = _row_limit(self.recipe, "gemv_max_rows", gemv_limit)
        if max_rows is not None and self._gemv is not None:
            self._gemv_max_rows = max_rows
        if knob_value(self.recipe, "fuse_gate_up_activation"):
            if self._gemv is None or not self.fuse_gate_up or cfg.family == "moe":
                raise ValueError("recipe fuse_gate_up_activation needs linear_backend: triton and fuse_gate_up: true "
                                 "on a dense model")
            self._gemv_gated = _kernel("gemv", "gemv_silu_and_mul", "fuse_gate_up_activation")
        self.fuse_norm = bool(knob_value(self.recipe, "fuse_norm_into_linear"))
        if self.fuse_norm and (self._gemv is None or not self.fuse_qkv or not self.fuse_gate_up
                               or cfg.family == "moe"):
            raise ValueError("recipe fuse_norm_into_linear needs linear_backend: triton, fuse_qkv: true and "
                             "fuse_gate_up: true on a dense model")
        # The most decode rows that take the norm-fused GEMVs (never more than the GEMV takes).
        self._fuse_norm_max_rows = self._gemv_max_rows if self.fuse_norm else 0
        norm_rows = _row_limit(self.recipe, "fuse_norm_max_rows", gemv_limit)
        if norm_rows is not None:
            if norm_rows < gemv_limit and not self.fuse_norm:  # a limit that would bind, on no fusion
                raise ValueError("recipe fuse_norm_max_rows needs fuse_norm_into_linear: true")
            self._fuse_norm_max_rows = min(self._fuse_norm_max_rows, norm_rows)
        self._layer_tail = None
        if knob_value(self.recipe, "fuse_layer_tail"):
            if not self.fuse_norm:
                raise ValueError("recipe fuse_layer_tail needs fuse_norm_into_linear: true (and with it "
                                 "linear_backend: triton, fuse_qkv, fuse_gate_up, a dense model)")
            self._layer_tail = _kernel("decode_layer_tail", "decode_layer_tail", "fuse_layer_tail")
        self._whole_layer = None
        if knob_value(self.recipe, "fuse_attention_into_layer"):
            if self._layer_tail is None or self._decode_attention_rope is None:
                raise ValueError("recipe fuse_attention_into_layer needs fuse_layer_tail: true and "
                                 "fuse_rotary_into_attention: true")
            problem = _kernel("decode_layer_tail", "head_dim_problem", "fuse_attention_into_layer")(cfg.head_dim)
            if problem:
                raise ValueError(f"recipe fuse_attention_into_layer: the model's {problem}")
            self._whole_layer = _kernel("decode_layer_tail", "decode_layer", "fuse_attention_into_layer")
        self._next_attention = None  # NextAttention, with fuse_attention_into_tail
        if knob_value(self.recipe, "fuse_attention_into_tail"):
            if self._layer_tail is None or self._decode_attention_rope is None or self._whole_layer is not None:
                raise ValueError("recipe fuse_attention_into_tail needs fuse_layer_tail: true and "
                                 "fuse_rotary_into_attention: true, and fuse_attention_into_layer off (both put "
                                 "attention into the layer kernel)")
            problem = _kernel("decode_layer_tail", "head_dim_problem", "fuse_attention_into_tail")(cfg.head_dim)
            most = _kernel("decode_layer_tail", "MAX_NEXT_ATTENTION_KV_HEADS", "fuse_attention_into_tail")
            if not problem and cfg.num_key_value_heads > most:
                problem = f"{cfg.num_key_value_heads} kv heads are more than the kernel's {most}"
            if problem:
                raise ValueError(f"recipe fuse_attention_into_tail: the model's {problem}")
            self._next_attention = _kernel("decode_layer_tail", "NextAttention", "fuse_attention_into_tail")

    def _apply_kernel_configs(self, table: dict[str, Any]) -> None:
        """Bind each op's recipe tile config into the launcher picked above (partial(config=...))."""
        if not isinstance(table, dict):
            raise ValueError(f"recipe kernel_configs must map an op name to a kernel config dict, got {table!r}")
        for op, config in table.items():
            if op not in KERNEL_CONFIG_OPS:
                raise ValueError(f"recipe kernel_configs names unknown op {op!r}; known: {sorted(KERNEL_CONFIG_OPS)}")
            attribute, backend_knob = KERNEL_CONFIG_OPS[op]
            launcher = getattr(self, attribute)
            if launcher is None:
                raise ValueError(f"recipe kernel_configs[{op!r}] needs {backend_knob}: triton (the torch path "
                                 "takes no tile config); drop the entry or switch the backend")
            try:
                kernel_config = _kernel_config(config)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"recipe kernel_configs[{op!r}] must be a kernel config dict with a 'variant' and "
                                 f"its tile parameters ({exc})") from exc
            setattr(self, attribute, functools.partial(launcher, config=kernel_config))
            if op == "decode_attention" and self._decode_attention_rope is not None:  # same kernel, same tiles
                self._decode_attention_rope = functools.partial(self._decode_attention_rope, config=kernel_config)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        layer = LayerWeights(input_norm=w[p + "input_layernorm.weight"],
                             post_norm=w[p + "post_attention_layernorm.weight"],
                             o_proj=w[p + "self_attn.o_proj.weight"])
        q, k, v = (w[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        biases = (None, None, None)
        if self.cfg.attention_bias:
            biases = tuple(w[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
        if self.fuse_qkv:
            # Derived copies: one GEMM instead of three (costs the memory of q/k/v once more).
            layer.qkv_proj = torch.cat([q, k, v], dim=0)
            layer.qkv_bias = torch.cat(biases, dim=0) if biases[0] is not None else None
        else:
            layer.q_proj, layer.k_proj, layer.v_proj = q, k, v
            layer.q_bias, layer.k_bias, layer.v_bias = biases
        if self.cfg.qk_norm:
            layer.q_norm, layer.k_norm = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
        if self.cfg.family == "moe":
            layer.router = w[p + "mlp.gate.weight"]
            layer.experts_gate_up = w[p + "mlp.experts.gate_up_proj"]
            layer.experts_down = w[p + "mlp.experts.down_proj"]
            layer.moe_row = i
        else:
            gate, up = w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]
            if self.fuse_gate_up:
                layer.gate_up_proj = torch.cat([gate, up], dim=0)
            else:
                layer.gate_proj, layer.up_proj = gate, up
            layer.down_proj = w[p + "mlp.down_proj.weight"]
        return layer

    # ------------------------------------------------------------------ ops with backends
    def norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); the sum is the next residual."""
        if self._triton_rmsnorm is not None:
            if residual is None:
                return self._triton_rmsnorm(x, weight, self.cfg.rms_norm_eps), x
            return self._triton_rmsnorm(x, weight, self.cfg.rms_norm_eps, residual)
        h = x if residual is None else x + residual
        return rms_norm(h, weight, self.cfg.rms_norm_eps), h

    def head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm (Qwen3 q/k norm): x [T, heads, D]."""
        if self._triton_rmsnorm is not None:
            tokens, heads, dim = x.shape
            return self._triton_rmsnorm(x.reshape(tokens * heads, dim), weight, self.cfg.rms_norm_eps).view(tokens, heads, dim)
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _gemv_config(self, rows: int, weight: torch.Tensor, gated: bool) -> Any:
        """The GEMV config for this (rows, N, K): a recipe override for the shape, else the
        kernel's per-shape default (cached: the lookup stays off the eager decode path)."""
        n, k = weight.shape[0] // (2 if gated else 1), weight.shape[1]
        key = (rows, n, k, gated)
        config = self._gemv_config_cache.get(key)
        if config is None:
            config = self._gemv_overrides.get((n, k))
            if config is None:
                from shapeshift.kernels.checks import dtype_name
                from shapeshift.kernels.gemv import GEMV_SPEC

                problem = {"m": rows, "n": n, "k": k, "dtype": dtype_name(weight.dtype)}
                if gated:  # the gated kernel has tiles of its own where they differ
                    problem["gated"] = True
                config = GEMV_SPEC.default_config(problem, weight.device)
            self._gemv_config_cache[key] = config
        return config

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               float32_out: bool = False) -> torch.Tensor:
        """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N]; float32 when ``float32_out``.

        With linear_backend: triton, T <= gemv_max_rows (at most 16) rows stream the weight
        through the Triton GEMV (cuBLAS reaches ~70% of bandwidth at batch 1); larger T stays
        on cuBLAS.
        """
        if self._gemv is not None and x.shape[0] <= self._gemv_max_rows and x.stride(-1) == 1:
            return self._gemv(x, weight, bias, out_dtype=torch.float32 if float32_out else None,
                              config=self._gemv_config(x.shape[0], weight, False))
        y = F.linear(x, weight, bias)
        return y.float() if float32_out else y

    def norm_linear(self, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, float32_out: bool = False,
                    gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(rms_norm(h + residual)), h + residual) in one GEMV launch (<= 16 rows).

        ``gated``: weight is [gate; up] and the result is silu(gate) * up.
        """
        kwargs: dict[str, Any] = dict(norm_weight=norm_weight, eps=self.cfg.rms_norm_eps, residual=residual,
                                      config=self._gemv_config(h.shape[0], weight, gated))
        if gated:
            y = self._gemv_gated(h, weight, **kwargs)
        else:
            y = self._gemv(h, weight, bias, out_dtype=torch.float32 if float32_out else None, **kwargs)
        return y if residual is not None else (y, h)

    # ------------------------------------------------------------------ blocks
    def attention(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor | None, positions: torch.Tensor,
                  cos: torch.Tensor | None, sin: torch.Tensor | None, ctx: AttentionContext, kv_cache: Any,
                  attn_bias: torch.Tensor | None = None, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """Self-attention of normed hidden states x [T, H] (or of a precomputed fused ``qkv``).

        ``attn_bias`` defaults to the decode mask the current forward built once for all layers
        (so subclasses overriding this method with the 8-argument signature keep working).
        """
        o = self.attend(layer_idx, layer, x, positions, cos, sin, ctx, kv_cache, attn_bias, qkv)
        return self.linear(o, layer.o_proj)

    def attend(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor | None, positions: torch.Tensor,
               cos: torch.Tensor | None, sin: torch.Tensor | None, ctx: AttentionContext, kv_cache: Any,
               attn_bias: torch.Tensor | None = None, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """attention() up to the o_proj: projections, rotary, KV write, attention -> [T, q_dim]."""
        cfg = self.cfg
        if attn_bias is None:
            attn_bias = getattr(self._call, "attn_bias", None)
        tokens = x.shape[0] if x is not None else qkv.shape[0]
        if qkv is not None or layer.qkv_proj is not None:
            if qkv is None:
                qkv = self.linear(x, layer.qkv_proj, layer.qkv_bias)  # [T, q_dim + 2 kv_dim]
            q, k, v = qkv.split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        else:
            q = self.linear(x, layer.q_proj, layer.q_bias)
            k = self.linear(x, layer.k_proj, layer.k_bias)
            v = self.linear(x, layer.v_proj, layer.v_bias)
        q = q.view(tokens, cfg.num_attention_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.view(tokens, cfg.num_key_value_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = self.head_norm(q, layer.q_norm)
            k = self.head_norm(k, layer.k_norm)
        k_cache, v_cache = kv_cache.k[layer_idx], kv_cache.v[layer_idx]
        if self._decode_attention_rope is not None and not ctx.is_prefill:
            # One launch: rotate q and the new key, write key and value to the cache, attend.
            o = self._decode_attention_rope(q, k, v, positions, self.cos_sin, ctx.slot_mapping, k_cache, v_cache,
                                            ctx.block_tables, ctx.context_lens, self.scale,
                                            l2_prefetch=self._attention_prefetch[layer_idx])
            return o.reshape(tokens, -1)
        if self._rotary_kv_write is not None:
            q = self._rotary_kv_write(q, k, v, positions, self.cos_sin, k_cache, v_cache, ctx.slot_mapping)
        elif self.joint_rotary:
            qk = apply_rotary(qkv[:, :self.q_dim + self.kv_dim].view(tokens, -1, cfg.head_dim), cos, sin)
            q, k = qk[:, :cfg.num_attention_heads], qk[:, cfg.num_attention_heads:]
            write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        else:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        if not ctx.is_prefill and self._decode_attention is not None:
            o = self._decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, self.scale,
                                       l2_prefetch=self._attention_prefetch[layer_idx])
        else:
            o = paged_attention(q, k_cache, v_cache, ctx, self.scale, attn_bias)  # [T, Hq, D]
        return o.reshape(tokens, -1)

    def mlp(self, layer: LayerWeights, x: torch.Tensor | None, ctx: AttentionContext,
            activated: torch.Tensor | None = None) -> torch.Tensor:
        """MLP of normed hidden states x [T, H]; ``activated`` [T, I]: gate/up and the SiLU
        already ran (the fused decode path), only the down projection is left."""
        if activated is not None:
            return self.linear(activated, layer.down_proj)
        if layer.router is None:
            if layer.gate_up_proj is None:
                if self._gemv is None:
                    return dense_mlp(x, layer.gate_proj, layer.up_proj, layer.down_proj)
                gate, up = self.linear(x, layer.gate_proj), self.linear(x, layer.up_proj)
                return self.linear(F.silu(gate) * up, layer.down_proj)
            if self._gemv_gated is not None and x.shape[0] <= self._gemv_max_rows:
                # [T, I] straight from the weight stream: no [T, 2I] intermediate, no extra launch.
                activated = self._gemv_gated(x, layer.gate_up_proj,
                                             config=self._gemv_config(x.shape[0], layer.gate_up_proj, True))
                return self.linear(activated, layer.down_proj)
            gate_up = self.linear(x, layer.gate_up_proj)  # [T, 2I]
            if self._silu_and_mul is not None:
                return self.linear(self._silu_and_mul(gate_up), layer.down_proj)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.linear(F.silu(gate) * up, layer.down_proj)
        weights, ids = route(x, layer.router, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        self.count_routing(layer, ids)
        if self._fused_moe is not None:
            return self._fused_moe(x, layer.experts_gate_up, layer.experts_down, weights, ids)
        if ctx.is_prefill:
            return moe_sparse(x, weights, ids, layer.experts_gate_up, layer.experts_down)
        if x.shape[0] * self.cfg.num_experts_per_tok <= self.moe_gather_max_rows:
            return moe_gather(x, weights, ids, layer.experts_gate_up, layer.experts_down)
        return moe_dense(x, weights, ids, layer.experts_gate_up, layer.experts_down)

    def count_routing(self, layer: LayerWeights, ids: torch.Tensor) -> None:
        """Add a MoE layer's top-k choices ids [T, k] to the routing counts (padded rows left out)."""
        if self.routing_counts is not None and layer.moe_row >= 0:
            self.routing_counts.record(layer.moe_row, ids, getattr(self._call, "routed_weights", None))

    # ------------------------------------------------------------------ entry
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                kv_cache: Any) -> torch.Tensor:
        """input_ids, positions: [T] -> float32 logits [B, V] of each sequence's last new token."""
        h = F.embedding(input_ids, self.embed)  # [T, H]
        # Rows that are tokens (padded rows of a graph bucket write to the null slot): what mlp() counts.
        null_slot = getattr(kv_cache, "null_slot", None)
        self._call.routed_weights = (
            ExpertRoutingCounts.choice_weights(ctx.slot_mapping != null_slot, self.cfg.num_experts_per_tok)
            if self.routing_counts is not None and null_slot is not None else None)
        cos = sin = None
        if self._rotary_kv_write is None:
            cos, sin = self.cos[positions], self.sin[positions]  # [T, D]
        self._call.attn_bias = None  # read by attention(): one mask per forward, shared by every layer
        if not ctx.is_prefill and self._decode_attention is None:
            width = ctx.block_tables.shape[1] * kv_cache.block_size
            self._call.attn_bias = decode_attention_bias(ctx.context_lens, width, h.dtype)  # [B, 1, 1, S]
        residual = None
        if self._layer_tail is not None and h.shape[0] == 1 and not ctx.is_prefill:
            return self._decode_one_token(h, positions, cos, sin, ctx, kv_cache)
        if h.shape[0] <= self._fuse_norm_max_rows and not ctx.is_prefill:
            # Decode: every RMSNorm runs inside the GEMV that consumes it (6 launches per layer).
            for i, layer in enumerate(self.layers):
                qkv, residual = self.norm_linear(h, residual, layer.input_norm, layer.qkv_proj, layer.qkv_bias)
                h = self.attention(i, layer, None, positions, cos, sin, ctx, kv_cache, qkv=qkv)
                if self._gemv_gated is not None:
                    activated, residual = self.norm_linear(h, residual, layer.post_norm, layer.gate_up_proj,
                                                           gated=True)
                else:
                    gate_up, residual = self.norm_linear(h, residual, layer.post_norm, layer.gate_up_proj)
                    activated = (self._silu_and_mul(gate_up) if self._silu_and_mul is not None
                                 else F.silu(gate_up[:, :gate_up.shape[1] // 2]) * gate_up[:, gate_up.shape[1] // 2:])
                h = self.mlp(layer, None, ctx, activated=activated)  # through mlp(): subclasses add collectives
            # The final norm stays a launch of its own: the lm_head's ~2000 programs would each
            # pay the prologue's L2 round trip, ~8 waves of it, for one saved launch.
            x, _ = self.norm(h, self.final_norm, residual)
            return self.linear(x, self.lm_head, float32_out=True)
        for i, layer in enumerate(self.layers):
            x, residual = self.norm(h, layer.input_norm, residual)
            h = self.attention(i, layer, x, positions, cos, sin, ctx, kv_cache)
            x, residual = self.norm(h, layer.post_norm, residual)
            h = self.mlp(layer, x, ctx)
        if ctx.is_prefill:
            rows = ctx.last_token_indices  # [B]: only these rows need the head
            h, residual = h[rows], residual[rows]
        # Decode: one token per sequence, so every row is a last row (no gather launches).
        x, _ = self.norm(h, self.final_norm, residual)
        return self.linear(x, self.lm_head, float32_out=True)  # [B, V] float32

    def _decode_one_token(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None,
                          sin: torch.Tensor | None, ctx: AttentionContext, kv_cache: Any) -> torch.Tensor:
        """Batch-1 decode with fuse_layer_tail: the first qkv projection (norm prologue), then per
        layer its attention and one persistent kernel for o_proj, the MLP and the next layer's
        qkv projection (2 launches per layer; 1 with fuse_attention_into_layer, or with
        fuse_attention_into_tail after the first layer's attention)."""
        first = self.layers[0]
        qkv, residual = self.norm_linear(h, None, first.input_norm, first.qkv_proj, first.qkv_bias)
        eps = self.cfg.rms_norm_eps
        o = None  # this layer's attention output, when the tail before it ran it (fuse_attention_into_tail)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if self._whole_layer is not None:  # attention as the kernel's first phase: one launch
                qkv, residual = self._whole_layer(
                    qkv, residual, layer.o_proj, layer.post_norm, layer.gate_up_proj, layer.down_proj, eps,
                    nxt and nxt.input_norm, nxt and nxt.qkv_proj, nxt and nxt.qkv_bias, positions=positions,
                    cos_sin_cache=self.cos_sin, slot_mapping=ctx.slot_mapping, k_cache=kv_cache.k[i],
                    v_cache=kv_cache.v[i], block_tables=ctx.block_tables, context_lens=ctx.context_lens,
                    scale=self.scale)
                continue
            if o is None:
                o = self.attend(i, layer, None, positions, cos, sin, ctx, kv_cache, qkv=qkv)
            following = None  # with fuse_attention_into_tail, every tail but the last ends in the next attention
            if self._next_attention is not None and nxt is not None:
                following = self._next_attention(positions, self.cos_sin, ctx.slot_mapping, kv_cache.k[i + 1],
                                                  kv_cache.v[i + 1], ctx.block_tables, ctx.context_lens, self.scale)
            out, residual = self._layer_tail(o, residual, layer.o_proj, layer.post_norm, layer.gate_up_proj,
                                             layer.down_proj, eps, nxt and nxt.input_norm, nxt and nxt.qkv_proj,
                                             nxt and nxt.qkv_bias, next_attention=following)
            # The next layer's attention output, or its qkv; after the last layer, its MLP output.
            o, qkv = (out, None) if following is not None else (None, out)
        x, _ = self.norm(qkv, self.final_norm, residual)
        return self.linear(x, self.lm_head, float32_out=True)


# kernel_configs op -> (attribute holding its launcher, the recipe knob that switches it on)
KERNEL_CONFIG_OPS = {"rmsnorm": ("_triton_rmsnorm", "norm_backend"),
                     "decode_attention": ("_decode_attention", "attention_backend"),
                     "rotary_kv_write": ("_rotary_kv_write", "rotary_backend"),
                     "silu_and_mul": ("_silu_and_mul", "activation_backend"),
                     "moe_grouped_gemm": ("_fused_moe", "moe_backend")}


def _prefetch_regions(layer: LayerWeights, budget: int) -> tuple[tuple[torch.Tensor, int], ...]:
    """(weight, bytes) regions decode attention prefetches into L2 (attention_l2_prefetch_mb):
    o_proj, then as much of the (fused) gate/up weight as the budget leaves. HBM is idle while
    attention runs at decode batch sizes; the projections after it then read from L2."""
    if not budget:
        return ()
    regions = [(layer.o_proj, budget)]
    following = layer.gate_up_proj if layer.gate_up_proj is not None else layer.gate_proj
    left = budget - layer.o_proj.numel() * layer.o_proj.element_size()
    if left > 0 and following is not None and layer.router is None:
        regions.append((following, left))
    return tuple(regions)


def _kernel_config(config: Any) -> Any:
    """A KernelConfig from a recipe dict (or an existing KernelConfig)."""
    from shapeshift.kernels.registry import KernelConfig

    return config if isinstance(config, KernelConfig) else KernelConfig.from_dict(config)


def _row_limit(recipe: dict[str, Any], knob: str, most: int) -> int | None:
    """recipe[knob] (None when unset), refused unless an integer from 1 to ``most`` (the GEMV
    kernel's row limit; 0 = no GEMV, where any limit is a no-op)."""
    value = recipe.get(knob)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1
                              or (most and value > most)):
        raise ValueError(f"recipe {knob} must be an integer from 1 to {most or 'the GEMV limit'}, got {value!r}")
    return value


def _gemv_overrides(table: dict[str, Any]) -> dict[tuple[int, int], Any]:
    """{"NxK": {"variant": "dot", "BLOCK_N": 32, ...}} -> {(N, K): KernelConfig}."""
    from shapeshift.kernels.registry import KernelConfig

    out = {}
    for shape, config in table.items():
        try:
            n, k = (int(v) for v in str(shape).lower().split("x"))
            out[(n, k)] = config if isinstance(config, KernelConfig) else KernelConfig.from_dict(config)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"recipe gemv_configs[{shape!r}] must map 'NxK' (e.g. '2048x8192') to a kernel config "
                             f"dict with a 'variant' and its tile parameters ({exc})") from exc
    return out


def build(model_config: ModelConfig, weights: dict[str, torch.Tensor], recipe: dict[str, Any]) -> StockForwardPass:
    return StockForwardPass(model_config, weights, recipe)
