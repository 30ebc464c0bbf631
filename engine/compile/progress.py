"""Where a compile run is: one line per phase and per trial.

    CompileLoop --on_progress(event, loop, **detail)--> Progress
        event: "baseline" (tier), "trial" (after each screen), "confirm" (candidate, round),
               "verify" (candidate), "closing" (candidate), "done" (stop_reason, summary)
      on a terminal (stdout is a TTY): one short line per event on stdout, and under it the loop's
      verdicts noted on the board since the last event,
            [    47s] confirming 749dfcbf133d (sweep) on the full tier: 8 paired replays with the incumbent
            [    58s]   749dfcbf133d not confirmed on the full tier: paired speed ratio 0.980 (...) does not clear 1.010
            [    58s] trial 7/12 | no verified gain over the shipped serving default yet (fast tier 1.14x)
                      | agents: sweep thinking, evolutionary waiting (queue full) | ETA ~41s   (one line)
      elsewhere (a pod's log, a file, a pipe): logging at INFO, one line per trial (report.progress_line)
        and one per confirmation, verification and closing comparison; nothing redraws, nothing ticks

A progress sink must never end a search: Progress swallows (and logs) its own errors.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, TextIO

log = logging.getLogger("shapeshift.engine.compile.loop")

ProgressCallback = Callable[..., None]


def duration(seconds: float | None) -> str:
    """72 -> '1m12s', 3725 -> '1h02m', 9 -> '9s'; None -> '?'."""
    if seconds is None:
        return "?"
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def short_baseline(name: str | None) -> str:
    """'the shipped serving default (recipe torch; max_num_seqs 64, ...)' -> 'the shipped serving default'."""
    name = (name or "the baseline").strip()
    return name.split(" (", 1)[0] or name


def where(loop: Any) -> str:
    """'trial 5/12' or 'trial 5, 1m12s of 15m00s' (both budgets: both)."""
    budget = loop.budget
    text = f"trial {loop.trials}" + (f"/{budget.max_trials}" if budget.max_trials is not None else "")
    if budget.max_seconds is not None:
        text += f", {duration(loop.elapsed)} of {duration(budget.max_seconds)}"
    return text


def best(loop: Any) -> str:
    """The best verified speedup against the run's baseline, and the best fast-tier screen."""
    against = short_baseline(getattr(loop.config, "baseline_name", None))
    inc = loop.incumbent
    fast = f"fast tier {loop.best_fast_speedup:.2f}x"
    if inc is None or inc.candidate.agent == "baseline":
        return f"no verified gain over {against} yet ({fast})"
    return f"best {loop.incumbent_speedup:.3f}x {against}, verified ({fast})"


def eta(loop: Any) -> str:
    """'ETA ~40s' when the budget gives one (time left, or trials left at the rate so far), else ''."""
    seconds = loop.eta_s()
    if seconds is None:
        return ""
    # a trial-based estimate is the mean so far: confirmations and the closing comparison come on top
    approx = "" if loop.budget.max_trials is None else "~"
    return f"ETA {approx}{duration(seconds)}"


def _repeats(loop: Any, name: str) -> int | None:
    settings = getattr(loop.evaluator, "settings", None)
    value = getattr(settings, name, None)
    return value if isinstance(value, int) else None


def phase_text(event: str, loop: Any, detail: dict[str, Any]) -> str | None:
    """The line of a phase event (None for events that have no line of their own)."""
    cand = detail.get("candidate")
    who = f"{cand.short} ({cand.agent})" if cand is not None else "the candidate"
    if event == "baseline":
        tier = detail.get("tier", "fast")
        return f"measuring the baseline, {short_baseline(loop.config.baseline_name)}, on the {tier} tier"
    if event == "confirm":
        n = _repeats(loop, "confirm_repeats")
        replays = f"{n} paired replays" if n else "paired replays"
        more = f" (round {detail['round'] + 1}: undecided so far)" if detail.get("round") else ""
        return f"confirming {who} on the full tier: {replays} with the incumbent{more}"
    if event == "verify":
        return f"verifying {who}: outputs, KV-cache isolation, anti-cheat gates"
    if event == "closing":
        n = _repeats(loop, "final_repeats")
        return (f"closing comparison: champion {who} against {short_baseline(loop.config.baseline_name)}, "
                f"side by side" + (f" ({n} pairs)" if n else ""))
    return None


def agent_states(agents: list[dict[str, Any]]) -> str:
    """'agents: sweep thinking, evolutionary waiting (queue full)' from status()["agents"]; '' without agents."""
    shown = []
    for a in agents:
        head, _, why = str(a.get("state", "?")).partition(":")
        # idle and stopped say why at length; a wait or an error names its reason in a word or two
        why = why.strip() if head in ("waiting", "error") else ""
        shown.append(f"{a.get('agent', '?')} {head.strip()}" + (f" ({why})" if why else ""))
    return "agents: " + ", ".join(shown) if shown else ""


def trial_text(loop: Any, st: dict[str, Any]) -> str:
    """The terminal's trial line; `st` is the loop's status() the trial event carries."""
    parts = [where(loop), best(loop)]
    if loop.confirms:
        parts.append(f"{loop.confirms} confirmation" + ("s" if loop.confirms > 1 else ""))
    agents = agent_states(st.get("agents") or [])
    if agents:
        parts.append(agents)
    text = eta(loop)
    if text:
        parts.append(text)
    return " | ".join(parts)


class Progress:
    """The loop's progress sink: lines on a terminal, log records elsewhere (see the module docstring)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream if stream is not None else sys.stdout
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self._seen_notes: int | None = None  # loop notes on the board already shown

    def __call__(self, event: str, loop: Any, **detail: Any) -> None:
        try:
            self._emit(event, loop, detail)
        except Exception:  # noqa: BLE001 - a display must not end the search
            log.debug("progress display failed", exc_info=True)

    def _emit(self, event: str, loop: Any, detail: dict[str, Any]) -> None:
        if self.tty:
            for text in self._verdicts(loop):
                self._line(loop, f"  {text}")
        if event == "done":
            # the leaderboard and the outcome line follow on stdout (report.print_outcome); a log keeps the summary
            log.log(logging.DEBUG if self.tty else logging.INFO, "compile finished (%s): %s",
                    detail.get("stop_reason", ""), detail.get("summary", ""))
            return
        if event == "trial":
            st = detail.get("status") or loop.status()
            if self.tty:
                self._line(loop, trial_text(loop, st))
            else:
                from shapeshift.engine.compile.report import progress_line  # report.py imports the loop

                log.info("%s", progress_line(st))
            return
        text = phase_text(event, loop, detail)
        if text is None:
            return
        if self.tty:
            self._line(loop, text)
        else:
            log.info("%s", text)

    def _verdicts(self, loop: Any) -> list[str]:
        """The loop's notes on the board since the last event (a candidate not confirmed, rejected by
        verification, withdrawn at the closing comparison), so a phase line is followed by its outcome."""
        notes = loop.board.entries("note")
        seen, self._seen_notes = self._seen_notes, len(notes)
        if seen is None:
            return []
        return [n["text"] for n in notes[seen:] if n.get("agent") == "loop" and not n.get("checkpoint")]

    def _line(self, loop: Any, text: str) -> None:
        self.stream.write(f"[{duration(loop.elapsed):>7}] {text}\n")
        self.stream.flush()


def default_progress() -> ProgressCallback:
    """What a loop built without a progress sink uses: lines on a terminal, log records elsewhere."""
    return Progress()
