"""On CUDA: the decode-path launchers are free of host syncs and replay correctly inside a
CUDA graph (static buffers updated in place between replays, as the engine's runner does)."""

import pytest
import torch

from shapeshift.kernels.decode_attention import decode_attention, decode_attention_ref
from shapeshift.kernels.gemv import gemv, gemv_ref
from shapeshift.kernels.moe import fused_moe, fused_moe_ref
from shapeshift.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from shapeshift.kernels.rotary import rope_cos_sin_cache, rotary_kv_write, rotary_kv_write_ref
from shapeshift.kernels.argmax import argmax
from shapeshift.kernels.sampling import sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream (per-stream kernel state)
        fn()
    return graph


def test_decode_step_replays_in_a_cuda_graph():
    dev = torch.device("cuda")
    B, hq, hkv, d, bs, hidden = 4, 8, 2, 64, 16, 256
    num_blocks, max_blocks = 64, 8
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=dev)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    context_lens = torch.zeros(B, dtype=torch.int32, device=dev)
    positions = torch.zeros(B, dtype=torch.int64, device=dev)
    slots = torch.zeros(B, dtype=torch.int64, device=dev)
    x = torch.zeros(B, hidden, device=dev, dtype=torch.bfloat16)
    residual = torch.zeros_like(x)
    norm_w = torch.randn(hidden, device=dev, dtype=torch.bfloat16)
    w_qkv = torch.randn((hq + 2 * hkv) * d, hidden, device=dev, dtype=torch.bfloat16) / hidden**0.5
    cos_sin = rope_cos_sin_cache(d, bs * max_blocks, 10000.0, device=dev)
    seeds = torch.zeros(B, dtype=torch.int64, device=dev)
    temperature = torch.ones(B, device=dev)
    top_k = torch.full((B,), 5, dtype=torch.int32, device=dev)
    top_p = torch.full((B,), 0.9, device=dev)
    out = {}

    def step():
        normed, _ = rmsnorm(x, norm_w, 1e-5, residual, residual_out=residual)
        qkv = gemv(normed, w_qkv)
        q = qkv[:, : hq * d].view(B, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(B, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(B, hkv, d)
        q_rot = rotary_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        attn = decode_attention(q_rot, k_cache, v_cache, block_tables, context_lens, d**-0.5)
        logits = attn.view(B, hq * d).float()
        out["attn"], out["greedy"] = attn, argmax(logits)
        out["sampled"] = sample(logits, temperature, top_k, top_p, seeds)
        # A split-K GEMV whose last split reduces (tile counters reset inside every replay).
        out["split"] = gemv(attn.view(B, hq * d), w_o, config=split_k)

    from shapeshift.kernels.registry import KernelConfig

    w_o = torch.randn(hidden, hq * d, device=dev, dtype=torch.bfloat16) / (hq * d) ** 0.5
    split_k = KernelConfig.make("dot", num_warps=4, num_stages=3, BLOCK_N=16, BLOCK_K=64, SPLIT_K=4)
    graph = _capture(step)
    for trial in range(3):
        lens = torch.randint(1, bs * max_blocks, (B,), device=dev, dtype=torch.int32)
        context_lens.copy_(lens)
        positions.copy_(lens.long() - 1)
        slots.copy_(block_tables.gather(1, ((lens.long() - 1) // bs)[:, None]).squeeze(1).long() * bs
                    + (lens.long() - 1) % bs)
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        seeds.copy_(torch.randint(0, 2**40, (B,), device=dev))
        expected_normed, _ = rmsnorm_ref(x, norm_w, 1e-5, residual.clone())
        graph.replay()
        torch.cuda.synchronize()
        # Reference from the float32 refs; the cache now holds the K/V the graph just wrote.
        qkv_ref = gemv_ref(expected_normed, w_qkv)
        k_new, v_new = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        q_ref = rotary_kv_write_ref(qkv_ref[:, : hq * d].view(B, hq, d), qkv_ref[:, hq * d : (hq + hkv) * d].view(B, hkv, d),
                                    qkv_ref[:, (hq + hkv) * d :].view(B, hkv, d), positions, cos_sin, k_new, v_new, slots)
        written = k_cache.view(-1, hkv, d)[slots].double()
        expected_k = k_new.view(-1, hkv, d)[slots].double()
        assert ((written - expected_k).norm() / expected_k.norm()).item() < 3e-2, "K written at the wrong slot"
        ref_attn = decode_attention_ref(q_ref, k_cache, v_cache, block_tables, context_lens, d**-0.5)
        rel = ((out["attn"].double() - ref_attn.double()).norm() / ref_attn.double().norm()).item()
        assert rel < 3e-2, f"replay {trial}: relative error {rel:.2e}"
        assert torch.equal(out["greedy"], out["attn"].view(B, -1).float().argmax(-1))
        split_ref = gemv_ref(out["attn"].view(B, hq * d), w_o).double()
        assert ((out["split"].double() - split_ref).norm() / split_ref.norm()).item() < 2e-2
        assert ((out["sampled"] >= 0) & (out["sampled"] < hq * d)).all()


def test_fused_moe_replays_in_a_cuda_graph():
    dev = torch.device("cuda")
    T, E, k, H, inner = 8, 16, 4, 128, 64
    x = torch.zeros(T, H, device=dev, dtype=torch.bfloat16)
    logits = torch.zeros(T, E, device=dev)
    w13 = (torch.randn(E, 2 * inner, H, device=dev) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inner, device=dev) / inner**0.5).to(torch.bfloat16)
    out = {}
    graph = _capture(lambda: out.__setitem__("y", fused_moe(x, w13, w2, logits, k, True)))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_moe_ref(x, w13, w2, logits, k, True)
        rel = ((out["y"].double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < 3e-2, rel
