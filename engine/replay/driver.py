"""Traffic replay: requests from a traffic profile, driven through an LLMEngine.

Data flow:

    TrafficProfile + seed --requests_from_profile (engine/replay/requests.py)-->
      [ReplayRequest(prompt_token_ids, max_tokens, arrival_s)]
      --replay(engine, requests, concurrency | arrival times)--> per request: TTFT,
         per-user decode tokens/s, per-user end-to-end tokens/s (queueing included);
         per run: output tokens/s
      --repeats--> ReplayReport: medians of the runs and the run-to-run coefficient of
         variation of output tokens/s (the noise a candidate must beat)

Closed loop (default): ``concurrency`` requests in flight; when one finishes the next
enters. Open loop (profile has an arrival rate): requests enter at their arrival
times. The prefix cache is flushed between runs so every run sees the same hits.
The engine and profile are duck-typed, so this module needs neither pydantic nor numpy.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from shapeshift.engine.replay.requests import ReplayRequest, requests_from_profile


@dataclass
class ReplayRun:
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    per_user_tokens_per_s_p50: float
    per_user_tokens_per_s_p90: float  # the 90th percentile of slowness: 10% of users are slower
    ttft_s_p50: float
    ttft_s_p90: float
    prefix_cache_hit_rate: float
    failed: int = 0
    # What a user gets end to end: output tokens over the time from submission to the last
    # token, so time spent queued behind a full batch counts (the decode-only speed above
    # does not see it). p90 in the same latency sense: the speed 90% of users beat.
    per_user_e2e_tokens_per_s_p50: float = float("nan")
    per_user_e2e_tokens_per_s_p90: float = float("nan")
    # With an SLO (engine/replay/slo.py): output tokens/s of the requests that met it, and
    # their share of the requests (NaN without one).
    goodput_tokens_per_s: float = float("nan")
    slo_attainment: float = float("nan")
    # Why requests missed it: the share of requests whose first token came late, and the share
    # that streamed slower than promised (a request can miss both; NaN without an SLO). The
    # search reads them to try first the settings that move the side that binds.
    slo_missed_ttft: float = float("nan")
    slo_missed_per_user: float = float("nan")
    # The tokens each request got, in request order: what was measured is checked against the
    # reference's tokens on the same requests (engine/verify/measured.py).
    output_token_ids: list[list[int]] | None = None


@dataclass
class ReplayReport:
    profile: str
    seed: int
    num_requests: int
    concurrency: int | None
    arrival_rate: float | None
    runs: list[ReplayRun] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return statistics.median(r.output_tokens_per_s for r in self.runs)

    @property
    def noise_cv(self) -> float:
        """Coefficient of variation of output tokens/s over the runs (0 with one run)."""
        values = [r.output_tokens_per_s for r in self.runs]
        if len(values) < 2:
            return 0.0
        mean = statistics.fmean(values)
        return statistics.stdev(values) / mean if mean else 0.0

    def summary(self) -> dict[str, Any]:
        def med(attr: str) -> float:
            return statistics.median(getattr(r, attr) for r in self.runs)

        return {"profile": self.profile, "seed": self.seed, "requests": self.num_requests,
                "concurrency": self.concurrency, "arrival_rate": self.arrival_rate, "repeats": len(self.runs),
                "output_tokens_per_s": self.output_tokens_per_s, "noise_cv": self.noise_cv,
                "per_user_tokens_per_s_p50": med("per_user_tokens_per_s_p50"),
                "per_user_tokens_per_s_p90": med("per_user_tokens_per_s_p90"),
                "per_user_e2e_tokens_per_s_p90": med("per_user_e2e_tokens_per_s_p90"),
                "ttft_s_p50": med("ttft_s_p50"), "ttft_s_p90": med("ttft_s_p90"),
                "prefix_cache_hit_rate": med("prefix_cache_hit_rate"),
                "failed": sum(r.failed for r in self.runs)}

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "runs": [asdict(r) for r in self.runs]}


# ---------------------------------------------------------------------- driving


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` by linear interpolation between order statistics (NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def fresh_engine_cache(engine: Any) -> None:
    """An empty prefix cache on an idle engine: a new block manager and scheduler over the same KV
    tensors (the blocks a replay left cached, and their counts, are forgotten)."""
    from shapeshift.engine.core.block_manager import BlockManager
    from shapeshift.engine.core.scheduler import Scheduler

    if engine.has_unfinished_requests():
        raise RuntimeError("cannot reset the KV cache of an engine with requests in flight")
    old_bm, old_sched = engine.block_manager, engine.scheduler
    bm = BlockManager(old_bm.num_blocks, old_bm.block_size, engine.config.enable_prefix_caching,
                      tag=getattr(old_bm, "tag", ""))
    engine.block_manager = bm
    engine.scheduler = Scheduler(bm, engine.config.max_num_seqs, engine.config.max_num_batched_tokens,
                                 engine.config.max_model_len, tokenizer=old_sched.tokenizer,
                                 eos_token_ids=sorted(old_sched.eos_token_ids))


def _flush_prefix_cache(engine: Any) -> None:
    bm = getattr(engine, "block_manager", None)
    if bm is not None and hasattr(bm, "set_tag"):
        tag = bm.tag
        bm.set_tag(f"{tag}#replay-flush")  # a tag change forgets every cached block
        bm.set_tag(tag)


def run_once(engine: Any, requests: list[ReplayRequest], concurrency: int | None,
             clock: Any = time.perf_counter, slo: Any = None) -> ReplayRun:
    from shapeshift.engine.core.sampling import SamplingParams

    if engine.has_unfinished_requests():
        raise RuntimeError("replay needs an idle engine")
    _flush_prefix_cache(engine)
    bm = engine.block_manager
    queried0, hit0 = bm.prefix_cache_queried_tokens, bm.prefix_cache_hit_tokens
    open_loop = concurrency is None
    limit = len(requests) if open_loop else max(1, concurrency)
    pending = list(enumerate(requests))
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    produced: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    failed = 0
    # Open loop: while nothing is in flight the clock jumps to the next arrival instead of
    # sleeping (the engine is idle either way), which also makes arrival times work on a CPU-time
    # clock, where sleeping would not advance it.
    skipped = 0.0

    def now_abs() -> float:
        return clock() + skipped

    start = now_abs()
    in_flight = 0
    while pending or in_flight:
        now = now_abs() - start
        while pending and in_flight < limit:
            i, req = pending[0]
            if open_loop and req.arrival_s is not None and req.arrival_s > now:
                break
            pending.pop(0)
            rid = f"replay-{i}"
            params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, list(req.prompt_token_ids), params)
            # open loop: a request's wait counts from its arrival, even when a step delayed its submission
            arrived = start + req.arrival_s if open_loop and req.arrival_s is not None else now_abs()
            submitted[rid] = min(arrived, now_abs())
            in_flight += 1
        if not in_flight:
            skipped += max(0.0, (pending[0][1].arrival_s or 0) - now)
            continue
        for out in engine.step():
            t = now_abs()
            if out.new_token_ids:
                first.setdefault(out.request_id, t)
                last[out.request_id] = t
                produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                if out.finish_reason not in ("length", "stop"):
                    failed += 1
    wall = now_abs() - start
    total = sum(produced.values())
    ttft = [first[r] - submitted[r] for r in first]
    per_user = [(produced[r] - 1) / (last[r] - first[r]) for r in first if produced[r] > 1 and last[r] > first[r]]
    end_to_end = [produced[r] / (last[r] - submitted[r]) for r in first if last[r] > submitted[r]]
    queried = bm.prefix_cache_queried_tokens - queried0
    goodput = attainment = missed_ttft = missed_per_user = float("nan")
    if slo is not None:
        def speed(r: str) -> float | None:
            return (produced[r] - 1) / (last[r] - first[r]) if produced[r] > 1 and last[r] > first[r] else None

        met = [r for r in first if slo.met(first[r] - submitted[r], speed(r))]
        goodput = sum(produced[r] for r in met) / wall if wall else 0.0
        attainment = len(met) / len(requests) if requests else 0.0
        if requests:
            # A request that never produced a token missed its first token.
            missed_ttft = sum(1 for i in range(len(requests)) if not slo.met(
                first.get(f"replay-{i}", math.inf) - submitted.get(f"replay-{i}", 0.0), None)) / len(requests)
            missed_per_user = sum(1 for r in first if speed(r) is not None and not slo.met(0.0, speed(r))) / len(requests)
    return ReplayRun(wall_s=wall, output_tokens=total, output_tokens_per_s=total / wall if wall else 0.0,
                     per_user_tokens_per_s_p50=percentile(per_user, 0.5),
                     # p90 of per-user speed in the latency sense: the speed 90% of users beat
                     per_user_tokens_per_s_p90=percentile(per_user, 0.1),
                     ttft_s_p50=percentile(ttft, 0.5), ttft_s_p90=percentile(ttft, 0.9),
                     prefix_cache_hit_rate=(bm.prefix_cache_hit_tokens - hit0) / queried if queried else 0.0,
                     failed=failed,
                     per_user_e2e_tokens_per_s_p50=percentile(end_to_end, 0.5),
                     per_user_e2e_tokens_per_s_p90=percentile(end_to_end, 0.1),
                     goodput_tokens_per_s=goodput, slo_attainment=attainment,
                     slo_missed_ttft=missed_ttft, slo_missed_per_user=missed_per_user,
                     output_token_ids=[tokens.get(f"replay-{i}", []) for i in range(len(requests))])


def replay(engine: Any, requests: list[ReplayRequest], *, profile_name: str, seed: int,
           concurrency: int | None, arrival_rate: float | None = None, repeats: int = 3,
           warmup_runs: int = 0) -> ReplayReport:
    """Run the same requests ``repeats`` times (after ``warmup_runs`` discarded ones)."""
    report = ReplayReport(profile=profile_name, seed=seed, num_requests=len(requests), concurrency=concurrency,
                          arrival_rate=arrival_rate)
    for _ in range(warmup_runs):
        run_once(engine, requests, concurrency)
    for _ in range(repeats):
        report.runs.append(run_once(engine, requests, concurrency))
    return report


def replay_profile(engine: Any, profile: Any, *, num_requests: int, seed: int = 0, repeats: int = 3,
                   warmup_runs: int = 0, concurrency: int | None = None) -> ReplayReport:
    """Requests from ``profile`` (closed loop at its concurrency unless it has an arrival rate)."""
    requests = requests_from_profile(profile, engine, num_requests, seed)
    rate = getattr(profile, "arrival_rate", None)
    conc = concurrency if concurrency is not None else (None if rate else profile.concurrency)
    return replay(engine, requests, profile_name=profile.name, seed=seed, concurrency=conc, arrival_rate=rate,
                  repeats=repeats, warmup_runs=warmup_runs)
