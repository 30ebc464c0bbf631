"""What every verification gate runs on: settings, tolerances, the context and the comparison.

Data flow: GateSettings + the model, weights, reference and candidate passes -> GateContext
(fresh random prompts, a PagedDriver per run) -> run_pair (reference greedy, candidate
teacher-forced on its tokens) -> compare (greedy agreement, logprob and relative-logit
bounds) -> evidence; a gate raises GateFailure(message, **evidence) when it fails.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shapeshift.engine.forward_pass.paged_driver import PagedDriver, Seq
# dtype -> (logprob absolute tolerance, logit difference relative to the reference logits'
# standard deviation, near-tie margin in logits) and the comparison, shared with the hot-reload
# KV check (which must not import the verifier: the package takes seconds to import).
from shapeshift.engine.forward_pass.tolerances import PRECISION_FACTOR, TOLERANCES, compare  # noqa: F401


@dataclass
class GateSettings:
    seed: int | None = None  # None -> fresh from os.urandom every run
    num_prompts: int = 4
    steps: int = 16
    min_prompt_len: int = 3
    max_prompt_len: int = 70
    long_prompt_len: int = 200
    # Decode batch sizes: None -> every size from 1 to max_batch_size, the graph buckets and the
    # engine's largest batch, and three sizes between each bucket past max_batch_size and the next
    # (odd sizes between buckets take other code paths than the buckets).
    batch_sizes: tuple[int, ...] | None = None
    max_batch_size: int = 12
    graph_buckets: tuple[int, ...] = ()
    # Contexts up to the deployment's max model length (coverage.long_context): one at the limit,
    # one drawn from the upper half (the profile's long tail).
    max_model_len: int = 512
    # Prompt lengths of the traffic the candidate was measured on (the replayed profile's p50,
    # p90 and p99, fitted into max_model_len): coverage.long_context decodes at each of them
    # besides the limit, in place of the one length drawn from the upper half. Empty: that draw.
    traffic_prompt_lens: tuple[int, ...] = ()
    odd_lengths: tuple[int, ...] | None = None  # None -> derived from the block size
    block_size: int = 16
    num_blocks: int = 96
    # coverage.block_pool: the serving engine's KV pool (blocks; 0: num_blocks), which that gate's
    # drivers match up to pool_bytes_max each (their KV caches; the evidence says when capped).
    pool_blocks: int = 0
    pool_bytes_max: int = 256 << 20
    gate_timeout_s: float = 120.0
    build_timeout_s: float = 120.0
    logprob_atol: float | None = None  # None -> TOLERANCES[dtype]
    logit_rtol: float | None = None
    tie_margin: float | None = None
    top_k_compare: int = 8
    # Half precision: measure the reference's rounding error against float32 first and widen
    # the logprob and logit bounds to precision_factor times it (see TOLERANCES).
    calibrate: bool = True
    precision_factor: float = PRECISION_FACTOR
    # Real text the replays draw their prompts from (engine/replay/corpus.py, the model's
    # tokenizer): each gate prompt is then a span of it from a fresh random offset, as served
    # traffic is text; None: random token ids. The canary stays random (a secret, not a phrase).
    prompt_tokens: tuple[int, ...] | None = None
    # outputs.sampling: one row each (temperature, top_p, top_k), seeded afresh every run, decoded
    # in one batch; the temperature-0 row is greedy beside the sampled ones, as the engine batches.
    sampling: tuple[tuple[float, float, int], ...] = ((0.7, 1.0, 0), (1.0, 0.9, 0), (0.8, 1.0, 40),
                                                      (1.2, 0.95, 20), (0.0, 1.0, 0))

    def decode_batch_sizes(self) -> list[int]:
        if self.batch_sizes is not None:
            return sorted(set(self.batch_sizes))
        sizes = set(range(1, self.max_batch_size + 1)) | set(self.graph_buckets)
        # Past max_batch_size, between each bucket and the next: just above the bucket, an odd size
        # mid-way and just below the next (an eager step runs them as they are; 17, 25, 31, 33, 41
        # and 47 for buckets 16, 32 and 48).
        points = sorted({self.max_batch_size} | {b for b in self.graph_buckets if b > self.max_batch_size})
        for low, high in zip(points, points[1:]):
            if high - low > 1:
                sizes |= {low + 1, (low + high) // 2 | 1, high - 1}
        return sorted(sizes)

    def odd(self) -> tuple[int, ...]:
        b = self.block_size
        return self.odd_lengths or (1, 2, 3, 5, 7, b - 1, b, b + 1, 2 * b - 1, 2 * b + 3, 3 * b + 5)


class GateFailure(AssertionError):
    def __init__(self, message: str, **evidence: Any) -> None:
        super().__init__(message)
        self.evidence = evidence


@dataclass
class GateContext:
    model_config: Any
    weights: dict[str, torch.Tensor]
    dtype: torch.dtype
    device: torch.device
    reference: Any
    candidate: Any
    reference_cache_format: str
    candidate_cache_format: str
    settings: GateSettings
    rng: random.Random
    seed: int
    # (logprob atol, logit rtol, near-tie margin) from calibrate_tolerance
    calibrated: tuple[float, float, float] | None = None
    # (num_blocks, block_size, seed) -> a driver whose KV cache the candidate's process maps too
    driver_factory: Callable[[int, int, int], PagedDriver] | None = None

    @property
    def tol(self) -> tuple[float, float, float]:
        atol, rtol, tie = TOLERANCES.get(self.dtype, (0.1, 5e-2, 0.1))
        if self.calibrated is not None:
            atol, rtol, tie = (max(atol, self.calibrated[0]), max(rtol, self.calibrated[1]),
                               max(tie, self.calibrated[2]))
        s = self.settings
        return (s.logprob_atol or atol, s.logit_rtol or rtol, s.tie_margin or tie)

    def driver(self, num_blocks: int | None = None) -> PagedDriver:
        blocks, seed = num_blocks or self.settings.num_blocks, self.rng.getrandbits(31)
        if self.driver_factory is not None:
            return self.driver_factory(blocks, self.settings.block_size, seed)
        return PagedDriver(self.model_config, self.dtype, self.device, num_blocks=blocks,
                           block_size=self.settings.block_size, seed=seed)

    def prompt(self, length: int | None = None, text: bool = True) -> list[int]:
        s = self.settings
        n = length if length is not None else self.rng.randint(s.min_prompt_len, s.max_prompt_len)
        corpus = s.prompt_tokens
        if text and corpus:
            out: list[int] = []
            while len(out) < n:  # a span from a fresh offset, wrapping into another at the end
                start = self.rng.randrange(len(corpus))
                out += corpus[start:start + n - len(out)]
            return out
        return [self.rng.randrange(self.model_config.vocab_size) for _ in range(n)]


def run_pair(ctx: GateContext, prompts: list[list[int]], steps: int, setup: Callable[[PagedDriver, list[Seq]], None]
             | None = None) -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Reference greedy on its own driver, candidate teacher-forced on the reference's tokens."""
    ref_driver, cand_driver = ctx.driver(), ctx.driver()
    ref_seqs = [Seq(list(p)) for p in prompts]
    ref_tokens, ref_logits = ref_driver.greedy(ctx.reference, ref_seqs, steps)
    cand_seqs = [Seq(list(p)) for p in prompts]
    _, cand_logits = cand_driver.greedy(ctx.candidate, cand_seqs, steps, forced=ref_tokens)
    return ref_tokens, ref_logits, cand_logits


def require(evidence: dict[str, Any], what: str) -> dict[str, Any]:
    if not evidence.get("ok", False):
        raise GateFailure(what, **evidence)
    return evidence
