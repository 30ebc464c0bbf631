"""What a compile run shows while it runs (engine/compile/progress.py), through the loop's progress hook.

The loop is driven by the orchestration tests' scripted evaluator (speeds from a table), so
the phases happen in a known order: baseline, trials, a confirmation, a verification, the
closing comparison.
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

from test_compile_loop_orchestration import FakeEvaluatorForOrchestrationTests, ListAgent, space

from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.loop import Budget, CompileLoop, LoopConfig
from shapeshift.engine.compile.progress import Progress, agent_states, duration, short_baseline

BASELINE = "the shipped serving default (recipe torch; max_num_seqs 64, block_size 16)"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(tmp_path: Path, progress, budget: Budget, items=("fast", "same"), fails=frozenset(), more_agents=()):
    board = Board(tmp_path / "board.jsonl")
    sp = space()
    ev = FakeEvaluatorForOrchestrationTests({"stock": 100, "fast": 130, "same": 100}, fails_verification=fails)
    agents = [ListAgent(sp, board, list(items)), *(make(sp, board) for make in more_agents)]
    loop = CompileLoop(ev, sp, board, agents, budget,
                       LoopConfig(deterministic=True, baseline_name=BASELINE), on_progress=progress)
    return loop.run()


def test_on_a_terminal_one_line_per_phase_and_trial(tmp_path: Path, caplog) -> None:
    term = Terminal()
    with caplog.at_level(logging.INFO, logger="shapeshift.engine.compile.loop"):
        result = run(tmp_path, Progress(term), Budget(max_trials=2))
    assert result.champion is not None
    lines = term.getvalue().splitlines()
    bodies = [line.split("] ", 1)[1] for line in lines]
    assert all(line.startswith("[") for line in lines)
    kinds = [b.split(" ", 1)[0] for b in bodies if not b.startswith("  ")]
    # baseline on both tiers, the start line, trial 1 (fast: confirmed, verified), trial 2, the closing comparison
    assert kinds == ["measuring", "measuring", "trial", "confirming", "verifying", "trial", "trial", "closing"], bodies
    assert bodies[0] == "measuring the baseline, the shipped serving default, on the full tier"
    assert bodies[1] == "measuring the baseline, the shipped serving default, on the fast tier"
    assert bodies[2].startswith("trial 0/2 | no verified gain over the shipped serving default yet")
    assert re.match(r"trial 1/2 \| best 1\.(29\d|30\d)x the shipped serving default, verified \(fast tier 1\.3\dx\) "
                    r"\| 1 confirmation \| agents: list idle \| ETA ~\d+s$", bodies[5]), bodies[5]
    assert bodies[6].startswith("trial 2/2 | best 1.") and bodies[6].endswith("ETA ~0s")
    assert bodies[7].startswith("closing comparison: champion ") and "(list)" in bodies[7]
    assert bodies[8].startswith("  final: champion ") and "paired speed ratio 1.2" in bodies[8]  # its verdict
    assert len(bodies) == 9
    # the terminal gets these instead of the per-trial log records; no leaderboard in the log
    logged = [r.getMessage() for r in caplog.records]
    assert not any(m.startswith("trials ") for m in logged), logged
    assert not any("# digest" in m for m in logged)


def test_elsewhere_plain_log_records_and_nothing_on_stdout(tmp_path: Path, caplog) -> None:
    pipe = io.StringIO()  # not a TTY
    with caplog.at_level(logging.INFO, logger="shapeshift.engine.compile.loop"):
        run(tmp_path, Progress(pipe), Budget(max_trials=2, max_seconds=3600))
    assert pipe.getvalue() == ""
    logged = [r.getMessage() for r in caplog.records]
    trials = [m for m in logged if m.startswith("trials ")]
    assert [m.split(",")[0] for m in trials] == ["trials 0/2", "trials 1/2", "trials 2/2"]
    assert sum(m.startswith("confirming ") for m in logged) == 1
    assert sum(m.startswith("verifying ") for m in logged) == 1
    finished = [m for m in logged if m.startswith("compile finished")]
    assert len(finished) == 1 and "# digest" not in finished[0] and '"speedup"' in finished[0]


def test_a_time_budget_shows_elapsed_of_budget_and_a_broken_display_does_not_stop_the_run(tmp_path: Path) -> None:
    term = Terminal()
    run(tmp_path / "a", Progress(term), Budget(max_trials=None, max_seconds=3600), items=("same",))
    trial_lines = [line for line in term.getvalue().splitlines() if "] trial " in line]
    assert trial_lines and all(" of 1h00m | " in line for line in trial_lines)
    assert "ETA " in trial_lines[-1] and "ETA ~" not in trial_lines[-1]

    class Broken(Terminal):
        def write(self, text: str) -> int:
            raise OSError("terminal gone")

    result = run(tmp_path / "b", Progress(Broken()), Budget(max_trials=2))
    assert result.trials == 2 and result.champion is not None


def test_helpers() -> None:
    assert [duration(s) for s in (None, 9, 72, 3725)] == ["?", "9s", "1m12s", "1h02m"]
    assert short_baseline(BASELINE) == "the shipped serving default"
    assert short_baseline("ForwardPass fp-1") == "ForwardPass fp-1"


def test_a_phase_line_is_followed_by_its_verdict(tmp_path: Path) -> None:
    term = Terminal()
    result = run(tmp_path, Progress(term), Budget(max_trials=1), items=("fast",), fails={"fast"})
    assert result.champion is None
    bodies = [line.split("] ", 1)[1] for line in term.getvalue().splitlines()]
    at = next(i for i, b in enumerate(bodies) if b.startswith("verifying "))
    assert bodies[at + 1].startswith("  ") and "rejected by verification" in bodies[at + 1], bodies
    assert bodies[at + 2].startswith("trial 1/1 | no verified gain")
    assert not any("checkpoint" in b for b in bodies)


def test_the_end_of_a_run_prints_one_leaderboard_and_the_outcome_last(tmp_path: Path, capsys, caplog) -> None:
    from shapeshift.engine.compile.report import print_outcome, write_report

    with caplog.at_level(logging.INFO):
        result = run(tmp_path, Progress(io.StringIO()), Budget(max_trials=2))
        board = Board(tmp_path / "board.jsonl")
        _, md_path = write_report(result, board, tmp_path / "out", {"model": "m", "profile": "p"})
        print_outcome(result, board, {"path": str(tmp_path / "out" / "champion")}, md_path)
    printed = capsys.readouterr().out
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert printed.count("# digest") == 1 and "# digest" not in logged
    assert "Leaderboard: the fast tier's screens" in printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"champion {result.champion.short} by list: ") and BASELINE in last
    assert last.endswith(f"-> {tmp_path / 'out' / 'champion'}; report: {md_path}")


class Blocked(ListAgent):
    """Proposes nothing and says it waits, as an agent thread does when the experiment queue is full."""

    name = "blocked"

    def __init__(self, sp, board):
        super().__init__(sp, board, [])

    def propose(self, n=1):
        self.state = "waiting: queue full"
        return []


def test_the_trial_line_shows_each_agents_state(tmp_path: Path) -> None:
    term = Terminal()
    run(tmp_path, Progress(term), Budget(max_trials=2), more_agents=(Blocked,))
    trials = [line.split("] ", 1)[1] for line in term.getvalue().splitlines() if "] trial " in line]
    assert trials[0].endswith("| agents: list idle, blocked idle"), trials[0]  # before any agent was asked
    assert all("| agents: list idle, blocked waiting (queue full)" in t for t in trials[1:]), trials
    # the states named as the loop's status() reports them, in the agents' order
    assert agent_states([{"agent": "sweep", "state": "thinking"},
                         {"agent": "llm", "state": "error: TimeoutError"},
                         {"agent": "evo", "state": "idle: nothing new to propose"},
                         {"agent": "model", "state": "stopped"}]) == \
        "agents: sweep thinking, llm error (TimeoutError), evo idle, model stopped"
    assert agent_states([]) == ""
