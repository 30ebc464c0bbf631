"""Coordinate-descent sweep: one knob at a time around the best recipe on the board.

Data flow: board (fast-tier results) -> best stock-source recipe -> the untried
neighbours along the next knob in turn -> candidates. When every knob of the current best
has been swept with nothing new, the sweep has converged and proposes nothing (it wakes
up again when another agent posts a better point).

Which knob comes first depends on the traffic. Where the traffic the space was built for does
not fit the best recipe's engine settings, those settings go first, the worst misfit first
(traffic_guidance): more requests in flight than engine.max_num_seqs admits (some always wait),
prompts longer than engine.max_num_batched_tokens (each prefill takes several steps). Such a line
goes wider only, from the narrowest value that fits the traffic outward (narrower values fit
worse still: they wait for the knob's ordinary turn). Otherwise the order is read from the best result's SLO misses (engine/replay/slo.py):
where more requests than the SLO's p90 allows stream too slowly, the batch width and the
prefill chunk go first (a narrower batch gives each user more of a step, a smaller chunk stalls
decodes less); where first tokens come late, the chunk, the batch width
and prefix caching go first (more admitted, prefills finished sooner). Where the SLO is met
(or there is none), the objective is throughput and the knobs go in the space's order, code
paths before engine settings. Each proposal's note says which it was.
"""

from __future__ import annotations

from typing import Any

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.agents.base import SCREEN_TIER, Agent, proposed_digests, scored

# More than this share of requests missing one side of the SLO: that side binds (a p90 promise
# allows 10% to miss).
SLO_BINDS_ABOVE = 0.10

KNOBS_FOR_SLOW_STREAMS = ("engine.max_num_seqs", "engine.max_num_batched_tokens")
KNOBS_FOR_LATE_FIRST_TOKENS = ("engine.max_num_batched_tokens", "engine.max_num_seqs", "engine.enable_prefix_caching")


def slo_guidance(metrics: dict[str, Any] | None) -> tuple[tuple[str, ...], str | None]:
    """(knobs to sweep first, why) from one result's metrics; ((), None) where the SLO does not bind."""
    metrics = metrics or {}
    slow = float(metrics.get("slo_missed_per_user") or 0.0)
    late = float(metrics.get("slo_missed_ttft") or 0.0)
    if max(slow, late) <= SLO_BINDS_ABOVE:
        return (), None
    if slow >= late:
        return KNOBS_FOR_SLOW_STREAMS, f"SLO binds: {slow:.0%} of requests streamed slower than promised"
    return KNOBS_FOR_LATE_FIRST_TOKENS, f"SLO binds: {late:.0%} of requests got their first token late"


BATCH_WIDTH, TOKEN_BUDGET = "engine.max_num_seqs", "engine.max_num_batched_tokens"


def traffic_guidance(space: Any, recipe: dict) -> list[tuple[str, int, str]]:
    """(knob, the least value that fits the traffic, why) for each engine setting of `recipe` that
    the traffic the space was built for does not fit, the worst misfit (needed over set) first:
    more requests in flight than the batch width admits, a p90 prompt longer than the step's
    token budget. Empty where the space knows no traffic or everything fits."""
    misfits = []
    for knob, needed, says in (
            (BATCH_WIDTH, space.concurrency,
             "requests queue: the traffic keeps {needed} in flight, the batch takes {now}"),
            (TOKEN_BUDGET, space.prompt_tokens_p90,
             "prefills take several steps: p90 prompts are {needed} tokens, a step takes {now}")):
        now = recipe.get(knob)
        if needed and isinstance(now, int) and 0 < now < needed:
            misfits.append((needed / now, knob, int(needed), says.format(needed=needed, now=now)))
    return [(knob, needed, why) for _, knob, needed, why in sorted(misfits, reverse=True)]


