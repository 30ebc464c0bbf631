"""Launchers memoise their checks per argument metadata (checks.LaunchPlans) and defaults per
problem (registry fast path): a repeat call must still catch what changed - a new dtype, shape,
stride or device - and compute the same function as a first call."""

import pytest
import torch

from kernel_test_utils import assert_close_elementwise, assert_close_norm, poisoned
from shapeshift.kernels import registry
from shapeshift.kernels.checks import LaunchPlans, check_tensor
from shapeshift.kernels.decode_attention import decode_attention, decode_attention_ref
from shapeshift.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from shapeshift.kernels.rotary import rope_cos_sin_cache, rotary_kv_write, rotary_kv_write_ref


def test_rmsnorm_replans_for_a_strided_view_and_still_rejects_bad_arguments(device):
    x = torch.randn(6, 40, device=device)
    w = torch.randn(40, device=device)
    out = poisoned((6, 40), torch.float32, device)
    rmsnorm(x, w, 1e-6, out=out)
    assert_close_elementwise(out, rmsnorm_ref(x, w, 1e-6), torch.float32)
    wide = torch.randn(6, 80, device=device)
    strided = wide[:, ::2]  # same shape, non-unit last stride: must be re-checked, not served
    with pytest.raises(ValueError, match="unit stride in its last dim"):
        rmsnorm(strided, w, 1e-6)
    rows = wide[:, :40]  # same shape, row stride 80: a new plan, correct result
    out2 = poisoned((6, 40), torch.float32, device)
    rmsnorm(rows, w, 1e-6, out=out2)
    assert_close_elementwise(out2, rmsnorm_ref(rows, w, 1e-6), torch.float32)
    with pytest.raises(ValueError, match="weight has shape"):
        rmsnorm(x, torch.randn(41, device=device), 1e-6)
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        rmsnorm(x.tolist(), w, 1e-6)


def test_rotary_repeat_calls_catch_a_changed_dtype(device):
    T, hq, hkv, d = 3, 4, 2, 16
    q, k, v = (torch.randn(T, h, d, device=device) for h in (hq, hkv, hkv))
    cos_sin = rope_cos_sin_cache(d, 32, 10000.0, device=device)
    positions = torch.tensor([0, 5, 31], device=device)
    slots = torch.tensor([1, 4, 7], device=device)
    kc, vc = torch.zeros(2, 4, hkv, d, device=device), torch.zeros(2, 4, hkv, d, device=device)
    for _ in range(2):  # the second call is served from the plan
        got = rotary_kv_write(q, k, v, positions, cos_sin, kc, vc, slots)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    ref = rotary_kv_write_ref(q, k, v, positions, cos_sin, ref_k, ref_v, slots)
    assert_close_elementwise(got, ref, torch.float32)
    assert_close_elementwise(kc, ref_k, torch.float32, "k_cache")
    with pytest.raises(ValueError, match="positions has dtype torch.float32"):
        rotary_kv_write(q, k, v, positions.float(), cos_sin, kc, vc, slots)


def test_decode_attention_plans_per_config(device):
    kc = torch.randn(12, 16, 2, 32, device=device)
    vc = torch.randn(12, 16, 2, 32, device=device)
    tables = torch.randperm(12, device=device)[:10].view(2, 5).to(torch.int32)
    lens = torch.tensor([70, 33], dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 32, device=device)
    ref = decode_attention_ref(q, kc, vc, tables, lens, 0.2)
    one = registry.KernelConfig.make("dot", num_warps=4, num_stages=1, BLOCK_N=16, NUM_SPLITS=1)
    three = one.replace(NUM_SPLITS=4)
    for config in (one, three, one, None):
        out = poisoned((2, 4, 32), torch.float32, device)
        decode_attention(q, kc, vc, tables, lens, 0.2, out=out, config=config)
        assert_close_norm(out, ref, torch.float32, f"config {config}")


def test_launch_plans_stay_bounded():
    plans = LaunchPlans(limit=3)
    for i in range(10):
        plans.remember(i, i)
    assert len(plans) <= 3 and plans[9] == 9


def test_fast_default_matches_the_registry_choice():
    spec = registry.get_spec("gemv")
    problem = {"m": 1, "n": 3072, "k": 2048, "dtype": "bfloat16"}
    first = spec.default_config(problem, None)
    assert spec.default_config(dict(problem), None) is first  # served from the memo
    assert first == spec.choose_default(problem, "interpreter")
    reordered = {"k": 2048, "dtype": "bfloat16", "m": 1, "n": 3072}  # another key order: same answer
    assert spec.default_config(reordered, None) == first
    assert spec.default_config({**problem, "n": 128256}, None) == spec.choose_default({**problem, "n": 128256},
                                                                                      "interpreter")


def test_check_tensor_messages_are_unchanged(device):
    x = torch.randn(2, 3, device=device)
    with pytest.raises(ValueError, match=r"op: t must have shape \(2, \*, 4\), got shape \(2, 3\)"):
        check_tensor("op", "t", x, shape=(2, None, 4))
    with pytest.raises(ValueError, match=r"op: t has shape \(2, 3\) but expected \(2, 4\) \(dim 1 must be 4\)"):
        check_tensor("op", "t", x, shape=(2, 4))
    with pytest.raises(ValueError, match="op: t has dtype torch.float32, expected one of: int32"):
        check_tensor("op", "t", x, dtypes=(torch.int32,))
    with pytest.raises(ValueError, match="must be contiguous"):
        check_tensor("op", "t", x.t(), contiguous=True, last_dim_contiguous=False)
    assert check_tensor("op", "t", x, shape=(2, None), dtypes=(torch.float32,), device=x.device) is x


