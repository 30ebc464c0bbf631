"""Compile every kernel for sm_90 (H100 / H200) without a GPU, as a subprocess of the tests.

Data flow: with TRITON_INTERPRET unset, each launcher is called on CPU tensors of realistic
(Llama-3.2-1B / Qwen3-MoE) shapes with its H200 default config; `JITFunction.run` is patched to
record the launch instead of running it. Each recorded launch is turned into a Triton
ASTSource (signature from the argument types, the launch's constexprs, 16-byte divisibility
hints like the runtime's specialisation) and compiled for GPUTarget("cuda", 90, 32) down to a
cubin with Triton's bundled ptxas, which also reports registers and spills.
Prints one JSON object per compiled kernel; exits non-zero if any compile failed.
SM90_COMPILE_ONLY (a label prefix) compiles one family only; SM90_CUBIN_DIR keeps each compiled
variant's cubin there (its path in the row's "cubin"); SM90_COMPILE_WORKERS (default: the CPU
count) compiles that many variants at once, in forked processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

LAUNCHES: list[tuple[JITFunction, tuple, dict, str]] = []
_CURRENT = {"label": ""}


def _record(self, *args, grid, warmup, **kwargs):
    LAUNCHES.append((self, args, kwargs, _CURRENT["label"]))


JITFunction.run = _record

from shapeshift.kernels import (activation, argmax, decode_attention, decode_layer_tail, gemv, moe,  # noqa: E402
                                prefill_attention, rmsnorm, rotary, sampling)

for module in (activation, argmax, decode_attention, decode_layer_tail, gemv, moe, prefill_attention, rmsnorm, rotary,
               sampling):
    module.check_runnable_device = lambda op, tensor: None

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1"}
BF16 = torch.bfloat16


def sm90(spec, problem):
    return spec.choose_default(problem, "sm90")


def launch_all(prefix: str = "") -> None:
    def label(name):
        _CURRENT["label"] = prefix + name

    e = torch.empty
    label("rmsnorm")
    x = e(64, 2048, dtype=BF16)
    rmsnorm.rmsnorm(x, e(2048, dtype=BF16), 1e-5, e(64, 2048, dtype=BF16),
                    config=sm90(rmsnorm.RMSNORM_SPEC, {"rows": 64, "hidden": 2048}))
    label("silu_and_mul")
    activation.silu_and_mul(e(64, 16384, dtype=BF16),
                            config=sm90(activation.SILU_AND_MUL_SPEC, {"rows": 64, "inner": 8192}))
    label("rotary_kv_write")
    qkv = e(64, 48 * 64, dtype=BF16)
    rotary.rotary_kv_write(qkv[:, :2048].view(64, 32, 64), qkv[:, 2048:2560].view(64, 8, 64),
                           qkv[:, 2560:].view(64, 8, 64), e(64, dtype=torch.int64), e(4096, 64),
                           e(100, 16, 8, 64, dtype=BF16), e(100, 16, 8, 64, dtype=BF16), e(64, dtype=torch.int64),
                           config=sm90(rotary.ROTARY_SPEC, {"q_heads": 32, "head_dim": 64}))
    for name, B, max_blocks in (("decode_attention split", 8, 256), ("decode_attention one-pass", 256, 64)):
        label(name)
        problem = {"batch": B, "q_heads": 32, "kv_heads": 8, "head_dim": 64, "max_context": max_blocks * 16}
        decode_attention.decode_attention(
            e(B, 32, 64, dtype=BF16), e(2000, 16, 8, 64, dtype=BF16), e(2000, 16, 8, 64, dtype=BF16),
            e(B, max_blocks, dtype=torch.int32), e(B, dtype=torch.int32), 0.125,
            config=sm90(decode_attention.DECODE_ATTENTION_SPEC, problem))
    label("decode_attention split, pass 2 as a launch of its own")
    problem = {"batch": 8, "q_heads": 32, "kv_heads": 8, "head_dim": 64, "max_context": 4096}
    decode_attention.decode_attention(
        e(8, 32, 64, dtype=BF16), e(2000, 16, 8, 64, dtype=BF16), e(2000, 16, 8, 64, dtype=BF16),
        e(8, 256, dtype=torch.int32), e(8, dtype=torch.int32), 0.125,
        config=sm90(decode_attention.DECODE_ATTENTION_SPEC, problem).replace(MERGE_LAST=0))
    label("decode_attention_rope")  # rotary + KV write fused in, at batch 1 in a 512-token width
    qkv = e(1, 48 * 64, dtype=BF16)
    decode_attention.decode_attention_rope(
        qkv[:, :2048].view(1, 32, 64), qkv[:, 2048:2560].view(1, 8, 64), qkv[:, 2560:].view(1, 8, 64),
        e(1, dtype=torch.int64), e(4096, 64), e(1, dtype=torch.int64),
        e(100, 16, 8, 64, dtype=BF16), e(100, 16, 8, 64, dtype=BF16), e(1, 32, dtype=torch.int32),
        e(1, dtype=torch.int32), 0.125,
        config=sm90(decode_attention.DECODE_ATTENTION_SPEC, {"batch": 1, "q_heads": 32, "kv_heads": 8,
                                                             "head_dim": 64, "max_context": 512}))
    label("decode_attention with an L2 prefetch of the next weights")
    decode_attention._prefetch_allowed = lambda q: True  # compiled for a GPU, launched from the CPU here
    decode_attention.decode_attention(
        e(1, 32, 64, dtype=BF16), e(100, 16, 8, 64, dtype=BF16), e(100, 16, 8, 64, dtype=BF16),
        e(1, 32, dtype=torch.int32), e(1, dtype=torch.int32), 0.125,
        config=sm90(decode_attention.DECODE_ATTENTION_SPEC, {"batch": 1, "q_heads": 32, "kv_heads": 8,
                                                             "head_dim": 64, "max_context": 512}),
        l2_prefetch=((e(2048, 2048, dtype=BF16), 8 << 20), (e(16384, 2048, dtype=BF16), 24 << 20)))
    label("decode_attention fma")
    decode_attention.decode_attention(
        e(4, 32, 64, dtype=BF16), e(100, 16, 8, 64, dtype=BF16), e(100, 16, 8, 64, dtype=BF16),
        e(4, 64, dtype=torch.int32), e(4, dtype=torch.int32), 0.125,
        config=decode_attention.KernelConfig.make("fma", num_warps=4, num_stages=2, BLOCK_N=32, NUM_SPLITS=4))
    for m, n, k in ((1, 2048, 8192), (1, 128256, 2048), (16, 3072, 2048)):
        label(f"gemv M={m} N={n} K={k}")
        gemv.gemv(e(m, k, dtype=BF16), e(n, k, dtype=BF16), config=sm90(gemv.GEMV_SPEC, {"m": m, "n": n, "k": k}))
    label("gemv split-K with its fix-up")  # the last split reduces: atomics with acquire/release
    split = gemv.KernelConfig.make("dot", num_warps=2, num_stages=5, BLOCK_N=16, BLOCK_K=512, SPLIT_K=2)
    gemv.gemv(e(1, 8192, dtype=BF16), e(2048, 8192, dtype=BF16), config=split)
    label("gemv split-K with a reduce launch")  # SHAPESHIFT_GEMV_SPLIT_K_FIXUP=0
    os.environ["SHAPESHIFT_GEMV_SPLIT_K_FIXUP"] = "0"
    try:
        gemv.gemv(e(1, 8192, dtype=BF16), e(2048, 8192, dtype=BF16), config=split)
    finally:
        del os.environ["SHAPESHIFT_GEMV_SPLIT_K_FIXUP"]
    label("gemv_silu_and_mul M=1")
    gemv.gemv_silu_and_mul(e(1, 2048, dtype=BF16), e(16384, 2048, dtype=BF16),
                           config=sm90(gemv.GEMV_SPEC, {"m": 1, "n": 8192, "k": 2048}))
    label("gemv fma")
    gemv.gemv(e(1, 2048, dtype=BF16), e(3072, 2048, dtype=BF16),
              config=gemv.KernelConfig.make("fma", num_warps=4, num_stages=2, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2))
    label("argmax")
    argmax.argmax(e(1, 128256), config=sm90(argmax.ARGMAX_SPEC, {"batch": 1, "vocab": 128256}))
    label("sample")
    sampling.sample(e(8, 128256), e(8), e(8, dtype=torch.int32), e(8), e(8, dtype=torch.int64),
                    config=sm90(sampling.SAMPLE_SPEC, {"batch": 8, "vocab": 128256}))
    label("sample sort")  # the full-sort candidate path, for Triton builds without tl.topk
    has_topk, sampling._TL_HAS_TOPK = sampling._TL_HAS_TOPK, False
    sampling.sample(e(1, 128256), e(1), e(1, dtype=torch.int32), e(1), e(1, dtype=torch.int64),
                    config=sm90(sampling.SAMPLE_SPEC, {"batch": 1, "vocab": 128256}))
    sampling._TL_HAS_TOPK = has_topk
    for name, max_q in (("prefill_attention long", 2048), ("prefill_attention short", 8)):
        label(name)
        prefill_attention.prefill_attention(
            e(2048, 32, 64, dtype=BF16), e(300, 16, 8, 64, dtype=BF16), e(300, 16, 8, 64, dtype=BF16),
            e(1, 256, dtype=torch.int32), e(2, dtype=torch.int32), e(1, dtype=torch.int32), 0.125, max_q,
            config=sm90(prefill_attention.PREFILL_ATTENTION_SPEC, {"max_query_len": max_q, "head_dim": 64,
                                                                   "query_group": 4}))
    label("topk_routing")
    moe.topk_routing(e(64, 128), 8, True, config=sm90(moe.TOPK_ROUTING_SPEC, {"experts": 128}))
    label("moe_align")
    moe.moe_align(torch.zeros(64, 8, dtype=torch.int32), 128, 16)
    for tokens in (16, 4096):
        label(f"moe_grouped_gemm T={tokens}")
        problem = {"tokens": tokens, "top_k": 8, "experts": 128}
        config = sm90(moe.MOE_GEMM_SPEC, problem)
        sorted_ids, expert_ids, num_padded = (e(n, dtype=torch.int32) for n in (
            *moe.moe_align_sizes(tokens * 8, 128, config["BLOCK_M"]), 1))
        moe.moe_grouped_gemm(e(tokens, 2048, dtype=BF16), e(128, 1536, 2048, dtype=BF16), sorted_ids, expert_ids,
                             num_padded, 8, a_per_token=True, config=config)


def _signature(fn: JITFunction, args: tuple, kwargs: dict):
    signature, constexprs, attrs = {}, {}, {}
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    for index, param in enumerate(fn.params):
        name = param.name
        value = bound[name] if name in bound else param.default  # a defaulted constexpr left out
        if param.is_constexpr or value is None:  # None arguments specialise as constexprs
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and value != 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    return signature, constexprs, attrs


def _ptxas_report(ptx: str) -> dict:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
        handle.write(ptx)
    try:
        result = subprocess.run([ptxas, "-v", f"-arch={arch}", handle.name, "-o", os.devnull],
                                capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(handle.name)
    text = result.stderr + result.stdout
    registers = re.search(r"Used (\d+) registers", text)
    spill_stores = re.search(r"(\d+) bytes spill stores", text)
    spill_loads = re.search(r"(\d+) bytes spill loads", text)
    return {"arch": arch, "registers": int(registers.group(1)) if registers else None,
            "spill_store_bytes": int(spill_stores.group(1)) if spill_stores else None,
            "spill_load_bytes": int(spill_loads.group(1)) if spill_loads else None}


PDL_MODULES = ("activation", "argmax", "decode_attention", "decode_layer_tail", "gemv", "rmsnorm", "rotary")


VARIANTS: list[tuple] = []  # (number, kernel, launch kwargs, label, signature, constexprs, attrs), deduplicated


def _compile(index: int) -> dict:
    """Compile VARIANTS[index] for sm_90a down to a cubin; its JSON row (ok False, with the error, if it failed)."""
    number, fn, kwargs, label, signature, constexprs, attrs = VARIANTS[index]
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    row = {"label": label, "kernel": fn.__name__, "triton": triton.__version__, **options}
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        row["shared_bytes"] = compiled.metadata.shared
        cubin_dir = os.environ.get("SM90_CUBIN_DIR")  # keep each variant's cubin (hack/sass_loops.py)
        if cubin_dir:
            row["cubin"] = os.path.join(cubin_dir, f"{number:03d}-{re.sub(r'[^A-Za-z0-9]+', '-', label)}.cubin")
            with open(row["cubin"], "wb") as handle:
                handle.write(compiled.asm["cubin"])
        row.update(_ptxas_report(compiled.asm["ptx"]))
        row["grid_dependency_wait"] = "griddepcontrol.wait" in compiled.asm["ptx"]
        row["l2_prefetch"] = "prefetch.global.L2" in compiled.asm["ptx"]
        row["prefetch_k"] = constexprs.get("PREFETCH_K", 0)
        row["fuse_rope"] = bool(constexprs.get("FUSE_ROPE", False))
        row["split_k_fixup"] = bool(constexprs.get("FUSED_REDUCE", False))
        row["attention_prefetch"] = bool(constexprs.get("PREFETCH", False))
        row["ok"] = True
    except Exception as error:  # report every failure, keep compiling the rest
        row["ok"] = False
        row["error"] = f"{type(error).__name__}: {str(error)[-1500:]}"
    return row


def main() -> int:
    launch_all()
    # Again with programmatic dependent launch on (checks.pdl_options): the decode-path kernels
    # compile with their grid-dependency prologue; kernels without one dedupe to the first pass.
    for name in PDL_MODULES:
        getattr(sys.modules["shapeshift.kernels." + name], "pdl_options")  # each launcher has it
        setattr(sys.modules["shapeshift.kernels." + name], "pdl_options",
                lambda device, family: {"USE_PDL": True, "launch_pdl": True})
    launch_all("pdl ")
    # And with the GEMVs' weight prefetch ahead of the wait (checks.gemv_prefetch_columns).
    os.environ["SHAPESHIFT_GEMV_PREFETCH"] = "512"
    gemv_module = sys.modules["shapeshift.kernels.gemv"]
    gemv_module._prefetch_allowed = lambda weight: True  # compiled for a GPU, launched from the CPU here
    launch_all("pdl prefetch ")
    os.environ["SHAPESHIFT_PDL_GEMV_TRIGGER"] = "late"  # ... letting the next kernel launch after the stream
    launch_all("pdl prefetch late ")
    seen = set()
    only = os.environ.get("SM90_COMPILE_ONLY", "")  # a label prefix, to recompile one kernel family
    for fn, args, kwargs, label in LAUNCHES:
        if only and not label.startswith(only):
            continue
        signature, constexprs, attrs = _signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sorted((k, str(v)) for k, v in constexprs.items())),
               kwargs.get("num_warps"), kwargs.get("num_stages"))
        if key in seen:
            continue
        seen.add(key)
        VARIANTS.append((len(seen), fn, kwargs, label, signature, constexprs, attrs))
    # Each variant compiles on its own (LLVM, then ptxas), so they spread over the cores: forked
    # workers inherit VARIANTS and the patched launchers and send back the rows, printed in order.
    workers = max(1, min(len(VARIANTS), int(os.environ.get("SM90_COMPILE_WORKERS", os.cpu_count() or 1))))
    if workers == 1:
        rows = [_compile(i) for i in range(len(VARIANTS))]
    else:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(workers) as pool:
            rows = pool.map(_compile, range(len(VARIANTS)), chunksize=1)
    failures = 0
    for row in rows:
        failures += not row["ok"]
        print(json.dumps(row), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
