"""What fits in what is left of a compile's wall-clock budget.

The loop asks three questions of its budget, each answered here from the baseline's own
full-tier seconds (warm-up included) and the wall time of the screens so far:

- may a confirmation start? (`confirmation_overrun`: a paired full-tier round replays two passes);
- may another candidate be screened? (`screening_closed`: the rest of the budget is kept for
  confirming what the next screen finds; without it a screen that beats the incumbent near the
  end cannot be confirmed: on the H200 a 150 s budget screened max_num_batched_tokens 8192 at
  1.155x with 21 s left, and ended with no champion);
- may the closing comparison take another round? (`closing_overruns`).

The closing comparison's first round is not counted: it runs after the search, in the run's
grace (a CompileRun's deadlineGraceSeconds). Budgets that count trials only answer "yes" to all.
"""
from __future__ import annotations

import statistics

from shapeshift.engine.compile.job import Budget
from shapeshift.engine.compile.measure import Measurement


def paired_round_seconds(budget: Budget, baseline_full: Measurement | None, pairs: int | None = None) -> float | None:
    """Seconds a paired full-tier round of `pairs` pairs (None: as many as the baseline's repeats)
    is estimated to take. None where no wall-clock budget applies or the baseline has no seconds."""
    if budget.max_seconds is None or baseline_full is None or not baseline_full.seconds:
        return None
    repeats = max(1, len(baseline_full.samples))
    return 2 * baseline_full.seconds * max(1.0, (pairs or repeats) / repeats)


def confirmation_overrun(budget: Budget, baseline_full: Measurement | None, elapsed: float,
                         short: str, rounds: int = 1) -> str | None:
    """Why `rounds` paired full-tier rounds for the candidate `short` would not fit (None when
    they fit). On the H200 a 75 s budget ran 253 s when a confirmation and its second round
    started near its end."""
    round_s = paired_round_seconds(budget, baseline_full)
    if round_s is None:
        return None
    need = rounds * round_s
    left = budget.max_seconds - elapsed
    if need <= left:
        return None
    return (f"{short} beat the incumbent on the fast tier, but confirming it (about {need:.0f} s) would "
            f"overrun the time budget ({left:.0f} s left of {budget.max_seconds:.0f} s); not confirmed")


def screening_closed(budget: Budget, baseline_full: Measurement | None, elapsed: float,
                     screen_walls: list[float]) -> str | None:
    """Why no further candidate is screened although time is left (None while one may be):
    another screen (the median of the screens so far) and a confirmation would not both fit."""
    round_s = paired_round_seconds(budget, baseline_full)
    if round_s is None or not screen_walls:
        return None
    screen_s = statistics.median(screen_walls)
    left = budget.max_seconds - elapsed
    if screen_s + round_s <= left:
        return None
    return (f"screening closed with {left:.0f} s of {budget.max_seconds:.0f} s left: another screen "
            f"(about {screen_s:.0f} s) and its confirmation (about {round_s:.0f} s) would not both fit")


def closing_overruns(budget: Budget, baseline_full: Measurement | None, elapsed: float,
                     closing_pairs: int | None) -> bool:
    """True when another round of the closing comparison would end past the wall-clock budget."""
    closing_s = paired_round_seconds(budget, baseline_full, closing_pairs)
    return closing_s is not None and elapsed + closing_s > budget.max_seconds
