"""The decode-path GEMV additions: float32 output (lm_head logits without a cast) and the
gate/up GEMV with SiLU-and-mul in its epilogue, against plain-torch references."""

import os

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_elementwise, assert_close_norm, poisoned

from shapeshift.kernels.activation import silu_and_mul_ref
from shapeshift.kernels.gemv import gemv, gemv_ref, gemv_silu_and_mul, gemv_silu_and_mul_ref
from shapeshift.kernels.registry import KernelConfig


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemv_float32_output(dtype, split_k, device):
    x = torch.randn(3, 96, dtype=dtype, device=device)
    w = torch.randn(40, 96, dtype=dtype, device=device)
    out = poisoned((3, 40), torch.float32, device)
    gemv(x, w, out=out, config=KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k))
    ref = x.float() @ w.float().t()  # unrounded: the float32 output skips the rounding to dtype
    assert out.dtype == torch.float32
    assert_close_norm(out, ref, torch.float32 if dtype == torch.float32 else torch.float16)
    y = gemv(x, w, out_dtype=torch.float32, config=KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1))
    assert y.dtype == torch.float32 and y.shape == (3, 40)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,inner,k,config",
    [
        (1, 40, 96, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),  # masked N tail, even K
        (5, 32, 100, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),  # K tail
        (16, 24, 64, KernelConfig.make("dot", BLOCK_N=32, BLOCK_K=16, SPLIT_K=4)),  # split ignored
        (2, 20, 48, KernelConfig.make("fma", BLOCK_N=8, BLOCK_K=16, SPLIT_K=1)),
    ],
)
def test_gemv_silu_and_mul_matches_unfused(m, inner, k, config, dtype, device):
    x = torch.randn(m, k, dtype=dtype, device=device)
    gate_up = torch.randn(2 * inner, k, dtype=dtype, device=device) / k ** 0.5
    out = poisoned((m, inner), dtype, device)
    gemv_silu_and_mul(x, gate_up, out=out, config=config)
    ref = gemv_silu_and_mul_ref(x, gate_up)
    assert_close_norm(out, ref, dtype)
    # The reference is the unfused path: projection rounded to dtype, then silu_and_mul.
    assert torch.equal(ref, silu_and_mul_ref(gemv_ref(x, gate_up)))


def test_gemv_silu_and_mul_default_config_and_errors(device):
    x = torch.randn(2, 64, device=device)
    gate_up = torch.randn(48, 64, device=device) / 8
    assert_close_norm(gemv_silu_and_mul(x, gate_up), gemv_silu_and_mul_ref(x, gate_up), torch.float32)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv_silu_and_mul(x, torch.randn(47, 64, device=device))
    with pytest.raises(ValueError, match="x has 17 rows"):
        gemv_silu_and_mul(torch.randn(17, 64, device=device), gate_up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("gated,config", [
    (False, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
    (False, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=3)),  # every split normalises
    (False, KernelConfig.make("fma", BLOCK_N=8, BLOCK_K=32, SPLIT_K=1)),
    (True, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
])
def test_gemv_rmsnorm_prologue_matches_separate_norm(dtype, with_residual, gated, config, device):
    from shapeshift.kernels.rmsnorm import rmsnorm_ref

    m, k, n = 3, 100, 40  # K tail: the prologue and the tiles both mask
    x = torch.randn(m, k, dtype=dtype, device=device)
    residual = torch.randn(m, k, dtype=dtype, device=device) if with_residual else None
    norm_w = 1 + 0.1 * torch.randn(k, dtype=dtype, device=device)
    w = torch.randn(2 * n if gated else n, k, dtype=dtype, device=device) / k ** 0.5
    ref_in = rmsnorm_ref(x, norm_w, 1e-5, residual)
    normed, ref_h = ref_in if with_residual else (ref_in, None)
    launcher, ref = (gemv_silu_and_mul, gemv_silu_and_mul_ref) if gated else (gemv, gemv_ref)
    out = poisoned((m, n), dtype, device)
    residual_out = poisoned((m, k), dtype, device) if with_residual else None
    result = launcher(x, w, out=out, norm_weight=norm_w, eps=1e-5, residual=residual, residual_out=residual_out,
                      config=config)
    expected = ref(normed, w)
    if gated and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        # Five bfloat16 roundings in a row, each toward zero under the CPU interpreter (biased,
        # unlike the GPU's round-to-nearest): allow twice the usual bfloat16 norm error.
        rel = ((out.double() - expected.double()).norm() / expected.double().norm()).item()
        assert rel < 4e-2, rel
    else:
        assert_close_norm(out, expected, dtype)
    if with_residual:
        assert result[1] is residual_out
        # Exact up to the last rounding (Triton's CPU interpreter rounds float32 -> bfloat16 toward zero).
        assert_close_elementwise(residual_out, ref_h, dtype, "residual_out")
    else:
        assert result is out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k,with_norm", [(2, False), (3, True), (4, False)])
def test_split_k_fixup_equals_the_reduce_launch(dtype, split_k, with_norm, device, monkeypatch):
    """The last split of each row tile reduces (one launch): bit for bit the separate reduce
    kernel's result, with a bias and with the norm prologue, and the tile counters are back at
    zero for the next launch."""
    from shapeshift.kernels import gemv as gemv_module
    from shapeshift.kernels.checks import StreamCounters

    # only this test's launches create counters
    monkeypatch.setattr(gemv_module, "_SPLIT_K_COUNTERS", StreamCounters(min_size=4096))
    m, k, n = 3, 200, 72  # a ragged last row tile and a K tail
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    bias = torch.randn(n, dtype=dtype, device=device)
    norm = dict(norm_weight=1 + 0.1 * torch.randn(k, dtype=dtype, device=device), eps=1e-5) if with_norm else {}
    config = KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k)
    monkeypatch.setenv("SHAPESHIFT_GEMV_SPLIT_K_FIXUP", "0")
    want = gemv(x, w, bias, config=config, **norm)
    assert not gemv_module._SPLIT_K_COUNTERS  # the reduce launch: no counters
    monkeypatch.setenv("SHAPESHIFT_GEMV_SPLIT_K_FIXUP", "1")
    for _ in range(2):  # twice: the counters reset themselves
        got = gemv(x, w, bias, config=config, **norm)
        assert torch.equal(got, want)
    counters = [c for key, c in gemv_module._SPLIT_K_COUNTERS.items() if key[0] == x.device.type]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)


