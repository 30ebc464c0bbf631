#!/usr/bin/env python3
"""Serving speed through the real server path: HTTP, streaming, replayed traffic profiles.

Data flow:
  for each engine configuration (--configs; CONFIGS below):
    `shapeshift serve`'s path in a server process of its own (this file with --serve-json:
    EngineConfig from the settings, the forward-pass recipe that serve resolves by default,
    engine.serving.server.serve on 127.0.0.1) -> wait for /health
    -> per profile (bench/profiles/<name>.json: the saved request shapes every replay uses;
       engine/replay/requests.make_requests turns them into token ids): one discarded warm-up
       run, then --repeats runs; each run streams every request through POST /v1/completions
       (prompt as token ids, ignore_eos, return_token_ids) from an asyncio client in this
       process, closed loop at the profile's concurrency or open loop at its arrival times
       -> per request: TTFT (submission to the first token), per-user decode tokens/s (tokens
       after the first over the time from the first to the last); per run: output tokens/s
       the engine's decode-chain counters (LLMEngine.decode_chains: chains started, chunks, why
       chains ended, steps run one at a time) gained over the runs, read from the server
    -> pure decode at the chat profile's concurrency: that many requests with 16-token prompts
       and --decode-tokens outputs, together; per-user tokens/s (the goal's reference)
    -> batch 1: one request at a time, greedy and sampled (temperature 0.7, top-p 0.9), --repeats
       each, per-user tokens/s
  -> medians over the runs, the run-to-run spread, and ratios of configurations paired by run;
     JSON (commit, GPU, command, settings, every run) rewritten after every measurement, and a
     PNG under bench/results/ (serving-<model>-<gpu>-<UTC stamp>.json|png).

Per-user p90 is the latency sense: the speed 90% of users beat (the 10th percentile of
per-user tokens/s), as engine/replay/driver.py reports it; TTFT p90 is the 90th percentile.

The device machine's image has no fastapi, starlette, pydantic or uvicorn: carry them as
wheels (.whl, see the device notes) and install them before running. Names, as the project's
own environment pins them: fastapi, starlette, pydantic, pydantic-core, annotated-types,
typing-inspection, opentelemetry-api (fastapi 0.165 imports it), typing-extensions 4.16
(pydantic 2.14 needs it), uvicorn (h11, click present).

    # H200 (one call; --num-requests keeps each profile's runs short)
    SHAPESHIFT_GIT_COMMIT=$(git rev-parse HEAD) python3 hack/bench_serving.py --num-requests 48
    # CPU smoke test
    python3 hack/bench_serving.py --device cpu --model tiny-llama --profiles chat-small \\
        --max-model-len 256 --num-requests 8 --repeats 2 --decode-tokens 16 --out-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES  # torch-free
from shapeshift.engine.replay.driver import percentile  # torch-free

ROOT = Path(__file__).resolve().parent.parent

# Named engine settings over EngineConfig's defaults (what `shapeshift serve` runs), each
# knob of this work named explicitly so a configuration means the same whatever the defaults.
# "before": serve as it was (decode_steps 1, mixed steps eager). Names are file-name safe (the
# server logs carry them).
CONFIGS: dict[str, dict[str, Any]] = {
    "before": {"mixed_cuda_graphs": False, "decode_steps": 1, "overlap_decode": False},
    "mixed-graphs": {"mixed_cuda_graphs": True, "decode_steps": 1, "overlap_decode": False},
    "mixed-graphs-overlap8": {"mixed_cuda_graphs": True, "decode_steps": 8, "overlap_decode": True,
                              "multi_step_sampling": True},
    "mixed-graphs-overlap8-host-sampling": {"mixed_cuda_graphs": True, "decode_steps": 8, "overlap_decode": True,
                                            "multi_step_sampling": False},
}
# What `shapeshift serve` runs with no flags: EngineConfig's own defaults, nothing named.
CONFIGS["serve-default"] = {}
# serve's default as it was before chain_across_finishes: every finish ends an overlapped chain.
CONFIGS["chains-end-at-finishes"] = {"chain_across_finishes": False}
# Chains across finishes, arrivals still ending them (chain_across_admissions off).
CONFIGS["chains-end-at-admissions"] = {"chain_across_admissions": False}
# Candidates for serve's default: another named recipe (engine/forward_pass/recipes.py), or one
# engine setting moved from serve's default.
for _recipe in ("gemv", "fast"):
    CONFIGS[f"recipe-{_recipe}"] = {"forward_pass_recipe": dict(NAMED_RECIPES[_recipe])}
# A mixture-of-experts model's experts through kernels.moe's grouped GEMM (moe_backend), on serve's
# recipe for such a model (`triton`).
CONFIGS["moe-grouped-experts"] = {"forward_pass_recipe": {**NAMED_RECIPES["triton"], "moe_backend": "triton"}}
CONFIGS["decode-steps-16"] = {"decode_steps": 16}
CONFIGS["batched-tokens-1024"] = {"max_num_batched_tokens": 1024}
CONFIGS["batched-tokens-4096"] = {"max_num_batched_tokens": 4096}
DEFAULT_CONFIGS = ("before", "mixed-graphs", "mixed-graphs-overlap8")
DEFAULT_PROFILES = ("chat", "agentic-long-context", "burst")
SAMPLED = {"temperature": 0.7, "top_p": 0.9}


# ---------------------------------------------------------------------------- server side
def serve_main(settings: dict[str, Any], port: int) -> None:
    """The server process: what engine.serving.server.serve runs (build_server, then uvicorn),
    with serve's default recipe plus ``settings``, and one route of this benchmark's own,
    GET /bench/runner-stats: the runner's counters (graph replays, mixed-step shapes)."""
    import logging

    import uvicorn

    logging.basicConfig(level="WARNING")
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.forward_pass.recipes import resolve_recipe
    from shapeshift.engine.serving.server import build_server

    settings = dict(settings)
    if "forward_pass_recipe" not in settings and "forward_pass" not in settings:
        import torch

        device = settings.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        settings["forward_pass_recipe"] = resolve_recipe("auto", device, settings["model"]) or None
    start = time.perf_counter()
    app, async_engine = build_server(EngineConfig(**settings))
    built_s = time.perf_counter() - start

    @app.get("/bench/runner-stats")
    async def runner_stats() -> dict[str, Any]:
        runner = async_engine.engine.runner
        buckets = runner.mixed_buckets
        return {"engine_build_s": built_s, "recipe": settings.get("forward_pass_recipe"),
                "decode_graphs": len(runner.graphs), "chunk_graphs": len(runner.chunk_graphs),
                "mixed_graphs": len(runner.mixed_graphs), "mixed_buckets": buckets.as_pairs() if buckets else None,
                "num_graph_replays": runner.num_graph_replays, "num_chunk_replays": runner.num_chunk_replays,
                "num_mixed_replays": runner.num_mixed_replays,
                "decode_chains": dict(async_engine.engine.decode_chains),
                "mixed_step_shapes": sorted([n, t, c] for (n, t), c in runner.mixed_step_shapes.items())}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, settings: dict[str, Any], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-json",
                                      json.dumps(settings), "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))

    def wait_ready(self, timeout_s: float) -> float:
        import httpx

        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s; see {self.log.name}")

    def model_name(self) -> str:
        import httpx

        return httpx.get(self.url + "/v1/models", timeout=10.0).json()["data"][0]["id"]

    def runner_stats(self) -> dict[str, Any] | None:
        import httpx

        try:
            return httpx.get(self.url + "/bench/runner-stats", timeout=10.0).json()
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------- client side
async def stream_one(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streaming completion -> submission, first and last token times, tokens, error."""
    submitted = time.perf_counter()
    first = last = None
    tokens = 0
    error = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = str(chunk["error"])[:200]
                        continue
                    for choice in chunk.get("choices", []):
                        n = len(choice.get("token_ids") or [])
                        if n:
                            now = time.perf_counter()
                            first = now if first is None else first
                            last = now
                            tokens += n
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        error = f"{type(exc).__name__}: {exc}"
    return {"submitted": submitted, "first": first, "last": last, "tokens": tokens, "error": error}


async def replay_run(url: str, model: str, requests: list[Any], concurrency: int | None,
                     sampling: dict[str, Any]) -> dict[str, Any]:
    """One run of ``requests``: closed loop at ``concurrency``, or open loop at their arrival times."""
    import httpx

    limits = httpx.Limits(max_connections=max(len(requests), 1), max_keepalive_connections=max(len(requests), 1))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        def body(req: Any) -> dict[str, Any]:
            return {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
                    "stream": True, "ignore_eos": True, "return_token_ids": True, "temperature": 0.0, **sampling}

        start = time.perf_counter()
        if concurrency is None:
            async def at_arrival(req: Any) -> dict[str, Any]:
                await asyncio.sleep(max(0.0, (req.arrival_s or 0.0) - (time.perf_counter() - start)))
                return await stream_one(client, url, body(req))

            results = await asyncio.gather(*(at_arrival(r) for r in requests))
        else:
            queue = list(reversed(requests))
            results = []

            async def worker() -> None:
                while queue:
                    results.append(await stream_one(client, url, body(queue.pop())))

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        wall = time.perf_counter() - start
    ok = [r for r in results if r["error"] is None and r["first"] is not None]
    per_user = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in ok if r["tokens"] > 1 and r["last"] > r["first"]]
    ttft = [r["first"] - r["submitted"] for r in ok]
    total = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "output_tokens": total, "output_tokens_per_s": total / wall if wall else 0.0,
            "per_user_tokens_per_s_p50": percentile(per_user, 0.5),
            "per_user_tokens_per_s_p90": percentile(per_user, 0.1),  # the speed 90% of users beat
            "ttft_s_p50": percentile(ttft, 0.5), "ttft_s_p90": percentile(ttft, 0.9),
            "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if r["error"]})[:3]}


def counts_between(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int] | None:
    """The engine's decode-chain counters (LLMEngine.decode_chains) gained between two readings."""
    if not before or not after or "decode_chains" not in after:
        return None
    return {k: v - before.get("decode_chains", {}).get(k, 0) for k, v in after["decode_chains"].items()}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("output_tokens_per_s", "per_user_tokens_per_s_p50", "per_user_tokens_per_s_p90", "ttft_s_p50",
            "ttft_s_p90")
    out: dict[str, Any] = {"repeats": len(runs), "failed": sum(r["failed"] for r in runs)}
    for k in keys:
        values = [r[k] for r in runs if not math.isnan(r[k])]
        out[k] = statistics.median(values) if values else float("nan")
        out[k + "_min"] = min(values) if values else float("nan")
        out[k + "_max"] = max(values) if values else float("nan")
    return out


# ---------------------------------------------------------------------------- driver
def model_facts(model: str) -> tuple[int, list[int]]:
    """(vocab size, EOS ids) of a preset or an HF-style folder, without loading weights."""
    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.models.presets import PRESETS

    if model in PRESETS:
        hf = PRESETS[model].hf_config
    else:
        hf = json.loads((Path(model) / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    return cfg.vocab_size, list(cfg.eos_token_ids)


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    commit = os.environ.get("SHAPESHIFT_GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    gpu = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {"commit": commit, "gpu": gpu, "host": platform.node(), "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def paired_ratios(report: dict[str, Any], base: str, key: str) -> dict[str, Any]:
    """Per profile and configuration: run j's figure over run j of ``base`` (runs alternate
    in time only across configurations, so the pairs share position, not the moment)."""
    out: dict[str, Any] = {}
    for name, cfg in report["configs"].items():
        if name == base:
            continue
        for profile, res in cfg["profiles"].items():
            ref = report["configs"][base]["profiles"].get(profile)
            if not ref:
                continue
            pairs = [a[key] / b[key] for a, b in zip(res["runs"], ref["runs"]) if b[key] and not math.isnan(a[key])]
            if pairs:
                out.setdefault(name, {})[profile] = {"median": statistics.median(pairs), "min": min(pairs),
                                                     "max": max(pairs), "pairs": len(pairs)}
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    configs = list(report["configs"])
    profiles = sorted({p for c in report["configs"].values() for p in c["profiles"]})
    metrics = [("output_tokens_per_s", "output tokens/s"), ("per_user_tokens_per_s_p90", "per-user tok/s p90"),
               ("ttft_s_p90", "TTFT p90 (s)")]
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(5 * (len(metrics) + 1), 4))
    width = 0.8 / max(1, len(configs))
    for ax, (key, label) in zip(axes, metrics):
        for i, name in enumerate(configs):
            vals = [report["configs"][name]["profiles"].get(p, {}).get("summary", {}).get(key, float("nan"))
                    for p in profiles]
            ax.bar([j + i * width for j in range(len(profiles))], vals, width, label=name)
        ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(profiles))], profiles, rotation=20)
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for i, name in enumerate(configs):
        b1 = report["configs"][name].get("batch1", {})
        vals = [b1.get(m, {}).get("per_user_tokens_per_s_p50", float("nan")) for m in ("greedy", "sampled")]
        ax.bar([j + i * width for j in range(2)], vals, width, label=name)
    ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(2)], ["greedy", "sampled t0.7 p0.9"])
    ax.set_title("batch 1 per-user tok/s")
    fig.suptitle(f"{report['model']} on {report['provenance']['gpu']} (HTTP streaming, median of runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    p.add_argument("--num-requests", type=int, default=None, help="first N shapes of each profile (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=256, help="output tokens of the pure-decode and batch-1 runs")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--serve-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_json is not None:
        serve_main(json.loads(args.serve_json), args.port)
        return 0

    from shapeshift.engine.replay.requests import load_shapes, make_requests

    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prov = provenance(args)
    gpu_slug = prov["gpu"].lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    stem = out_dir / f"serving-{Path(args.model).name}-{gpu_slug}-{stamp}"  # no suffix: the model name has dots
    json_path, png_path = Path(f"{stem}.json"), Path(f"{stem}.png")
    vocab, eos = model_facts(args.model)
    base = {"model": args.model, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed}
    for key in ("device", "dtype"):
        if getattr(args, key):
            base[key] = getattr(args, key)
    report: dict[str, Any] = {"benchmark": "serving", "model": args.model, "provenance": prov,
                              "engine_settings": base, "sampled": SAMPLED, "configs": {}}
    profiles = {}
    for name in args.profiles.split(","):
        data = load_shapes(ROOT / "bench" / "profiles" / f"{name}.json")
        shapes = data["shapes"][:args.num_requests] if args.num_requests else data["shapes"]
        reqs = make_requests(shapes, data["seed"], vocab, args.max_model_len, set(eos))
        conc = None if data["arrival_rate"] else data["concurrency"]
        profiles[name] = (reqs, conc)
    decode_batch = next((c for n, (_, c) in profiles.items() if n.startswith("chat") and c), 32)

    def save() -> None:
        json_path.write_text(json.dumps(report, indent=1) + "\n")

    from shapeshift.engine.replay.requests import ReplayRequest

    decode_reqs = [ReplayRequest(prompt_token_ids=[(7 * i + j) % (vocab - 2) + 1 for j in range(16)],
                                 max_tokens=args.decode_tokens) for i in range(decode_batch)]
    for cfg_name in args.configs.split(","):
        settings = {**base, **CONFIGS[cfg_name]}
        server = ServerProcess(settings, Path(f"{stem}-{cfg_name}-server.log"))
        entry: dict[str, Any] = {"settings": settings, "profiles": {}}
        report["configs"][cfg_name] = entry
        try:
            entry["startup_s"] = server.wait_ready(args.ready_timeout)
            model = server.model_name()
            for name, (reqs, conc) in profiles.items():
                asyncio.run(replay_run(server.url, model, reqs, conc, {}))  # warm-up (discarded)
                counters = server.runner_stats()
                runs = [asyncio.run(replay_run(server.url, model, reqs, conc, {})) for _ in range(args.repeats)]
                entry["profiles"][name] = {"requests": len(reqs), "concurrency": conc, "runs": runs,
                                           "summary": summarize(runs),
                                           "decode_chains": counts_between(counters, server.runner_stats())}
                save()
                s = entry["profiles"][name]["summary"]
                chains = entry["profiles"][name]["decode_chains"] or {}
                ends = " ".join(f"{k[4:]} {v}" for k, v in chains.items() if k.startswith("end.") and v)
                print(f"{cfg_name:>22} {name:>22}: {s['output_tokens_per_s']:8.0f} tok/s  per-user p90 "
                      f"{s['per_user_tokens_per_s_p90']:7.1f}  TTFT p90 {s['ttft_s_p90']:.3f} s  failed {s['failed']}"
                      + (f"  chains {chains['chains']} (ended: {ends or 'none'}), {chains['steps']} chained steps, "
                         f"{chains['single.prefill']} prefill steps, {chains.get('admitted_in_chain', 0)} admitted "
                         "into chains" if chains else ""), flush=True)
            # Pure decode at the chat batch: every request decoding at once (the goal's reference).
            asyncio.run(replay_run(server.url, model, decode_reqs, decode_batch, {}))
            counters = server.runner_stats()
            runs = [asyncio.run(replay_run(server.url, model, decode_reqs, decode_batch, {}))
                    for _ in range(args.repeats)]
            entry["pure_decode"] = {"batch": decode_batch, "runs": runs, "summary": summarize(runs),
                                    "decode_chains": counts_between(counters, server.runner_stats())}
            entry["batch1"] = {}
            for mode, sampling in (("greedy", {}), ("sampled", SAMPLED)):
                one = decode_reqs[:1]
                asyncio.run(replay_run(server.url, model, one, 1, sampling))
                runs = [asyncio.run(replay_run(server.url, model, one, 1, sampling)) for _ in range(args.repeats)]
                entry["batch1"][mode] = {"runs": runs, **summarize(runs)}
            save()
            pd = entry["pure_decode"]["summary"]["per_user_tokens_per_s_p50"]
            chat = next((v for n, v in entry["profiles"].items() if n.startswith("chat")), None)
            if chat is not None and pd:
                entry["goal"] = {"chat_per_user_p90": chat["summary"]["per_user_tokens_per_s_p90"],
                                 "pure_decode_per_user_p50": pd,
                                 "ratio": chat["summary"]["per_user_tokens_per_s_p90"] / pd, "target": 0.5}
            b1 = entry["batch1"]
            print(f"{cfg_name:>22} pure decode x{decode_batch}: per-user {pd:7.1f} tok/s; batch 1: greedy "
                  f"{b1['greedy']['per_user_tokens_per_s_p50']:7.1f}, sampled {b1['sampled']['per_user_tokens_per_s_p50']:7.1f}"
                  + (f"; goal ratio {entry['goal']['ratio']:.2f} (target 0.5)" if "goal" in entry else ""), flush=True)
        except Exception as exc:  # noqa: BLE001 - keep what was measured, say what failed
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{cfg_name}: {entry['error']}", flush=True)
        finally:
            if server.proc.poll() is None:
                entry["server"] = server.runner_stats()
            server.stop()
            save()
    names = list(report["configs"])
    if names and names[0] in report["configs"]:
        report["paired_ratios"] = {k: paired_ratios(report, names[0], k)
                                   for k in ("output_tokens_per_s", "per_user_tokens_per_s_p90")}
    save()
    plot(report, png_path)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
