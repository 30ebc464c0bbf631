"""Benchmark: hot-reload time (with CUDA-graph capture) vs engine cold start, and replay
figures for the built-in traffic profiles. Writes JSON under bench/results/.

    # H200 (the lead's run):
    PYTHONSAFEPATH=1 python hack/bench_reload.py --model llama-3.2-1b-shape
    # CPU smoke test:
    PYTHONSAFEPATH=1 python hack/bench_reload.py --model tiny-llama --small --out /tmp/bench.json
    # refresh the request shapes used where pydantic is missing:
    PYTHONSAFEPATH=1 python hack/bench_reload.py --write-shapes

Data flow: EngineConfig -> LLMEngine (cold start timed) -> ForwardPassManager.reload of a
bundle copy of the stock pass, several times (import, build, smoke, graph capture, swap
timed) -> replay of chat / agentic-long-context / burst (scaled to fit max_model_len)
-> one JSON document with the commit, the GPU, the command and every number.

Traffic profiles need pydantic (shapeshift.engine.contracts.traffic_profile). Where it is missing (the
benchmark GPU machine), the request shapes come from bench/profiles/<name>.json, written
by --write-shapes from the same profiles and seed, so both paths replay the same requests.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROFILES_DIR = REPO / "bench" / "profiles"
# profile -> (length scale, requests) for the full run; lengths scaled so prompts fit max_model_len
PLAN = {"chat": (1.0, 96), "agentic-long-context": (1 / 16, 24), "burst": (1.0, 96)}
SMALL_PLAN = {"chat": (1 / 32, 8), "agentic-long-context": (1 / 512, 4), "burst": (1 / 64, 8)}
SEED = 20260101


def shapes_file(name: str, small: bool) -> Path:
    return PROFILES_DIR / f"{name}{'-small' if small else ''}.json"


def write_shapes() -> None:
    from shapeshift.engine.replay.requests import save_shapes
    from shapeshift.engine.contracts.traffic_profile import builtin_profile

    PROFILES_DIR.mkdir(parents=True, exist_ok=True)
    for small, plan in ((False, PLAN), (True, SMALL_PLAN)):
        for name, (scale, n) in plan.items():
            save_shapes(shapes_file(name, small), builtin_profile(name), n, SEED, scale)
            print(f"wrote {shapes_file(name, small)}")


def load_plan(small: bool) -> dict[str, dict]:
    """profile name -> {"shapes", "concurrency", "arrival_rate", "source"}."""
    plan = SMALL_PLAN if small else PLAN
    out = {}
    try:
        from shapeshift.engine.replay.requests import sample_shapes
        from shapeshift.engine.contracts.traffic_profile import builtin_profile
    except ImportError as exc:  # no pydantic/numpy/yaml here: use the saved shapes
        print(f"traffic profiles unavailable ({exc}); using {PROFILES_DIR}", file=sys.stderr)
        for name in plan:
            data = json.loads(shapes_file(name, small).read_text())
            out[name] = {"shapes": data["shapes"], "concurrency": data["concurrency"],
                         "arrival_rate": data["arrival_rate"], "source": str(shapes_file(name, small))}
        return out
    for name, (scale, n) in plan.items():
        profile = builtin_profile(name)
        profile = profile.scaled(scale) if scale != 1.0 else profile
        out[name] = {"shapes": sample_shapes(profile, n, SEED), "concurrency": profile.concurrency,
                     "arrival_rate": profile.arrival_rate, "source": f"builtin x{scale:g}"}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="hot-reload and replay benchmark")
    parser.add_argument("--model", default="llama-3.2-1b-shape")
    parser.add_argument("--small", action="store_true", help="tiny plan (CPU smoke test)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profiles", default=",".join(PLAN))
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/reload-<model>-<gpu>-<utc>.json)")
    parser.add_argument("--write-shapes", action="store_true", help="write bench/profiles/*.json and exit")
    args = parser.parse_args()
    if args.write_shapes:
        write_shapes()
        return 0

    import torch

    # Sibling module; imported here so that loading this file for load_plan() leaves sys.path alone.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchmeta import git_commit, hardware_slug, result_name

    from shapeshift.engine.forward_pass.bundle import create_bundle, stock_bundle_dir
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.forward_pass.swap import ForwardPassManager
    from shapeshift.engine.core.llm_engine import LLMEngine
    from shapeshift.engine.replay.driver import replay
    from shapeshift.engine.replay.requests import make_requests

    cuda = torch.cuda.is_available()
    max_model_len = args.max_model_len or (8192 if not args.small else 256)
    max_num_seqs = args.max_num_seqs or (128 if not args.small else 8)
    config = EngineConfig(model=args.model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(8192 if not args.small else 256, max_num_seqs))
    commit, dirty = git_commit()
    result: dict = {
        "benchmark": "hot_reload_and_replay", "commit": commit, "dirty": dirty,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "model": args.model,
        "engine_config": {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                          "dtype": config.resolved_dtype(), "device": config.resolved_device()},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }

    name = result_name("reload", args.model, hardware_slug(result["gpu"] or "cpu"))
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        # Written after every stage, so a run stopped by a time limit keeps what it measured.
        out.write_text(json.dumps(result, indent=2) + "\n")

    t0 = time.perf_counter()
    engine = LLMEngine(config)
    if cuda:
        torch.cuda.synchronize()
    result["cold_start_s"] = time.perf_counter() - t0
    print(f"cold start {result['cold_start_s']:.2f} s", flush=True)

    manager = ForwardPassManager(engine)
    reloads = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.reloads):
            bundle = Path(tmp) / f"stock-copy-{i}"
            create_bundle(stock_bundle_dir(), None, bundle, name=f"stock-copy-{i}")
            t0 = time.perf_counter()
            prepared = manager.prepare(bundle)
            t1 = time.perf_counter()
            res = manager.commit(prepared)
            t2 = time.perf_counter()
            reloads.append({"total_s": t2 - t0, "off_serving_path_s": t1 - t0, "serving_pause_s": t2 - t1,
                            "stages_s": res.timings_s, "flushed_kv": res.flushed_kv})
            print(f"reload {i}: {t2 - t0:.3f} s (serving paused {t2 - t1:.3f} s) {res.timings_s}", flush=True)
        # the same with capture on the serving path (no off-path runner), for comparison
        manager.offpath_capture = False
        bundle = Path(tmp) / "stock-copy-onpath"
        create_bundle(stock_bundle_dir(), None, bundle, name="stock-copy-onpath")
        t0 = time.perf_counter()
        res = manager.reload(bundle)
        onpath = {"total_s": time.perf_counter() - t0, "stages_s": res.timings_s}
        manager.offpath_capture = None
    result["reloads"] = reloads
    result["reload_on_path_capture"] = onpath
    result["reload_best_s"] = min(r["total_s"] for r in reloads)
    result["reload_goal_s"] = 2.0
    print(f"on-path capture reload: {onpath}", flush=True)
    result["replay"] = {}
    save()

    replays = result["replay"]
    eos = set(engine.model_config.eos_token_ids)
    for name, spec in load_plan(args.small).items():
        if name not in args.profiles.split(","):
            continue
        requests = make_requests(spec["shapes"], SEED, engine.model_config.vocab_size, max_model_len, eos)
        conc = None if spec["arrival_rate"] else min(spec["concurrency"], max_num_seqs)
        t0 = time.perf_counter()
        report = replay(engine, requests, profile_name=name, seed=SEED, concurrency=conc,
                        arrival_rate=spec["arrival_rate"], repeats=args.repeats, warmup_runs=1 if cuda else 0)
        replays[name] = {**report.to_dict(), "shapes_source": spec["source"],
                         "bench_wall_s": time.perf_counter() - t0}
        s = report.summary()
        print(f"{name}: {s['output_tokens_per_s']:.1f} tok/s, per-user p50 {s['per_user_tokens_per_s_p50']:.1f} "
              f"p90 {s['per_user_tokens_per_s_p90']:.1f}, TTFT p50 {s['ttft_s_p50']:.3f} s p90 {s['ttft_s_p90']:.3f} s,"
              f" noise cv {s['noise_cv']:.3f}", flush=True)
        save()

    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
