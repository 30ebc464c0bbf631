"""The run's closing comparisons: the champion against the baseline (the reported speedup),
against the plain-PyTorch pass (the second, labelled figure) and against the pass to beat.

Each is the champion and its rival replayed in alternation on the full tier (the evaluator's
``compare_final``: at least 5 pairs), recorded on the board with a note of the paired speed
ratio and its 95% bounds. Functions of a CompileLoop (loop.py), split out of it by concern.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.measure import beats, beats_paired, paired_gain

if TYPE_CHECKING:
    from shapeshift.engine.compile.loop import CompileLoop

FULL = "full"


def final_comparison(loop: CompileLoop, champion: Candidate) -> float | None:
    """Champion against the stock pass, alternated in one window: the speedup we report."""
    compare = getattr(loop.evaluator, "compare", None)
    if not callable(compare):
        inc = loop.incumbent
        return inc.full.mean / loop.baseline_full.mean if inc.full and loop.baseline_full else None
    base = loop._baseline_candidate()
    tid = loop._trial_id(champion) + "-final"
    loop.board.append("trial", trial_id=tid, digest=champion.digest, tier=FULL, role="final")
    champ_m, stock_m = getattr(loop.evaluator, "compare_final", compare)(champion, base)
    loop._record(base, tid + "-stock", FULL, stock_m, None, role="final-stock")
    loop._record(champion, tid, FULL, champ_m, stock_m, role="final")
    if stock_m.ok:
        loop._note_drift(FULL, base, stock_m)
    if not (champ_m.ok and stock_m.ok):
        return None
    loop.final = (champ_m, stock_m)
    gain, low, high = paired_gain(champ_m, stock_m)
    loop.board.note("loop", f"final: champion {champion.short} vs {loop.config.baseline_name}, paired speed "
                    f"ratio {gain:.3f} (95% bounds {low:.3f}..{high:.3f})", final=True, gain=gain, low=low, high=high)
    return gain


def final_comparison_more(loop: CompileLoop, champion: Candidate) -> float | None:
    """Another round of the closing comparison, pooled with the first (an undecided one: mean
    above the bar, lower bound below it). The pooled pairs are judged as a second look (the
    stricter bound, measure.paired_gain looks=2). Returns the pooled speed ratio."""
    assert loop.final is not None
    first_champ, first_stock = loop.final
    gain, low, high = paired_gain(first_champ, first_stock)
    loop.board.note("loop", f"final: champion {champion.short} undecided against {loop.config.baseline_name} "
                    f"(paired ratio {gain:.3f}, 95% bounds {low:.3f}..{high:.3f} over {len(first_champ.samples)} "
                    "pairs); measuring one more round", digest=champion.digest)
    compare = getattr(loop.evaluator, "compare_final", loop.evaluator.compare)
    base = loop._baseline_candidate()
    tid = loop._trial_id(champion) + "-final-more"
    loop.board.append("trial", trial_id=tid, digest=champion.digest, tier=FULL, role="final-more")
    champ_m, stock_m = compare(champion, base)
    loop._record(base, tid + "-stock", FULL, stock_m, None, role="final-more-stock")
    loop._record(champion, tid, FULL, champ_m, stock_m, role="final-more")
    if not (champ_m.ok and stock_m.ok):
        return gain  # the first round's verdict stands
    loop.final = (first_champ.extended(champ_m), first_stock.extended(stock_m))
    gain, low, high = paired_gain(*loop.final, looks=2)
    loop.board.note("loop", f"final: champion {champion.short} vs {loop.config.baseline_name}, pooled paired speed "
                    f"ratio {gain:.3f} (97.5% bounds {low:.3f}..{high:.3f}, a second look) over "
                    f"{len(loop.final[0].samples)} pairs", final=True, gain=gain, low=low, high=high, looks=2)
    return gain


def compare_with_plain(loop: CompileLoop, champion: Candidate) -> None:
    """Champion against the plain-PyTorch pass (the second figure, labelled), when that is not the baseline."""
    plain = loop.plain_pass
    if plain is None or plain.digest == loop._baseline_candidate().digest or plain.digest == champion.digest:
        return
    tid = loop._trial_id(champion) + "-final-vs-plain"
    loop.board.append("trial", trial_id=tid, digest=champion.digest, tier=FULL, role="final-vs-plain")
    champ_m, plain_m = getattr(loop.evaluator, "compare_final", loop.evaluator.compare)(champion, plain)
    loop._record(plain, tid + "-plain", FULL, plain_m, None, role="final-plain")
    loop._record(champion, tid, FULL, champ_m, plain_m, role="final-vs-plain")
    if champ_m.ok and plain_m.ok:
        gain, low, high = paired_gain(champ_m, plain_m)
        loop.vs_plain = {"speedup": gain, "low": low, "high": high, "pairs": len(champ_m.samples)}
        loop.board.note("loop", f"final: champion {champion.short} vs the plain-PyTorch pass, paired speed ratio "
                        f"{gain:.3f} (95% bounds {low:.3f}..{high:.3f})", final_vs_plain=True, **loop.vs_plain)


def loses_to_pass_to_beat(loop: CompileLoop, champion: Candidate) -> str | None:
    """Champion against the pass to beat, alternated in one window: why it is withdrawn (not
    faster by min_speedup beyond the noise, or the champion failed to run), else None."""
    rival = loop.pass_to_beat
    assert rival is not None
    compare = getattr(loop.evaluator, "compare_final", None) or getattr(loop.evaluator, "compare", None)
    tid = loop._trial_id(champion) + "-final-vs-pass"
    loop.board.append("trial", trial_id=tid, digest=champion.digest, tier=FULL, role="final-vs-pass")
    if callable(compare):
        champ_m, rival_m = compare(champion, rival)
    else:
        champ_m, rival_m = loop.evaluator.confirm(champion), loop.evaluator.confirm(rival)
    loop._record(rival, tid + "-pass", FULL, rival_m, None, role="final-pass")
    loop._record(champion, tid, FULL, champ_m, rival_m, role="final-vs-pass")
    if not champ_m.ok:
        return f"the champion failed in its comparison with the pass to beat ({champ_m.error})"
    if not rival_m.ok:
        # A serving pass that no longer runs here is nothing to hold a verified champion back.
        loop.board.note("loop", f"the pass to beat ({rival.note}) failed to run ({rival_m.error}); the champion "
                        "stands on its comparison with the stock pass", final_vs_pass=True, won=True)
        return None
    paired = callable(compare) and len(champ_m.samples) == len(rival_m.samples)
    won = (beats_paired(champ_m, rival_m, loop.config.min_speedup - 1) if paired
           else beats(champ_m, rival_m) and champ_m.mean >= rival_m.mean * loop.config.min_speedup)
    gain, low, high = paired_gain(champ_m, rival_m) if paired else (champ_m.mean / rival_m.mean,) * 3
    loop.board.note("loop", f"final: champion {champion.short} vs the pass to beat ({rival.note}), speed ratio "
                    f"{gain:.3f} (95% bounds {low:.3f}..{high:.3f})", final_vs_pass=True, gain=gain, won=won)
    if won:
        return None
    return (f"not faster than the pass to beat beyond the noise (speed ratio {gain:.3f}, "
            f"95% bounds {low:.3f}..{high:.3f}, needs {loop.config.min_speedup:.3f})")
