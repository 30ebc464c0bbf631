"""What a compile run tells: its status while it runs, its closing report, its last words.

    CompileLoop --run_status--> the status callback (worker.py: CompileRun status), every trial
                --on_progress--> progress.py: lines on a terminal; elsewhere progress_line, the log line
    CompileResult + board --write_report--> OUT/report.json, OUT/report.md
                          --print_outcome--> the leaderboard and the outcome on stdout
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shapeshift.engine.compile.board import Board, format_leaderboard
from shapeshift.engine.compile.loop import FAST, CompileLoop, CompileResult
from shapeshift.engine.compile.measure import MISSED_SLO


def run_status(loop: CompileLoop, phase: str = "Running") -> dict[str, Any]:
    """The loop's progress as the status callback gets it (worker.py turns it into CompileRun status)."""
    rows = loop.board.leaderboard(FAST, k=5)
    inc = loop.incumbent
    best_full = None
    if inc is not None and inc.candidate.agent != "baseline":
        best_full = round(loop.incumbent_speedup, 4)
    results = loop.board.entries("result")
    verified = {v["digest"] for v in loop.board.entries("verification") if v.get("passed")}
    return {
        "phase": phase,
        "trials": loop.trials,
        "improved": len(loop.board.entries("incumbent")),
        # rejected by a check: a failed verification, or a replay in which no request met the SLO
        "rejected": len([v for v in loop.board.entries("verification") if not v.get("passed")])
        + len([r for r in results if r.get("status") == MISSED_SLO and not r.get("role")]),
        "failed": len([r for r in results if r.get("status") == "failed" and not r.get("role")]),
        "trials_budget": loop.budget.max_trials,
        "confirms": loop.confirms,
        "verifications": loop.verifications,
        "best_speedup": best_full,
        "best_fast_speedup": round(loop.best_fast_speedup, 4),
        "incumbent": None if inc is None else inc.candidate.digest,
        "elapsed_s": round(loop.elapsed, 1),
        "eta_s": None if loop.eta_s() is None else round(loop.eta_s(), 1),
        "agents": [a.describe() for a in loop.agents],
        "leaderboard": [{"digest": r.digest[:12], "agent": r.agent, "throughput": round(r.throughput, 2),
                         "speedup": None if r.speedup is None else round(r.speedup, 4),
                         "verified": r.digest in verified} for r in rows],
    }


def progress_line(st: dict[str, Any]) -> str:
    """The progress log line of a status: trials, best speedup, confirmations, ETA, agents' states."""
    eta = "?" if st["eta_s"] is None else f"{st['eta_s']:.0f}s"
    best = "none verified" if st["best_speedup"] is None else f"{st['best_speedup']:.3f}x verified"
    agents = ", ".join(f"{a['agent']}:{a['state'].split(':')[0]}" for a in st["agents"])
    budget = st["trials_budget"] if st["trials_budget"] is not None else "-"
    return (f"trials {st['trials']}/{budget}, best {best} (fast tier {st['best_fast_speedup']:.3f}x), "
            f"confirms {st['confirms']}, ETA {eta} [{agents}]")


