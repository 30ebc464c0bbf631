'''Source edits: mechanical rewrites of the forward-pass module that the search can switch on.

Data flow: base forward.py text (the stock module, or an LLM agent's module that keeps
the stock structure) + enabled edit names --apply_edits--> new forward.py text.

Each edit appends an override block to the module: it subclasses the class bound to
``StockForwardPass`` at that point and rebinds the name, so edits compose in a fixed
order and ``build()`` (which looks the class up when called) returns the most derived
one. The result is one self-contained module, shipped as a bundle like any other and
held to the same verification gates: an edit that changes the numbers is rejected there.

Edits:
  split_mixed_attention  in mixed prefill+decode batches, the decode rows attend in one batched
                 call instead of one call per sequence (the stock loop is kept for prefill rows)
  sdpa_decode_attention  decode steps gather the cache with one index_select and attend with
                 the fused scaled_dot_product_attention kernel under a validity mask
  fused_qkv      q/k/v projections as one GEMM over a concatenated weight (derived table,
                 built once in ``build``; costs one extra copy of the attention weights)
  fused_gate_up  gate/up projections of the dense MLP as one GEMM, then SiLU-and-mul
  triton_kernels RMSNorm and SiLU-and-mul through the Triton kernels of shapeshift.kernels,
                 each with the tile config named by the recipe's ``kernel.<op>`` knob (CUDA)
'''

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceEdit:
    name: str
    doc: str
    block: str  # Python source appended to the module
    cuda_only: bool = False
    families: tuple[str, ...] = ()  # empty: every family
    requires: str = "class StockForwardPass"  # text the module must contain for the edit to apply


_FUSED_QKV = '''
# ---- source edit: fused_qkv (one GEMM for q, k and v) ----
_BaseBeforeFusedQKV = StockForwardPass


class StockForwardPass(_BaseBeforeFusedQKV):  # noqa: F811 - the edit rebinds the name on purpose
    def __init__(self, cfg, weights, recipe):
        super().__init__(cfg, weights, recipe)
        # Derived tables: [Hq*D + 2*Hkv*D, H] weight (and bias) concatenated once at build time.
        self._qkv = [torch.cat([l.q_proj, l.k_proj, l.v_proj], dim=0) for l in self.layers]
        self._qkv_bias = [None if l.q_bias is None else torch.cat([l.q_bias, l.k_bias, l.v_bias])
                          for l in self.layers]
        self._q_width = cfg.num_attention_heads * cfg.head_dim
        self._kv_width = cfg.num_key_value_heads * cfg.head_dim

    def attention(self, layer_idx, layer, x, cos, sin, ctx, kv_cache):
        cfg = self.cfg
        tokens = x.shape[0]
        qkv = F.linear(x, self._qkv[layer_idx], self._qkv_bias[layer_idx])  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self._q_width, self._kv_width, self._kv_width], dim=-1)
        q = q.reshape(tokens, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(tokens, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(tokens, cfg.num_key_value_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k_cache, v_cache = kv_cache.k[layer_idx], kv_cache.v[layer_idx]
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        if not ctx.is_prefill and self._decode_attention is not None:
            o = self._decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, self.scale)
        else:
            o = paged_attention(q, k_cache, v_cache, ctx, self.scale)
        return F.linear(o.reshape(tokens, -1), layer.o_proj)
'''

_FUSED_GATE_UP = '''
# ---- source edit: fused_gate_up (one GEMM for the MLP's gate and up projections) ----
_BaseBeforeFusedGateUp = StockForwardPass


def _silu_and_mul_torch(gate_up):
    """gate_up: [T, 2I] -> [T, I] (silu(gate) * up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class StockForwardPass(_BaseBeforeFusedGateUp):  # noqa: F811
    def __init__(self, cfg, weights, recipe):
        super().__init__(cfg, weights, recipe)
        self._gate_up = {id(l): torch.cat([l.gate_proj, l.up_proj], dim=0)  # [2I, H]
                         for l in self.layers if l.router is None}
        self._silu_and_mul = _silu_and_mul_torch

    def mlp(self, layer, x, ctx):
        fused = self._gate_up.get(id(layer))
        if fused is None:
            return super().mlp(layer, x, ctx)
        return F.linear(self._silu_and_mul(F.linear(x, fused)), layer.down_proj)
'''

