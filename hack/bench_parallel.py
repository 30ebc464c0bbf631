#!/usr/bin/env python3
"""Parallel layouts on one multi-GPU host: measured throughput next to the cost model's prediction.

Data flow: for each model (``llama-3.2-1b-shape``, ``moe-medium-shape``) -> the layouts
over exactly --gpus GPUs (the engine's executable ones, union the cost model's ranked ones
with pp=1; pp>1 layouts are listed as ranked but not run) -> the cost model
(shapeshift.engine.compile.cost_model) predicts each layout's decode step time at batch
1 and 32 and its prefill throughput -> unless --dry-run: one ``launch`` of
world_size processes per layout (NCCL, one GPU each, NVLink multicast off), every
replica's driver runs a greedy probe (tokens compared across layouts), then decode at
each batch (B sequences split over the dp replicas; prompts of --prompt-len tokens; after
prefill and --warmup-steps, --decode-steps steps timed between barriers of the
replicas' drivers) and prefill (--prefill-prompts prompts of --prefill-len tokens,
max_tokens=1, timed from a barrier until all finish) -> throughput = all replicas'
tokens / the slowest replica's time -> table on stdout (measured and predicted, ranks
side by side, Spearman rank correlation) and JSON under bench/results/ (commit, GPUs,
command line, every figure).

    python3 hack/bench_parallel.py --dry-run --gpus 8          # plan + predictions, no GPU needed
    python3 hack/bench_parallel.py                             # all visible GPUs (needs >= 2)
    python3 hack/bench_parallel.py --gpus 4 --models llama-3.2-1b-shape
    # plumbing check on CPUs (gloo, tiny models; NOT a benchmark):
    python3 hack/bench_parallel.py --device cpu --gpus 2 --models tiny-llama,tiny-moe \
        --batches 1,4 --prompt-len 16 --decode-steps 4 --warmup-steps 1 --prefill-prompts 2 --prefill-len 32 \
        --out-dir /tmp/bench

It refuses (exit code 2) when fewer GPUs are visible than --gpus asks for.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmeta import REPO_ROOT, git_commit, hardware_slug, result_name  # noqa: E402  (sibling module)

DEFAULT_MODELS = ("llama-3.2-1b-shape", "moe-medium-shape")


# ----------------------------------------------------------------------------- plan (no torch)
def model_config(name: str) -> Any:
    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.models.presets import PRESETS

    if name not in PRESETS or not PRESETS[name].is_random:
        raise SystemExit(f"model {name!r} is not a random preset; choose from "
                         f"{[n for n, p in PRESETS.items() if p.is_random]}")
    return ModelConfig.from_hf(PRESETS[name].hf_config)


def plan_layouts(cfg: Any, gpus: int, cost_model: Any) -> list[dict[str, Any]]:
    """Rows {name, layout, executable, why_not, cost_layout}: the engine's layouts union the cost model's."""
    from shapeshift.engine.parallel.layout import LayoutError, ParallelLayout, candidate_layouts

    rows: dict[str, dict[str, Any]] = {}
    for layout in candidate_layouts(cfg, gpus):
        rows[layout.name] = {"name": layout.name, "layout": layout, "executable": True, "why_not": "",
                             "cost_layout": None}
    for cl in cost_model.layouts(gpus) if cost_model is not None else []:
        name = str(cl)
        row = rows.get(name)
        if row is None:
            try:
                layout = ParallelLayout(tp=cl.tp, ep=cl.ep, dp=cl.dp, pp=cl.pp).validate(cfg, gpus)
                why = "" if layout.is_executable else "pipeline stages are not executed by the engine"
            except LayoutError as exc:
                layout, why = None, str(exc)
            row = rows[name] = {"name": name, "layout": layout, "executable": not why, "why_not": why,
                                "cost_layout": None}
        row["cost_layout"] = cl
    return sorted(rows.values(), key=lambda r: (not r["executable"], r["name"]))


def predictions(cost_model: Any, row: dict[str, Any], batches: list[int], decode_context: int,
                prefill_len: int, prefill_tokens: int) -> dict[str, Any] | None:
    cl = row["cost_layout"]
    if cost_model is None or cl is None:
        return None
    out: dict[str, Any] = {"decode": {}}
    for b in batches:
        p = cost_model.predict(cl, batch=b, context=decode_context, prefill_tokens=prefill_tokens)
        out["decode"][str(b)] = {"step_s": p.decode_step_s, "tokens_per_s": p.decode_tokens_per_s,
                                 "feasible": p.feasible, "reason": p.reason}
    p = cost_model.predict(cl, batch=1, context=prefill_len, prefill_tokens=prefill_tokens)
    out["prefill"] = {"tokens_per_s": p.prefill_tokens_per_s, "seconds": prefill_tokens / p.prefill_tokens_per_s}
    out["memory_per_gpu_gb"] = p.memory_per_gpu / 1e9
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Rank correlation of two equally long lists (no ties expected; None below 3 items)."""
    n = len(a)
    if n < 3:
        return None

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(n), key=lambda i: xs[i])
        r = [0.0] * n
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1))


