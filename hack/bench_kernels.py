#!/usr/bin/env python3
"""Benchmark every shapeshift kernel on a CUDA GPU against the measured ceilings and torch.

Data flow: the parent process starts one worker subprocess per op group (ceilings, rmsnorm,
silu_and_mul, rotary, decode_attention, gemv, sampling, prefill_attention, moe, host) so that
a crash or an illegal memory access in one kernel cannot take the others down; each worker
builds decode-sized and prefill-sized inputs (Llama-3.2-1B and Qwen3-30B-A3B shapes), checks
the kernel against its float32 reference and times it and a plain torch baseline, saving its
rows after every case. The parent merges the rows with the ceilings (device-to-device copy
bandwidth and a bf16 8192^3 matmul, measured in the same run), rewrites
bench/results/kernels-<shapes>-<gpu>-<utc>.json after every group (commit, GPU, versions, command), and
prints a table at the end. A worker or the whole run cut short still leaves its results.

Timing. Decode-sized rows are timed twice:
  graph us: N calls captured into one CUDA graph and replayed (CUDA events around the replay,
            divided by N), cycling through copies of the large inputs (weights, KV cache,
            logits) that together exceed 3x the L2, so the kernel streams from HBM as in a
            real decode step. This is the kernel as the engine's CUDA-graph runner sees it,
            and the figure of record: GB/s, %copy, TF/s and x torch come from it.
  eager us: triton.testing.do_bench on Python launches (L2 flushed between calls). For small
            kernels this is the host launch rate (launcher checks + Triton dispatch), not the
            kernel: the GPU waits for the host.
Prefill-sized rows run long enough that eager time is the kernel time; they are timed eagerly.
The torch baseline is timed the same way as the row (graphs where it can be captured).
The `host` group reports each launcher's host cost per call, with and without Triton's launch.
`shapeshift.kernels` must be importable: the editable install (hack/setup.sh), or the namespace
hack/gpu_run.sh builds on a GPU machine (`hack/gpu_run.sh kernels`).

    python3 hack/bench_kernels.py                     # full run (~2-4 min on an H200, --budget-s 240)
    python3 hack/bench_kernels.py --quick             # smaller subset
    python3 hack/bench_kernels.py --tune --ops gemv --budget-s 300
                                                      # also sweep the search space (graph-timed for
                                                      # decode rows) and print a GEMV default table
    python3 hack/bench_kernels.py --ops gemv,moe --out-dir /tmp/results
    python3 hack/bench_kernels.py --smoke             # CPU, Triton interpreter, tiny shapes: plumbing only

Shares: memory-bound rows quote achieved bytes / measured copy bandwidth (nominal ~4.2 TB/s
on an H200); compute-bound rows quote FLOP/s / measured bf16 matmul rate (~790 TFLOP/s).
Bytes are the fewest the op must move (each input read once, each output written once).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import os
import pathlib
import platform
import random
import subprocess
import sys
import time
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
from benchmeta import claim_result_name, git_commit, hardware_slug, result_name  # noqa: E402  (sibling module)

GROUPS = ("ceilings", "rmsnorm", "silu_and_mul", "rotary", "decode_attention", "gemv", "sampling",
          "prefill_attention", "moe", "host")
# --smoke runs every group on the CPU through Triton's interpreter with tiny shapes and a
# plain timer: it checks this script's plumbing on a machine without a GPU, nothing more.
DEVICE = "cuda"
SMOKE = False
NOMINAL_COPY_TBS = 4.2
NOMINAL_BF16_TFLOPS = 790.0


def _sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _cap(n, limit=8):
    """A size, shrunk to `limit` in --smoke mode."""
    return min(n, limit) if SMOKE else n


def _configure(smoke):
    global DEVICE, SMOKE, LLAMA, MOE
    if smoke:
        DEVICE, SMOKE = "cpu", True
        os.environ["TRITON_INTERPRET"] = "1"
        LLAMA = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "vocab": 300}
        MOE = {"experts": 8, "top_k": 2, "hidden": 32, "inter": 16}


# ----------------------------------------------------------------------------- measurement
class Case:
    """One benchmark row: a kernel call (optionally with a config), a torch baseline, a check."""

    def __init__(self, op, group, label, shape, run, torch_fn=None, check=None, nbytes=None, flops=None,
                 problem=None, extra=None, tune=False, spec_op=None, tolerance=3e-2, rotate=None, graph=None,
                 torch_graph=True):
        self.op, self.group, self.label, self.shape = op, group, label, shape
        self.run = run  # run(config=None) -> output
        # rotate() -> another run(config=None) over a fresh copy of the large inputs; the graph
        # timing cycles through copies totalling several L2 sizes, so the kernel streams from
        # HBM as it does in a real decode step (weights and KV never stay in L2 there).
        self.rotate = rotate
        # CUDA-graph timing: default for decode-sized rows, where launch overhead hides the kernel.
        self.graph = (label == "decode") if graph is None else graph
        self.torch_graph = torch_graph  # False where the torch baseline syncs with the host
        self.torch_fn = torch_fn
        self.check = check  # check() -> relative error vs the float32 reference
        self.nbytes, self.flops = nbytes, flops
        self.problem = problem
        self.extra = extra or {}
        self.tune = tune  # a representative case the --tune sweep runs on
        self.spec_op = spec_op or op  # registry op whose configs `run` accepts
        self.tolerance = tolerance  # largest acceptable check() value (bf16 relative error)


def _time(fn, quick, short=False):
    """Eager timing: triton.testing.do_bench (events around each call, L2 flushed between
    calls). For small kernels this includes the host's launch overhead: the GPU waits for the
    launcher, so the figure is the launch rate, not the kernel."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        return {"median_us": elapsed * 1e6, "p20_us": elapsed * 1e6, "p80_us": elapsed * 1e6}
    import triton.testing

    warmup, rep = (5, 20) if short else (10, 30) if quick else (25, 100)
    median, p20, p80 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return {"median_us": median * 1e3, "p20_us": p20 * 1e3, "p80_us": p80 * 1e3}


def _l2_bytes():
    import torch

    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size) or 50 << 20
    except Exception:
        return 50 << 20  # an H200's 50 MB