_TRITON_KERNELS = '''
# ---- source edit: triton_kernels (RMSNorm / SiLU-and-mul through shapeshift.kernels) ----
_BaseBeforeTritonKernels = StockForwardPass


def _kernel_config(recipe, op):
    """The recipe's kernel.<op> value: "default" (the registry's per-GPU choice) or a config dict."""
    from shapeshift.kernels.registry import KernelConfig

    value = recipe.get("kernel." + op, "default")
    return None if value in (None, "default") else KernelConfig.from_dict(value)


class StockForwardPass(_BaseBeforeTritonKernels):  # noqa: F811
    def __init__(self, cfg, weights, recipe):
        super().__init__(cfg, weights, recipe)
        if self.embed.device.type != "cuda":
            raise ValueError("edit triton_kernels needs a CUDA device (Triton on the CPU is interpreter-only)")
        from shapeshift.kernels.rmsnorm import rmsnorm as _rmsnorm_kernel

        self._rmsnorm_kernel = _rmsnorm_kernel
        self._rmsnorm_config = _kernel_config(self.recipe, "rmsnorm")
        try:
            from shapeshift.kernels.activation import silu_and_mul as _silu_kernel
        except ImportError:
            _silu_kernel = None
        if _silu_kernel is not None and hasattr(self, "_silu_and_mul"):
            config = _kernel_config(self.recipe, "silu_and_mul")
            self._silu_and_mul = lambda x: _silu_kernel(x, config=config)

    def _norm(self, x, weight):
        shape = x.shape
        return self._rmsnorm_kernel(x.reshape(-1, shape[-1]), weight, self.cfg.rms_norm_eps,
                                    config=self._rmsnorm_config).view(shape)

    @torch.inference_mode()
    def forward(self, input_ids, positions, ctx, kv_cache):
        h = F.embedding(input_ids, self.embed)  # [T, H]
        cos, sin = self.cos[positions], self.sin[positions]
        for i, layer in enumerate(self.layers):
            h = h + self.attention(i, layer, self._norm(h, layer.input_norm), cos, sin, ctx, kv_cache)
            h = h + self.mlp(layer, self._norm(h, layer.post_norm), ctx)
        h = h[ctx.last_token_indices]
        return F.linear(self._norm(h, self.final_norm), self.lm_head).float()
'''

_SPLIT_MIXED_ATTENTION = '''
# ---- source edit: split_mixed_attention (decode rows of a mixed batch in one batched call) ----
from shapeshift.engine.attention import paged_decode_attention as _batched_decode_attention

_paged_attention_before_split = paged_attention


def paged_attention(q, k_cache, v_cache, ctx, scale):  # noqa: F811 - rebinds the module's attention on purpose
    """Mixed batches: sequences with one new token go through the batched decode path together;
    only sequences with several new tokens take the per-sequence prefill loop.

    q: [T, Hq, D] -> [T, Hq, D].
    """
    qsl, lens = ctx.query_start_loc_cpu, ctx.context_lens_cpu
    if not ctx.is_prefill or qsl is None or lens is None:
        return _paged_attention_before_split(q, k_cache, v_cache, ctx, scale)
    decode_seqs = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    if len(decode_seqs) < 2:
        return _paged_attention_before_split(q, k_cache, v_cache, ctx, scale)
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    rows = torch.tensor([qsl[i] for i in decode_seqs], device=q.device)  # [Bd] token rows
    seqs = torch.tensor(decode_seqs, device=q.device)  # [Bd]
    out[rows] = _batched_decode_attention(q[rows], k_cache, v_cache, ctx.block_tables[seqs],
                                          ctx.context_lens[seqs], scale)
    decode_set = set(decode_seqs)
    for i, context_len in enumerate(lens):
        if i in decode_set:
            continue
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-context_len // block_size)
        blocks = ctx.block_tables[i, :num_blocks]
        k = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:context_len]  # [S, Hkv, D]
        v = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:context_len]
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        ki, vi = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        if q_len == context_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            offset = context_len - q_len
            allowed = torch.arange(context_len, device=q.device)[None, :] <= (
                torch.arange(q_len, device=q.device)[:, None] + offset)  # [L, S] bottom-right causal
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out
'''