def write_report(result: CompileResult, board: Board, out_dir: Path, context: dict[str, Any]) -> tuple[Path, Path]:
    """report.json and report.md in `out_dir`: baseline, champion, speedups, rates per tier, leaderboard."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hours = max(result.elapsed_s, 1e-9) / 3600
    inc = result.incumbent
    data = {
        **context,
        **result.summary(),
        "baseline": {"fast": result.baseline_fast.metrics(), "full": result.baseline_full.metrics() if result.baseline_full else None},
        "champion_metrics": None if result.champion is None else {
            "fast": inc.fast.metrics(result.baseline_fast),
            "full": inc.full.metrics(result.baseline_full) if inc.full else None},
        "champion_recipe": None if result.champion is None else dict(result.champion.recipe),
        "champion_agent": None if result.champion is None else result.champion.agent,
        "champion_note": None if result.champion is None else result.champion.note,
        "verification": None if inc.verification is None else {"passed": inc.verification.passed,
                                                              "gates": inc.verification.gates},
        "trials_per_hour": {"fast": result.trials / hours, "full": result.confirms / hours},
        "leaderboard": result.leaderboard,
        "board": str(board.path),
        "garbage_or_errors": len([n for n in board.entries("note") if n.get("garbage") or n.get("error")]),
        "routing": routing_summary(board),
    }
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    lines = [f"# Compile report: {context.get('model', '?')} / {context.get('profile', '?')}", "",
             f"Pass to beat: {_baseline(result)}.", "",
             f"Objective: {(context.get('evaluator') or {}).get('objective', 'output tokens/s')} (the leaderboard's "
             "tok/s; speedups are paired ratios of it)." + _fast_tier_slo(context), ""]
    if result.champion is None:
        lines.append(f"No candidate beat {_baseline(result)} beyond the measured noise and passed verification; "
                     "it stays.")
    else:
        lines.append(f"Champion `{result.champion.digest[:12]}` by **{result.champion.agent}**: "
                     f"**{_versus(result)}** (full tier, verified).")
        lines.append(f"- why: {result.champion.note}")
        lines.append(f"- recipe: `{json.dumps(dict(result.champion.recipe), sort_keys=True)}`")
    lines += ["", f"- trials (fast tier): {result.trials}, confirmations (full tier): {result.confirms}, "
              f"verifications: {result.verifications}",
              f"- trials per hour: fast {data['trials_per_hour']['fast']:.0f}, full {data['trials_per_hour']['full']:.0f}",
              f"- baseline: fast {result.baseline_fast.mean:.1f} tok/s (cv {result.baseline_fast.cv:.3f})"
              + (f", full {result.baseline_full.mean:.1f} tok/s (cv {result.baseline_full.cv:.3f})" if result.baseline_full else ""),
              *_drift_lines(result),
              *_routing_lines(data["routing"]),
              f"- stopped: {result.stop_reason}", "", "## Leaderboard (fast tier)", "", "```",
              format_leaderboard(board.leaderboard(FAST, k=10)), "```", ""]
    md_path = out_dir / "report.md"
    md_path.write_text("\n".join(lines))
    return json_path, md_path


def routing_summary(board: Board) -> dict[str, Any] | None:
    """MoE: how far the measured replays' expert routing was from the profile's (the results'
    ``routing``, engine/replay/routing.py); None where no result was checked (a dense model, or a
    profile without expertRouting)."""
    checked = [r for r in board.entries("result") if r.get("routing")]
    if not checked:
        return None
    far = [{"digest": r["digest"][:12], "tier": r["tier"], "distance": r["routing"]["distance"],
            "worst_layer": r["routing"]["worst_layer"]} for r in checked if not r["routing"]["representative"]]
    return {"checked": len(checked), "max_distance": max(r["routing"]["distance"] for r in checked),
            "threshold": checked[-1]["routing"]["threshold"], "representative": not far, "not_representative": far}


def _routing_lines(summary: dict[str, Any] | None) -> list[str]:
    if summary is None:
        return []
    if summary["representative"]:
        return [f"- expert routing: every measured replay within total variation {summary['threshold']:.3f} of the "
                f"profile's (largest {summary['max_distance']:.3f}, {summary['checked']} measurements)"]
    return [f"- **warning: not representative**: {len(summary['not_representative'])} of {summary['checked']} "
            f"measurements replayed an expert routing further than {summary['threshold']:.3f} (total variation) "
            f"from the profile's (largest {summary['max_distance']:.3f}); their figures measure other experts' work "
            "than the traffic's"]


def _drift_lines(result: CompileResult) -> list[str]:
    """One line per tier: how far the incumbent's own figure moved over the run."""
    lines = []
    for tier, d in sorted((result.drift or {}).items()):
        who = "the baseline" if d["stock"] else f"incumbent {d['digest'][:12]}"
        lines.append(f"- drift ({tier} tier): {who} measured {d['measurements']}x, first {d['first']:.1f}, last "
                     f"{d['last']:.1f} tok/s (last/first {d['last_over_first'] or 0:.3f}, high/low "
                     f"{d['high_over_low'] or 0:.3f}); every comparison is paired, so this drift cancels")
    return lines


def _fast_tier_slo(context: dict[str, Any]) -> str:
    """The fast tier's own SLO, where the evaluator scaled one (EngineEvaluator.calibrate_tier_slo)."""
    scaled = (context.get("evaluator") or {}).get("fast_tier_slo")
    if not scaled:
        return ""
    return (f" The fast tier screens at p90 TTFT <= {scaled['ttft_p90_s']:.3g} s, p90 per-user >= "
            f"{scaled['per_user_tokens_per_s_p90']:.3g} tok/s: the SLO scaled by the stock pass's speed there.")


def _baseline(result: CompileResult) -> str:
    return result.baseline_name or "the stock forward pass"


def _versus(result: CompileResult) -> str:
    """'1.234x (95% 1.10..1.38, paired) <baseline>[; 2.1x (...) the plain-PyTorch pass]'."""
    def figure(gain: float, bounds: Any) -> str:
        return f"{gain:.3f}x" + (f" (95% bounds {bounds[0]:.3f}..{bounds[1]:.3f}, paired)" if bounds else "")

    text = f"{figure(result.speedup or 0.0, result.speedup_bounds)} {_baseline(result)}"
    if result.vs_plain:
        p = result.vs_plain
        text += f"; {figure(p['speedup'], (p['low'], p['high']))} the plain-PyTorch pass"
    return text


def print_outcome(result: CompileResult, board: Board, exported: dict[str, Any] | None, md_path: Path) -> None:
    """The leaderboard and one line on the outcome, on stdout, when the run ends."""
    print()
    print("Leaderboard: the fast tier's screens (speedups chained through paired comparisons); the champion "
          "is decided on the full tier and verified")
    print(format_leaderboard(board.leaderboard(FAST, k=10)))
    print()
    if result.champion is None:
        print(f"no verified improvement over {_baseline(result)} ({result.stop_reason}); report: {md_path}")
    else:
        print(f"champion {result.champion.digest[:12]} by {result.champion.agent}: {_versus(result)} "
              f"(full tier, verified) -> {exported['path']}; report: {md_path}")
