"""Orchestration logic of the compile loop, against `FakeEvaluatorForOrchestrationTests`.

The fake evaluator exists only to drive the loop's decisions into known corners (a
candidate that is faster but fails verification, one inside the noise, a crash); every
measurement claim of the project comes from the real evaluator (test_loop_real.py).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from shapeshift.engine.compile.agents.base import Agent
from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.loop import Budget, CompileLoop, LoopConfig
from shapeshift.engine.compile.report import write_report
from shapeshift.engine.compile.measure import (Measurement, Verification, beats, beats_paired, paired_gain,
                                               per_user_not_worse)
from shapeshift.engine.compile.search_space import Knob, SearchSpace


class FakeEvaluatorForOrchestrationTests:
    """Speeds are a table lookup plus seeded noise; verification verdicts are scripted."""

    def __init__(self, speed: dict[str, float], fails_verification: set[str] = frozenset(), crashes: set[str] = frozenset(),
                 noise: float = 0.002, seed: int = 0, misses_slo: set[str] = frozenset()):
        self.speed, self.fails, self.crashes = speed, set(fails_verification), set(crashes)
        self.misses_slo = set(misses_slo)
        self.rng = random.Random(seed)
        self.noise = noise
        self.calls: list[tuple[str, str]] = []

    def _key(self, c: Candidate) -> str:
        return c.recipe.get("variant", "stock")

    def _measure(self, c: Candidate, n: int) -> Measurement:
        key = self._key(c)
        if key in self.crashes:
            return Measurement(error="crashed in forward()")
        if key in self.misses_slo:  # ran; no request met the SLO, as the real evaluator reports it
            return Measurement(samples=[0.0] * n, error="no request met the SLO (p90 TTFT <= 0.04 s): goodput 0",
                               missed_slo=True)
        base = self.speed[key]
        return Measurement(samples=[base * (1 + self.rng.uniform(-self.noise, self.noise)) for _ in range(n)],
                           per_user_p90=[base / 10] * n)

    def screen(self, c):
        self.calls.append(("screen", self._key(c)))
        return self._measure(c, 3)

    def confirm(self, c):
        self.calls.append(("confirm", self._key(c)))
        return self._measure(c, 3)

    def compare(self, c, inc):
        self.calls.append(("compare", self._key(c)))
        return self._measure(c, 5), self._measure(inc, 5)

    def verify(self, c):
        self.calls.append(("verify", self._key(c)))
        ok = self._key(c) not in self.fails
        return Verification(ok, {"outputs.agreement": ok, "smoke": True})

    def export(self, c, out_dir):
        return {"path": str(out_dir), "digest": c.digest}

    def describe(self):
        return {"fake": True}


class ListAgent(Agent):
    """Proposes a fixed list, one per call."""

    name = "list"

    def __init__(self, space, board, items):
        super().__init__(space, board)
        self.items = list(items)

    def propose(self, n=1):
        return [Candidate({"variant": self.items.pop(0)}, agent=self.name, note="scripted")] if self.items else []


def space() -> SearchSpace:
    return SearchSpace([Knob("variant", ("stock", "fast", "wrong", "same", "crash", "faster"), "stock")])


def run_loop(tmp_path, speed, items, budget=10, **kw):
    board = Board(tmp_path / "board.jsonl")
    sp = space()
    ev = FakeEvaluatorForOrchestrationTests(speed, **kw)
    statuses = []
    loop = CompileLoop(ev, sp, board, [ListAgent(sp, board, items)], Budget(max_trials=budget),
                       LoopConfig(deterministic=True), on_status=statuses.append)
    return loop.run(), board, ev, statuses


def test_noise_test_helpers() -> None:
    inc = Measurement([100.0, 101.0, 99.0])
    assert beats(Measurement([110.0, 111.0, 109.0]), inc)
    assert not beats(Measurement([101.5, 102.0, 101.0]), inc)  # inside the incumbent's range
    same = Measurement([100.0, 100.5, 99.5, 100.2])
    assert not beats_paired(same, Measurement([100.1, 100.4, 99.7, 100.0]))
    gain, low, high = paired_gain(Measurement([120, 118, 125, 121]), Measurement([100, 99, 104, 100]))
    assert 1.18 < gain < 1.22 and low > 1.1 and high < 1.3
    # a load swing that hits both members of each pair alike is not mistaken for noise
    assert beats_paired(Measurement([60, 120, 90]), Measurement([50, 100, 75]))
    assert not per_user_not_worse(Measurement([1.0], per_user_p90=[5.0]), Measurement([1.0], per_user_p90=[10.0]))
    # Where both measured the end-to-end speed (queueing included), that is what is judged: a
    # wider batch decodes each row slower but nobody waits, so users get their answers as fast.
    wide = Measurement([1.3], per_user_p90=[1820.0], e2e_per_user_p90=[790.0])
    narrow = Measurement([1.0], per_user_p90=[2790.0], e2e_per_user_p90=[780.0])
    assert per_user_not_worse(wide, narrow)
    assert not per_user_not_worse(Measurement([1.3], per_user_p90=[2790.0], e2e_per_user_p90=[600.0]), narrow)
    # Decode-only against end-to-end is no comparison: then both are judged decode-only.
    assert not per_user_not_worse(Measurement([1.3], per_user_p90=[1820.0]), narrow)


def test_faster_verified_candidate_becomes_champion(tmp_path: Path) -> None:
    result, board, ev, statuses = run_loop(tmp_path, {"stock": 100, "fast": 130, "faster": 160},
                                           ["fast", "faster"])
    assert result.champion is not None and result.champion.recipe["variant"] == "faster"
    assert 1.55 < result.speedup < 1.65
    assert [e["digest"] for e in board.entries("incumbent")] == [
        Candidate({"variant": "fast"}).digest, Candidate({"variant": "faster"}).digest]
    assert statuses[-1]["phase"] == "Succeeded" and statuses[-1]["best_speedup"] > 1.5
    assert all("leaderboard" in s and "eta_s" in s for s in statuses)
    json_path, md_path = write_report(result, board, tmp_path / "out", {"model": "m", "profile": "p"})
    assert "faster" in json_path.read_text() and "verified" in md_path.read_text()


def test_only_verified_winners_become_champions(tmp_path: Path) -> None:
    result, board, ev, _ = run_loop(tmp_path, {"stock": 100, "wrong": 200}, ["wrong"], fails_verification={"wrong"})
    assert result.champion is None and result.speedup is None
    assert ("verify", "wrong") in ev.calls
    assert not board.entries("incumbent")
    assert any("rejected by verification" in n["text"] for n in board.entries("note"))


def test_never_accepts_within_noise(tmp_path: Path) -> None:
    result, board, ev, _ = run_loop(tmp_path, {"stock": 100, "same": 100.5}, ["same"], noise=0.02)
    assert result.champion is None
    assert not [c for c in ev.calls if c[0] == "verify"]  # verification only for confirmed winners


def run_with_pass_to_beat(tmp_path, speed, items, **kw):
    board = Board(tmp_path / "board.jsonl")
    sp = space()
    ev = FakeEvaluatorForOrchestrationTests(speed, **kw)
    active = Candidate({"variant": "fast"}, agent="pass-to-beat", note="ForwardPass fp-1")
    loop = CompileLoop(ev, sp, board, [ListAgent(sp, board, items)], Budget(max_trials=10),
                       LoopConfig(deterministic=True), pass_to_beat=active)
    return loop.run(), board, ev


def test_a_champion_must_also_beat_the_pass_to_beat(tmp_path: Path) -> None:
    # faster than the active pass: published, its speedup still quoted against the stock pass
    result, board, ev = run_with_pass_to_beat(tmp_path / "a", {"stock": 100, "fast": 130, "faster": 160}, ["faster"])
    assert result.champion is not None and result.champion.recipe["variant"] == "faster"
    assert 1.55 < result.speedup < 1.65
    assert [k for op, k in ev.calls if op == "screen" and k != "stock"][0] == "fast"  # the pass first
    roles = [r.get("role") for r in board.entries("result")]
    assert "final-vs-pass" in roles and "final-pass" in roles
    # measured first, like a seed: the pass to beat becomes the incumbent the search must beat
    assert board.entries("incumbent")[0]["digest"] == Candidate({"variant": "fast"}).digest

    # nothing beats it: the active pass is still the best, nothing new is published
    result, board, ev = run_with_pass_to_beat(tmp_path / "b", {"stock": 100, "fast": 130, "same": 130.2}, ["same"])
    assert result.champion is None and result.speedup is None
    assert "the pass to beat is still the best" in result.stop_reason

    # the pass could not become the incumbent (here it fails verification, as a pass verified
    # under an older engine might), so the search's
    # champion beat only the stock pass; the final comparison with the pass withdraws it
    result, board, ev = run_with_pass_to_beat(tmp_path / "c", {"stock": 100, "fast": 130, "same": 130.2}, ["same"],
                                              fails_verification={"fast"})
    assert result.champion is None
    assert "not faster than the pass to beat beyond the noise" in result.stop_reason
    assert any(n.get("final_vs_pass") and not n["won"] for n in board.entries("note"))

    # a pass to beat that no longer runs here holds nothing back
    result, board, ev = run_with_pass_to_beat(tmp_path / "e", {"stock": 100, "fast": 130, "same": 130.2}, ["same"],
                                              crashes={"fast"})
    assert result.champion is not None and result.champion.recipe["variant"] == "same"
    assert any("failed to run" in n["text"] for n in board.entries("note"))

    # without a pass to beat the same search publishes that champion
    result, _, _, _ = run_loop(tmp_path / "d", {"stock": 100, "fast": 130, "same": 130.2}, ["same"],
                            fails_verification={"fast"})
    assert result.champion is not None and result.champion.recipe["variant"] == "same"


def test_crashing_candidate_is_a_failed_trial_and_the_run_goes_on(tmp_path: Path) -> None:
    result, board, ev, _ = run_loop(tmp_path, {"stock": 100, "fast": 150}, ["crash", "fast"], crashes={"crash"})
    failed = [r for r in board.entries("result") if r["status"] == "failed"]
    assert len(failed) == 1 and "crashed" in failed[0]["error"]
    assert result.champion is not None and result.champion.recipe["variant"] == "fast"
    assert result.trials == 2


def test_a_candidate_that_meets_the_slo_for_nobody_is_rejected_not_failed(tmp_path: Path) -> None:
    """It ran: a measured outcome (goodput 0), counted among the rejected candidates; "failed"
    stays for candidates that crashed, hung or did not build."""
    from shapeshift.engine.compile.measure import MISSED_SLO, result_status

    result, board, _, statuses = run_loop(tmp_path, {"stock": 100, "fast": 150}, ["wrong", "crash", "fast"],
                                          crashes={"crash"}, misses_slo={"wrong"})
    by_status = {r["status"]: r for r in board.entries("result") if not r.get("role")}
    assert by_status[MISSED_SLO]["error"].startswith("no request met the SLO") and "crashed" in by_status["failed"]["error"]
    assert statuses[-1]["failed"] == 1 and statuses[-1]["rejected"] == 1, statuses[-1]
    assert result.champion is not None and result.champion.recipe["variant"] == "fast" and result.trials == 3
    assert result_status(Measurement([0.0], error="no request met the SLO", missed_slo=True)) == MISSED_SLO
    assert result_status(Measurement(error="crashed")) == "failed" and result_status(Measurement([1.0])) == "ok"


def test_resume_counts_each_trial_once(tmp_path: Path) -> None:
    board_path = tmp_path / "board.jsonl"
    result1, board, ev, _ = run_loop(tmp_path, {"stock": 100, "fast": 101, "same": 100}, ["fast", "same"], budget=2)
    assert result1.trials == 2
    # Simulate a crash after a trial started: a "trial" entry without its result.
    pending = Candidate({"variant": "faster"}, agent="list", note="scripted")
    board.append("candidate", **pending.to_entry())
    board.append("trial", trial_id="t00099-" + pending.digest[:10], digest=pending.digest, tier="fast", agent="list")
    sp = space()
    ev2 = FakeEvaluatorForOrchestrationTests({"stock": 100, "fast": 101, "same": 100, "faster": 150})
    loop = CompileLoop(ev2, sp, Board(board_path), [ListAgent(sp, Board(board_path), ["fast", "same"])],
                       Budget(max_trials=3), LoopConfig(deterministic=True))
    result2 = loop.run()
    assert ("screen", "stock") not in ev2.calls  # the baseline is not measured again
    assert [c for c in ev2.calls if c[0] == "screen"] == [("screen", "faster")]  # only the unfinished trial
    assert result2.trials == 3
    finished = [r for r in Board(board_path).entries("result") if r["tier"] == "fast" and not r.get("role")]
    assert len({r["trial_id"] for r in finished}) == 3 and len({r["digest"] for r in finished}) == 3
    assert any(r["trial_id"].startswith("t00099-") for r in finished)  # re-run under its own id


class SlowThinker(Agent):
    """Takes a long time per proposal (like an LLM call)."""

    name = "slow"

    def propose(self, n=1):
        time.sleep(1.5)
        self.done = getattr(self, "done", 0) + 1
        return [Candidate({"variant": "faster"}, agent=self.name, note="after long thought")] if self.done == 1 else []


def test_measurement_never_waits_for_a_thinking_agent(tmp_path: Path) -> None:
    board = Board(tmp_path / "board.jsonl")
    sp = space()
    ev = FakeEvaluatorForOrchestrationTests({"stock": 100, "fast": 101, "same": 100, "wrong": 99, "faster": 150})
    slow = SlowThinker(sp, board)
    quick = ListAgent(sp, board, ["fast", "same", "wrong"])
    loop = CompileLoop(ev, sp, board, [slow, quick], Budget(max_trials=4), LoopConfig(queue_size=2))
    result = loop.run()
    screened = [k for op, k in ev.calls if op == "screen" and k != "stock"]
    # The quick agent's three candidates were measured while the slow one was still thinking.
    assert screened[:3] == ["fast", "same", "wrong"] and screened[3] == "faster"
    assert result.trials == 4 and result.champion.recipe["variant"] == "faster"


class ScriptedPairsEvaluator(FakeEvaluatorForOrchestrationTests):
    """compare() returns scripted (candidate, incumbent) sample lists in turn: a test double."""

    def __init__(self, speed, pairs):
        super().__init__(speed)
        self.pairs = list(pairs)

    def compare(self, c, inc):
        self.calls.append(("compare", self._key(c)))
        cand, base = self.pairs.pop(0)
        return (Measurement(samples=cand, per_user_p90=[10.0] * len(cand)),
                Measurement(samples=base, per_user_p90=[10.0] * len(base)))


def _run_scripted(tmp_path, pairs, **config):
    board = Board(tmp_path / "board.jsonl")
    sp = space()
    ev = ScriptedPairsEvaluator({"stock": 100, "fast": 190}, pairs)
    loop = CompileLoop(ev, sp, board, [ListAgent(sp, board, ["fast"])], Budget(max_trials=1),
                       LoopConfig(deterministic=True, **config))
    return loop.run(), board, ev


def test_undecided_confirmation_measures_more_pairs(tmp_path: Path) -> None:
    """Two pairs at 3.0x and 1.2x: a mean gain of 1.9x whose bounds (t(1) = 12.7) include 1.
    One more round of five pairs at 1.9x, pooled with the first two, confirms it."""
    first = ([300.0, 120.0], [100.0, 100.0])
    more = ([190.0] * 5, [100.0] * 5)
    closing = ([190.0] * 5, [100.0] * 5)  # the closing comparison with the stock pass
    result, board, ev = _run_scripted(tmp_path, [first, more, closing])
    assert [c for c in ev.calls if c[0] == "compare"] == [("compare", "fast")] * 3
    assert any("undecided on the full tier" in n["text"] for n in board.entries("note"))
    assert result.champion is not None and result.champion.recipe["variant"] == "fast"
    more_rows = [r for r in board.results("full") if r["trial_id"].endswith("-full-more1")]
    assert len(more_rows) == 1 and more_rows[0]["role"] == "confirm-more"
    assert len(more_rows[0]["metrics"]["samples"]) == 5
    assert result.confirms == 1  # the extra round is part of one confirmation


def test_undecided_twice_is_not_confirmed_and_clear_losers_are_not_remeasured(tmp_path: Path) -> None:
    wild = ([300.0, 120.0], [100.0, 100.0])
    still_wild = ([400.0, 60.0], [100.0, 100.0])
    result, board, ev = _run_scripted(tmp_path, [wild, still_wild])
    assert result.champion is None
    assert len([c for c in ev.calls if c[0] == "compare"]) == 2  # one extra round, no more
    assert any("not confirmed on the full tier" in n["text"] for n in board.entries("note"))

    slower = ([95.0, 97.0], [100.0, 100.0])  # mean gain below the bar: nothing to decide
    result, board, ev = _run_scripted(tmp_path / "b", [slower])
    assert result.champion is None and len([c for c in ev.calls if c[0] == "compare"]) == 1

    result, board, ev = _run_scripted(tmp_path / "c", [wild], extend_undecided=0)
    assert result.champion is None and len([c for c in ev.calls if c[0] == "compare"]) == 1


class SlowFullTierEvaluator(FakeEvaluatorForOrchestrationTests):
    """Full-tier measurements that say they took `full_s` seconds (the fake does not sleep)."""

    def __init__(self, *args, full_s: float, **kw):
        super().__init__(*args, **kw)
        self.full_s = full_s

    def confirm(self, c):
        m = super().confirm(c)
        m.seconds = self.full_s
        return m


def test_no_confirmation_starts_that_would_overrun_the_time_budget(tmp_path: Path) -> None:
    """A wall-clock budget bounds the search: a faster candidate whose confirmation, estimated
    from the baseline's own full-tier seconds, would not fit in what is left is not confirmed,
    and the board says why; with room for it, it is confirmed."""
    def run(budget_s: float, full_s: float):
        board = Board(tmp_path / f"board-{budget_s}.jsonl")
        sp = space()
        ev = SlowFullTierEvaluator({"stock": 100, "fast": 130}, full_s=full_s)
        loop = CompileLoop(ev, sp, board, [ListAgent(sp, board, ["fast"])],
                           Budget(max_trials=None, max_seconds=budget_s), LoopConfig(deterministic=True))
        return loop.run(), board, ev

    result, board, ev = run(budget_s=60, full_s=40)  # a paired round (80 s) > the 60 s budget
    assert result.champion is None and ("compare", "fast") not in ev.calls
    notes = [n["text"] for n in board.entries("note") if n.get("over_budget")]
    assert len(notes) == 1 and "would overrun the time budget" in notes[0], notes
    result, board, ev = run(budget_s=600, full_s=40)
    assert result.champion is not None and ("compare", "fast") in ev.calls
    assert not [n for n in board.entries("note") if n.get("over_budget")]


def test_a_resumed_loop_confirms_first_what_an_earlier_attempt_left_unconfirmed(tmp_path: Path) -> None:
    """An attempt whose budget could not confirm a screen that beat the incumbent leaves it on the
    board (an over-budget note); the next attempt on that board, given time, confirms it before it
    screens anything new, and it becomes the champion. A screen confirmed (or judged) meanwhile is
    not confirmed again."""
    board_path = tmp_path / "board.jsonl"
    sp = space()
    first = SlowFullTierEvaluator({"stock": 100, "fast": 130}, full_s=40)
    board = Board(board_path)
    CompileLoop(first, sp, board, [ListAgent(sp, board, ["fast"])], Budget(max_trials=None, max_seconds=60),
                LoopConfig(deterministic=True)).run()
    assert [n for n in board.entries("note") if n.get("over_budget")] and ("compare", "fast") not in first.calls
    second = SlowFullTierEvaluator({"stock": 100, "fast": 130, "same": 100}, full_s=40)
    board = Board(board_path)
    result = CompileLoop(second, sp, board, [ListAgent(sp, board, ["same"])],
                         Budget(max_trials=None, max_seconds=600), LoopConfig(deterministic=True)).run()
    # fast's confirmation comes before the new candidate's screen; fast is not screened again
    assert second.calls.index(("compare", "fast")) < second.calls.index(("screen", "same")), second.calls
    assert ("screen", "fast") not in second.calls
    assert result.champion is not None and result.champion.recipe["variant"] == "fast"
    def earlier(board: Board) -> list[str]:
        return [n["text"] for n in board.entries("note") if "in an earlier attempt" in n["text"]]

    assert len(earlier(board)) == 1
    # A third attempt: fast is the incumbent now, nothing is left unconfirmed.
    third = SlowFullTierEvaluator({"stock": 100, "fast": 130, "same": 100}, full_s=40)
    board = Board(board_path)
    result = CompileLoop(third, sp, board, [ListAgent(sp, board, [])], Budget(max_trials=None, max_seconds=600),
                         LoopConfig(deterministic=True)).run()
    assert len(earlier(board)) == 1 and result.champion is not None


class ClockedEvaluator(FakeEvaluatorForOrchestrationTests):
    """Every measurement advances a simulated clock by what it says it took (screens `screen_s`
    each pass, full-tier replays `full_s`), so the loop's wall-clock budget runs out in a test
    that takes no time."""

    def __init__(self, *args, screen_s: float, full_s: float, **kw):
        super().__init__(*args, **kw)
        self.now, self.screen_s, self.full_s = 0.0, screen_s, full_s

    def _timed(self, m: Measurement, s: float) -> Measurement:
        self.now += s
        m.seconds = s
        return m

    def screen(self, c):
        return self._timed(super().screen(c), self.screen_s)

    def confirm(self, c):
        return self._timed(super().confirm(c), self.full_s)

    def compare(self, c, inc):
        m, i = super().compare(c, inc)
        return self._timed(m, self.full_s), self._timed(i, self.full_s)


def test_screening_stops_while_a_confirmation_still_fits(tmp_path: Path, monkeypatch) -> None:
    """The end of a wall-clock budget is kept for confirming: no candidate is screened once
    another screen and a paired confirmation would not both fit, so a screen that beats the
    incumbent always has room to be confirmed (no over-budget note), and the stop reason says so.
    With room for everything, every candidate is screened and the faster one is the champion."""
    import types

    from shapeshift.engine.compile import loop as loop_module

    def run(budget_s: float, items: list[str]):
        ev = ClockedEvaluator({"stock": 100, "same": 100, "wrong": 99, "fast": 130}, screen_s=20, full_s=40,
                             crashes={"crash"})
        monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(monotonic=lambda: ev.now))
        board = Board(tmp_path / f"board-{budget_s}-{'-'.join(items)}.jsonl")  # a fresh board per run
        sp = space()
        loop = CompileLoop(ev, sp, board, [ListAgent(sp, board, items)],
                           Budget(max_trials=None, max_seconds=budget_s), LoopConfig(deterministic=True))
        return loop.run(), board, ev

    # baseline: full 40 s, fast 20 s (t=60); same, wrong screened (t=100); then 100 s are left,
    # exactly a screen (20 s) and a paired round (2 x 40 s): fast is screened (t=120) and confirmed.
    result, board, ev = run(200, ["same", "wrong", "fast", "crash"])
    assert ("screen", "fast") in ev.calls and ("compare", "fast") in ev.calls, ev.calls
    assert not [n for n in board.entries("note") if n.get("over_budget")]
    assert result.champion is not None and result.champion.recipe["variant"] == "fast"
    # one screen more before it: fast would come too late to confirm, so it is never screened
    result, board, ev = run(200, ["same", "wrong", "crash", "fast"])
    assert ("screen", "fast") not in ev.calls and result.champion is None
    assert not [n for n in board.entries("note") if n.get("over_budget")]
    assert "screening closed with" in result.stop_reason and "would not both fit" in result.stop_reason
    result, board, ev = run(2000, ["same", "wrong", "crash", "fast"])
    assert ("compare", "fast") in ev.calls and result.champion is not None
    assert "screening closed" not in result.stop_reason


def test_an_undecided_closing_comparison_gets_one_more_round_judged_as_a_second_look(tmp_path: Path) -> None:
    """The closing comparison (champion against the shipped default) with its mean above the bar
    and its lower bound below: one more round, pooled, held to the second look's 97.5% bound.
    A clear second round keeps the champion; a second wild round withdraws it; no third round."""
    confirmed = ([190.0] * 5, [100.0] * 5)
    undecided = ([300.0, 100.0, 180.0, 95.0, 260.0], [100.0] * 5)  # mean 1.6x, bounds include 1
    clear = ([150.0] * 5, [100.0] * 5)
    result, board, ev = _run_scripted(tmp_path, [confirmed, undecided, clear])
    assert len([c for c in ev.calls if c[0] == "compare"]) == 3
    assert result.champion is not None and result.speedup is not None and result.speedup > 1.2
    notes = [n for n in board.entries("note") if n.get("looks") == 2]
    assert len(notes) == 1 and "pooled paired speed ratio" in notes[0]["text"]
    assert [r for r in board.results("full") if r.get("role") == "final-more"]

    wild = ([90.0, 400.0, 80.0, 300.0, 95.0], [100.0] * 5)
    result, board, ev = _run_scripted(tmp_path / "b", [confirmed, undecided, wild])
    assert len([c for c in ev.calls if c[0] == "compare"]) == 3
    assert result.champion is None and "final comparison with the baseline within noise" in result.stop_reason

    result, board, ev = _run_scripted(tmp_path / "c", [confirmed, undecided], extend_undecided=0)
    assert result.champion is None and len([c for c in ev.calls if c[0] == "compare"]) == 2