# ----------------------------------------------------------------------------- measuring (per rank)
def _share(total: int, parts: int, index: int) -> int:
    return total // parts + (1 if index < total % parts else 0)


def _sync(engine: Any) -> None:
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _time_decode(engine: Any, prompts: list[list[int]], steps: int, warmup: int, barrier: Any) -> dict[str, Any]:
    from shapeshift.engine.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):  # prefill (chunked) until every sequence has its first token
        started.update(o.request_id for o in engine.step())
    for _ in range(warmup):
        engine.step()
    _sync(engine)
    barrier()
    send_s0 = getattr(engine.runner, "send_seconds", 0.0)
    t0 = time.perf_counter()
    batch_sizes = set()
    for _ in range(steps if prompts else 0):
        engine.step()
        batch_sizes.add(engine.stats().batch_size_last_step)
    _sync(engine)
    seconds = time.perf_counter() - t0
    broadcast_s = getattr(engine.runner, "send_seconds", 0.0) - send_s0
    barrier()
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return {"seqs": len(prompts), "steps": steps if prompts else 0, "tokens": len(prompts) * steps if prompts else 0,
            "seconds": seconds, "batch_sizes_seen": sorted(batch_sizes),
            "broadcast_s": broadcast_s}  # part of `seconds` the driver spent sending batches to followers


