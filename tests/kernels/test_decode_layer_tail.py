"""kernels/decode_layer_tail.py: o_proj -> MLP -> next layer's qkv in one persistent kernel.

On the CPU (interpreter) each phase runs as a launch of its own; on CUDA the tests also run
all four phases in one launch with grid barriers, and check that one launch equals the
per-phase launches bit for bit, inside CUDA graphs replayed many times (the barrier counters
must reset themselves after each launch).
"""

from __future__ import annotations

import pytest
import torch

from kernel_test_utils import assert_close_norm
from shapeshift.kernels.decode_layer_tail import _COUNTERS, decode_layer_tail, decode_layer_tail_ref

pytest.importorskip("triton")


def _layer(hidden, q_dim, inner, nqkv, dtype, device, bias):
    def rand(*shape, scale):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    weights = dict(o_proj=rand(hidden, q_dim, scale=q_dim ** -0.5), post_norm=1 + rand(hidden, scale=0.1),
                   gate_up=rand(2 * inner, hidden, scale=hidden ** -0.5), down_proj=rand(hidden, inner, scale=inner ** -0.5))
    following = dict(next_input_norm=1 + rand(hidden, scale=0.1), next_qkv=rand(nqkv, hidden, scale=hidden ** -0.5),
                     next_qkv_bias=rand(nqkv, scale=0.1) if bias else None)
    return rand(1, q_dim, scale=1.0), rand(1, hidden, scale=1.0), weights, following


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims", [(64, 64, 128, 96), (96, 80, 176, 144)])  # the second: no power of two
@pytest.mark.parametrize("with_next,bias", [(True, False), (True, True), (False, False)])
def test_layer_tail_matches_reference(dtype, dims, with_next, bias, device):
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("the interpreter truncates float32 -> bf16 (test_interpreter_quirks.py); the GPU rounds to nearest")
    hidden, q_dim, inner, nqkv = dims
    attn, residual, weights, following = _layer(hidden, q_dim, inner, nqkv, dtype, device, bias)
    nxt = following if with_next else {}
    out, res_out = decode_layer_tail(attn, residual, **weights, eps=1e-5, **nxt)
    ref, ref_res = decode_layer_tail_ref(attn, residual, **weights, eps=1e-5, **nxt)
    assert out.shape == (1, nqkv if with_next else hidden) and res_out.shape == (1, hidden)
    assert_close_norm(out, ref, dtype, "qkv" if with_next else "mlp output")
    assert_close_norm(res_out, ref_res, dtype, "residual out")
    if not with_next:  # the layer's output is mlp_out + residual_out, as the separate kernels give
        layer_out = out.float() + res_out.float()
        assert_close_norm(layer_out, ref.float() + ref_res.float(), torch.float32 if dtype == torch.float32 else dtype)


def test_layer_tail_programs_stride_over_every_tile(device):
    """With 1, 2 and 5 programs (tiles per program from many to one) the result is the same:
    each program walks its tiles pid, pid + G, ... and none is skipped or done twice."""
    attn, residual, weights, following = _layer(64, 64, 128, 96, torch.float32, device, True)
    results = [decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, programs=g, sync=False)
               for g in (1, 2, 5)]
    for out, res_out in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(res_out, results[0][1], rtol=0, atol=0)


def test_layer_tail_errors(device):
    attn, residual, weights, following = _layer(64, 64, 128, 96, torch.float32, device, False)
    with pytest.raises(ValueError, match="serves one token"):
        decode_layer_tail(attn.expand(2, -1).contiguous(), residual, **weights, eps=1e-5)
    with pytest.raises(ValueError, match="gate_up must be"):
        decode_layer_tail(attn, residual, **{**weights, "gate_up": weights["gate_up"][:-1]}, eps=1e-5)
    with pytest.raises(ValueError, match="next_input_norm and next_qkv come together"):
        decode_layer_tail(attn, residual, **weights, eps=1e-5, next_qkv=following["next_qkv"])
    with pytest.raises(ValueError, match="dtype"):
        decode_layer_tail(attn, residual.half(), **weights, eps=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="grid barriers need every program resident (CUDA)")