def test_gemv_rmsnorm_prologue_errors(device):
    x = torch.randn(2, 32, device=device)
    w = torch.randn(8, 32, device=device)
    with pytest.raises(ValueError, match="need norm_weight"):
        gemv(x, w, residual=torch.randn(2, 32, device=device))
    res = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="must not alias"):
        gemv(x, w, norm_weight=torch.ones(32, device=device), residual=res, residual_out=res)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above compile and run these kernels")
def test_decode_path_kernels_compile_for_sm90_without_spills():
    """Compile-only failures (layouts, types, shared memory) that the interpreter cannot see."""
    import collections
    import json
    import pathlib
    import subprocess
    import sys

    import triton

    here = pathlib.Path(__file__).resolve().parent
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton's bundled ptxas not found")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(here) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, str(here / "sm90_compile_decode_paths.py")], capture_output=True,
                            text=True, env=env, cwd=here, timeout=600)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if not r["ok"]]
    assert not failed, "\n".join(f"{r['label']} {r['kernel']}: {r['error']}" for r in failed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {r["kernel"] for r in rows} == {"_gemv_kernel", "_gemv_silu_and_mul_kernel", "_decode_layer_tail_kernel"}
    tail = [r for r in rows if r["kernel"] == "_decode_layer_tail_kernel"]
    labels = collections.Counter(r["label"] for r in tail)
    # decode_layer_tail: one launch with (split) barriers, the last layer's, unsplit barriers, 1 early
    # tile, with the next layer's attention, a launch per phase (4); the five one-launch forms
    # again under PDL, each with its grid-dependency wait.
    assert labels["decode_layer_tail, a launch per phase"] == 4
    assert sum(r["grid_dependency_wait"] for r in tail) == 5
    assert all(r["grid_dependency_wait"] == r["label"].startswith("pdl ") for r in tail)
    # decode_layer: 8, 1 and 4 attention splits, unsplit barriers, o_proj tiles before the attention
    # barrier, timestamps, and a launch per phase (5: attention + the tail's four).
    assert labels["decode_layer, a launch per phase"] == 5
    assert len(tail) == 25, labels
    assert len(rows) >= 6
    assert all(r["shared_bytes"] <= 227 * 1024 for r in rows), rows
    spilled = [r for r in rows if r["spill_store_bytes"]]
    assert not spilled, f"register spills: {spilled}"
    # Every one-launch form of the layer kernel leaves room for PROGRAMS_PER_SM programs an H100/H200
    # SM, by the launcher's own residency arithmetic (its grid and its speed assume them; one
    # program an SM cost 10-33% in measured variants, docs/decode-performance.md).
    from shapeshift.kernels.decode_layer_tail import PROGRAMS_PER_SM, programs_per_sm

    one_launch = [r for r in tail if "a launch per phase" not in r["label"]]
    too_many = [(r["label"], r["registers"]) for r in one_launch
                if programs_per_sm(r["registers"], r["num_warps"], r["shared_bytes"]) < PROGRAMS_PER_SM]
    assert not too_many, f"fewer than {PROGRAMS_PER_SM} programs an SM: {too_many}"


def test_gated_gemv_has_its_own_h200_tiles():
    """The gated gate/up GEMV takes its own tuned tiles where listed; the plain GEMV of the same
    (N, K) keeps the plain table's, and unlisted shapes fall back to the plain default."""
    from shapeshift.kernels.gemv import GEMV_SPEC, SM90_GATED_GEMV_TABLE, SM90_GEMV_TABLE

    problem = {"m": 1, "n": 8192, "k": 2048, "dtype": "bfloat16"}
    assert GEMV_SPEC.choose_default({**problem, "gated": True}, "sm90") == SM90_GATED_GEMV_TABLE[(8192, 2048)]
    assert GEMV_SPEC.choose_default(problem, "sm90") == SM90_GEMV_TABLE[(8192, 2048)]
    assert SM90_GATED_GEMV_TABLE[(8192, 2048)] != SM90_GEMV_TABLE[(8192, 2048)]
    other = {"m": 1, "n": 5632, "k": 2048, "dtype": "bfloat16"}
    assert GEMV_SPEC.choose_default({**other, "gated": True}, "sm90") == GEMV_SPEC.choose_default(other, "sm90")