_SDPA_DECODE_ATTENTION = '''
# ---- source edit: sdpa_decode_attention (decode steps: one index_select gather + fused SDPA) ----
_paged_attention_before_sdpa = paged_attention


def _sdpa_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q: [B, Hq, D]; block_tables: [B, W]; context_lens: [B] -> [B, Hq, D].

    The cache blocks of every sequence are gathered with one index_select (cheaper than
    advanced indexing) and attended by the fused scaled_dot_product_attention kernel with
    a mask of each sequence's valid positions, instead of matmul / masked_fill / softmax /
    matmul over permuted (copied) views. Shape-static, so CUDA graphs can capture it.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1).long()  # [B*W]
    k = k_cache.index_select(0, flat).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache.index_select(0, flat).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(width, device=q.device)[None, :] < context_lens[:, None]  # [B, S]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale,
                                       enable_gqa=True)  # [B, Hq, 1, D]
    return o[:, :, 0, :]


def paged_attention(q, k_cache, v_cache, ctx, scale):  # noqa: F811 - rebinds the module's attention on purpose
    if ctx.is_prefill:
        return _paged_attention_before_sdpa(q, k_cache, v_cache, ctx, scale)
    return _sdpa_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale)
'''

EDITS: dict[str, SourceEdit] = {
    e.name: e
    for e in (
        SourceEdit("split_mixed_attention", "mixed prefill+decode batches: all decode rows in one batched "
                   "attention call instead of one call per sequence", _SPLIT_MIXED_ATTENTION,
                   requires="paged_attention("),
        SourceEdit("sdpa_decode_attention", "decode attention as one index_select gather plus the fused SDPA "
                   "kernel with a validity mask", _SDPA_DECODE_ATTENTION, requires="paged_attention("),
        SourceEdit("fused_qkv", "q/k/v projections as one GEMM over a concatenated weight", _FUSED_QKV),
        SourceEdit("fused_gate_up", "MLP gate/up projections as one GEMM (dense models)", _FUSED_GATE_UP,
                   families=("llama",)),
        SourceEdit("triton_kernels", "RMSNorm and SiLU-and-mul through the Triton kernels with tuned tiles",
                   _TRITON_KERNELS, cuda_only=True),
    )
}
ORDER = tuple(EDITS)  # application order: later edits build on earlier ones


class SourceEditError(ValueError):
    """An edit cannot apply to this module (it lacks the class the edit extends)."""


def apply_edits(source: str, names: list[str] | tuple[str, ...]) -> str:
    """`source` with the named edits appended in the canonical order; unknown names raise."""
    unknown = sorted(set(names) - set(EDITS))
    if unknown:
        raise SourceEditError(f"unknown source edits {unknown}; known: {list(EDITS)}")
    out = source
    for name in ORDER:
        if name not in names:
            continue
        edit = EDITS[name]
        if edit.requires not in source:
            raise SourceEditError(
                f"source edit {name!r} needs {edit.requires!r} in forward.py, which this module lacks")
        out = out.rstrip("\n") + "\n\n" + edit.block.strip("\n") + "\n"
    return out