@pytest.mark.parametrize("split_barrier", [False, True])
def test_one_launch_with_barriers_equals_a_launch_per_phase_in_replayed_graphs(split_barrier):
    device = torch.device("cuda")
    dtype = torch.bfloat16
    attn, residual, weights, following = _layer(2048, 2048, 8192, 3072, dtype, device, True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        expected = decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, sync=False)
        first = decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, sync=True,
                                  split_barrier=split_barrier)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            # 16 layers' worth of launches in one graph, as a decode step has.
            outs = [decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, sync=True,
                                      split_barrier=split_barrier) for _ in range(16)]
    stream.synchronize()
    for got in first:
        assert not torch.isnan(got).any()
    torch.testing.assert_close(first[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(first[1], expected[1], rtol=0, atol=0)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    for qkv, res_out in outs:
        torch.testing.assert_close(qkv, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(res_out, expected[1], rtol=0, atol=0)
    with torch.cuda.stream(stream):  # the last program out of every launch zeroed the counters
        assert not _COUNTERS.for_stream(device, 2).any()
    ref, ref_res = decode_layer_tail_ref(attn, residual, **weights, eps=1e-5, **following)
    assert_close_norm(expected[0], ref, dtype, "qkv")


def test_programs_per_sm_counts_registers_in_eights_threads_and_shared_memory():
    """The residency arithmetic the launcher (and the sm_90 register check) uses, on an H100/H200
    SM: 65,536 registers allocated 8 a thread at a time, 2,048 threads, 228 KB of shared memory."""
    from shapeshift.kernels.decode_layer_tail import programs_per_sm

    assert programs_per_sm(109, 8) == 2  # the default tail: 112 x 256 x 2 <= 65,536
    assert programs_per_sm(128, 8) == 2 and programs_per_sm(121, 8) == 2  # 121 rounds up to 128
    assert programs_per_sm(129, 8) == 1  # 136 x 256 x 2 > 65,536
    assert programs_per_sm(83, 16) == 1  # 88 x 512 x 2 > 65,536
    assert programs_per_sm(16, 4) == 16  # the thread limit binds: 2,048 / 128
    assert programs_per_sm(32, 4, 100 * 1024) == 2  # the shared-memory limit binds
    assert programs_per_sm(109, 8, regs_per_sm=32768) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="residency is read from the compiled kernel (CUDA)")
def test_a_grid_that_cannot_be_resident_is_refused_not_launched():
    """More programs than the SMs hold at once would leave the barrier waiting forever."""
    device = torch.device("cuda")
    attn, residual, weights, following = _layer(2048, 2048, 8192, 3072, torch.bfloat16, device, False)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    with pytest.raises(ValueError, match="cannot all be resident"):
        decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, programs=64 * sms, sync=True)
    out = decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, programs=sms, sync=True)
    torch.cuda.synchronize()
    assert not torch.isnan(out[0]).any()


def test_layer_tail_early_tiles_only_move_loads(device):
    """early_tiles 0, 1 and 2 (how many of a phase's first tiles load before the barrier's wait)
    give the same bits; anything else is refused."""
    attn, residual, weights, following = _layer(64, 64, 128, 96, torch.float32, device, True)
    results = [decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, early_tiles=early)
               for early in (2, 1, 0)]
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="early_tiles must be 0, 1 or 2"):
        decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, early_tiles=3)


# ---------------------------------------------------------------- decode_layer (attention first)