def least_fitting(knob: Any, needed: int) -> Any:
    """The knob's first value at least `needed` (its values ascend), else its largest."""
    return next((v for v in knob.values if v >= needed), knob.values[-1])


def first_fitting(space: Any) -> list[Candidate]:
    """For the space's default (the pass to beat), the first value of each traffic_guidance line:
    the least setting that fits the traffic, as candidates to measure before anything else (the
    CLI's seeds, ahead of the named recipes)."""
    base = space.default()
    out = []
    for name, needed, why in traffic_guidance(space, base):
        value = least_fitting(space.knob(name), needed)
        recipe = {**base, name: value}
        if value != base[name] and space.is_valid(recipe):
            out.append(Candidate(recipe, None, "traffic", f"{name}={value!r} fits the traffic ({why})", None))
    return out


def result_metrics(board: Any, digest: str, tier: str = SCREEN_TIER) -> dict[str, Any] | None:
    """The metrics of `digest`'s best ok result on `tier` (the one scored() ranked it by)."""
    best = None
    for r in board.entries("result"):
        if r.get("digest") == digest and r.get("tier") == tier and r.get("status") == "ok":
            m = r.get("metrics") or {}
            if best is None or float(m.get("throughput") or 0.0) > float(best.get("throughput") or 0.0):
                best = m
    return best


class SweepAgent(Agent):
    name = "sweep"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cursor = 0

    def _line(self, base: dict, knob: Any, parent: str | None, seen: set[str], why: str | None,
              needed: int | None = None) -> list[Candidate]:
        """One coordinate's untried values, nearest the current one first (one step down, one up,
        two down, ...): a budget that ends inside the line has screened the likeliest values. On
        an H200 the token budget's line from the bottom spent three of four screens on 256, 512
        and 1024 (0.2x to 0.84x) before 4096 (docs/compile-loop.md M15). `needed`: the least
        value the traffic fits (traffic_guidance): only values wider than now, nearest the first
        value at least that first. The narrower ones fit the traffic worse still, and wait for the
        knob's ordinary turn: on an H200 the line 2048 / 1024 / 512 / 256 after a winning 8192
        spent four screens at 0.03x to 0.61x (docs/compile-loop.md M16)."""
        suffix = f" ({why})" if why else ""
        def position(value: Any) -> int:
            return next((i for i, v in enumerate(knob.values) if v == value), len(knob.values))

        here = position(base.get(knob.name))
        target = here if needed is None else position(least_fitting(knob, needed))

        def order(recipe: dict) -> tuple[int, int]:
            at = position(recipe[knob.name])
            return abs(at - target), at

        line = [r for r in self.space.neighbors(base, knob.name) if needed is None or position(r[knob.name]) > here]
        options = [Candidate(r, None, self.name, f"sweep {knob.name}={r[knob.name]!r} around the best{suffix}",
                             parent) for r in sorted(line, key=order)]
        return self.fresh(options, seen)

    def propose(self, n: int = 1) -> list[Candidate]:
        results = [s for s in scored(self.board, self.space) if s.source is None and not s.failed]
        base = results[0].recipe if results else self.space.default()
        parent = results[0].digest if results else None
        seen = proposed_digests(self.board)
        by_name = {k.name: k for k in self.space.knobs}
        for name, needed, why in traffic_guidance(self.space, base):
            if name in by_name:
                fresh = self._line(base, by_name[name], parent, seen, why, needed)
                if fresh:
                    return fresh
        first, why = slo_guidance(result_metrics(self.board, parent)) if parent else ((), None)
        for name in first:
            if name in by_name:
                fresh = self._line(base, by_name[name], parent, seen, why)
                if fresh:
                    return fresh
        for _ in range(len(self.space.knobs)):
            knob = self.space.knobs[self.cursor % len(self.space.knobs)]
            self.cursor += 1
            fresh = self._line(base, knob, parent, seen, None)
            if fresh:
                return fresh  # the whole coordinate at once: one line search
        return []
