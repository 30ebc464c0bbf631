"""Model-based agent: Optuna's TPE sampler over the search space, told of the board's results.

Data flow: board (fast-tier results of stock-source candidates) -> each result not yet
known is added to the study as a completed trial (knob value indices as categorical
parameters, throughput as the objective to maximise; a failed candidate counts as 0) ->
`study.ask()` -> a recipe -> a candidate. The asked trial is closed at once as FAIL (TPE
ignores failed trials); its real outcome arrives later through the board like everyone
else's, so what the sampler learns does not depend on which agent proposed what.
"""

from __future__ import annotations

import logging

import optuna

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.agents.base import Agent, proposed_digests, scored

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger(__name__)


class BayesAgent(Agent):
    name = "bayes"

    def __init__(self, *args, n_startup_trials: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=n_startup_trials,
                                                  multivariate=True)
        self.study = optuna.create_study(direction="maximize", sampler=self.sampler)
        # Categorical over value indices: knob values may be dicts (kernel configs), which
        # optuna's categorical distribution cannot hold.
        self.distributions = {k.name: optuna.distributions.CategoricalDistribution(list(range(len(k.values))))
                              for k in self.space.knobs}
        self.known: set[str] = set()

    def _learn(self) -> int:
        added = 0
        for s in scored(self.board, self.space):
            if s.digest in self.known or s.source is not None:
                continue
            self.known.add(s.digest)
            try:
                params = {k.name: k.index(s.recipe[k.name]) for k in self.space.knobs}
            except (KeyError, ValueError):
                continue  # a recipe from an older space: not comparable
            self.study.add_trial(optuna.trial.create_trial(
                params=params, distributions=self.distributions, value=s.throughput))
            added += 1
        return added

    def propose(self, n: int = 1) -> list[Candidate]:
        self._learn()
        seen = proposed_digests(self.board)
        out: list[Candidate] = []
        for _ in range(10 * n):
            if len(out) >= n:
                break
            trial = self.study.ask(self.distributions)
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            recipe = {k.name: k.values[trial.params[k.name]] for k in self.space.knobs}
            if not self.space.is_valid(recipe):
                continue
            completed = len(self.study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
            cand = Candidate(recipe, None, self.name, f"TPE suggestion after {completed} observed results")
            if cand.digest in seen:
                # TPE exploits: on a small space it keeps suggesting measured points. Try the
                # suggestion's one-knob neighbours instead, so each call still proposes something.
                cand = self._unseen_neighbour(recipe, seen, completed) or cand
            fresh = self.fresh([cand], seen)
            if fresh:
                seen.add(cand.digest)
                out.extend(fresh)
        return out

    def _unseen_neighbour(self, recipe: dict, seen: set[str], completed: int) -> Candidate | None:
        knobs = [k.name for k in self.space.knobs]
        self.rng.shuffle(knobs)
        for knob in knobs:
            options = self.space.neighbors(recipe, knob)
            self.rng.shuffle(options)
            for other in options:
                cand = Candidate(other, None, self.name,
                                 f"TPE suggestion after {completed} observed results, {knob} moved (the suggestion was measured)")
                if cand.digest not in seen:
                    return cand
        return None
