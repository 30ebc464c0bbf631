"""The compile loop: agents propose, the device measures, only verified winners are kept.

Data flow:
    agents (threads) --candidates--> bounded experiment queue --> loop (one measuring thread)
    loop: screen on the fast tier, paired with the incumbent (ABBA) -> board "trial" + "result"
          faster than the incumbent by screen_margin? -> confirm on the full tier: traffic
            replay of candidate and incumbent in alternation (evaluator.compare)
          lower 95% bound of the paired speed ratio > 1 + noise floor (and >= min_speedup),
            (undecided: mean above that bar, lower bound below -> one more round of pairs, pooled)
            p90 per-user speed not worse? -> verify (the gate suite, against the stock pass)
          passed -> new incumbent -------------------------------> board "incumbent"
    every screen measures the incumbent too: its series over the run is the drift the report
      gives (an evaluator that cannot pair: the incumbent is re-screened every few trials)
    budget (trials, wall clock) spent -> stop agents -> final paired comparison of the
      incumbent with the stock pass (the reported speedup; within noise -> nothing published)
      -> with a pass to beat (the deployment's active forward pass, measured first like a
         seed): a paired comparison with it too; not faster by min_speedup beyond the noise,
         or the pass itself -> nothing published
      -> champion bundle + report (JSON, markdown: report.py)
    every trial -> progress log line (trials, best speedup, ETA, agents' states) and the
      status callback

Restart: the board is the state. A resumed loop reads it back: finished trials are not
measured or counted again, a trial that was started but never finished is re-run under
its own id, candidates proposed but never started are measured first, screens that beat the incumbent
with no budget left to confirm them are confirmed first, and the incumbent is restored.

Deterministic mode (``LoopConfig.deterministic``) drives the agents in rounds from the
loop's own thread instead of concurrently: every agent proposes against the same board,
then the round is measured. The first round sees only the baseline, so with the same seed
it is the same; later rounds depend on measured results (timings are never exact).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shapeshift.engine.compile import closing, time_budget
from shapeshift.engine.compile.agents.base import Agent, AgentWorker, submit
from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.job import Budget
from shapeshift.engine.compile.progress import ProgressCallback, default_progress
from shapeshift.engine.compile.measure import (FAST, FULL, Evaluator, Measurement, Verification, beats, beats_paired, drift_summary,
                                               paired_gain, per_user_not_worse, result_status)
from shapeshift.engine.compile.search_space import SearchSpace
from shapeshift.engine.compile.tier_slo import calibrate_fast_tier_slo

log = logging.getLogger(__name__)

StatusCallback = Callable[[dict[str, Any]], None]


@dataclass
class LoopConfig:
    seed: int = 0
    queue_size: int = 4  # experiments waiting for the device
    deterministic: bool = False
    max_confirms: int | None = None  # full-tier confirmations allowed (None: no cap)
    candidate_wait_s: float = 30.0  # give up waiting for agents after this long with an empty queue
    status_every_s: float = 0.0  # min seconds between status callbacks (0: after every trial)
    min_speedup: float = 1.0  # besides beating the noise, the least ratio over the incumbent to accept
    screen_margin: float = 0.02  # fast-tier gain over the incumbent that earns a full-tier confirmation
    refresh_incumbent_every: int = 4  # re-measure the incumbent on the fast tier every N trials (load drift)
    # An undecided paired confirmation (mean gain clears the bar, its 95% lower bound does not)
    # gets this many more rounds of pairs, pooled with the first. With 2 pairs the bounds are
    # t(1) = 12.7 standard errors wide and a 2x candidate can read as noise (seen on an H200:
    # 2.08x, bounds 0.40..10.8). One look more raises the false-accept rate a little; the
    # verification gates and the closing 5-pair comparison with the stock pass still follow.
    extend_undecided: int = 1
    # What the baseline is (the report and the last line name it): the shipped serving default
    # (forward_pass/recipes.py serving_default) when the composition says so.
    baseline_name: str = "the stock forward pass with default knobs"


@dataclass
class Incumbent:
    candidate: Candidate
    fast: Measurement
    full: Measurement | None
    verification: Verification | None = None


@dataclass
class CompileResult:
    baseline_fast: Measurement
    baseline_full: Measurement | None
    incumbent: Incumbent
    champion: Candidate | None  # None: nothing beat the stock pass beyond the noise and passed verification
    speedup: float | None  # champion vs baseline on the full tier
    trials: int
    confirms: int
    verifications: int
    elapsed_s: float
    leaderboard: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = ""
    baseline_name: str = ""
    speedup_bounds: tuple[float, float] | None = None  # 95% bounds of `speedup` (paired, the closing comparison)
    # The champion against the plain-PyTorch pass where the baseline is another pass:
    # {"speedup", "low", "high", "pairs"} (None: the baseline is the plain pass, or no champion).
    vs_plain: dict[str, Any] | None = None
    drift: dict[str, Any] = field(default_factory=dict)  # the incumbents' drift over the run (measure.drift_summary)

    def summary(self) -> dict[str, Any]:
        return {
            "champion": None if self.champion is None else self.champion.digest,
            "speedup": self.speedup,
            "speedup_bounds": None if self.speedup_bounds is None else list(self.speedup_bounds),
            "baseline_name": self.baseline_name,
            "vs_plain": self.vs_plain,
            "drift": self.drift,
            "trials": self.trials,
            "confirms": self.confirms,
            "verifications": self.verifications,
            "elapsed_s": round(self.elapsed_s, 2),
            "stop_reason": self.stop_reason,
        }


class CompileLoop:
    def __init__(self, evaluator: Evaluator, space: SearchSpace, board: Board, agents: list[Agent],
                 budget: Budget, config: LoopConfig | None = None, on_status: StatusCallback | None = None,
                 seed_candidates: list[Candidate] | None = None, pass_to_beat: Candidate | None = None,
                 plain_pass: Candidate | None = None, on_progress: ProgressCallback | None = None):
        """`pass_to_beat`: a forward pass already serving (e.g. the deployment's active one) that a
        champion must beat besides the baseline; it is measured first, as a seed. `plain_pass`:
        the plain-PyTorch pass, the champion's second figure when the baseline is another pass.
        `on_progress(event, loop, **detail)`: where the run is, at each phase and trial (progress.py;
        default: lines on a terminal, log records elsewhere)."""
        self.evaluator = evaluator
        self.space = space
        self.board = board
        self.agents = agents
        self.budget = budget
        self.config = config or LoopConfig()
        self.on_status = on_status
        self.on_progress = on_progress if on_progress is not None else default_progress()
        self.seed_candidates = list(seed_candidates or [])
        # completed as submit() completes every candidate, so its digest is the one on the board
        self.pass_to_beat = None if pass_to_beat is None else dataclasses.replace(
            pass_to_beat, recipe=space.complete(pass_to_beat.recipe), agent=pass_to_beat.agent or "pass-to-beat")
        if self.pass_to_beat is not None:
            self.seed_candidates.insert(0, self.pass_to_beat)
        self.plain_pass = plain_pass
        self.vs_plain: dict[str, Any] | None = None
        self.experiments: queue.Queue[Candidate] = queue.Queue(maxsize=max(1, self.config.queue_size))
        self.pending: collections.deque[tuple[Candidate, str | None]] = collections.deque()  # (cand, trial id)
        # (cand, its fast-tier screen): screens of an earlier attempt that beat the incumbent and
        # that the budget left unconfirmed; a resumed loop confirms them before screening more
        self.unconfirmed: list[tuple[Candidate, Measurement]] = []
        self.stop = threading.Event()
        self.workers: list[AgentWorker] = []
        self.trials = 0
        self.confirms = 0
        self.verifications = 0
        self.started = time.monotonic()
        self.elapsed_before = 0.0  # wall time of earlier (crashed) attempts, from the board
        self._next_index = 1
        self._rr = 0
        self._last_status = 0.0
        self._attempt = "?"
        self.baseline_fast: Measurement | None = None
        self.baseline_full: Measurement | None = None
        self.incumbent: Incumbent | None = None
        self.incumbent_speedup = 1.0  # the incumbent over the stock pass, chained through paired comparisons
        self.incumbent_fast_speedup = 1.0  # the same on the fast tier, chained through paired screens
        self.drift: list[dict[str, Any]] = []  # the incumbent's measurements over the run (measure.drift_summary)
        self.best_fast_speedup = 1.0
        self._screen_walls: list[float] = []  # wall seconds of each screen (paired incumbent included)
        self.final: tuple[Measurement, Measurement] | None = None  # (champion, stock) of the final comparison

    # ------------------------------------------------------------------ helpers
    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    def _budget_left(self) -> str | None:
        """None while budget remains, else why it is spent."""
        if self.budget.max_trials is not None and self.trials >= self.budget.max_trials:
            return f"trial budget spent ({self.trials}/{self.budget.max_trials})"
        if self.budget.max_seconds is not None and self.elapsed >= self.budget.max_seconds:
            return f"time budget spent ({self.elapsed:.0f}s/{self.budget.max_seconds:.0f}s)"
        return None

    def eta_s(self) -> float | None:
        etas = []
        if self.budget.max_seconds is not None:
            etas.append(max(0.0, self.budget.max_seconds - self.elapsed))
        if self.budget.max_trials is not None and self.trials:
            etas.append(self.elapsed / self.trials * max(0, self.budget.max_trials - self.trials))
        return min(etas) if etas else None

    def _trial_id(self, cand: Candidate) -> str:
        tid = f"t{self._next_index:05d}-{cand.digest[:10]}"
        self._next_index += 1
        return tid

    def _baseline_candidate(self) -> Candidate:
        return Candidate(self.space.default(), None, "baseline", self.config.baseline_name)

    # ------------------------------------------------------------------ resume
    def _restore(self) -> None:
        """Read the board back (see module docstring); sets counters, baseline, incumbent, pending."""
        runs = self.board.entries("run")
        per_attempt: dict[str, float] = {}
        for note in self.board.entries("note"):
            if note.get("checkpoint"):
                attempt = note.get("attempt", "?")
                per_attempt[attempt] = max(per_attempt.get(attempt, 0.0), float(note.get("elapsed_s", 0.0)))
        self.elapsed_before = sum(per_attempt.values())
        trials = self.board.entries("trial")
        finished = self.board.finished_trials()
        cands = {c["digest"]: c for c in self.board.entries("candidate")}
        floor = getattr(self.evaluator, "noise_floor", None)

        def meas(entry: dict[str, Any]) -> Measurement:
            return Measurement.from_metrics(entry["metrics"], **({"noise_floor": floor} if floor else {}))

        for t in trials:
            idx = int(t["trial_id"][1:6])
            self._next_index = max(self._next_index, idx + 1)
        for r in finished.values():
            if r.get("role") == "baseline" and r.get("status") == "ok":
                if r["tier"] == FAST:
                    self.baseline_fast = meas(r)
                elif r["tier"] == FULL:
                    self.baseline_full = meas(r)
        # Only candidate screens count as trials (not baseline, incumbent refreshes or paired re-measures).
        self.trials = len({r["trial_id"] for r in finished.values() if r.get("tier") == FAST and not r.get("role")})
        self.confirms = len([r for r in finished.values() if r.get("tier") == FULL and not r.get("role")])
        self.verifications = len(self.board.entries("verification"))
        started_unfinished = [t for t in trials if t["trial_id"] not in finished and not t.get("role")]
        seen_trial_digests = {t["digest"] for t in trials}
        for t in started_unfinished:
            if t.get("tier", FAST) == FAST and t["digest"] in cands:
                self.pending.append((Candidate.from_entry(cands[t["digest"]]), t["trial_id"]))
        for digest, c in cands.items():
            if digest not in seen_trial_digests and c.get("agent") != "baseline":
                self.pending.append((Candidate.from_entry(c), None))
        # Screens that beat the incumbent of their time but were left unconfirmed for want of budget
        # (an over_budget note, no full-tier result since, no new incumbent since): confirmed first.
        confirmed = {r["digest"] for r in finished.values() if r.get("tier") == FULL and not r.get("role")}
        waiting: dict[str, Candidate] = {}
        for entry in self.board.entries(("note", "incumbent")):
            if entry["kind"] == "incumbent":
                waiting.clear()
            elif entry.get("over_budget") and entry.get("digest") in cands and entry["digest"] not in confirmed:
                waiting.setdefault(entry["digest"], Candidate.from_entry(cands[entry["digest"]]))
        for digest, cand in waiting.items():
            screens = [r for r in finished.values() if r["digest"] == digest and r["tier"] == FAST
                       and not r.get("role") and r.get("status") == "ok"]
            if screens:
                self.unconfirmed.append((cand, meas(screens[-1])))
        incumbents = self.board.entries("incumbent")
        if incumbents and self.baseline_fast is not None:
            last = incumbents[-1]
            cand = Candidate.from_entry(cands[last["digest"]]) if last["digest"] in cands else None
            fast = [r for r in finished.values() if r["digest"] == last["digest"] and r["tier"] == FAST and r.get("status") == "ok"]
            full = [r for r in finished.values() if r["digest"] == last["digest"] and r["tier"] == FULL and r.get("status") == "ok"]
            if cand is not None and fast:
                self.incumbent = Incumbent(cand, meas(fast[-1]), meas(full[-1]) if full else None)
                self.incumbent_speedup = last.get("speedup") or 1.0
        if runs:
            log.info("resuming from %s: %d trials done, %d pending, incumbent %s", self.board.path, self.trials,
                     len(self.pending), self.incumbent.candidate.short if self.incumbent else "stock")

    # ------------------------------------------------------------------ measuring
    def _record(self, cand: Candidate, trial_id: str, tier: str, m: Measurement, baseline: Measurement | None,
                role: str | None = None, paired_with: Measurement | None = None, speedup: float | None = None) -> None:
        metrics = m.metrics(baseline) if m.ok else {"seconds": m.seconds}
        if paired_with is not None and m.ok and paired_with.ok:
            gain, low, high = paired_gain(m, paired_with)
            metrics["paired_gain"] = {"mean": gain, "low": low, "high": high}
        if speedup is not None and m.ok:
            metrics["speedup"] = speedup  # over the stock pass, chained through paired comparisons
        self.board.append("result", trial_id=trial_id, digest=cand.digest, tier=tier, agent=cand.agent,
                          status=result_status(m), metrics=metrics,
                          error=m.error, text=(f"{cand.agent} {cand.short}: {m.error}" if m.error else None),
                          role=role, **({"routing": m.details["routing"]} if m.details.get("routing") else {}))

    def _measure_baseline(self) -> None:
        base = self._baseline_candidate()
        if self.board.candidate(base.digest) is None:
            self.board.append("candidate", **base.to_entry())
        # The full tier first: its figures set the fast tier's SLO (engine/compile/tier_slo.py),
        # which the fast baseline and every screen after it are scored by.
        if self.baseline_full is None:
            self.baseline_full = self._measure_stock(base, FULL, f"t00000-{base.digest[:10]}-full")
        calibrate_fast_tier_slo(self.evaluator, self.board, base, self.baseline_full)
        if self.baseline_fast is None:
            self.baseline_fast = self._measure_stock(base, FAST, f"t00000-{base.digest[:10]}")
        if self.incumbent is None:
            self.incumbent = Incumbent(base, self.baseline_fast, self.baseline_full)

    def _measure_stock(self, base: Candidate, tier: str, trial_id: str) -> Measurement:
        """The stock pass on one tier (screen or confirm), recorded as the baseline; it must run."""
        self.on_progress("baseline", self, tier=tier)
        self.board.append("trial", trial_id=trial_id, digest=base.digest, tier=tier, role="baseline")
        m = self.evaluator.screen(base) if tier == FAST else self.evaluator.confirm(base)
        self._record(base, trial_id, tier, m, m, role="baseline")
        if m.ok:
            self._note_drift(tier, base, m)
        if not m.ok:
            raise RuntimeError(f"the stock forward pass failed on the {tier} tier: {m.error}; nothing to compare against")
        return m

    @property
    def _pairs_screens(self) -> bool:
        return callable(getattr(self.evaluator, "screen_paired", None))

    def _screen(self, cand: Candidate, trial_id: str | None) -> Measurement:
        """The candidate on the fast tier, in alternation with the incumbent where the evaluator
        can pair (the incumbent's fresh measurement replaces its fast figure and joins the drift)."""
        trial_id = trial_id or self._trial_id(cand)
        self.board.append("trial", trial_id=trial_id, digest=cand.digest, tier=FAST, agent=cand.agent)
        t0 = time.monotonic()
        inc = self.incumbent
        inc_m = None
        try:
            if self._pairs_screens:
                m, inc_m = self.evaluator.screen_paired(cand, inc.candidate)
            else:
                m = self.evaluator.screen(cand)
        except Exception as exc:  # noqa: BLE001 - an evaluator bug for one candidate must not end the run
            log.exception("screening %s raised", cand.short)
            m = Measurement(error=f"evaluator raised {type(exc).__name__}: {exc}")
        speedup = None
        if inc_m is not None and inc_m.ok:
            self._record(inc.candidate, trial_id + "-incumbent", FAST, inc_m, self.baseline_fast,
                         role="incumbent-paired", speedup=self.incumbent_fast_speedup)
            self._note_drift(FAST, inc.candidate, inc_m)
            inc.fast = inc_m
            if m.ok:
                speedup = paired_gain(m, inc_m)[0] * self.incumbent_fast_speedup
        elif m.ok and self.baseline_fast is not None:
            speedup = m.mean / self.baseline_fast.mean
        self._record(cand, trial_id, FAST, m, self.baseline_fast, paired_with=inc_m, speedup=speedup)
        self.trials += 1
        self._screen_walls.append(time.monotonic() - t0)
        if speedup is not None:
            self.best_fast_speedup = max(self.best_fast_speedup, speedup)
        return m

    def _note_drift(self, tier: str, cand: Candidate, m: Measurement) -> None:
        self.drift.append({"tier": tier, "digest": cand.digest, "elapsed_s": round(self.elapsed, 2), "mean": m.mean,
                           "cv": m.cv, "stock": cand.agent == "baseline"})

    def _promising(self, fast: Measurement) -> bool:
        """Screening: faster than the incumbent by `screen_margin`, paired (the ratio of the two
        measured in alternation) where the evaluator pairs. Deliberately lenient: the fast tier
        is quick but noisy; the paired full-tier confirmation decides."""
        inc = self.incumbent.fast
        if not (fast.ok and inc.ok):
            return False
        if self._pairs_screens and len(fast.samples) == len(inc.samples):
            return paired_gain(fast, inc)[0] > 1 + self.config.screen_margin
        return fast.mean > inc.mean * (1 + self.config.screen_margin)

    def _refresh_incumbent(self) -> None:
        """Re-measure the incumbent on the fast tier (the machine's load drifts; screening compares with it)."""
        inc = self.incumbent
        tid = self._trial_id(inc.candidate) + "-ref"
        self.board.append("trial", trial_id=tid, digest=inc.candidate.digest, tier=FAST, role="incumbent-refresh")
        try:
            m = self.evaluator.screen(inc.candidate)
        except Exception as exc:  # noqa: BLE001
            m = Measurement(error=f"evaluator raised {type(exc).__name__}: {exc}")
        self._record(inc.candidate, tid, FAST, m, self.baseline_fast, role="incumbent-refresh")
        if m.ok:
            inc.fast = m

    def _confirm(self, cand: Candidate, round_: int = 0) -> tuple[Measurement, Measurement | None, bool]:
        """Full-tier replay of the candidate, and of the incumbent in the same window when the
        evaluator can alternate them (so a change of machine load cannot fake a gain).
        ``round_`` > 0: another round of an undecided confirmation (recorded with role
        confirm-more: a resumed loop counts confirmations from the board)."""
        inc = self.incumbent
        compare = getattr(self.evaluator, "compare", None)
        self.on_progress("confirm", self, candidate=cand, round=round_)
        tid = self._trial_id(cand) + ("-full" if round_ == 0 else f"-full-more{round_}")
        self.board.append("trial", trial_id=tid, digest=cand.digest, tier=FULL, agent=cand.agent)
        inc_full = inc.full
        paired = callable(compare)
        try:
            if paired:
                full, inc_full = compare(cand, inc.candidate)
                self._record(inc.candidate, tid + "-incumbent", FULL, inc_full, self.baseline_full,
                             role="incumbent-paired")
                if inc_full.ok:
                    self._note_drift(FULL, inc.candidate, inc_full)
            else:
                full = self.evaluator.confirm(cand)
        except Exception as exc:  # noqa: BLE001
            log.exception("confirming %s raised", cand.short)
            full = Measurement(error=f"evaluator raised {type(exc).__name__}: {exc}")
        if round_ == 0:
            self.confirms += 1
        self._record(cand, tid, FULL, full, self.baseline_full, paired_with=inc_full if paired else None,
                     role=None if round_ == 0 else "confirm-more")
        return full, inc_full, paired

    def _overruns_budget(self, cand: Candidate, rounds: int) -> str | None:
        return time_budget.confirmation_overrun(self.budget, self.baseline_full, self.elapsed, cand.short, rounds)

    def _screening_closed(self) -> str | None:
        return time_budget.screening_closed(self.budget, self.baseline_full, self.elapsed, self._screen_walls)

    def _overruns_closing(self) -> bool:
        pairs = getattr(getattr(self.evaluator, "settings", None), "closing_pairs", None)
        return time_budget.closing_overruns(self.budget, self.baseline_full, self.elapsed, pairs)

    def _undecided(self, full: Measurement, inc_full: Measurement | None) -> bool:
        """Paired confirmation whose mean gain clears the bar but whose lower bound does not."""
        if inc_full is None or not (full.ok and inc_full.ok) or len(full.samples) != len(inc_full.samples):
            return False
        gain, low, _ = paired_gain(full, inc_full)
        bar = 1 + max(inc_full.noise_floor, self.config.min_speedup - 1)
        return gain > bar >= low

    def _confirm_more(self, cand: Candidate, full: Measurement, inc_full: Measurement,
                      round_: int) -> tuple[Measurement, Measurement]:
        """Another round of paired full-tier replays, pooled with the pairs so far."""
        gain, low, high = paired_gain(full, inc_full)
        self.board.note("loop", f"{cand.short} undecided on the full tier: paired speed ratio {gain:.3f} "
                        f"(95% bounds {low:.3f}..{high:.3f}) over {len(full.samples)} pairs; measuring more",
                        digest=cand.digest)
        more, inc_more, _ = self._confirm(cand, round_)
        if not (more.ok and inc_more is not None and inc_more.ok):
            return full, inc_full  # the first round's verdict stands
        return full.extended(more), inc_full.extended(inc_more)

    def _consider(self, cand: Candidate, fast: Measurement, screened_against_incumbent: bool = False) -> None:
        """Confirm and verify a screened candidate that beats the incumbent beyond noise
        (`screened_against_incumbent`: an earlier attempt found that it did, against this incumbent)."""
        assert self.incumbent is not None
        if not screened_against_incumbent and not self._promising(fast):
            return
        if self.config.max_confirms is not None and self.confirms >= self.config.max_confirms:
            self.board.note("loop", f"{cand.short} beat the incumbent on the fast tier but the confirm cap is reached")
            return
        overrun = self._overruns_budget(cand, rounds=1)
        if overrun:
            self.board.note("loop", overrun, digest=cand.digest, over_budget=True)
            return
        full, inc_full, paired = self._confirm(cand)
        if paired:
            accepted = inc_full is not None and beats_paired(full, inc_full, self.config.min_speedup - 1)
            for round_ in range(self.config.extend_undecided):
                if accepted or not self._undecided(full, inc_full):
                    break
                overrun = self._overruns_budget(cand, rounds=1)
                if overrun:
                    self.board.note("loop", overrun + " (another round of an undecided confirmation)",
                                    digest=cand.digest, over_budget=True)
                    break
                full, inc_full = self._confirm_more(cand, full, inc_full, round_ + 1)
                accepted = beats_paired(full, inc_full, self.config.min_speedup - 1, looks=round_ + 2)
        else:
            accepted = inc_full is not None and beats(full, inc_full) and \
                full.mean >= inc_full.mean * self.config.min_speedup
        if not accepted:
            if paired and inc_full is not None and full.ok and inc_full.ok:
                gain, low, high = paired_gain(full, inc_full)
                why = f"paired speed ratio {gain:.3f} (95% bounds {low:.3f}..{high:.3f}) does not clear {1 + max(inc_full.noise_floor, self.config.min_speedup - 1):.3f}"
            else:
                why = (f"[{full.low:.1f}, {full.high:.1f}] tok/s vs incumbent "
                       f"[{inc_full.low if inc_full else 0:.1f}, {inc_full.high if inc_full else 0:.1f}]")
            self.board.note("loop", f"{cand.short} not confirmed on the full tier: {why}"
                            + (f" ({full.error})" if full.error else ""), digest=cand.digest)
            return
        if not per_user_not_worse(full, inc_full):
            kind, mine = full.user_speed_p90()
            _, theirs = inc_full.user_speed_p90()
            self.board.note("loop", f"{cand.short} is faster overall but slower per user at p90 "
                            f"({kind}: {mine:.2f} vs {theirs:.2f} tok/s)", digest=cand.digest)
            return
        self.on_progress("verify", self, candidate=cand)
        try:
            verdict = self.evaluator.verify(cand)
        except Exception as exc:  # noqa: BLE001
            log.exception("verifying %s raised", cand.short)
            verdict = Verification(False, {"verifier": False}, {"error": f"{type(exc).__name__}: {exc}"})
        self.verifications += 1
        self.board.append("verification", digest=cand.digest, passed=verdict.passed, gates=verdict.gates,
                          report=verdict.report, seconds=verdict.seconds)
        if not verdict.passed:
            self.board.note("loop", f"{cand.short} rejected by verification: failed {verdict.failed_gates()}",
                            digest=cand.digest)
            return
        gain = paired_gain(full, inc_full)[0] if paired else full.mean / inc_full.mean
        speedup = gain * self.incumbent_speedup
        if self._pairs_screens and len(fast.samples) == len(self.incumbent.fast.samples):
            self.incumbent_fast_speedup *= paired_gain(fast, self.incumbent.fast)[0]
        self.incumbent = Incumbent(cand, fast, full, verdict)
        self.incumbent_speedup = speedup
        self.board.append("incumbent", digest=cand.digest, speedup=speedup, agent=cand.agent)
        log.info("new incumbent %s by %s: %.3fx the baseline (%s) on the full tier", cand.short, cand.agent, speedup or 0,
                 self.config.baseline_name)

    # ------------------------------------------------------------------ agents
    def _start_agents(self) -> None:
        if self.config.deterministic:
            return
        for agent in self.agents:
            worker = AgentWorker(agent, self.board, self.space, self.experiments, self.stop)
            worker.start()
            self.workers.append(worker)

    def _stop_agents(self) -> None:
        self.stop.set()
        for worker in self.workers:
            worker.join(timeout=10)

    def _measured(self, digest: str) -> bool:
        return any(r["digest"] == digest and r.get("tier") == FAST for r in self.board.entries("result"))

    def _next_pending(self) -> tuple[Candidate, str | None] | None:
        """The first pending candidate not yet screened (the ones screened meanwhile are dropped)."""
        while self.pending:
            cand, tid = self.pending.popleft()
            if not self._measured(cand.digest):
                return cand, tid
        return None

    def _propose_round(self) -> None:
        """Deterministic mode: each agent in turn proposes one candidate against the board as it is."""
        for agent in self.agents:
            try:
                proposals = agent.propose(1)
            except Exception as exc:  # noqa: BLE001
                agent.errors += 1
                self.board.note(agent.name, f"agent raised {type(exc).__name__}: {exc}", error=True)
                continue
            for cand in submit(agent, self.board, self.space, proposals):
                self.pending.append((cand, None))

    def _next_candidate(self) -> tuple[Candidate, str | None] | None:
        nxt = self._next_pending()
        if nxt is not None:
            return nxt
        if self.config.deterministic:
            # Rounds: every agent proposes against the same board, then the round is measured
            # in agent order. Round one sees only the baseline (it is proposed before any seed
            # is measured, see run()), so it is a function of the seed.
            for _ in range(3):
                self._propose_round()
                nxt = self._next_pending()
                if nxt is not None:
                    return nxt
            return None
        deadline = time.monotonic() + self.config.candidate_wait_s
        while time.monotonic() < deadline and not self._budget_left():
            try:
                cand = self.experiments.get(timeout=0.2)
            except queue.Empty:
                if not any(w.is_alive() for w in self.workers):
                    return None
                continue
            if not self._measured(cand.digest):
                return cand, None
        return None

    # ------------------------------------------------------------------ progress
    def status(self, phase: str = "Running") -> dict[str, Any]:
        """What the status callback gets (report.py run_status)."""
        from shapeshift.engine.compile.report import run_status  # report.py renders this module's results

        return run_status(self, phase)

    def _progress(self, force: bool = False) -> None:
        st = self.status()
        self.on_progress("trial", self, status=st)
        now = time.monotonic()
        if force or now - self._last_status >= self.config.status_every_s:
            self._last_status = now
            self._send_status(st)

    def _send_status(self, st: dict[str, Any]) -> None:
        if self.on_status:
            try:
                self.on_status(st)
            except Exception:  # noqa: BLE001 - a status sink must not end the search
                log.exception("status callback failed")

    # ------------------------------------------------------------------ main
    def run(self) -> CompileResult:
        self._restore()
        resumed = bool(self.board.entries("run"))
        run_entry = self.board.append("run", resumed=resumed, seed=self.config.seed,
                          budget={"trials": self.budget.max_trials, "seconds": self.budget.max_seconds},
                          agents=[a.name for a in self.agents], evaluator=_safe_describe(self.evaluator),
                          space=self.space.names)
        self._attempt = run_entry["id"]
        self._measure_baseline()
        if self.config.deterministic and self.seed_candidates and not self.pending:
            # Round one is proposed against the baseline alone, before the seeds' (timed, so
            # noisy) results reach the board; the seeds are still measured first.
            self._propose_round()
        for cand in reversed(self.seed_candidates):  # nearest champions of earlier runs, named recipes: measured first
            for good in submit(_SeedAgent(cand.agent or "registry"), self.board, self.space, [cand]):
                self.pending.appendleft((good, None))
        self._progress(force=True)
        self._start_agents()
        stop_reason = ""
        try:
            while True:
                stop_reason = self._budget_left() or self._screening_closed() or ""
                if stop_reason:
                    break
                if self.unconfirmed:
                    cand, fast = self.unconfirmed.pop(0)
                    self.board.note("loop", f"{cand.short} beat the incumbent on the fast tier in an earlier attempt "
                                    "that had no budget left to confirm it: confirming it now", digest=cand.digest)
                    self._consider(cand, fast, screened_against_incumbent=True)
                    continue
                nxt = self._next_candidate()
                if nxt is None:
                    stop_reason = self._budget_left() or "agents have nothing new to propose"
                    break
                cand, tid = nxt
                if self.trials and self.config.refresh_incumbent_every and not self._pairs_screens and \
                        self.trials % self.config.refresh_incumbent_every == 0:
                    self._refresh_incumbent()
                fast = self._screen(cand, tid)
                if fast.ok:
                    self._consider(cand, fast)
                self._progress()
                self.board.note("loop", "checkpoint", checkpoint=True, attempt=self._attempt,
                                elapsed_s=time.monotonic() - self.started, trials=self.trials)
        finally:
            self._stop_agents()
            self.board.note("loop", "attempt ended", checkpoint=True, attempt=self._attempt,
                            elapsed_s=time.monotonic() - self.started)
        assert self.incumbent is not None and self.baseline_fast is not None
        champion = None if self.incumbent.candidate.agent == "baseline" else self.incumbent.candidate
        speedup = None
        looks = 1  # looks at the closing pairs: 2 after an undecided first round was extended
        if champion is not None and self.pass_to_beat is not None and champion.digest == self.pass_to_beat.digest:
            self.board.note("loop", f"the pass to beat ({self.pass_to_beat.note}) is still the best: nothing new "
                            "to publish", withdrawn=True)
            stop_reason = (stop_reason + "; " if stop_reason else "") + "the pass to beat is still the best"
            champion = None
        if champion is not None:
            self.on_progress("closing", self, candidate=champion)
            speedup = closing.final_comparison(self, champion)
            if self.final is not None and not beats_paired(*self.final) and self.config.extend_undecided and \
                    self._undecided(*self.final) and not self._overruns_closing():
                speedup = closing.final_comparison_more(self, champion)
                looks = 2
            if self.final is not None and not beats_paired(*self.final, looks=looks):
                # Each step beat its incumbent, but against the stock pass, measured side by side
                # at the end, the gain does not clear the noise: publish nothing.
                gain, low, high = paired_gain(*self.final, looks=looks)
                self.board.note("loop", f"champion {champion.short} withdrawn: against {self.config.baseline_name} its "
                                f"paired speed ratio is {gain:.3f} ({low:.3f}..{high:.3f}), within the noise", withdrawn=True)
                stop_reason = (stop_reason + "; " if stop_reason else "") + \
                    f"final comparison with the baseline within noise (paired ratio {gain:.3f}, 95% bounds {low:.3f}..{high:.3f})"
                champion, speedup = None, None
        if champion is not None and self.pass_to_beat is not None:
            why = closing.loses_to_pass_to_beat(self, champion)
            if why:
                stop_reason = (stop_reason + "; " if stop_reason else "") + why
                champion, speedup = None, None
        if champion is not None and callable(getattr(self.evaluator, "compare", None)):
            closing.compare_with_plain(self, champion)
        bounds = tuple(paired_gain(*self.final, looks=looks)[1:]) if champion is not None and self.final is not None \
            else None
        result = CompileResult(self.baseline_fast, self.baseline_full, self.incumbent, champion, speedup,
                               self.trials, self.confirms, self.verifications, self.elapsed,
                               [r.to_dict() for r in self.board.leaderboard(FAST, k=10)], stop_reason,
                               self.config.baseline_name, bounds, self.vs_plain, drift_summary(self.drift))
        self.on_progress("done", self, stop_reason=stop_reason, summary=json.dumps(result.summary()))
        if self.on_status:
            self._send_status({**self.status("Succeeded"), "stop_reason": stop_reason})
        return result


class _SeedAgent(Agent):
    """Stands in for the registry when seeding candidates (so they pass the same validation)."""

    name = "registry"

    def __init__(self, name: str = "registry") -> None:  # noqa: D107 - no space/board needed: submit() gets them
        self.name = name
        self.state, self.proposed, self.errors = "idle", 0, 0


def _safe_describe(evaluator: Any) -> dict[str, Any]:
    try:
        return dict(evaluator.describe())
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)}