def _attention_problem(context_len, hq, hkv, d, block_size, dtype, device):
    """A paged cache holding context_len - 1 tokens of one sequence (scattered blocks), the
    step's un-rotated qkv row and the slot its new token goes to."""
    from shapeshift.kernels.rotary import rope_cos_sin_cache

    max_blocks = -(-context_len // block_size) + 1
    num_blocks = max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device)[:max_blocks].view(1, -1).to(torch.int32)
    n = context_len
    slot = block_tables[0, (n - 1) // block_size].long() * block_size + (n - 1) % block_size
    qkv = torch.randn(1, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    return dict(positions=torch.tensor([n - 1 + 5], device=device), cos_sin_cache=rope_cos_sin_cache(d, 512, 1e4,
                                                                                                     device=device),
                slot_mapping=slot.view(1), k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                context_lens=torch.tensor([n], dtype=torch.int32, device=device), scale=d ** -0.5), qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("context_len,splits", [(1, 1), (37, 1), (37, 4), (150, 8), (9, None)])
@pytest.mark.parametrize("with_next", [True, False])
def test_decode_layer_matches_attention_then_tail(dtype, context_len, splits, with_next, device):
    """Phase 0 (rotary, KV write, split attention) merged into phase 1's input: the outputs and
    both caches as decode_attention_rope's reference followed by the tail's. Splits past the
    context's tiles are empty (lse -inf) and must weigh nothing."""
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("the interpreter truncates float32 -> bf16 (test_interpreter_quirks.py); the GPU rounds to nearest")
    from shapeshift.kernels.decode_layer_tail import decode_layer, decode_layer_ref

    hq, hkv, d, hidden, inner = 4, 2, 16, 48, 80
    attention, qkv = _attention_problem(context_len, hq, hkv, d, 4, dtype, device)
    _, residual, weights, following = _layer(hidden, hq * d, inner, (hq + 2 * hkv) * d, dtype, device, True)
    nxt = following if with_next else {}
    ref_attention = dict(attention, k_cache=attention["k_cache"].clone(), v_cache=attention["v_cache"].clone())
    ref, ref_res = decode_layer_ref(qkv, residual, **weights, eps=1e-5, **nxt, **ref_attention)
    out, res_out = decode_layer(qkv, residual, **weights, eps=1e-5, **nxt, **attention, attention_splits=splits)
    assert_close_norm(out, ref, dtype, "qkv" if with_next else "mlp output")
    assert_close_norm(res_out, ref_res, dtype, "residual out")
    assert torch.equal(attention["v_cache"], ref_attention["v_cache"])
    if dtype == torch.float32:
        torch.testing.assert_close(attention["k_cache"], ref_attention["k_cache"], atol=1e-6, rtol=1e-6)
    else:
        assert_close_norm(attention["k_cache"], ref_attention["k_cache"], dtype, "k cache")


def test_decode_layer_default_splits_stay_within_the_tiles():
    """decode_layer merges every split in every program, so its default never rounds the tiles
    up the way decode attention's own default does (6 tiles: 4 splits here, 8 there)."""
    from shapeshift.kernels.decode_attention import DECODE_ATTENTION_SPEC
    from shapeshift.kernels.decode_layer_tail import default_layer_splits

    problem = {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 64, "max_context": 400, "block_size": 16,
               "dtype": "bfloat16"}
    attention = DECODE_ATTENTION_SPEC.choose_default(problem, "sm90")
    assert (attention["BLOCK_N"], attention["NUM_SPLITS"]) == (64, 8)
    assert default_layer_splits(attention["NUM_SPLITS"], 400 // 64) == 4
    assert default_layer_splits(8, 8) == 8 and default_layer_splits(32, 64) == 8  # MAX_ATTENTION_SPLITS
    assert default_layer_splits(2, 1) == 1 and default_layer_splits(2, 0) == 1


def test_decode_layer_launches_with_its_default_splits(device, monkeypatch):
    """The launch takes default_layer_splits' count: a block table 8 tokens wide is less than
    one tile, so one split (decode attention's own default asks 2 in the interpreter)."""
    from shapeshift.kernels import decode_layer_tail as module

    attention, qkv = _attention_problem(3, 4, 2, 16, 4, torch.float32, device)
    _, residual, weights, following = _layer(64, 64, 128, 96, torch.float32, device, False)
    launched = []
    kernel = module._decode_layer_tail_kernel

    class Recorded:  # the kernel, with its launches' split counts recorded (the plan compiles through it)
        def __getattr__(self, name):
            return getattr(kernel, name)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["SPLITS"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_decode_layer_tail_kernel", Recorded())
    module.decode_layer(qkv, residual, **weights, eps=1e-5, **following, **attention)
    assert launched and set(launched) == {1}


def test_decode_layer_programs_and_splits_give_one_answer(device):
    """1, 2 and 5 programs walk the (kv head, split) items and the tiles without skipping or
    repeating any (bit for bit); 1, 2 and 8 splits agree to float32 rounding."""
    from shapeshift.kernels.decode_layer_tail import decode_layer

    attention, qkv = _attention_problem(70, 8, 2, 16, 8, torch.float32, device)
    _, residual, weights, following = _layer(32, 128, 64, 192, torch.float32, device, False)
    _programs_and_splits_agree(attention, lambda programs, splits, caches: decode_layer(
        qkv, residual, **weights, eps=1e-5, **following, **caches, attention_splits=splits, programs=programs,
        sync=False))


def _programs_and_splits_agree(attention, run, after_each=lambda: None):
    """run(programs, splits, caches) on fresh copies of the caches: 1, 2 and 5 programs at 2 splits
    give the same bits; 1 and 8 splits agree with them to float32 rounding."""
    results = {}
    for programs, splits in ((1, 2), (2, 2), (5, 2), (3, 1), (3, 8)):
        caches = dict(attention, k_cache=attention["k_cache"].clone(), v_cache=attention["v_cache"].clone())
        results[programs, splits] = run(programs, splits, caches)
        after_each()
    for key in ((2, 2), (5, 2)):
        for got, want in zip(results[key], results[1, 2]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for key in ((3, 1), (3, 8)):
        for got, want in zip(results[key], results[1, 2]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_layer_errors(device):
    from shapeshift.kernels.decode_layer_tail import decode_layer

    attention, qkv = _attention_problem(9, 4, 2, 16, 4, torch.float32, device)
    _, residual, weights, following = _layer(48, 64, 80, 128, torch.float32, device, False)
    with pytest.raises(ValueError, match=r"qkv has shape \(1, 127\)"):
        decode_layer(qkv[:, :-1].contiguous(), residual, **weights, eps=1e-5, **attention)
    with pytest.raises(ValueError, match="attention_splits must be a power of two"):
        decode_layer(qkv, residual, **weights, eps=1e-5, **attention, attention_splits=3)
    odd, odd_qkv = _attention_problem(9, 4, 2, 24, 4, torch.float32, device)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        decode_layer(odd_qkv, residual, **{**weights, "o_proj": torch.randn(48, 96, device=device)}, eps=1e-5,
                     **odd)
    with pytest.raises(ValueError, match="context_lens has dtype torch.int64"):
        decode_layer(qkv, residual, **weights, eps=1e-5, **dict(attention, context_lens=attention["context_lens"].long()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="grid barriers need every program resident (CUDA)")
@pytest.mark.parametrize("splits,split_barrier", [(1, True), (8, True), (8, False)])
def test_decode_layer_one_launch_equals_a_launch_per_phase_in_replayed_graphs(splits, split_barrier):
    """Llama-3.2-1B shapes: the five phases with barriers in one launch give the per-phase
    launches' result bit for bit, in a graph of 16 layers replayed 50 times (the counters reset
    after each launch; the cache write is the same each time), and the reference's within bf16."""
    from shapeshift.kernels.decode_layer_tail import decode_layer, decode_layer_ref

    device, dtype = torch.device("cuda"), torch.bfloat16
    attention, qkv = _attention_problem(300, 32, 8, 64, 16, dtype, device)
    _, residual, weights, following = _layer(2048, 2048, 8192, 3072, dtype, device, False)
    ref_attention = dict(attention, k_cache=attention["k_cache"].clone(), v_cache=attention["v_cache"].clone())
    expected = _one_launch_equals_a_launch_per_phase_in_graphs(device, lambda sync: decode_layer(
        qkv, residual, **weights, eps=1e-5, **following, **attention, attention_splits=splits, sync=sync,
        split_barrier=split_barrier))
    ref, ref_res = decode_layer_ref(qkv, residual, **weights, eps=1e-5, **following, **ref_attention)
    assert_close_norm(expected[0], ref, dtype, "qkv")
    assert_close_norm(expected[1], ref_res, dtype, "residual out")
    assert torch.equal(attention["v_cache"], ref_attention["v_cache"])


# ---------------------------------------------------------------- phase 5: the next layer's attention

def _tail_then_attention_ref(attn, residual, weights, following, attention):
    """The tail's reference for the next layer's qkv, then decode_attention_rope's reference on
    it (which writes the caches): (the next layer's attention output [1, QD], residual out)."""
    from shapeshift.kernels.decode_attention import decode_attention_rope_ref

    qkv, res_out = decode_layer_tail_ref(attn, residual, **weights, eps=1e-5, **following)
    k_cache = attention["k_cache"]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    q, k, v = qkv.split([qkv.shape[1] - 2 * hkv * d, hkv * d, hkv * d], dim=-1)
    out = decode_attention_rope_ref(q.reshape(1, -1, d), k.reshape(1, -1, d), v.reshape(1, -1, d),
                                    attention["positions"], attention["cos_sin_cache"], attention["slot_mapping"],
                                    k_cache, attention["v_cache"], attention["block_tables"],
                                    attention["context_lens"], attention["scale"])
    return out.reshape(1, -1), res_out


def _next_attention(attention, splits=None):
    from shapeshift.kernels.decode_layer_tail import NextAttention

    return NextAttention(**attention, splits=splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("context_len,splits", [(1, 1), (37, 1), (37, 4), (150, 8), (150, 32), (9, None)])
def test_tail_with_next_attention_matches_tail_then_attention(dtype, context_len, splits, device):
    """Phase 5 (rotary, KV write, split attention on phase 4's qkv row, each kv head merged by its
    last split): the attention output and both caches as the tail's reference followed by
    decode_attention_rope's. Splits past the context's tiles are empty and must weigh nothing."""
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("the interpreter truncates float32 -> bf16 (test_interpreter_quirks.py); the GPU rounds to nearest")
    hq, hkv, d, hidden, inner = 4, 2, 16, 48, 80
    attention, _ = _attention_problem(context_len, hq, hkv, d, 4, dtype, device)
    attn, residual, weights, following = _layer(hidden, hq * d, inner, (hq + 2 * hkv) * d, dtype, device, True)
    ref_attention = dict(attention, k_cache=attention["k_cache"].clone(), v_cache=attention["v_cache"].clone())
    ref, ref_res = _tail_then_attention_ref(attn, residual, weights, following, ref_attention)
    out, res_out = decode_layer_tail(attn, residual, **weights, eps=1e-5, **following,
                                     next_attention=_next_attention(attention, splits))
    assert out.shape == (1, hq * d) and res_out.shape == (1, hidden)
    assert_close_norm(out, ref, dtype, "next layer's attention")
    assert_close_norm(res_out, ref_res, dtype, "residual out")
    if dtype == torch.float32:
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(attention[name], ref_attention[name], atol=1e-5, rtol=1e-5)
    else:
        for name in ("k_cache", "v_cache"):
            assert_close_norm(attention[name], ref_attention[name], dtype, name)
    untouched = torch.ones_like(attention["k_cache"], dtype=torch.bool)
    slot = int(attention["slot_mapping"])
    untouched[slot // 4, slot % 4] = False  # only the new token's slot is written
    assert torch.equal(attention["k_cache"][untouched], ref_attention["k_cache"][untouched])


def test_tail_with_next_attention_programs_and_splits_give_one_answer(device):
    """1, 2 and 5 programs walk the tiles and the (kv head, split) items without skipping or
    repeating any (bit for bit); 1, 2 and 8 splits agree to float32 rounding; the merge
    counters are zero again after every launch."""
    from shapeshift.kernels.decode_layer_tail import _COUNTERS

    attention, _ = _attention_problem(70, 8, 2, 16, 8, torch.float32, device)
    attn, residual, weights, following = _layer(32, 128, 64, 192, torch.float32, device, False)
    def counters_zero():
        assert not _COUNTERS.for_stream(device, 2).any()

    _programs_and_splits_agree(attention, lambda programs, splits, caches: decode_layer_tail(
        attn, residual, **weights, eps=1e-5, **following, next_attention=_next_attention(caches, splits),
        programs=programs, sync=False), counters_zero)


def test_tail_with_next_attention_errors(device):
    from shapeshift.kernels.decode_layer_tail import MAX_NEXT_ATTENTION_SPLITS

    attention, _ = _attention_problem(9, 4, 2, 16, 4, torch.float32, device)
    attn, residual, weights, following = _layer(48, 64, 80, 128, torch.float32, device, False)
    with pytest.raises(ValueError, match="next_attention needs the next layer"):
        decode_layer_tail(attn, residual, **weights, eps=1e-5, next_attention=_next_attention(attention))
    short = dict(following, next_qkv=following["next_qkv"][:-16].contiguous())
    with pytest.raises(ValueError, match="next_qkv has 112 rows"):
        decode_layer_tail(attn, residual, **weights, eps=1e-5, **short, next_attention=_next_attention(attention))
    for splits in (3, 2 * MAX_NEXT_ATTENTION_SPLITS):
        with pytest.raises(ValueError, match="attention_splits must be a power of two"):
            decode_layer_tail(attn, residual, **weights, eps=1e-5, **following,
                              next_attention=_next_attention(attention, splits))
    with pytest.raises(ValueError, match="next_attention must be a NextAttention"):
        decode_layer_tail(attn, residual, **weights, eps=1e-5, **following, next_attention=tuple(attention.values()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="grid barriers need every program resident (CUDA)")
@pytest.mark.parametrize("splits", [1, 8])
def test_tail_with_next_attention_one_launch_equals_a_launch_per_phase_in_replayed_graphs(splits):
    """Llama-3.2-1B shapes: the tail and the next layer's attention in one launch give the
    per-phase launches' result bit for bit, in a graph of 16 layers replayed 50 times (the
    barrier and merge counters reset after each launch), and the references' within bf16."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    attention, _ = _attention_problem(300, 32, 8, 64, 16, dtype, device)
    attn, residual, weights, following = _layer(2048, 2048, 8192, 3072, dtype, device, False)
    ref_attention = dict(attention, k_cache=attention["k_cache"].clone(), v_cache=attention["v_cache"].clone())
    nxt = _next_attention(attention, splits)
    expected = _one_launch_equals_a_launch_per_phase_in_graphs(device, lambda sync: decode_layer_tail(
        attn, residual, **weights, eps=1e-5, **following, next_attention=nxt, sync=sync))
    ref, ref_res = _tail_then_attention_ref(attn, residual, weights, following, ref_attention)
    assert_close_norm(expected[0], ref, dtype, "next layer's attention")
    assert_close_norm(expected[1], ref_res, dtype, "residual out")
    # The new token's key and value come from phase 4's qkv, within bf16 of the reference's; every
    # other slot of the caches is untouched.
    slot = int(attention["slot_mapping"])
    block, offset = slot // 16, slot % 16
    for name in ("k_cache", "v_cache"):
        assert_close_norm(attention[name][block, offset], ref_attention[name][block, offset], dtype, name)
        attention[name][block, offset] = ref_attention[name][block, offset]
        assert torch.equal(attention[name], ref_attention[name]), name


def _one_launch_equals_a_launch_per_phase_in_graphs(device, launch):
    """launch(sync) -> outputs, on a side stream: a launch per phase, then one launch with
    barriers, then a CUDA graph of 16 such launches replayed 50 times. Every one-launch result
    equals the per-phase one bit for bit, and the counters are zero after (each launch resets
    what it used). Returns the per-phase launch's outputs."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        expected = launch(False)
        first = launch(True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = [launch(True) for _ in range(16)]
    stream.synchronize()
    for got, want in zip(first, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    for out in outs:
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.cuda.stream(stream):
        assert not _COUNTERS.for_stream(device, 2).any()
    return expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stamps read the GPU clock (%globaltimer)")
def test_timestamps_are_each_programs_phases_in_order():
    """Every program stamps its kernel start, then each phase's begin and end, in time order, and
    the SM it ran on (at most two programs an SM); the results equal the unstamped launch's."""
    from shapeshift.kernels.decode_layer_tail import SM_SLOT, STAMP_SLOTS, decode_layer

    device, dtype = torch.device("cuda"), torch.bfloat16
    attention, qkv = _attention_problem(100, 32, 8, 64, 16, dtype, device)
    _, residual, weights, following = _layer(2048, 2048, 8192, 3072, dtype, device, False)
    plain = decode_layer(qkv, residual, **weights, eps=1e-5, **following, **attention)
    stamps = torch.zeros((1024, STAMP_SLOTS), dtype=torch.int64, device=device)
    stamped = decode_layer(qkv, residual, **weights, eps=1e-5, **following, **attention, timestamps=stamps)
    torch.cuda.synchronize()
    for got, want in zip(stamped, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ran = stamps[stamps[:, 0] > 0][:, :10]
    assert ran.shape[0] >= torch.cuda.get_device_properties(device).multi_processor_count
    assert (ran[:, 1:] >= ran[:, :-1]).all(), "a program's stamps go back in time"
    for phase in range(1, 5):  # the barriers: no program begins a phase before every program ended the last
        assert ran[:, 2 * phase].min() >= ran[:, 2 * phase - 1].max(), phase
    sms = stamps[stamps[:, 0] > 0][:, SM_SLOT]  # each program's SM, two programs on each
    assert torch.bincount(sms, minlength=torch.cuda.get_device_properties(device).multi_processor_count).max() <= 2
    with pytest.raises(ValueError, match="timestamps must be"):
        decode_layer(qkv, residual, **weights, eps=1e-5, **following, **attention, timestamps=stamps[:4])


def test_pdl_launch_options_reach_the_launch(monkeypatch, device):
    """Under programmatic dependent launch the plan carries pdl_options' launch options whole
    (USE_PDL for the kernel and launch_pdl for the launch), for the one-launch tail only."""
    from shapeshift.kernels import decode_layer_tail as module

    monkeypatch.setattr(module, "pdl_options", lambda dev, family: {"USE_PDL": True, "launch_pdl": True})
    monkeypatch.setattr(module, "_resident_per_sm", lambda *args: 2)  # no compile for the residency check
    attn, residual, weights, following = _layer(64, 64, 128, 96, torch.float32, device, False)
    args = (attn, residual, weights["o_proj"], weights["post_norm"], weights["gate_up"], weights["down_proj"],
            following["next_input_norm"], following["next_qkv"], None, *(None,) * 7)
    one_launch = module._plan(*args, module._Options(3, True, 8, 8192, True, False, use_pdl=True))
    assert one_launch.meta["USE_PDL"] and one_launch.meta["launch_pdl"]
    per_phase = module._plan(*args, module._Options(3, False, 8, 8192, True, False, use_pdl=True))
    assert not per_phase.meta["USE_PDL"] and "launch_pdl" not in per_phase.meta


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script measures (minutes)")
def test_bench_layer_tail_imports_its_siblings_and_refuses_without_a_gpu():
    """hack/bench_layer_tail.py imports its sibling scripts' helpers (copy ceiling, graph timing)
    and says why it cannot measure here, with exit status 2."""
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "hack" / "bench_layer_tail.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(script), "--phases"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "needs a CUDA GPU" in result.stderr


def test_bench_layer_tail_finds_the_slow_sms_from_the_stamps():
    """bench_layer_tail's per-SM view of gate/up (synthetic stamps, two programs an SM): SMs slow in
    every layer come out as the slowest with the two halves of the layers correlated; a straggler
    drawn anew each layer leaves them uncorrelated."""
    from harness.scripts import load_hack_script
    from shapeshift.kernels.decode_layer_tail import SM_SLOT, STAMP_SLOTS

    bench = load_hack_script("bench_layer_tail")
    gen = torch.Generator().manual_seed(0)

    def stamps(pace):  # pace(layer) -> us of extra gate/up work per SM
        ran = []
        for layer in range(16):
            t = torch.zeros((264, STAMP_SLOTS), dtype=torch.int64)
            sm = torch.arange(264) // 2
            t[:, 0], t[:, 4], t[:, SM_SLOT] = 1_000, 5_000, sm
            t[:, 5] = 5_000 + 16_000 + (1e3 * pace(layer)[sm]).long() + torch.randint(0, 50, (264,), generator=gen)
            ran.append(t)
        return ran

    fixed = torch.zeros(132)
    fixed[124:] = 0.5  # the last 8 SMs half a microsecond slower in every layer
    steady = bench._gate_up_by_sm(stamps(lambda layer: fixed))
    assert sorted(steady["slowest_sms"]) == list(range(124, 132))
    assert steady["half_correlation"] > 0.9 and 0.4 < steady["slowest_minus_median_us"] < 0.6
    noise = bench._gate_up_by_sm(stamps(lambda layer: torch.rand(132, generator=gen)))
    assert abs(noise["half_correlation"]) < 0.5