def _time_prefill(engine: Any, prompts: list[list[int]], barrier: Any) -> dict[str, Any]:
    from shapeshift.engine.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = [f"prefill-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    _sync(engine)
    barrier()
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done = 0
    while done < len(ids):
        done += sum(1 for o in engine.step() if o.finished)
    _sync(engine)
    seconds = time.perf_counter() - t0
    barrier()
    return {"prompts": len(prompts), "tokens": sum(len(p) for p in prompts), "seconds": seconds}


def bench_rank(rank: int, world_size: int, layout_name: str, model: str, opts: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of one layout: followers follow; each replica's driver measures and returns its figures."""
    import torch.distributed as dist
    from decode_baselines import random_prompts  # the decode benchmark's seeded prompts

    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.parallel.engine import ParallelLLMEngine
    from shapeshift.engine.parallel.layout import ParallelLayout
    from shapeshift.engine.parallel.process_group import init_parallel
    from shapeshift.engine.core.sampling import SamplingParams

    import faulthandler

    # A rank still running shortly before the parent gives up prints every thread's stack to
    # stderr, so a hang in a layout says where it hangs (collective, capture, control channel).
    if opts.get("hang_dump_s"):
        faulthandler.dump_traceback_later(opts["hang_dump_s"], exit=False)
    layout = ParallelLayout.parse(layout_name)
    state = init_parallel(layout, rank, world_size, device=None if opts["device"] == "cuda" else "cpu")
    drivers = [layout.replica_ranks(d)[0] for d in range(layout.dp)]
    driver_group = dist.new_group(drivers, backend="gloo")  # every rank creates it; drivers use it
    config = EngineConfig(model=model, dtype=opts["dtype"], max_model_len=opts["max_model_len"],
                          max_num_seqs=max(opts["batches"]), max_num_batched_tokens=opts["max_num_batched_tokens"],
                          enable_prefix_caching=False, enforce_eager=opts["eager"],
                          gpu_memory_utilization=opts["gpu_memory_utilization"],
                          num_kv_blocks=opts.get("num_kv_blocks"))
    t_build = time.perf_counter()
    engine = ParallelLLMEngine(config, state)
    build_s = time.perf_counter() - t_build
    if not engine.is_driver:
        engine.follow()
        return None
    try:
        def barrier() -> None:
            if layout.dp > 1:
                dist.barrier(group=driver_group)

        replica = state.coords.dp_rank
        vocab = engine.model_config.vocab_size
        probe = engine.generate([random_prompts(1, 32, vocab, seed=7)[0]],
                                SamplingParams(max_tokens=opts["probe_tokens"], temperature=0.0, ignore_eos=True))[0]
        out: dict[str, Any] = {"replica": replica, "build_s": build_s, "probe_tokens": probe, "decode": {},
                               "kv_blocks": engine.block_manager.num_blocks,
                               "cuda_graphs": len(engine.runner.graphs)}
        for b in opts["batches"]:
            prompts = random_prompts(_share(b, layout.dp, replica), opts["prompt_len"], vocab, seed=1000 * b + replica)
            out["decode"][str(b)] = _time_decode(engine, prompts, opts["decode_steps"], opts["warmup_steps"], barrier)
        warm = random_prompts(1, opts["prefill_len"], vocab, seed=5)
        _time_prefill(engine, warm, lambda: None)  # warm the prefill shapes, untimed
        prompts = random_prompts(_share(opts["prefill_prompts"], layout.dp, replica), opts["prefill_len"], vocab,
                                  seed=77 + replica)
        out["prefill"] = _time_prefill(engine, prompts, barrier)
        return out
    finally:
        engine.shutdown()


def aggregate(replicas: list[dict[str, Any]], batches: list[int]) -> dict[str, Any]:
    """All replicas' tokens over the slowest replica's seconds."""
    measured: dict[str, Any] = {"decode": {}}
    for b in batches:
        parts = [r["decode"][str(b)] for r in replicas]
        seconds = max(p["seconds"] for p in parts if p["seqs"]) if any(p["seqs"] for p in parts) else float("nan")
        tokens = sum(p["tokens"] for p in parts)
        steps = max(p["steps"] for p in parts)
        broadcast = max(p.get("broadcast_s", 0.0) for p in parts)
        measured["decode"][str(b)] = {"tokens_per_s": tokens / seconds, "step_s": seconds / steps if steps else None,
                                      "tokens": tokens, "seconds": seconds,
                                      "broadcast_share": broadcast / seconds if seconds else None}
    parts = [r["prefill"] for r in replicas]
    seconds = max(p["seconds"] for p in parts if p["prompts"])
    tokens = sum(p["tokens"] for p in parts)
    measured["prefill"] = {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds}
    measured["build_s"] = max(r["build_s"] for r in replicas)
    measured["kv_blocks"] = replicas[0]["kv_blocks"]
    measured["cuda_graphs"] = replicas[0]["cuda_graphs"]
    return measured


# ----------------------------------------------------------------------------- reporting
def rankings(rows: list[dict[str, Any]], batches: list[int]) -> dict[str, Any]:
    """Per metric: layouts ordered by measured and by predicted throughput (best first), and their agreement."""
    metrics = [(f"decode_b{b}", ("decode", str(b))) for b in batches] + [("prefill", ("prefill",))]
    out = {}
    for metric, path in metrics:
        both = []
        for r in rows:
            m, p = r.get("measured"), r.get("predicted")
            if not m or not p:
                continue
            mv = m[path[0]][path[1]]["tokens_per_s"] if len(path) == 2 else m["prefill"]["tokens_per_s"]
            pv = p[path[0]][path[1]]["tokens_per_s"] if len(path) == 2 else p["prefill"]["tokens_per_s"]
            both.append((r["name"], mv, pv))
        measured_order = [n for n, _, _ in sorted(both, key=lambda x: -x[1])]
        predicted_order = [n for n, _, _ in sorted(both, key=lambda x: -x[2])]
        out[metric] = {"measured": measured_order, "predicted": predicted_order,
                       "spearman": spearman([x[1] for x in both], [x[2] for x in both]),
                       "same_best": bool(both) and measured_order[0] == predicted_order[0]}
    return out


def _fmt(x: float | None, scale: float = 1.0, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * scale:,.{digits}f}"


def print_table(model: str, rows: list[dict[str, Any]], batches: list[int], ranks: dict[str, Any] | None) -> None:
    print(f"\n== {model}")
    head = ["layout", "run"]
    for b in batches:
        head += [f"b{b} tok/s meas", f"pred", f"step ms meas", "pred", "rank m/p"]
    head += ["prefill tok/s meas", "pred", "rank m/p"]
    print(" | ".join(head))

    def rank_of(metric: str, name: str) -> str:
        if not ranks or metric not in ranks:
            return "-"
        r = ranks[metric]
        m = r["measured"].index(name) + 1 if name in r["measured"] else None
        p = r["predicted"].index(name) + 1 if name in r["predicted"] else None
        return f"{m or '-'}/{p or '-'}"

    for r in rows:
        m, p = r.get("measured"), r.get("predicted")
        cells = [r["name"], "yes" if r["executable"] else "no"]
        for b in batches:
            md = m["decode"][str(b)] if m else {}
            pd = p["decode"][str(b)] if p else {}
            cells += [_fmt(md.get("tokens_per_s")), _fmt(pd.get("tokens_per_s")), _fmt(md.get("step_s"), 1e3, 2),
                      _fmt(pd.get("step_s"), 1e3, 2), rank_of(f"decode_b{b}", r["name"])]
        cells += [_fmt(m["prefill"]["tokens_per_s"] if m else None), _fmt(p["prefill"]["tokens_per_s"] if p else None),
                  rank_of("prefill", r["name"])]
        if r.get("error"):
            cells.append(f"ERROR: {r['error'].splitlines()[-1][:120]}")
        elif not r["executable"]:
            cells.append(f"({r['why_not'][:100]})")
        print(" | ".join(cells))
    if ranks:
        for metric, rr in ranks.items():
            rho = rr["spearman"]
            print(f"  {metric}: measured {rr['measured']}  predicted {rr['predicted']}  "
                  f"spearman {'-' if rho is None else f'{rho:.2f}'}  same best: {rr['same_best']}")


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs every layout spans (default: all visible)")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--layouts", default="", help="only these layouts, e.g. tp2-ep1-dp1-pp1,tp1-ep1-dp2-pp1")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=512, help="decode: prompt tokens per sequence")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--prefill-prompts", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: gloo plumbing check with tiny models, not a benchmark")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per layout")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the predictions; no GPU needed")
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    batches = [int(b) for b in args.batches.split(",") if b]
    models = [m for m in args.models.split(",") if m]
    only = {x for x in args.layouts.split(",") if x}
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")

    visible = 0
    gpu_names: list[str] = []
    if args.device == "cuda" and not args.dry_run:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        gpu_names = [torch.cuda.get_device_name(i) for i in range(visible)]
    gpus = args.gpus if args.gpus is not None else (visible if args.device == "cuda" else 2)
    if gpus is None or gpus < 2:
        if args.dry_run and args.gpus is None:
            gpus = 8
        else:
            print(f"bench_parallel: parallel layouts need at least 2 GPUs; --gpus is {gpus} and {visible} are "
                  "visible. Run on a multi-GPU host, or pass --dry-run --gpus N for the plan.", file=sys.stderr)
            return 2
    if args.device == "cuda" and not args.dry_run and visible < gpus:
        print(f"bench_parallel: refusing to run: {gpus} GPUs requested, {visible} visible "
              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). "
              f"Use --gpus {visible} if that is >= 2, run on a larger host, or --dry-run for the plan.",
              file=sys.stderr)
        return 2

    try:
        from shapeshift.engine.compile.cost_model import CostModel, HardwareSpec
    except ImportError as exc:
        print(f"bench_parallel: cost model unavailable ({exc}); measuring without predictions", file=sys.stderr)
        CostModel = HardwareSpec = None  # noqa: N806

    decode_context = args.prompt_len + args.warmup_steps + args.decode_steps // 2
    prefill_tokens = args.prefill_prompts * args.prefill_len
    opts = {"device": args.device, "dtype": dtype, "batches": batches, "prompt_len": args.prompt_len,
            "decode_steps": args.decode_steps, "warmup_steps": args.warmup_steps,
            "prefill_prompts": args.prefill_prompts, "prefill_len": args.prefill_len,
            "probe_tokens": args.probe_tokens, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "eager": args.eager or args.device == "cpu",
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "num_kv_blocks": None if args.device == "cuda" else 4 * args.max_model_len // 16,
            "hang_dump_s": max(5.0, args.timeout_s - 15.0)}
    commit, dirty = git_commit()
    report: dict[str, Any] = {
        "benchmark": "parallel-layouts", "commit": commit, "dirty": dirty,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device, "gpus": gpus, "gpu_names": gpu_names, "host": platform.node(),
        "dry_run": args.dry_run, "settings": {k: v for k, v in opts.items() if k != "device"},
        "decode_context_for_predictions": decode_context, "models": {},
    }
    if args.device == "cpu":
        report["note"] = "CPU/gloo plumbing check with float32 tiny models: not a benchmark of anything"
    out_dir = Path(args.out_dir)
    hardware = "cpu" if args.device == "cpu" else hardware_slug(gpu_names[0] if gpu_names else "gpu", gpus)
    path = out_dir / f"{result_name('parallel', '-'.join(models), hardware)}.json"
    if not args.dry_run:
        out_dir.mkdir(parents=True, exist_ok=True)
    for model in models:
        cfg = model_config(model)
        cost_model = CostModel(cfg, HardwareSpec(), dtype) if CostModel else None
        rows = plan_layouts(cfg, gpus, cost_model)
        if only:
            rows = [r for r in rows if r["name"] in only]
        for r in rows:
            r["predicted"] = predictions(cost_model, r, batches, decode_context, args.prefill_len, prefill_tokens)
        if not args.dry_run:
            from shapeshift.engine.parallel.process_group import launch

            for r in rows:
                if not r["executable"]:
                    continue
                print(f"[{model}] {r['name']} ...", flush=True)
                t0 = time.perf_counter()
                try:
                    per_rank = launch(bench_rank, r["layout"].world_size, r["name"], model, opts,
                                      timeout_s=args.timeout_s, threads_per_process=0 if args.device == "cuda" else 1)
                    replicas = [x for x in per_rank if x is not None]
                    r["measured"] = aggregate(replicas, batches)
                    r["probe_tokens"] = replicas[0]["probe_tokens"]
                    r["replicas"] = replicas
                except Exception as exc:  # noqa: BLE001 - one failing layout must not lose the others
                    r["error"] = f"{type(exc).__name__}: {exc}"
                shares = ", ".join(f"b{b} {100 * (r['measured']['decode'][str(b)]['broadcast_share'] or 0):.1f}%"
                                   for b in batches) if r.get("measured") else ""
                print(f"[{model}] {r['name']} done in {time.perf_counter() - t0:.0f} s"
                      + (f"; decode time spent broadcasting batches: {shares}" if shares else "")
                      + (f" ERROR {r['error'][-300:]}" if r.get("error") else ""), flush=True)
            reference = next((r.get("probe_tokens") for r in rows if r.get("probe_tokens")), None)
            for r in rows:
                if r.get("probe_tokens") and reference:
                    same = sum(a == b for a, b in zip(r["probe_tokens"], reference))
                    r["probe_agreement"] = same / len(reference)  # bf16 sums in another order may flip late tokens
        ranks = rankings(rows, batches) if not args.dry_run else None
        if args.dry_run and cost_model is not None:
            ranked = [r for r in rows if r["predicted"]]
            ranks = {f"decode_b{b}": {"measured": [], "predicted": [r["name"] for r in sorted(
                ranked, key=lambda r: -r["predicted"]["decode"][str(b)]["tokens_per_s"])], "spearman": None,
                "same_best": None} for b in batches}
            ranks["prefill"] = {"measured": [], "predicted": [r["name"] for r in sorted(
                ranked, key=lambda r: -r["predicted"]["prefill"]["tokens_per_s"])], "spearman": None, "same_best": None}
        print_table(model, rows, batches, ranks)
        report["models"][model] = {
            "layouts": [{k: (v.name if k == "layout" and v is not None else v) for k, v in r.items()
                         if k != "cost_layout"} for r in rows],
            "rankings": ranks,
        }
        if not args.dry_run:
            # After every model, so a run stopped by a time limit keeps the models it finished.
            path.write_text(json.dumps(report, indent=2, default=str) + "\n")
            print(f"\nwrote {path} ({len(report['models'])} of {len(models)} models)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
