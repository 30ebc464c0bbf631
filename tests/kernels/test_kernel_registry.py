"""The declared search spaces: every op registered, enumerable, defaults inside the space,
and a sample of non-default configs per op computing the same function as the reference."""

import random

import pytest
import torch

from shapeshift.kernels import registry
from shapeshift.kernels.registry import KernelConfig, all_specs, get_spec

EXPECTED_OPS = {"rmsnorm", "silu_and_mul", "rotary_kv_write", "decode_attention", "gemv", "sample", "argmax",
                "prefill_attention", "topk_routing", "moe_grouped_gemm"}

PROBLEMS = {
    "rmsnorm": {"rows": 4, "hidden": 2048, "dtype": "bfloat16"},
    "silu_and_mul": {"rows": 4, "inner": 8192, "dtype": "bfloat16"},
    "rotary_kv_write": {"tokens": 4, "q_heads": 32, "kv_heads": 8, "head_dim": 64, "dtype": "bfloat16"},
    "decode_attention": {"batch": 8, "q_heads": 32, "kv_heads": 8, "head_dim": 64, "max_context": 4096,
                         "block_size": 16, "dtype": "bfloat16"},
    "gemv": {"m": 1, "n": 8192, "k": 2048, "dtype": "bfloat16"},
    "sample": {"batch": 8, "vocab": 128256},
    "argmax": {"batch": 1, "vocab": 128256},
    "prefill_attention": {"max_query_len": 512, "head_dim": 64, "query_group": 4, "dtype": "bfloat16"},
    "topk_routing": {"tokens": 64, "experts": 128, "top_k": 8},
    "moe_grouped_gemm": {"tokens": 64, "top_k": 8, "experts": 128, "n": 1536, "k": 2048, "dtype": "bfloat16"},
}


def test_every_op_is_registered_with_reference_and_launcher():
    specs = all_specs()
    assert EXPECTED_OPS <= set(specs)
    for op, spec in specs.items():
        assert callable(spec.launcher) and callable(spec.reference), op
        assert spec.config_space.size() > 1, f"{op}: a search space with one point is not a search space"
        assert set(PROBLEMS[op]) == set(spec.problem_keys), op


@pytest.mark.parametrize("device_key", ["interpreter", "sm90", "sm80", "cuda"])
def test_defaults_are_points_of_their_space(device_key):
    for op, spec in all_specs().items():
        config = spec.choose_default(PROBLEMS[op], device_key)
        assert spec.is_valid(config, PROBLEMS[op]), f"{op} default {config} for {device_key} is outside its space"


def test_enumeration_respects_constraints_and_round_trips():
    spec = get_spec("gemv")
    problem = {"m": 8, "n": 2048, "k": 256, "dtype": "bfloat16"}
    configs = list(spec.config_space.configs(problem))
    assert configs and all(c.variant == "dot" for c in configs), "fma serves at most 4 rows"
    assert all(c["SPLIT_K"] == 1 or c["SPLIT_K"] * c["BLOCK_K"] <= 256 for c in configs)
    assert len(configs) < spec.config_space.size() * 5 * 3  # the constraint removed something
    for config in configs[:5]:
        assert KernelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown kernel op 'nope'"):
        get_spec("nope")


def test_device_key_on_this_machine():
    expected = "interpreter" if not torch.cuda.is_available() else registry.device_key(torch.device("cuda"))
    assert registry.device_key(torch.device("cpu")) == "interpreter"
    assert registry.device_key(None) == "interpreter"
    assert expected in {"interpreter", "sm90", "sm80", "cuda"}


# Small problems that every config of the space can run, for the sampled-config check below.
def _run_rmsnorm(config, device):
    from shapeshift.kernels.rmsnorm import rmsnorm, rmsnorm_ref
    x, w = torch.randn(6, 96, device=device), torch.randn(96, device=device)
    return rmsnorm(x, w, 1e-5, config=config), rmsnorm_ref(x, w, 1e-5)


def _run_gemv(config, device):
    from shapeshift.kernels.gemv import gemv, gemv_ref
    x, w = torch.randn(3, 256, device=device), torch.randn(40, 256, device=device)
    return gemv(x, w, config=config), gemv_ref(x, w)


def _run_decode(config, device):
    from shapeshift.kernels.decode_attention import decode_attention, decode_attention_ref
    kc = torch.randn(12, 16, 2, 32, device=device)
    vc = torch.randn(12, 16, 2, 32, device=device)
    bt = torch.randperm(12, device=device)[:10].view(2, 5).to(torch.int32)
    cl = torch.tensor([70, 33], dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 32, device=device)
    return decode_attention(q, kc, vc, bt, cl, 0.2, config=config), decode_attention_ref(q, kc, vc, bt, cl, 0.2)


SAMPLED = {"rmsnorm": (_run_rmsnorm, {"rows": 6, "hidden": 96, "dtype": "float32"}),
           "gemv": (_run_gemv, {"m": 3, "n": 40, "k": 256, "dtype": "float32"}),
           "decode_attention": (_run_decode, {"batch": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 32,
                                              "max_context": 80, "block_size": 16, "dtype": "float32"})}


@pytest.mark.parametrize("op", sorted(SAMPLED))
def test_sampled_configs_compute_the_reference(op, device):
    run, problem = SAMPLED[op]
    configs = list(get_spec(op).config_space.configs(problem))
    rng = random.Random(op)
    # Interpreter runs are slow: a few configs per op there, more on a GPU; always every variant.
    count = 3 if device.type == "cpu" else 6
    picked = rng.sample(configs, min(count, len(configs)))
    for variant in get_spec(op).config_space.variant_names():
        picked.append(next(c for c in configs if c.variant == variant))
    for config in picked:
        out, ref = run(config, device)
        rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < 2e-3, f"{op} {config}: relative error {rel:.2e}"


def test_gemv_h200_table_entries_are_valid_defaults():
    from shapeshift.kernels.gemv import GEMV_SPEC, SM90_GEMV_TABLE

    assert {(3072, 2048), (2048, 8192), (8192, 2048), (128256, 2048)} <= set(SM90_GEMV_TABLE)
    for (n, k), config in SM90_GEMV_TABLE.items():
        for m in (1, 16):
            problem = {"m": m, "n": n, "k": k, "dtype": "bfloat16"}
            assert GEMV_SPEC.is_valid(config, problem), f"({n}, {k}) M={m}: {config} is outside the space"
            assert GEMV_SPEC.choose_default(problem, "sm90") == config
    # Other devices and untabled shapes keep the heuristic.
    assert GEMV_SPEC.choose_default({"m": 1, "n": 3072, "k": 2048, "dtype": "bfloat16"}, "sm80").num_stages == 3
    untabled = {"m": 1, "n": 3000, "k": 2048, "dtype": "bfloat16"}
    assert GEMV_SPEC.is_valid(GEMV_SPEC.choose_default(untabled, "sm90"), untabled)
