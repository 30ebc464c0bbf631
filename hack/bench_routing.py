"""Expert routing of replays (real text vs random token ids) and what counting it costs.

    python hack/bench_routing.py [--model tiny-moe] [--requests 32] [--draws 3] [--pairs 7] [--out FILE]

1. Distances: for each profile, `--draws` replays of real-text prompts (the corpus through the
   model's tokenizer, engine/replay/requests.py) and as many of random token ids with the same
   shapes, each replay's routing histogram taken from the engine's counters; printed and saved:
   the total variation (max over layers) between real-text draws, and from the first real-text
   draw to each random-token one (engine/contracts/expert_routing.py).
2. Overhead: a decode step of `--batch` sequences on the CPU (one torch thread, thread CPU time),
   with the routing counters on and off in alternation (ABBA), `--pairs` pairs of `--steps`
   steps each; the ratio per pair and its mean.

Writes JSON (commit, hardware, command, figures) to --out (default
bench/results/expert-routing-<model>-cpu-<UTC stamp>.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from shapeshift.engine.compile.evaluator import FULL, EngineEvaluator, EvaluatorSettings, replay
from shapeshift.engine.contracts.expert_routing import REPRESENTATIVE_TV
from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile, builtin_profile
from shapeshift.engine.core.expert_routing import counts_of
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.provenance import git_commit, result_name
from shapeshift.engine.replay import routing as rr
from shapeshift.engine.replay.requests import make_requests, requests_from_profile, sample_shapes

PROMPT_HEAVY = TrafficProfile(name="moe-short", prompt_length=LengthDistribution(p50=48, p90=96, p99=128, min=16),
                              output_length=LengthDistribution(p50=4, p90=6, p99=8, min=2), concurrency=8)


def distances(ev: EngineEvaluator, profile: TrafficProfile, n: int, draws: int) -> dict:
    ev.retarget(profile)
    eng, fitted = ev._engine(FULL, {}), ev._profile()

    def routed(reqs):
        before = rr.routing_snapshot(eng)
        ev._fresh_cache(eng)
        replay(eng, reqs, fitted.concurrency)
        return rr.routing_between(before, rr.routing_snapshot(eng))

    eos = set(eng.model_config.eos_token_ids)
    real = [routed(requests_from_profile(fitted, eng, n, seed=s, token_seed=1000 + s)) for s in range(draws)]
    rand = [routed(make_requests(sample_shapes(fitted, n, s), 2000 + s, eng.model_config.vocab_size,
                                 eng.config.max_model_len, eos, None)) for s in range(draws)]
    return {"profile": fitted.name, "requests": n,
            "real_vs_real": [round(real[0].distance(r).max, 4) for r in real[1:]],
            "real_vs_random": [round(real[0].distance(r).max, 4) for r in rand],
            "random_vs_random": [round(rand[0].distance(r).max, 4) for r in rand[1:]],
            "real_shares": real[0].shares(), "random_shares": rand[0].shares()}


def overhead(ev: EngineEvaluator, batch: int, steps: int, pairs: int) -> dict:
    eng = ev._engine(FULL, {})
    ev._fresh_cache(eng)
    fp = eng.forward_pass
    counts = counts_of(fp)
    prompt = list(range(40, 72))
    for i in range(batch):
        eng.add_request(f"bench-{i}", prompt[i:] + prompt[:i],
                        SamplingParams(max_tokens=steps * (2 * pairs + 2) + 4, temperature=0.0, ignore_eos=True))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill
    for _ in range(steps):
        eng.step()  # warm-up

    def timed(on: bool) -> float:
        fp.routing_counts = counts if on else None
        t0 = time.thread_time()
        for _ in range(steps):
            eng.step()
        return (time.thread_time() - t0) / steps

    ratios, on_s, off_s = [], [], []
    for rep in range(pairs):
        order = (True, False) if rep % 2 == 0 else (False, True)
        got = {on: timed(on) for on in order}
        on_s.append(got[True])
        off_s.append(got[False])
        ratios.append(got[True] / got[False])
    fp.routing_counts = counts
    # The counting itself, apart from the step's noise: the forward's choice weights, then one record()
    # per MoE layer on ids [batch, k].
    ids = torch.randint(0, counts.num_experts, (batch, eng.model_config.num_experts_per_tok))
    valid = torch.ones(batch, dtype=torch.bool)
    reps = 2000
    t0 = time.thread_time()
    with torch.inference_mode():  # as the forward pass runs
        for _ in range(reps):
            weights = counts.choice_weights(valid, ids.shape[1])  # once per forward
            for row in range(len(counts.layers)):
                counts.record(row, ids, weights)
    record_s = (time.thread_time() - t0) / reps
    for i in range(batch):
        eng.abort_request(f"bench-{i}")
    while eng.has_unfinished_requests():
        eng.step()
    return {"batch": batch, "steps_per_sample": steps, "pairs": pairs, "step_s_counting": on_s,
            "step_s_not_counting": off_s, "ratio_per_pair": [round(r, 4) for r in ratios],
            "ratio_mean": round(statistics.fmean(ratios), 4),
            "ratio_stdev": round(statistics.stdev(ratios), 4) if pairs > 1 else None,
            "record_s_per_step": record_s, "record_share_of_step": round(record_s / statistics.fmean(off_s), 5)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ev = EngineEvaluator(PROMPT_HEAVY, EvaluatorSettings(model=args.model, device="cpu", cpu_threads=1,
                                                         max_model_len=args.max_model_len))
    result = {"benchmark": "expert-routing", "model": args.model, "hardware": f"cpu ({platform.processor() or platform.machine()})",
              "git_commit": git_commit()[0], "tree_dirty": git_commit()[1], "command": "python " + " ".join(sys.argv),
              "threshold": REPRESENTATIVE_TV, "distance": "total variation per layer, max over layers",
              "distances": [], "utc": datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")}
    for profile in (PROMPT_HEAVY, builtin_profile("chat")):
        d = distances(ev, profile, args.requests, args.draws)
        result["distances"].append(d)
        print(f"{d['profile']}: real vs real {d['real_vs_real']}, real vs random {d['real_vs_random']}, "
              f"random vs random {d['random_vs_random']} (threshold {REPRESENTATIVE_TV})")
    o = overhead(ev, args.batch, args.steps, args.pairs)
    result["overhead"] = o
    print(f"decode step, batch {o['batch']}: counting/not counting {o['ratio_mean']}x "
          f"(per pair {o['ratio_per_pair']}; {statistics.fmean(o['step_s_not_counting']) * 1e3:.2f} ms per step); "
          f"the counting alone {o['record_s_per_step'] * 1e6:.1f} us per step = {o['record_share_of_step']:.2%} of it")
    out = Path(args.out or f"bench/results/{result_name('expert-routing', args.model, 'cpu')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
