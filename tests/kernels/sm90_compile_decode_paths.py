"""Compile the decode-path GEMV variants (RMSNorm prologue, float32 logits, SiLU-and-mul
epilogue) and the batch-1 layer-tail and whole-layer kernels (kernels/decode_layer_tail.py) for sm_90 without a GPU, at the H200 default configs of the Llama-3.2-1B shapes.

Data flow: reuses sm90_compile_check's recording launcher and compiler (imported, so its
JITFunction patch is active), swaps in this file's launches, and runs its main(): one JSON
line per compiled kernel, non-zero exit on any failure.
"""

from __future__ import annotations

import sys

import torch

import sm90_compile_check as check  # noqa: E402  (patches JITFunction.run to record launches)
from shapeshift.kernels import decode_layer_tail, gemv  # noqa: E402

BF16 = torch.bfloat16


def launch_decode_paths(prefix: str = "") -> None:
    """prefix: label prefix of a second pass (sm90_compile_check.main runs one with PDL on)."""
    e = torch.empty

    def cfg(n, k):
        return gemv.GEMV_SPEC.choose_default({"m": 1, "n": n, "k": k, "dtype": "bfloat16"}, "sm90")

    for m in (1, 16):
        check._CURRENT["label"] = prefix + f"gemv+norm qkv M={m}"
        gemv.gemv(e(m, 2048, dtype=BF16), e(3072, 2048, dtype=BF16), norm_weight=e(2048, dtype=BF16), eps=1e-5,
                  residual=e(m, 2048, dtype=BF16), config=cfg(3072, 2048))
        check._CURRENT["label"] = prefix + f"gemv+norm lm_head float32 M={m}"
        gemv.gemv(e(m, 2048, dtype=BF16), e(128256, 2048, dtype=BF16), out_dtype=torch.float32,
                  norm_weight=e(2048, dtype=BF16), eps=1e-5, residual=e(m, 2048, dtype=BF16),
                  config=cfg(128256, 2048))
        check._CURRENT["label"] = prefix + f"gemv_silu_and_mul+norm M={m}"
        gemv.gemv_silu_and_mul(e(m, 2048, dtype=BF16), e(16384, 2048, dtype=BF16), norm_weight=e(2048, dtype=BF16),
                               eps=1e-5, residual=e(m, 2048, dtype=BF16),
                               config=gemv.SM90_GATED_GEMV_TABLE[(8192, 2048)])  # the gated kernel's own tiles
    check._CURRENT["label"] = prefix + "gemv+norm first layer (no residual)"
    gemv.gemv(e(1, 2048, dtype=BF16), e(3072, 2048, dtype=BF16), norm_weight=e(2048, dtype=BF16), eps=1e-5,
              config=cfg(3072, 2048))
    check._CURRENT["label"] = prefix + "gemv_silu_and_mul"
    gemv.gemv_silu_and_mul(e(1, 2048, dtype=BF16), e(16384, 2048, dtype=BF16), config=cfg(8192, 2048))
    check._CURRENT["label"] = prefix + "gemv float32 out"
    gemv.gemv(e(1, 2048, dtype=BF16), e(128256, 2048, dtype=BF16), out_dtype=torch.float32, config=cfg(128256, 2048))
    decode_layer_tail.check_runnable_device = lambda op, tensor: None
    for name, sync, nxt, split in (("decode_layer_tail, one launch with grid barriers", True, True, True),
                                   ("decode_layer_tail, last layer", True, False, True),
                                   ("decode_layer_tail, a launch per phase", False, True, True),
                                   ("decode_layer_tail, barriers without split", True, True, False)):
        check._CURRENT["label"] = prefix + name
        following = dict(next_input_norm=e(2048, dtype=BF16), next_qkv=e(3072, 2048, dtype=BF16)) if nxt else {}
        decode_layer_tail.decode_layer_tail(
            e(1, 2048, dtype=BF16), e(1, 2048, dtype=BF16), e(2048, 2048, dtype=BF16), e(2048, dtype=BF16),
            e(16384, 2048, dtype=BF16), e(2048, 8192, dtype=BF16), 1e-5, programs=264, sync=sync,
            split_barrier=split, **following)
    check._CURRENT["label"] = prefix + "decode_layer_tail, 1 early tile"
    decode_layer_tail.decode_layer_tail(
        e(1, 2048, dtype=BF16), e(1, 2048, dtype=BF16), e(2048, 2048, dtype=BF16), e(2048, dtype=BF16),
        e(16384, 2048, dtype=BF16), e(2048, 8192, dtype=BF16), 1e-5, e(2048, dtype=BF16), e(3072, 2048, dtype=BF16),
        programs=264, sync=True, early_tiles=1)
    check._CURRENT["label"] = prefix + "decode_layer_tail with the next layer's attention, 8 splits"
    decode_layer_tail.decode_layer_tail(
        e(1, 2048, dtype=BF16), e(1, 2048, dtype=BF16), e(2048, 2048, dtype=BF16), e(2048, dtype=BF16),
        e(16384, 2048, dtype=BF16), e(2048, 8192, dtype=BF16), 1e-5, e(2048, dtype=BF16), e(3072, 2048, dtype=BF16),
        programs=264, sync=True, next_attention=decode_layer_tail.NextAttention(**_attention_inputs(), splits=8))
    if prefix:  # decode_layer never launches with PDL (its phase 0 reads the kernel ahead's qkv first)
        return
    for name, sync, splits, extra in (
            ("decode_layer, attention + tail in one launch, 8 splits", True, 8, {}),
            ("decode_layer, 1 split", True, 1, {}), ("decode_layer, 4 splits", True, 4, {}),
            ("decode_layer, a launch per phase", False, 4, {}),
            ("decode_layer, o_proj tiles before the attention barrier", True, 4, {"early_o_proj_tiles": True}),
            ("decode_layer, barriers without split", True, 4, {"split_barrier": False}),
            ("decode_layer, per-phase timestamps", True, 4,
             {"timestamps": e(264, decode_layer_tail.STAMP_SLOTS, dtype=torch.int64)})):
        check._CURRENT["label"] = name
        attention = _attention_inputs()
        decode_layer_tail.decode_layer(
            e(1, 3072, dtype=BF16), e(1, 2048, dtype=BF16), e(2048, 2048, dtype=BF16), e(2048, dtype=BF16),
            e(16384, 2048, dtype=BF16), e(2048, 8192, dtype=BF16), 1e-5, e(2048, dtype=BF16),
            e(3072, 2048, dtype=BF16), programs=264, sync=sync, attention_splits=splits, **attention, **extra)


def _attention_inputs() -> dict:
    """A batch-1 step's attention tensors at the Llama-3.2-1B shape (8 kv heads of 64, 512 tokens)."""
    e = torch.empty
    return dict(positions=e(1, dtype=torch.int64), cos_sin_cache=e(4096, 64), slot_mapping=e(1, dtype=torch.int64),
                k_cache=e(64, 16, 8, 64, dtype=BF16), v_cache=e(64, 16, 8, 64, dtype=BF16),
                block_tables=e(1, 32, dtype=torch.int32), context_lens=e(1, dtype=torch.int32), scale=0.125)


check.launch_all = launch_decode_paths

if __name__ == "__main__":
    sys.exit(check.main())