def test_programmatic_dependent_launch_only_where_asked_and_possible(monkeypatch):
    """SHAPESHIFT_PDL turns it on for Hopper-class CUDA devices only (unset: the default
    families); the CPU (and the interpreter) never get launch_pdl, whatever the environment says."""
    from shapeshift.kernels import checks

    monkeypatch.setattr(checks, "_PDL", {})
    monkeypatch.delenv("SHAPESHIFT_PDL", raising=False)
    assert checks.pdl_options(torch.device("cpu"), "gemv") == {"USE_PDL": False}
    monkeypatch.setattr(checks, "_PDL", {})
    monkeypatch.setenv("SHAPESHIFT_PDL", "1")
    assert checks.pdl_options(torch.device("cpu"), "gemv") == {"USE_PDL": False}
    with pytest.raises(ValueError, match="unknown kernel family 'matmul'"):
        checks.pdl_options(torch.device("cpu"), "matmul")
    if torch.cuda.is_available():
        monkeypatch.setattr(checks, "_PDL", {})
        cuda = torch.device("cuda", torch.cuda.current_device())
        hopper = torch.cuda.get_device_capability()[0] >= 9 and checks._triton_knows_pdl()
        assert checks.pdl_options(cuda, "gemv") == ({"USE_PDL": True, "launch_pdl": True} if hopper
                                                    else {"USE_PDL": False})
        monkeypatch.delenv("SHAPESHIFT_PDL")  # the default families: gemv yes, layer tail no
        assert checks.pdl_options(cuda, "gemv")["USE_PDL"] == hopper
        assert checks.pdl_options(cuda, "layer_tail") == {"USE_PDL": False}
        monkeypatch.setenv("SHAPESHIFT_PDL", "0")
        assert checks.pdl_options(cuda, "gemv") == {"USE_PDL": False}
        monkeypatch.setenv("SHAPESHIFT_PDL", "norm,attention")
        assert checks.pdl_options(cuda, "gemv") == {"USE_PDL": False}
        assert checks.pdl_options(cuda, "norm")["USE_PDL"] == hopper


def test_pdl_families_parse_the_environment_value(monkeypatch):
    from shapeshift.kernels import checks

    monkeypatch.delenv("SHAPESHIFT_PDL", raising=False)
    assert checks.pdl_families() == {"gemv", "norm", "sampling"}
    monkeypatch.setenv("SHAPESHIFT_PDL", "off")
    assert checks.pdl_families() == frozenset()

    assert checks.pdl_families("0") == checks.pdl_families("") == checks.pdl_families("off") == frozenset()
    assert checks.pdl_families(checks.DEFAULT_PDL_FAMILIES) == {"gemv", "norm", "sampling"}
    assert checks.pdl_families("1") == checks.pdl_families("all") == frozenset(checks.PDL_FAMILIES)
    assert checks.pdl_families(" norm, rotary ") == {"norm", "rotary"}
    with pytest.raises(ValueError, match=r"unknown kernel families \['gemm'\]"):
        checks.pdl_families("norm,gemm")


def test_gemv_weight_prefetch_follows_the_environment(monkeypatch):
    """SHAPESHIFT_GEMV_PREFETCH: whole columns >= 0, rounded up to a power of two, at least one
    128-byte line of the weight's dtype, on CUDA only; with or without PDL."""
    from shapeshift.kernels import checks, gemv

    monkeypatch.delenv("SHAPESHIFT_GEMV_PREFETCH", raising=False)
    assert checks.gemv_prefetch_columns() == 0
    for bad in ("many", "-64", "1.5"):
        monkeypatch.setenv("SHAPESHIFT_GEMV_PREFETCH", bad)
        with pytest.raises(ValueError, match="SHAPESHIFT_GEMV_PREFETCH"):
            checks.gemv_prefetch_columns()
    weight = torch.empty(8, 8, dtype=torch.bfloat16)
    monkeypatch.setenv("SHAPESHIFT_GEMV_PREFETCH", "300")
    monkeypatch.setattr(gemv, "pdl_options", lambda device, family: {"USE_PDL": False})
    assert gemv._pdl_and_prefetch(weight) == {"USE_PDL": False}  # a CPU weight: no PTX prefetch
    monkeypatch.setattr(gemv, "_prefetch_allowed", lambda weight: True)  # as on a GPU
    assert gemv._pdl_and_prefetch(weight) == {"USE_PDL": False, "PREFETCH_K": 512, "PREFETCH_LINE": 64}
    monkeypatch.setattr(gemv, "pdl_options", lambda device, family: {"USE_PDL": True, "launch_pdl": True})
    monkeypatch.delenv("SHAPESHIFT_PDL_GEMV_TRIGGER", raising=False)
    assert gemv._pdl_and_prefetch(weight) == {"USE_PDL": True, "launch_pdl": True, "PREFETCH_K": 512,
                                              "PREFETCH_LINE": 64, "TRIGGER_LATE": False}
    monkeypatch.setenv("SHAPESHIFT_PDL_GEMV_TRIGGER", "late")
    assert gemv._pdl_and_prefetch(weight)["TRIGGER_LATE"] is True
    monkeypatch.setenv("SHAPESHIFT_PDL_GEMV_TRIGGER", "soon")
    with pytest.raises(ValueError, match="early or late"):
        gemv._pdl_and_prefetch(weight)
    monkeypatch.delenv("SHAPESHIFT_PDL_GEMV_TRIGGER")
    assert gemv._pdl_and_prefetch(weight.float())["PREFETCH_LINE"] == 32
    monkeypatch.setenv("SHAPESHIFT_GEMV_PREFETCH", "32")  # under one bf16 line: none
    assert "PREFETCH_K" not in gemv._pdl_and_prefetch(weight)
