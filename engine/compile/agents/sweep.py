"""Coordinate-descent sweep: one knob at a time around the best recipe on the board.

Data flow: board (fast-tier results) -> best stock-source recipe -> the untried
neighbours along the next knob in turn -> candidates. When every knob of the current best
has been swept with nothing new, the sweep has converged and proposes nothing (it wakes
up again when another agent posts a better point).
"""

from __future__ import annotations

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.agents.base import Agent, proposed_digests, scored


class SweepAgent(Agent):
    name = "sweep"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cursor = 0

    def propose(self, n: int = 1) -> list[Candidate]:
        results = [s for s in scored(self.board, self.space) if s.source is None and not s.failed]
        base = results[0].recipe if results else self.space.default()
        parent = results[0].digest if results else None
        seen = proposed_digests(self.board)
        for _ in range(len(self.space.knobs)):
            knob = self.space.knobs[self.cursor % len(self.space.knobs)]
            self.cursor += 1
            options = [Candidate(r, None, self.name, f"sweep {knob.name}={r[knob.name]!r} around the best",
                                 parent) for r in self.space.neighbors(base, knob.name)]
            fresh = self.fresh(options, seen)
            if fresh:
                return fresh  # the whole coordinate at once: one line search
        return []
