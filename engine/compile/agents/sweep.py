"""Coordinate-descent sweep: one knob at a time around the best recipe on the board.

Data flow: board (fast-tier results) -> best stock-source recipe -> the untried
neighbours along the next knob in turn -> candidates. When every knob of the current best
has been swept with nothing new, the sweep has converged and proposes nothing (it wakes
up again when another agent posts a better point).

Which knob comes first depends on the traffic. Where the traffic keeps more requests in flight
than the best recipe's batch takes (the space's concurrency against its engine.max_num_seqs),
requests queue whatever the code does: the batch width goes first, wider values first, from the
one that admits the whole traffic's concurrency down (queue_guidance). Otherwise it is read
from the best result's SLO misses (engine/replay/slo.py): where more requests than the SLO's p90 allows stream too slowly, the
batch width and the prefill chunk go first (a narrower batch gives each user more of a step, a
smaller chunk stalls decodes less); where first tokens come late, the chunk, the batch width
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


BATCH_WIDTH = "engine.max_num_seqs"


def queue_guidance(space: Any, recipe: dict) -> str | None:
    """Why the batch width goes first for `recipe`, or None: the traffic the space was built for
    keeps more requests in flight than its engine.max_num_seqs admits, so some always wait."""
    concurrency, width = getattr(space, "concurrency", None), recipe.get(BATCH_WIDTH)
    if not concurrency or not isinstance(width, int) or width >= concurrency:
        return None
    return f"requests queue: the traffic keeps {concurrency} in flight, the batch takes {width}"


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

    def _line(self, base: dict, knob: Any, parent: str | None, seen: set[str], why: str | None) -> list[Candidate]:
        """One coordinate's untried values, nearest the current one first (one step down, one up,
        two down, ...): a budget that ends inside the line has screened the likeliest values. On
        an H200 the token budget's line from the bottom spent three of four screens on 256, 512
        and 1024 (0.2x to 0.84x) before 4096 (docs/compile-loop.md M15)."""
        suffix = f" ({why})" if why else ""
        def position(value: Any) -> int:
            return next((i for i, v in enumerate(knob.values) if v == value), len(knob.values))

        here = position(base.get(knob.name))

        def distance(recipe: dict) -> tuple[int, int]:
            return abs(position(recipe[knob.name]) - here), position(recipe[knob.name])

        order = distance
        if knob.name == BATCH_WIDTH and queue_guidance(self.space, base):
            # wider than now first, nearest the narrowest width that admits the whole concurrency
            # (fewer rows cost less per step where nobody waits), narrower than now last
            target = position(next((v for v in knob.values if v >= self.space.concurrency), knob.values[-1]))

            def order(recipe: dict) -> tuple[bool, int, int]:
                at = position(recipe[knob.name])
                return at <= here, abs(at - target), at

        options = [Candidate(r, None, self.name, f"sweep {knob.name}={r[knob.name]!r} around the best{suffix}",
                             parent) for r in sorted(self.space.neighbors(base, knob.name), key=order)]
        return self.fresh(options, seen)

    def propose(self, n: int = 1) -> list[Candidate]:
        results = [s for s in scored(self.board, self.space) if s.source is None and not s.failed]
        base = results[0].recipe if results else self.space.default()
        parent = results[0].digest if results else None
        seen = proposed_digests(self.board)
        queued = queue_guidance(self.space, base)
        if queued:
            first, why = (BATCH_WIDTH,), queued
        else:
            first, why = slo_guidance(result_metrics(self.board, parent)) if parent else ((), None)
        by_name = {k.name: k for k in self.space.knobs}
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