def _rotation_count(nbytes):
    """Input copies to cycle through so that one pass over all of them is >= 3 L2 sizes."""
    if SMOKE or not nbytes:
        return 1
    return max(1, min(16, -(-3 * _l2_bytes() // int(nbytes))))


def time_graph(fns, quick):
    """Graph timing: capture calls cycling through `fns` (one per input copy) into one CUDA
    graph, replay it, and divide the event time by the calls per replay. No host launch cost
    is in the figure, only the kernels and the GPU's back-to-back launch gaps, as inside the
    engine's decode graph. Calls per graph are sized so one replay lasts ~1 ms (10..400)."""
    if SMOKE:
        return _time(fns[0], quick)
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up outside the capture: compilation, allocator, autotuning
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def capture(calls):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: per-stream kernel state
            for i in range(calls):
                fns[i % len(fns)]()
        return graph

    def replay_us(graph, calls, replays):
        graph.replay()  # first replay uploads the graph
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return sorted(times)

    calls = max(10, len(fns))
    probe = capture(calls)
    per_call = replay_us(probe, calls, 3)[1]
    del probe
    target_calls = int(min(400, max(calls, 1000.0 / max(per_call, 0.5))))
    target_calls = -(-target_calls // len(fns)) * len(fns)  # whole cycles through the copies
    graph = capture(target_calls)
    times = replay_us(graph, target_calls, 10 if quick else 25)
    del graph
    n = len(times)
    return {"median_us": times[n // 2], "p20_us": times[int(0.2 * (n - 1))], "p80_us": times[int(0.8 * (n - 1))],
            "calls_per_graph": target_calls, "input_copies": len(fns)}


def _rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not bool(out.isfinite().all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _rotated_runs(case):
    """(kernel runs, torch runs): case.run / case.torch_fn plus enough rotated copies to
    stream several L2 sizes per graph cycle. rotate() returns run or (run, torch_fn)."""
    runs, torch_runs = [case.run], [case.torch_fn]
    if case.rotate is not None:
        for _ in range(_rotation_count(case.nbytes) - 1):
            made = case.rotate()
            run, torch_fn = made if isinstance(made, tuple) else (made, None)
            runs.append(run)
            torch_runs.append(torch_fn)
    return runs, [f for f in torch_runs if f is not None]


def _measure_case(case, quick):
    """One row. `kernel` is the figure of record: the graph time where the row is timed in a
    CUDA graph (decode-sized rows), else the eager time; `graph` and `eager` keep both."""
    row = {"op": case.op, "group": case.group, "label": case.label, "shape": case.shape,
           "bytes": case.nbytes, "flops": case.flops, **case.extra}
    try:
        if case.check is not None:
            row["rel_err"] = case.check()
            row["check_ok"] = bool(row["rel_err"] <= case.tolerance)
        case.run()
        _sync()
        row["eager"] = _time(case.run, quick, short=case.graph)
        row["kernel"], row["timing"] = row["eager"], "eager"
        runs, torch_runs = ([case.run], [case.torch_fn]) if not case.graph else _rotated_runs(case)
        if case.graph:
            try:
                row["graph"] = time_graph(runs, quick)
                row["kernel"], row["timing"] = row["graph"], "graph"
            except Exception as error:
                row["graph_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                _sync()
        t = row["kernel"]["median_us"] * 1e-6
        if case.nbytes:
            row["gbps"] = case.nbytes / t / 1e9
        if case.flops:
            row["tflops"] = case.flops / t / 1e12
    except Exception as error:  # one failing case must not stop the others
        row["error"] = f"{type(error).__name__}: {error}"
        row["traceback"] = traceback.format_exc()[-3000:]
        return row
    if case.torch_fn is not None:
        try:
            case.torch_fn()
            _sync()
            row["torch_eager"] = _time(case.torch_fn, quick, short=case.graph)
            row["torch"] = row["torch_eager"]
            if case.graph and case.torch_graph:
                try:
                    row["torch"] = row["torch_graph"] = time_graph(torch_runs, quick)
                except Exception as error:
                    row["torch_graph_error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    _sync()
            row["speedup_vs_torch"] = row["torch"]["median_us"] / row["kernel"]["median_us"]
        except Exception as error:
            row["torch_error"] = f"{type(error).__name__}: {error}"
    return row


def _axis_distance(a, b):
    """How many of (params, num_warps, num_stages) differ between two configs of one variant."""
    pa, pb = dict(a.params), dict(b.params)
    return sum(pa[k] != pb.get(k) for k in pa) + (a.num_warps != b.num_warps) + (a.num_stages != b.num_stages)


def _tune_case(case, spec, budget_s, max_configs, quick):
    """Time a random sample of the op's search space (plus the default) on one case."""
    import torch

    configs = list(spec.config_space.configs(case.problem))
    random.Random(case.op).shuffle(configs)
    default = spec.default_config(case.problem, torch.device(DEVICE))
    # First the default's one-axis neighbours (cheap, informative), then random points.
    neighbours = [c for c in configs if c.variant == default.variant and _axis_distance(c, default) == 1]
    ordered = [default] + neighbours + [c for c in configs if c != default and c not in neighbours]
    configs = ordered[:max_configs]
    # Decode-sized cases are tuned on graph time over rotated inputs, as they are reported:
    # eager time there is the launch rate and would rank every config the same.
    runs = _rotated_runs(case)[0] if case.graph else [case.run]
    results, start = [], time.time()
    for config in configs:
        if time.time() - start > budget_s:
            break
        entry = {"config": config.to_dict(), "is_default": config == default,
                 "timing": "graph" if case.graph else "eager"}
        try:
            case.run(config)
            _sync()
            if case.graph:
                entry.update(time_graph([lambda run=run: run(config) for run in runs], True))
            else:
                entry.update(_time(lambda: case.run(config), True))
        except Exception as error:
            entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            try:
                _sync()
            except Exception:
                pass
        results.append(entry)
    del runs
    timed = [r for r in results if "median_us" in r]
    best = min(timed, key=lambda r: r["median_us"]) if timed else None
    default_row = next((r for r in timed if r["is_default"]), None)
    return {"op": case.op, "label": case.label, "shape": case.shape, "tried": len(results),
            "space_size": len(list(spec.config_space.configs(case.problem))),
            "best": best, "default": default_row,
            "best_vs_default": (default_row["median_us"] / best["median_us"]) if best and default_row else None,
            "results": results}


# ----------------------------------------------------------------------------- cases
# (label, rows) of the elementwise cases that --tune sweeps: one decode, one prefill size.
TUNE_SIZES = {("decode", 64), ("prefill", 16384), ("prefill", 8192)}


def _row_sizes(quick):
    """(label, rows or tokens) of the rmsnorm, silu_and_mul and rotary cases."""
    if quick:
        return [("decode", 1), ("decode", 64), ("prefill", 8192)]
    return [("decode", 1), ("decode", 64), ("decode", 256), ("prefill", 4096), ("prefill", 16384)]
LLAMA = {"hidden": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64, "inter": 8192, "vocab": 128256}
SHAPES_OF = "llama-3.2-1b-qwen3-30b-a3b"  # the model slot of this benchmark's result names
MOE = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}  # Qwen3-30B-A3B-like


def cases_ceilings(quick):
    import torch

    nbytes = (1 << 30) if not quick else (1 << 29)
    nbytes = _cap(nbytes, 1 << 16)
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    n = _cap(8192 if not quick else 4096, 64)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    return [
        Case("copy", "ceilings", "d2d copy", f"{nbytes >> 20} MiB", lambda config=None: dst.copy_(src),
             nbytes=2 * nbytes),
        Case("matmul", "ceilings", "bf16 matmul", f"{n}^3 random", lambda config=None: a @ b, flops=2 * n**3),
    ]


def cases_rmsnorm(quick):
    import torch
    import torch.nn.functional as F
    from shapeshift.kernels.rmsnorm import rmsnorm, rmsnorm_ref

    hidden = LLAMA["hidden"]
    sizes = _row_sizes(quick)
    out = []
    for label, size in sizes:
        rows = _cap(size)
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
        r = torch.randn_like(x)
        w = torch.randn(hidden, dtype=torch.bfloat16, device=DEVICE)
        y, h = torch.empty_like(x), torch.empty_like(x)

        def run(config=None, x=x, r=r, w=w, y=y, h=h):
            return rmsnorm(x, w, 1e-5, r, out=y, residual_out=h, config=config)[0]

        def check(x=x, r=r, w=w, run=run):
            return _rel_err(run(), rmsnorm_ref(x, w, 1e-5, r)[0])

        def rotate(x=x, r=r, w=w):
            x2, r2 = x.clone(), r.clone()
            y2, h2 = torch.empty_like(x2), torch.empty_like(x2)
            return (lambda config=None: rmsnorm(x2, w, 1e-5, r2, out=y2, residual_out=h2, config=config)[0],
                    lambda: F.rms_norm(x2 + r2, (hidden,), w, 1e-5))

        out.append(Case("rmsnorm", "rmsnorm", label, f"{rows}x{hidden} +residual", run, rotate=rotate,
                        torch_fn=lambda x=x, r=r, w=w: F.rms_norm(x + r, (hidden,), w, 1e-5), check=check,
                        nbytes=(4 * rows * hidden + hidden) * 2,
                        problem={"rows": rows, "hidden": hidden, "dtype": "bfloat16"},
                        tune=(label, size) in TUNE_SIZES))
    return out


def cases_silu_and_mul(quick):
    import torch
    import torch.nn.functional as F
    from shapeshift.kernels.activation import silu_and_mul, silu_and_mul_ref

    inner = LLAMA["inter"]
    sizes = _row_sizes(quick)
    out = []
    for label, size in sizes:
        rows = _cap(size)
        x = torch.randn(rows, 2 * inner, dtype=torch.bfloat16, device=DEVICE)
        y = torch.empty(rows, inner, dtype=torch.bfloat16, device=DEVICE)

        def run(config=None, x=x, y=y):
            return silu_and_mul(x, out=y, config=config)

        def rotate(x=x, rows=rows):
            x2 = x.clone()
            y2 = torch.empty(rows, inner, dtype=torch.bfloat16, device=DEVICE)
            return (lambda config=None: silu_and_mul(x2, out=y2, config=config),
                    lambda: F.silu(x2[:, :inner]) * x2[:, inner:])

        out.append(Case("silu_and_mul", "silu_and_mul", label, f"{rows}x{2 * inner}", run, rotate=rotate,
                        torch_fn=lambda x=x: F.silu(x[:, :inner]) * x[:, inner:],
                        check=lambda x=x, run=run: _rel_err(run(), silu_and_mul_ref(x)),
                        nbytes=3 * rows * inner * 2, problem={"rows": rows, "inner": inner, "dtype": "bfloat16"},
                        tune=(label, size) in TUNE_SIZES))
    return out


def cases_rotary(quick):
    import torch
    from shapeshift.kernels.rotary import rope_cos_sin_cache, rotary_kv_write, rotary_kv_write_ref

    hq, hkv, d = LLAMA["heads"], LLAMA["kv_heads"], LLAMA["head_dim"]
    max_position = _cap(32768, 64)
    cos_sin = rope_cos_sin_cache(d, max_position, 500000.0, device=DEVICE)
    sizes = _row_sizes(quick)
    out = []
    for label, size in sizes:
        tokens = _cap(size)
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=DEVICE)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
        positions = torch.randint(0, max_position, (tokens,), device=DEVICE)
        num_blocks = tokens // 16 + 4
        slots = torch.randperm(num_blocks * 16, device=DEVICE)[:tokens]
        kc = torch.zeros(num_blocks, 16, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        vc = torch.zeros_like(kc)
        q_out = torch.empty(tokens, hq, d, dtype=torch.bfloat16, device=DEVICE)

        def run(config=None, q=q, k=k, v=v, positions=positions, slots=slots, kc=kc, vc=vc, q_out=q_out):
            return rotary_kv_write(q, k, v, positions, cos_sin, kc, vc, slots, q_out=q_out, config=config)

        def torch_fn(q=q, k=k, v=v, positions=positions, slots=slots, kc=kc, vc=vc):
            cs = cos_sin[positions]
            cos, sin = cs[:, None, : d // 2].to(q.dtype), cs[:, None, d // 2 :].to(q.dtype)

            def rot(x):
                x1, x2 = x[..., : d // 2], x[..., d // 2 :]
                return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

            kc.view(-1, hkv, d)[slots] = rot(k)
            vc.view(-1, hkv, d)[slots] = v
            return rot(q)

        def check(q=q, k=k, v=v, positions=positions, slots=slots, kc=kc, vc=vc, run=run):
            got = run().clone()
            got_k = kc.view(-1, hkv, d)[slots].clone()
            ref_k = torch.zeros_like(kc)
            ref = rotary_kv_write_ref(q, k, v, positions, cos_sin, ref_k, torch.zeros_like(vc), slots)
            return max(_rel_err(got, ref), _rel_err(got_k, ref_k.view(-1, hkv, d)[slots]))

        def rotate(qkv=qkv, positions=positions, slots=slots, kc=kc, vc=vc, tokens=tokens, q_out=q_out):
            qkv2 = qkv.clone()
            q2 = qkv2[:, : hq * d].view(tokens, hq, d)
            k2 = qkv2[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
            v2 = qkv2[:, (hq + hkv) * d :].view(tokens, hkv, d)
            q_out2 = torch.empty_like(q_out)
            return (lambda config=None: rotary_kv_write(q2, k2, v2, positions, cos_sin, kc, vc, slots, q_out=q_out2,
                                                        config=config),
                    lambda: torch_fn(q2, k2, v2, positions, slots, kc, vc))

        nbytes = tokens * ((hq + 2 * hkv) * d * 2 * 2 + d * 4 + 16)
        out.append(Case("rotary_kv_write", "rotary", label, f"T={tokens} Hq={hq} Hkv={hkv} D={d}", run, rotate=rotate,
                        torch_fn=torch_fn, check=check, nbytes=nbytes,
                        problem={"tokens": tokens, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
                                 "dtype": "bfloat16"}, tune=(label, size) in TUNE_SIZES))
    return out


def _paged_kv(context_lens, hkv, d, block_size, dtype, table_blocks=None):
    """Random paged K/V caches and block tables; table_blocks widens each table past the
    longest context (a decode graph reads a fixed width: the engine's KV width bucket)."""
    import torch

    B = len(context_lens)
    max_blocks = max([-(-n // block_size) for n in context_lens] + [table_blocks or 0])
    num_blocks = B * max_blocks + 1
    kc = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=DEVICE)
    vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks, device=DEVICE)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return kc, vc, tables, lens


def cases_decode_attention(quick):
    import torch
    import torch.nn.functional as F
    from shapeshift.kernels.decode_attention import decode_attention, decode_attention_ref

    hq, hkv, d, bs = LLAMA["heads"], LLAMA["kv_heads"], LLAMA["head_dim"], 16
    rng = random.Random(0)
    # "width=512": a batch-1 chat context (384 tokens) as the engine's decode graph sees it,
    # inside its 512-token KV width bucket (the table is 32 blocks wide).
    shapes = [("decode", "B=1 ctx=384 width=512", [384]), ("decode", "B=1 ctx=4096", [4096]),
              ("decode", "B=1 ctx=32768", [32768]),
              ("decode", "B=32 ctx=2048", [2048] * 32), ("decode", "B=128 ctx~U(64,2048)",
                                                          [rng.randint(64, 2048) for _ in range(128)])]
    if quick:
        shapes = [shapes[0], shapes[1], shapes[3]]
    out = []
    for label, name, lens in shapes:
        tune = name in ("B=1 ctx=384 width=512", "B=1 ctx=32768", "B=32 ctx=2048")
        width = 512 // bs if "width=512" in name else None
        lens = [_cap(n, 70) for n in lens][: _cap(len(lens), 3)]
        kc, vc, tables, cl = _paged_kv(lens, hkv, d, bs, torch.bfloat16, _cap(width, 5) if width else None)
        B = len(lens)
        q = torch.randn(B, hq, d, dtype=torch.bfloat16, device=DEVICE)
        o = torch.empty_like(q)
        scale = d**-0.5

        def run(config=None, q=q, kc=kc, vc=vc, tables=tables, cl=cl, o=o):
            return decode_attention(q, kc, vc, tables, cl, scale, out=o, config=config)

        max_ctx = tables.shape[1] * bs

        def torch_fn(q=q, kc=kc, vc=vc, tables=tables, cl=cl, B=B, max_ctx=max_ctx):
            k = kc[tables.long()].view(B, max_ctx, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            v = vc[tables.long()].view(B, max_ctx, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            mask = (torch.arange(max_ctx, device=DEVICE)[None, :] < cl[:, None])[:, None, None, :]
            return F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale)

        def check(q=q, kc=kc, vc=vc, tables=tables, cl=cl, run=run):
            return _rel_err(run(), decode_attention_ref(q, kc, vc, tables, cl, scale))

        def rotate(q=q, kc=kc, vc=vc, tables=tables, cl=cl, max_ctx=max_ctx, B=B):
            kc2, vc2, o2 = kc.clone(), vc.clone(), torch.empty_like(q)
            return (lambda config=None: decode_attention(q, kc2, vc2, tables, cl, scale, out=o2, config=config),
                    lambda: torch_fn(q, kc2, vc2, tables, cl, B, max_ctx))

        nbytes = 2 * sum(lens) * hkv * d * 2 + 2 * B * hq * d * 2 + tables.numel() * 4
        out.append(Case("decode_attention", "decode_attention", label, name, run, torch_fn=torch_fn, check=check,
                        rotate=rotate,
                        nbytes=nbytes, flops=4 * sum(lens) * hq * d,
                        problem={"batch": B, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "max_context": max_ctx,
                                 "block_size": bs, "dtype": "bfloat16"}, tune=tune))
    return out


def cases_gemv(quick):
    import torch
    from shapeshift.kernels.gemv import gemv, gemv_ref

    h, inter, vocab = LLAMA["hidden"], LLAMA["inter"], LLAMA["vocab"]
    qkv = (LLAMA["heads"] + 2 * LLAMA["kv_heads"]) * LLAMA["head_dim"]  # 3072 for Llama-3.2-1B
    shapes = [("qkv_proj", qkv, h), ("o_proj", h, h), ("gate_up_proj", 2 * inter, h), ("up_proj", inter, h),
              ("down_proj", h, inter), ("lm_head", vocab, h)]
    rows = [1, 4, 16]
    if quick:
        shapes = [s for s in shapes if s[0] in ("qkv_proj", "up_proj", "down_proj", "lm_head")]
        rows = [1]
    out = []
    for name, n, k in shapes:
        w = torch.randn(n, k, dtype=torch.bfloat16, device=DEVICE) / k**0.5
        for m in rows:
            m = _cap(m, 2)
            x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
            y = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)

            def run(config=None, x=x, w=w, y=y):
                return gemv(x, w, out=y, config=config)

            def rotate(x=x, w=w, m=m, n=n):
                w2, y2 = w.clone(), torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
                return (lambda config=None: gemv(x, w2, out=y2, config=config), lambda: x @ w2.t())

            out.append(Case("gemv", "gemv", "decode", f"{name} M={m} N={n} K={k}", run, rotate=rotate,
                            torch_fn=lambda x=x, w=w: x @ w.t(),
                            check=lambda x=x, w=w, run=run: _rel_err(run(), gemv_ref(x, w)),
                            nbytes=(n * k + m * k + m * n) * 2, flops=2 * m * n * k,
                            problem={"m": m, "n": n, "k": k, "dtype": "bfloat16"}, tune=m == 1))
    return out


def _torch_sample(logits, temperature, top_k, top_p):
    import torch

    scaled = logits / temperature[:, None]
    probs = scaled.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    ranks = torch.arange(probs.shape[1], device=probs.device)[None, :]
    sorted_probs = torch.where(ranks < top_k[:, None], sorted_probs, 0)
    cum = sorted_probs.cumsum(-1)
    sorted_probs = torch.where(cum - sorted_probs < top_p[:, None] * cum[:, -1:], sorted_probs, 0)
    picked = torch.multinomial(sorted_probs, 1)
    return order.gather(1, picked).squeeze(1)


def cases_sampling(quick):
    import torch
    from shapeshift.kernels.argmax import argmax, argmax_ref
    from shapeshift.kernels.sampling import sample, sampling_probs_ref

    vocab = LLAMA["vocab"]
    batches = [1, 64, 256] if not quick else [1, 64]
    out = []
    for B in batches:
        B = _cap(B, 3)
        logits = torch.randn(B, vocab, device=DEVICE) * 3
        tokens = torch.empty(B, dtype=torch.int64, device=DEVICE)

        def run_argmax(config=None, logits=logits, tokens=tokens):
            return argmax(logits, out=tokens, config=config)

        def check_argmax(logits=logits, run=run_argmax):
            return float((run() != argmax_ref(logits)).float().mean())  # fraction of wrong rows

        def rotate_argmax(logits=logits, B=B):
            logits2, tokens2 = logits.clone(), torch.empty(B, dtype=torch.int64, device=DEVICE)
            return (lambda config=None: argmax(logits2, out=tokens2, config=config), lambda: logits2.argmax(-1))

        out.append(Case("argmax", "sampling", "decode", f"B={B} V={vocab} fp32", run_argmax, rotate=rotate_argmax,
                        torch_fn=lambda logits=logits: logits.argmax(-1), check=check_argmax, tolerance=0.0,
                        extra={"check_metric": "fraction of rows whose argmax differs from torch"},
                        nbytes=B * vocab * 4, problem={"batch": B, "vocab": vocab}, tune=B == 1))
        temperature = torch.full((B,), 0.8, device=DEVICE)
        top_k = torch.full((B,), 50, dtype=torch.int32, device=DEVICE)
        top_p = torch.full((B,), 0.9, device=DEVICE)
        seeds = torch.arange(B, dtype=torch.int64, device=DEVICE)

        def run_sample(config=None, logits=logits, temperature=temperature, top_k=top_k, top_p=top_p,
                       seeds=seeds, tokens=tokens):
            return sample(logits, temperature, top_k, top_p, seeds, out=tokens, config=config)

        def check_sample(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, run=run_sample, B=B):
            rows = min(B, 8)  # the float64 reference is per row; a few rows suffice
            probs = sampling_probs_ref(logits[:rows], temperature[:rows], top_k[:rows], top_p[:rows])
            drawn = run()[:rows]
            return float((probs[torch.arange(rows, device=DEVICE), drawn] == 0).float().mean())  # outside set

        def rotate_sample(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, B=B):
            logits2, tokens2 = logits.clone(), torch.empty(B, dtype=torch.int64, device=DEVICE)
            return (lambda config=None: sample(logits2, temperature, top_k, top_p, seeds, out=tokens2, config=config),
                    lambda: _torch_sample(logits2, temperature, top_k, top_p))

        out.append(Case("sample", "sampling", "decode", f"B={B} V={vocab} top_k=50 top_p=0.9", run_sample,
                        rotate=rotate_sample,
                        torch_fn=lambda logits=logits, temperature=temperature, top_k=top_k, top_p=top_p:
                        _torch_sample(logits, temperature, top_k, top_p),
                        check=check_sample, nbytes=B * vocab * 4, problem={"batch": B, "vocab": vocab},
                        tolerance=0.0, extra={"check_metric": "fraction of rows that drew a token outside the kept set"},
                        tune=B == 64))
        if B == _cap(1, 3):
            # The other two paths of the split kernel at batch 1: no filter (the race winners
            # of the chunks are merged) and top-p alone, whose nucleus may be wider than the
            # per-chunk candidates (then the exact one-program-per-row search decides the row).
            for name, k_value, p_value in (("temperature only", 0, 1.0), ("top_p=0.9 only", 0, 0.9)):
                k_only = torch.full((B,), k_value, dtype=torch.int32, device=DEVICE)
                k_torch = torch.full((B,), vocab, dtype=torch.int32, device=DEVICE)  # _torch_sample: all ranks
                p_only = torch.full((B,), p_value, device=DEVICE)

                def run_variant(config=None, logits=logits, k_only=k_only, p_only=p_only, tokens=tokens,
                                temperature=temperature, seeds=seeds):
                    return sample(logits, temperature, k_only, p_only, seeds, out=tokens, config=config)

                def check_variant(logits=logits, k_only=k_only, p_only=p_only, run=run_variant, temperature=temperature):
                    probs = sampling_probs_ref(logits[:1], temperature[:1], k_only[:1], p_only[:1])
                    return float(probs[0, run()[0]] == 0)

                def rotate_variant(logits=logits, k_only=k_only, k_torch=k_torch, p_only=p_only, B=B,
                                   temperature=temperature, seeds=seeds):
                    logits2, tokens2 = logits.clone(), torch.empty(B, dtype=torch.int64, device=DEVICE)
                    return (lambda config=None: sample(logits2, temperature, k_only, p_only, seeds, out=tokens2,
                                                       config=config),
                            lambda: _torch_sample(logits2, temperature, k_torch, p_only))

                out.append(Case("sample", "sampling", "decode", f"B={B} V={vocab} {name}", run_variant,
                                torch_fn=lambda logits=logits, k_torch=k_torch, p_only=p_only, temperature=temperature:
                                _torch_sample(logits, temperature, k_torch, p_only),
                                check=check_variant, nbytes=B * vocab * 4, rotate=rotate_variant, tolerance=0.0,
                                extra={"check_metric": "drew a token outside the kept set (1) or not (0)"}))
    return out


def cases_prefill_attention(quick):
    import torch
    import torch.nn.functional as F
    from shapeshift.kernels.prefill_attention import prefill_attention, prefill_attention_ref

    hq, hkv, d, bs = LLAMA["heads"], LLAMA["kv_heads"], LLAMA["head_dim"], 16
    # (name, query lens, context lens)
    shapes = [("1x2048 fresh", [2048], [2048]), ("4x1024 fresh", [1024] * 4, [1024] * 4),
              ("chunk 512 after 7680 cached", [512], [8192]),
              ("mixed: 1x512 chunk + 63 decodes@2048", [512] + [1] * 63, [512] + [2048] * 63)]
    if quick:
        shapes = shapes[:1] + shapes[2:3]
    out = []
    for name, qlens, clens in shapes:
        tune = name == "1x2048 fresh"
        qlens, clens = [_cap(n, 40) for n in qlens][: _cap(len(qlens), 3)], [_cap(n, 60) for n in clens][: _cap(len(clens), 3)]
        kc, vc, tables, cl = _paged_kv(clens, hkv, d, bs, torch.bfloat16)
        qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device=DEVICE)
        T = sum(qlens)
        q = torch.randn(T, hq, d, dtype=torch.bfloat16, device=DEVICE)
        o = torch.empty_like(q)
        scale = d**-0.5
        max_q = max(qlens)

        def run(config=None, q=q, kc=kc, vc=vc, tables=tables, qsl=qsl, cl=cl, o=o, max_q=max_q):
            return prefill_attention(q, kc, vc, tables, qsl, cl, scale, max_q, out=o, config=config)

        torch_fn = None
        if len(set(qlens)) == 1 and qlens == clens:  # fresh equal-length prompts: SDPA causal baseline
            B, L = len(qlens), qlens[0]
            qd = q.view(B, L, hq, d).transpose(1, 2)
            kd = torch.randn(B, hq, L, d, dtype=torch.bfloat16, device=DEVICE)
            vd = torch.randn_like(kd)
            torch_fn = lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

        def check(q=q, kc=kc, vc=vc, tables=tables, qsl=qsl, cl=cl, run=run):
            return _rel_err(run(), prefill_attention_ref(q, kc, vc, tables, qsl, cl, scale))

        visible = sum(sum(n - L + i + 1 for i in range(L)) for L, n in zip(qlens, clens))
        out.append(Case("prefill_attention", "prefill_attention", "prefill", name, run, torch_fn=torch_fn,
                        check=check, flops=4 * visible * hq * d,
                        nbytes=2 * sum(clens) * hkv * d * 2 + 2 * T * hq * d * 2,
                        problem={"max_query_len": max_q, "head_dim": d, "query_group": hq // hkv,
                                 "dtype": "bfloat16"}, tune=tune))
    return out


def _routing_logits(kind, tokens, experts, generator):
    """Router logits whose top-k follows a distribution over experts.

    uniform: i.i.d. normal logits, so every expert is equally likely (the common, misleading
    benchmark input). zipf: log(p_e) + Gumbel noise with p_e ~ 1 / rank^1.2 over a random
    expert order; top-k of log p + Gumbel draws k experts without replacement in proportion to
    p (Gumbel-top-k), giving a few hot experts and a long cold tail, as real traffic does.
    """
    import torch

    if kind == "uniform":
        return torch.randn(tokens, experts, generator=generator, device=DEVICE)
    ranks = torch.randperm(experts, generator=generator, device=DEVICE).float() + 1
    log_p = -1.2 * ranks.log()
    u = torch.rand(tokens, experts, generator=generator, device=DEVICE).clamp_min(1e-20)
    return log_p[None, :] - (-u.log()).log()


def cases_moe(quick):
    import torch
    from shapeshift.kernels.moe import (MOE_GEMM_SPEC, fused_moe, fused_moe_ref, moe_align, moe_grouped_gemm,
                                        topk_routing)

    E, k, H, inner = MOE["experts"], MOE["top_k"], MOE["hidden"], MOE["inter"]
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(0)
    w13 = (torch.randn(E, 2 * inner, H, device=DEVICE, generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inner, device=DEVICE, generator=gen) / inner**0.5).to(torch.bfloat16)
    expert_bytes = (2 * inner * H + H * inner) * 2
    sizes = [("decode", 1), ("decode", 16), ("decode", 64), ("decode", 256), ("prefill", 2048)]
    if quick:
        sizes = [("decode", 16), ("decode", 64), ("prefill", 2048)]
    out = []
    for label, size in sizes:
        T = _cap(size, 12)
        x = torch.randn(T, H, dtype=torch.bfloat16, device=DEVICE, generator=gen)
        for routing in ("uniform", "zipf"):
            # float32 router logits: bfloat16 ones tie often across 128 experts, and the kernel
            # and the reference may break a tie differently (a different, equally valid expert).
            logits = _routing_logits(routing, T, E, gen)
            weights, ids = topk_routing(logits, k, True)
            counts = torch.bincount(ids.flatten().long(), minlength=E)
            active = int((counts > 0).sum())
            stats = {"routing": routing, "active_experts": active, "max_tokens_per_expert": int(counts.max()),
                     "tokens_per_active_expert": T * k / max(1, active)}
            nbytes = active * expert_bytes + 2 * T * H * 2
            flops = 2 * T * k * 3 * inner * H
            shape = f"T={T} E={E} k={k} H={H} I={inner} {routing}"

            def run_moe(config=None, x=x, logits=logits):
                return fused_moe(x, w13, w2, logits, k, True, config=config)

            def torch_moe(x=x, weights=weights, ids=ids):
                y = torch.zeros_like(x)
                for e in ids.unique().tolist():
                    tok, slot = torch.nonzero(ids == e, as_tuple=True)
                    h = x[tok] @ w13[e].t()
                    h = torch.nn.functional.silu(h[:, :inner]) * h[:, inner:]
                    y.index_add_(0, tok, (h @ w2[e].t()) * weights[tok, slot, None].to(x.dtype))
                return y

            def check(x=x, logits=logits, run=run_moe):
                return _rel_err(run(), fused_moe_ref(x, w13, w2, logits, k, True))

            # Tune on skewed routing only: configs tuned on uniform routing mislead.
            tune = routing == "zipf" and size in (64, 2048)
            out.append(Case("fused_moe", "moe", label, shape, run_moe, torch_fn=torch_moe, check=check, torch_graph=False,
                            nbytes=nbytes, flops=flops, extra=stats, tune=tune, spec_op="moe_grouped_gemm",
                            problem={"tokens": T, "top_k": k, "experts": E, "n": 2 * inner, "k": H,
                                     "dtype": "bfloat16"}))

            default = MOE_GEMM_SPEC.default_config({"tokens": T, "top_k": k, "experts": E, "n": 2 * inner, "k": H,
                                                    "dtype": "bfloat16"}, torch.device(DEVICE))
            aligned = moe_align(ids, E, default["BLOCK_M"])

            def run_gemm(config=None, x=x, ids=ids, aligned=aligned, default=default):
                config = config or default
                al = aligned if config["BLOCK_M"] == default["BLOCK_M"] else moe_align(ids, E, config["BLOCK_M"])
                return moe_grouped_gemm(x, w13, *al, k, a_per_token=True, config=config)

            out.append(Case("moe_grouped_gemm", "moe", label, f"w13 {shape}", run_gemm, nbytes=active * 2 * inner * H * 2
                            + T * H * 2 + T * k * 2 * inner * 2, flops=2 * T * k * 2 * inner * H, extra=stats, tune=tune,
                            problem={"tokens": T, "top_k": k, "experts": E, "n": 2 * inner, "k": H,
                                     "dtype": "bfloat16"}))
            out.append(Case("topk_routing", "moe", label, f"T={T} E={E} k={k} {routing}",
                            lambda config=None, logits=logits: topk_routing(logits, k, True, config=config),
                            torch_fn=lambda logits=logits: logits.float().softmax(-1).topk(k, -1),
                            nbytes=T * E * 4 + T * k * 8, extra=stats, tune=tune and size == 2048,
                            problem={"tokens": T, "experts": E, "top_k": k}))
            out.append(Case("moe_align", "moe", label, f"T={T} E={E} k={k} {routing}",
                            lambda config=None, ids=ids: moe_align(ids, E, 16), extra=stats))
    return out


def _host_launch_cases():
    """(name, call) pairs: each launcher once at a decode-step shape of Llama-3.2-1B."""
    import torch
    from shapeshift.kernels.activation import silu_and_mul
    from shapeshift.kernels.decode_attention import decode_attention
    from shapeshift.kernels.gemv import gemv
    from shapeshift.kernels.rmsnorm import rmsnorm
    from shapeshift.kernels.rotary import rope_cos_sin_cache, rotary_kv_write
    from shapeshift.kernels.argmax import argmax
    from shapeshift.kernels.sampling import sample

    hidden, hq, hkv, d = LLAMA["hidden"], LLAMA["heads"], LLAMA["kv_heads"], LLAMA["head_dim"]
    vocab, inter = LLAMA["vocab"], LLAMA["inter"]
    bf16 = torch.bfloat16
    x = torch.randn(1, hidden, dtype=bf16, device=DEVICE)
    r, y, h = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
    w_norm = torch.randn(hidden, dtype=bf16, device=DEVICE)
    gate_up = torch.randn(1, 2 * inter, dtype=bf16, device=DEVICE)
    act = torch.empty(1, inter, dtype=bf16, device=DEVICE)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, dtype=bf16, device=DEVICE)
    q, k, v = (qkv[:, : hq * d].view(1, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(1, hkv, d),
               qkv[:, (hq + hkv) * d :].view(1, hkv, d))
    cos_sin = rope_cos_sin_cache(d, 64, 500000.0, device=DEVICE)
    kc, vc, tables, lens = _paged_kv([_cap(4096, 48)], hkv, d, 16, bf16)
    positions = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    q_out, attn = torch.empty_like(q), torch.empty(1, hq, d, dtype=bf16, device=DEVICE)
    w_qkv = torch.randn((hq + 2 * hkv) * d, hidden, dtype=bf16, device=DEVICE)
    y_qkv = torch.empty(1, (hq + 2 * hkv) * d, dtype=bf16, device=DEVICE)
    logits = torch.randn(1, vocab, device=DEVICE)
    tokens = torch.empty(1, dtype=torch.int64, device=DEVICE)
    temperature, top_k = torch.ones(1, device=DEVICE), torch.full((1,), 50, dtype=torch.int32, device=DEVICE)
    top_p, seeds = torch.full((1,), 0.9, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE)
    return [
        ("rmsnorm 1x2048 +residual", lambda: rmsnorm(x, w_norm, 1e-5, r, out=y, residual_out=h)),
        ("silu_and_mul 1x16384", lambda: silu_and_mul(gate_up, out=act)),
        ("rotary_kv_write T=1", lambda: rotary_kv_write(q, k, v, positions, cos_sin, kc, vc, slots, q_out=q_out)),
        ("decode_attention B=1", lambda: decode_attention(q_out, kc, vc, tables, lens, d**-0.5, out=attn)),
        ("gemv 1x2048 -> 3072", lambda: gemv(x, w_qkv, out=y_qkv)),
        ("argmax B=1", lambda: argmax(logits, out=tokens)),
        ("sample B=1", lambda: sample(logits, temperature, top_k, top_p, seeds, out=tokens)),
    ]


def _host_us_per_call(call, calls):
    """Median over 5 batches of host seconds per call (no device sync inside a batch)."""
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        _sync()
    return sorted(samples)[2]


def measure_host_overhead(quick):
    """Host cost of one launcher call at a decode shape, split in two: `host_us` is the whole
    call as the engine pays it outside a graph (our checks and config lookup + Triton's
    dispatch + the driver's launch); `launcher_us` is the same call with Triton's kernel
    launch stubbed out, i.e. only the launcher's own Python. Their difference is Triton's."""
    from triton.runtime.jit import JITFunction

    rows = []
    cases = _host_launch_cases()
    calls = 50 if SMOKE else (100 if quick else 300)
    for name, call in cases:
        row = {"op": "host_overhead", "group": "host", "label": "host", "shape": name}
        try:
            call()
            _sync()
            if not SMOKE:  # in the interpreter a real call runs the kernel on the CPU
                row["host_us"] = _host_us_per_call(call, calls)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
    patched = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        patched.append(InterpretedFunction)
    except ImportError:
        pass
    saved = [(cls, cls.run) for cls in patched]
    try:
        for cls in patched:
            cls.run = lambda self, *args, **kwargs: None
        for row, (name, call) in zip(rows, cases):
            if "error" not in row:
                row["launcher_us"] = _host_us_per_call(call, calls)
                if "host_us" in row:
                    row["triton_and_driver_us"] = row["host_us"] - row["launcher_us"]
    finally:
        for cls, run in saved:
            cls.run = run
    return rows


CASE_BUILDERS = {
    "ceilings": cases_ceilings, "rmsnorm": cases_rmsnorm, "silu_and_mul": cases_silu_and_mul,
    "rotary": cases_rotary, "decode_attention": cases_decode_attention, "gemv": cases_gemv,
    "sampling": cases_sampling, "prefill_attention": cases_prefill_attention, "moe": cases_moe,
    "host": lambda quick: [],
}


# ----------------------------------------------------------------------------- worker
def run_worker(group, quick, tune, tune_budget_s, result_path):
    import torch

    rows, tuning = [], []
    started = time.time()
    try:
        torch.manual_seed(0)
        cases = CASE_BUILDERS[group](quick)
    except Exception as error:
        rows.append({"op": group, "group": group, "label": "setup", "error": f"{type(error).__name__}: {error}",
                     "traceback": traceback.format_exc()[-3000:]})
        cases = []

    def save():  # after every case, so a timed-out worker still leaves its rows
        tmp = pathlib.Path(str(result_path) + ".tmp")
        tmp.write_text(json.dumps({"rows": rows, "tuning": tuning, "seconds": time.time() - started}, default=str))
        os.replace(tmp, result_path)

    if group == "host":
        try:
            rows.extend(measure_host_overhead(quick))
        except Exception as error:
            rows.append({"op": "host_overhead", "group": group, "label": "host",
                         "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]})
        cases = []
    for case in cases:
        rows.append(_measure_case(case, quick))
        save()
    if tune and group not in ("ceilings", "host"):
        from shapeshift.kernels.registry import get_spec

        picked = [c for c in cases if c.tune and c.problem is not None]
        per_case = tune_budget_s / max(1, len(picked))
        for case in picked:
            try:
                tuning.append(_tune_case(case, get_spec(case.spec_op), per_case, 12 if quick else 40, quick))
            except Exception as error:
                tuning.append({"op": case.op, "label": case.label, "error": f"{type(error).__name__}: {error}"})
            save()
    save()


# ----------------------------------------------------------------------------- parent
def _environment(argv):
    env = {"command": " ".join([sys.executable, *argv]), "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(),
           "host": platform.node(), "python": platform.python_version()}
    # The caller's SHAPESHIFT_GIT_COMMIT first (GPU machines get a copy of the tree whose git
    # metadata may be stale), then git.
    env["commit"], env["dirty"] = git_commit()
    try:
        import torch
        import triton

        env["torch"] = torch.__version__
        env["triton"] = triton.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["gpu"] = props.name
            env["sm_count"] = props.multi_processor_count
            env["capability"] = list(torch.cuda.get_device_capability(0))
            env["memory_gib"] = round(props.total_memory / 2**30, 1)
    except Exception as error:
        env["torch_error"] = str(error)
    return env


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _print_table(rows, copy_gbps, matmul_tflops):
    """One line per row. `graph us` is the kernel (CUDA-graph replay, launch gaps only),
    `eager us` the same call launched from Python; GB/s, %copy, TF/s, %mm and x torch come
    from the figure of record (graph time where measured, else eager time)."""
    header = (f"{'op':<18} {'case':<8} {'shape':<42} {'graph us':>9} {'eager us':>9} {'GB/s':>7} {'%copy':>6} "
              f"{'TF/s':>7} {'%mm':>5} {'torch us':>9} {'x torch':>7} {'rel err':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if r.get("group") in ("ceilings", "host"):
            continue
        if "error" in r:
            print(f"{r['op']:<18} {r.get('label', ''):<8} {str(r.get('shape', ''))[:42]:<42} ERROR {r['error'][:80]}")
            continue
        graph_us = (r.get("graph") or {}).get("median_us")
        eager_us = (r.get("eager") or r.get("kernel") or {}).get("median_us")
        share_copy = 100 * r["gbps"] / copy_gbps if r.get("gbps") and copy_gbps else None
        share_mm = 100 * r["tflops"] / matmul_tflops if r.get("tflops") and matmul_tflops else None
        torch_us = r.get("torch", {}).get("median_us")
        print(f"{r['op']:<18} {r['label']:<8} {str(r['shape'])[:42]:<42} {_fmt(graph_us, '9.2f')} "
              f"{_fmt(eager_us, '9.2f')} {_fmt(r.get('gbps'), '7.0f')} {_fmt(share_copy, '6.1f')} "
              f"{_fmt(r.get('tflops'), '7.1f')} {_fmt(share_mm, '5.1f')} {_fmt(torch_us, '9.2f')} "
              f"{_fmt(r.get('speedup_vs_torch'), '7.2f')} {_fmt(r.get('rel_err'), '8.1e')}"
              f"{'' if r.get('check_ok', True) else ' CHECK FAILED'}"
              f"{' (graph failed: eager)' if r.get('graph_error') else ''}")


def _print_host(rows):
    host = [r for r in rows if r.get("group") == "host" and "error" not in r]
    if host:
        print("\nhost cost per launcher call (us): whole call | launcher Python only | Triton + driver")
        for r in host:
            print(f"  {r['shape']:<30} {_fmt(r.get('host_us'), '8.1f')} {_fmt(r.get('launcher_us'), '8.1f')} "
                  f"{_fmt(r.get('triton_and_driver_us'), '8.1f')}")


def gemv_table_from_tuning(tuning):
    """{(n, k): best config dict} from --tune's gemv entries, for kernels/gemv.py's H200 table."""
    table = {}
    for t in tuning:
        if t.get("op") != "gemv" or not t.get("best"):
            continue
        n, k = (int(part.split("=")[1]) for part in str(t["shape"]).split()[2:4])
        best = t["best"]
        if (n, k) not in table or best["median_us"] < table[(n, k)][1]:
            table[(n, k)] = (best["config"], best["median_us"])
    return {key: config for key, (config, _) in table.items()}


def _moe_summary(rows):
    """Skewed vs uniform routing, per op and batch size: time ratio and experts touched."""
    by_key = {}
    for r in rows:
        if r.get("group") == "moe" and "kernel" in r:
            by_key.setdefault((r["op"], r["label"], r["shape"].split(" uniform")[0].split(" zipf")[0]), {})[
                r.get("routing")] = r
    summary = []
    for (op, label, shape), pair in sorted(by_key.items()):
        if "uniform" in pair and "zipf" in pair:
            u, z = pair["uniform"], pair["zipf"]
            summary.append({"op": op, "label": label, "shape": shape,
                            "uniform_us": u["kernel"]["median_us"], "zipf_us": z["kernel"]["median_us"],
                            "zipf_over_uniform": z["kernel"]["median_us"] / u["kernel"]["median_us"],
                            "active_experts_uniform": u.get("active_experts"),
                            "active_experts_zipf": z.get("active_experts"),
                            "max_load_uniform": u.get("max_tokens_per_expert"),
                            "max_load_zipf": z.get("max_tokens_per_expert")})
    return summary


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing windows")
    parser.add_argument("--tune", action="store_true", help="also sweep each op's search space (time-boxed)")
    parser.add_argument("--tune-budget-s", type=float, default=None, help="seconds of tuning per op group")
    parser.add_argument("--ops", default=",".join(GROUPS), help=f"comma-separated groups from {GROUPS}")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget for the whole run")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU through Triton's interpreter: checks the script, not the GPU")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _configure(args.smoke)
    groups = [g.strip() for g in args.ops.split(",") if g.strip()]
    if args.tune_budget_s is not None:
        tune_budget = args.tune_budget_s
    else:
        # Whatever the plain measurements (<= ~40 s per group) leave of the budget, shared out.
        tune_budget = max(10.0, (args.budget_s - 40.0 * (len(groups) + 1)) / max(1, len(groups)))

    if args.worker:
        run_worker(args.worker, args.quick, args.tune, tune_budget, args.result_path)
        return 0

    started = time.time()
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown groups {unknown}; choose from {GROUPS}")
    if "ceilings" not in groups:
        groups.insert(0, "ceilings")
    env = _environment(sys.argv[:1] + argv)
    print(f"# {env.get('gpu', 'no GPU')} | torch {env.get('torch')} | triton {env.get('triton')} | "
          f"commit {env['commit']}", flush=True)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    benchmark = f"kernels{'-quick' if args.quick else ''}{'-tune' if args.tune else ''}"
    name = result_name(benchmark, SHAPES_OF, hardware_slug(env.get("gpu") or "nogpu"))
    path = out_dir / (claim_result_name(out_dir, name) + ".json")
    rows, tuning, group_status = [], [], {}

    def assemble(complete):
        copy = next((r for r in rows if r.get("op") == "copy" and "gbps" in r), None)
        matmul = next((r for r in rows if r.get("op") == "matmul" and "tflops" in r), None)
        copy_gbps = copy["gbps"] if copy else None
        matmul_tflops = matmul["tflops"] if matmul else None
        for r in rows:
            if r.get("gbps") and copy_gbps:
                r["share_of_copy_bw"] = r["gbps"] / copy_gbps
            if r.get("tflops") and matmul_tflops:
                r["share_of_matmul"] = r["tflops"] / matmul_tflops
        result = {
            "environment": env,
            "ceilings": {"copy_gbps_measured": copy_gbps, "copy_tbs_nominal": NOMINAL_COPY_TBS,
                         "bf16_matmul_tflops_measured": matmul_tflops,
                         "bf16_matmul_tflops_nominal": NOMINAL_BF16_TFLOPS},
            "timing_note": "kernel = figure of record: CUDA-graph replay time (rows with 'graph'), else eager "
                           "do_bench time; gbps / tflops / shares / speedup_vs_torch come from it",
            "quick": args.quick, "complete": complete, "groups": group_status, "rows": rows,
            "moe_skewed_vs_uniform": _moe_summary(rows), "tuning": tuning,
            "gemv_table_from_tuning": {f"{n}x{k}": c for (n, k), c in gemv_table_from_tuning(tuning).items()},
            "wall_seconds": time.time() - started,
        }
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, path)  # saved after every group: a killed run still leaves its results
        return result, copy_gbps, matmul_tflops

    for i, group in enumerate(groups):
        remaining = args.budget_s - (time.time() - started)
        if remaining < 10:
            group_status[group] = "skipped: wall-clock budget exhausted"
            rows.append({"op": group, "group": group, "label": "skipped", "error": group_status[group]})
            continue
        # Leave time for the groups still to come: each may take 2.5x an equal share.
        timeout = max(20.0, min(remaining - 3, remaining / max(1, len(groups) - i) * 2.5))
        result_path = out_dir / f".worker-{group}-{os.getpid()}.json"
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", group, "--result-path",
               str(result_path), "--tune-budget-s", str(tune_budget)]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--tune"] if args.tune else []
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
            status = f"exit {proc.returncode}"
            stderr_tail = proc.stderr[-2000:]
        except subprocess.TimeoutExpired as error:
            status = f"timeout after {timeout:.0f}s"
            stderr_tail = (error.stderr or b"")[-2000:].decode(errors="replace") if isinstance(error.stderr, bytes) \
                else str(error.stderr or "")[-2000:]
        if result_path.exists():  # a worker saves after every case: a timeout keeps what it measured
            data = json.loads(result_path.read_text())
            rows.extend(data["rows"])
            tuning.extend(data["tuning"])
            result_path.unlink()
            if not status.startswith("exit 0"):
                rows.append({"op": group, "group": group, "label": "incomplete", "error": f"worker {status}",
                             "stderr": stderr_tail})
        else:
            rows.append({"op": group, "group": group, "label": "crashed", "error": f"worker {status}",
                         "stderr": stderr_tail})
        group_status[group] = f"{status} in {time.time() - t0:.0f}s"
        print(f"# {group}: {group_status[group]}", flush=True)
        assemble(complete=False)

    result, copy_gbps, matmul_tflops = assemble(complete=True)
    moe_summary = result["moe_skewed_vs_uniform"]
    print()
    print(f"ceilings: copy {_fmt(copy_gbps, '.0f')} GB/s (nominal {NOMINAL_COPY_TBS} TB/s), "
          f"bf16 matmul {_fmt(matmul_tflops, '.0f')} TFLOP/s (nominal ~{NOMINAL_BF16_TFLOPS:.0f})")
    _print_table(rows, copy_gbps, matmul_tflops)
    _print_host(rows)
    if moe_summary:
        print("\nMoE, skewed (zipf) vs uniform routing (figure of record):")
        for s in moe_summary:
            print(f"  {s['op']:<17} {s['shape']:<40} uniform {s['uniform_us']:9.1f} us  zipf {s['zipf_us']:9.1f} us "
                  f" ratio {s['zipf_over_uniform']:.2f}  active experts {s['active_experts_uniform']} vs "
                  f"{s['active_experts_zipf']}  max load {s['max_load_uniform']} vs {s['max_load_zipf']}")
    if tuning:
        print("\ntuning (best of the sampled configs vs the default; graph time for decode rows):")
        for t in tuning:
            if t.get("best"):
                print(f"  {t['op']:<18} {t['label']:<8} {str(t['shape'])[:40]:<40} tried {t['tried']:>3}/"
                      f"{t['space_size']:<5} best {t['best']['median_us']:9.2f} us "
                      f"default {_fmt((t.get('default') or {}).get('median_us'), '9.2f')} us  "
                      f"x{_fmt(t.get('best_vs_default'), '.2f')}  {t['best']['config']}")
            else:
                print(f"  {t.get('op')} {t.get('label')}: no timed config ({t.get('error', 'all failed')})")
        table = gemv_table_from_tuning(tuning)
        if table:
            print("\ngemv: best tuned configs, for kernels/gemv.py SM90_GEMV_TABLE ((N, K): config):")
            for (n, k), config in sorted(table.items()):
                params = {key: value for key, value in config.items() if key not in ("variant", "num_warps", "num_stages")}
                print(f"    ({n}, {k}): KernelConfig.make({config['variant']!r}, num_warps={config['num_warps']}, "
                      f"num_stages={config['num_stages']}, " + ", ".join(f"{key}={value}" for key, value in
                                                                       sorted(params.items())) + "),")
    errors = [r for r in rows if "error" in r or r.get("check_ok") is False]
    print(f"\n{len(rows) - len(errors)} rows ok, {len(errors)} errors; saved {path} "
          f"({time.time() - started:.0f}s)")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
