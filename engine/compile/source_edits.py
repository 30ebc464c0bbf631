'''Source edits: mechanical rewrites of the forward-pass module that the search can switch on.

Data flow: base forward.py text (the stock module, or an LLM agent's module that keeps
the stock structure) + enabled edit names --apply_edits--> new forward.py text.

Each edit appends an override block to the module: it subclasses the class bound to
``StockForwardPass`` at that point and rebinds the name, so edits compose in a fixed
order and ``build()`` (which looks the class up when called) returns the most derived
one. The result is one self-contained module, shipped as a bundle like any other and
held to the same verification gates: an edit that changes the numbers is rejected there.

Edits:
  index_select_gather  decode attention gathers the cache blocks with one index_select over the
                 flattened block table instead of advanced indexing

Switches that the stock module already offers (fused q/k/v and gate/up projections, a
Triton kernel per op and its tile configs) are recipe knobs, not edits.
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


_INDEX_SELECT_GATHER = '''
# ---- source edit: index_select_gather (decode: gather cache blocks with one index_select) ----
_paged_attention_before_gather = paged_attention


def _decode_attention_index_select(q, k_cache, v_cache, block_tables, context_lens, scale, attn_bias):
    """q: [B, Hq, D]; block_tables: [B, W]; context_lens: [B] -> [B, Hq, D].

    Same math as the stock decode path; the blocks of all sequences are gathered with one
    index_select over the flattened table (a plain gather kernel) instead of advanced
    indexing with a 2-D index tensor. Shape-static, so CUDA graphs can capture it.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = block_tables.shape[1] * block_size
    if attn_bias is None:
        attn_bias = decode_attention_bias(context_lens, width, q.dtype)  # [B, 1, 1, S]
    flat = block_tables.reshape(-1).long()  # [B*W]
    k = k_cache.index_select(0, flat).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache.index_select(0, flat).view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
    q4 = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(q4, k, v, attn_mask=attn_bias, scale=scale)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)


def paged_attention(q, k_cache, v_cache, ctx, scale, attn_bias=None):  # noqa: F811 - rebinds on purpose
    if ctx.is_prefill:
        return _paged_attention_before_gather(q, k_cache, v_cache, ctx, scale, attn_bias)
    return _decode_attention_index_select(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, attn_bias)
'''

EDITS: dict[str, SourceEdit] = {
    e.name: e
    for e in (
        SourceEdit("index_select_gather", "decode attention gathers the cache blocks with one index_select "
                   "instead of 2-D advanced indexing", _INDEX_SELECT_GATHER, requires="paged_attention("),
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
