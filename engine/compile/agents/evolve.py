"""Evolutionary agent: recombines the best candidates on the board.

Data flow: board (fast-tier results, any source) -> the top `population` -> tournament
selection of two parents -> uniform crossover of their recipes, the source of one of
them, then a mutation with probability `mutation_rate` -> a child not tried before.
With fewer than two results it explores with random valid points.
"""

from __future__ import annotations

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.agents.base import Agent, proposed_digests, scored


class EvolveAgent(Agent):
    name = "evolve"

    def __init__(self, *args, population: int = 8, mutation_rate: float = 0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.population = population
        self.mutation_rate = mutation_rate

    def _tournament(self, pool):
        a, b = self.rng.sample(pool, 2) if len(pool) >= 2 else (pool[0], pool[0])
        return a if a.rank >= b.rank else b

    def propose(self, n: int = 1) -> list[Candidate]:
        pool = [s for s in scored(self.board, self.space) if not s.failed][: self.population]
        seen = proposed_digests(self.board)
        out: list[Candidate] = []
        for _ in range(20 * n):
            if len(out) >= n:
                break
            if len(pool) < 2:
                recipe = self.space.sample(self.rng)
                cand = Candidate(recipe, None, self.name, "explore: random valid point (population too small)")
            else:
                mom, dad = self._tournament(pool), self._tournament(pool)
                recipe = self.space.crossover(mom.recipe, dad.recipe, self.rng)
                mutated = self.rng.random() < self.mutation_rate
                if mutated:
                    recipe = self.space.mutate(recipe, self.rng)
                source_parent = mom if self.rng.random() < 0.5 else dad
                cand = Candidate(recipe, source_parent.source, self.name,
                                 f"crossover {mom.digest[:8]} x {dad.digest[:8]}" + (" + mutation" if mutated else ""),
                                 parent=mom.digest)
            fresh = self.fresh([cand], seen)
            if fresh:
                seen.add(cand.digest)
                out.extend(fresh)
        return out
