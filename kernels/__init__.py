"""Triton kernels for the engine's forward pass, each with a plain-torch reference and a
declared search space.

One module per op family; import ops from their module (the module names equal some op
names, so the package itself does not re-export them):
    rmsnorm.rmsnorm                      RMSNorm fused with the residual add
    activation.silu_and_mul              SwiGLU gate
    rotary.rotary_kv_write               rotary embedding + paged KV-cache write
    decode_attention.decode_attention    paged GQA decode attention, split-K (flash-decoding)
    decode_attention.decode_attention_rope  ... with the rotary embedding and the KV write fused in
    prefill_attention.prefill_attention  chunked-prefill attention over paged KV
    gemv.gemv                            batch-1..16 weight-streaming GEMV / skinny GEMM
    decode_layer_tail.decode_layer_tail  batch 1: o_proj, MLP and the next qkv in one persistent kernel
    decode_layer_tail.decode_layer       ... with the layer's attention (rotary, KV write) as its first phase
    argmax.argmax                        greedy sampling (split-vocabulary argmax)
    sampling.sample                      temperature / top-k / top-p sampling
    moe.topk_routing / moe_align / moe_grouped_gemm / fused_moe
Each module also holds `<op>_ref()` in plain torch. `registry.all_specs()` lists every op's
`KernelSpec` (launcher, reference, search space, per-GPU default config) for the compile loop.

Importing this package imports nothing heavy. On a machine without CUDA, set
TRITON_INTERPRET=1 before triton is imported to run the kernels on the CPU (slowly).
"""
