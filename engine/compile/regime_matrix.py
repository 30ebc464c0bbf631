"""The regime matrix: every regime's champion and the shipped serving default, each measured on
every regime's traffic, paired; and the best one-size-fits-all configuration among them.

Data flow (hack/bench_regimes.py drives it):
    one compile run per regime (cli.py `run`) -> OUT/<regime>/report.json + champion/ bundle
      --champion_of--> RegimeChampion (the champion as a Candidate, or None: that regime serves the default)
    an EngineEvaluator (one pair of engines, loaded once) --retarget(profile)--> each regime's traffic
      --measure_together([default, champion...])--> Measurements paired repeat by repeat (ABBA order)
      --summarize--> matrix (champion regime -> traffic regime -> speedup, low, high, pairs, each
         against the shipped default on that traffic), best_static (the configuration with the highest
         geometric-mean goodput ratio over all regimes), vs_best_static (regime -> that regime's champion
         against the best static configuration on its own traffic)

The thesis the matrix tests: a deployment compiled per regime beats the best single configuration.
`vs_best_static` is that test; `matrix` shows whether the optimum moves with traffic (a champion
that wins on its own traffic and loses on another's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.measure import Measurement, paired_gain

DEFAULT = "default"  # the label of the shipped serving default in every table


@dataclass
class RegimeChampion:
    """What one regime's compile run left: its verified champion (None: none beat the default)."""

    regime: str
    candidate: Candidate | None
    digest: str | None = None
    verified: bool = False
    recipe: dict[str, Any] = field(default_factory=dict)
    compile: dict[str, Any] = field(default_factory=dict)  # the run's economics and headline

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "verified": self.verified, "recipe": self.recipe, **self.compile}


def champion_of(regime: str, run_dir: Path, stock_source: str) -> RegimeChampion:
    """The champion a compile run left in `run_dir` (its report.json and champion/ bundle)."""
    from shapeshift.engine.compile.pass_to_beat import candidate_from_bundle
    from shapeshift.engine.forward_pass.bundle import verify_bundle

    report = json.loads((run_dir / "report.json").read_text())
    compile_summary = {
        "speedup_in_compile": report.get("speedup"), "elapsed_s": report.get("elapsed_s"),
        "trials": report.get("trials"), "confirms": report.get("confirms"),
        "verifications": report.get("verifications"), "trials_per_hour": report.get("trials_per_hour"),
        "confirms_per_hour": _per_hour(report.get("confirms"), report.get("elapsed_s")),
        "stop_reason": report.get("stop_reason"), "champion_note": report.get("champion_note"),
    }
    bundle = run_dir / "champion"
    verification = report.get("verification") or {}
    if not report.get("champion") or not (bundle / "manifest.json").is_file():
        return RegimeChampion(regime, None, compile=compile_summary)
    digest = verify_bundle(bundle).digest
    recipe = dict(report.get("champion_recipe") or {})
    cand = candidate_from_bundle(bundle, recipe, stock_source, f"the {regime} champion", digest)
    return RegimeChampion(regime, cand, digest, bool(verification.get("passed", True)), recipe, compile_summary)


def _per_hour(count: Any, seconds: Any) -> float | None:
    try:
        return round(float(count) * 3600.0 / float(seconds), 1) if count is not None and float(seconds) > 0 else None
    except (TypeError, ValueError):
        return None


def configurations(default: Candidate, champions: Sequence[RegimeChampion]) -> dict[str, Candidate]:
    """Label -> candidate: the default, then each distinct champion (labelled by the first regime
    whose champion it is; a regime whose champion is the default, or another's, adds nothing)."""
    out: dict[str, Candidate] = {DEFAULT: default}
    seen = {default.digest: DEFAULT}
    for champ in champions:
        if champ.candidate is None:
            continue
        key = champ.candidate.digest
        if key not in seen:
            seen[key] = champ.regime
            out[champ.regime] = champ.candidate
    return out


def label_of(champ: RegimeChampion, configs: Mapping[str, Candidate]) -> str:
    """The configuration label a regime's deployment serves (its champion's, else the default's)."""
    if champ.candidate is None:
        return DEFAULT
    for label, cand in configs.items():
        if cand.digest == champ.candidate.digest:
            return label
    return DEFAULT


def measure_matrix(evaluator: Any, profiles: Mapping[str, Any], configs: Mapping[str, Candidate],
                   pairs: int, requests: int | None = None,
                   progress: Any = None) -> dict[str, dict[str, Measurement]]:
    """Traffic regime -> configuration label -> Measurement: on each regime's traffic, every
    configuration replayed in alternation (ABBA) with `pairs` repeats, so their samples pair up."""
    labels = list(configs)
    out: dict[str, dict[str, Measurement]] = {}
    for traffic, profile in profiles.items():
        evaluator.retarget(profile)
        ms = evaluator.measure_together([configs[k] for k in labels], repeats=pairs, requests=requests)
        out[traffic] = dict(zip(labels, ms))
        if progress is not None:
            progress(traffic, out[traffic])
    return out


def _gain(a: Measurement, b: Measurement) -> dict[str, Any]:
    if not (a.ok and b.ok):
        return {"speedup": None, "low": None, "high": None, "pairs": 0,
                "error": a.error or b.error or "no samples"}
    if a is b:
        return {"speedup": 1.0, "low": 1.0, "high": 1.0, "pairs": len(a.samples)}
    gain, low, high = paired_gain(a, b)
    return {"speedup": round(gain, 4), "low": round(low, 4), "high": round(high, 4) if math.isfinite(high) else None,
            "pairs": min(len(a.samples), len(b.samples))}


def summarize(measured: Mapping[str, Mapping[str, Measurement]], champions: Sequence[RegimeChampion],
              configs: Mapping[str, Candidate]) -> dict[str, Any]:
    """The matrix, the best static configuration and each regime's champion against it."""
    traffic = list(measured)
    labels = list(configs)
    matrix: dict[str, dict[str, Any]] = {}
    for label in labels:
        matrix[label] = {t: _gain(measured[t][label], measured[t][DEFAULT]) for t in traffic}
    goodput = {t: {k: {"mean": round(m.mean, 3), "samples": [round(s, 3) for s in m.samples],
                       "slo_attainment": (round(sum(m.slo_attainment) / len(m.slo_attainment), 4)
                                          if m.slo_attainment else None),
                       "per_user_p90": m.per_user_p90_mean(), "error": m.error}
                   for k, m in row.items()} for t, row in measured.items()}
    # Geometric mean over the regimes of each configuration's goodput ratio to the default there
    # (the ranking equals that of the geometric mean of its goodputs; a failed cell counts as 0).
    geomean: dict[str, float] = {}
    for label in labels:
        ratios = [matrix[label][t]["speedup"] or 0.0 for t in traffic]
        geomean[label] = 0.0 if min(ratios, default=0.0) <= 0 else math.exp(sum(map(math.log, ratios)) / len(ratios))
    best_static = max(labels, key=lambda k: (geomean[k], k == DEFAULT))
    vs_best: dict[str, Any] = {}
    for champ in champions:
        if champ.regime not in measured:
            continue
        serves = label_of(champ, configs)
        row = measured[champ.regime]
        vs_best[champ.regime] = {"serves": serves,
                                 **_gain(row[serves], row[best_static] if serves != best_static else row[serves])}
    # Pairs of regimes whose champions differ: each champion against the other on its own traffic.
    head_to_head = []
    for i, a in enumerate(champions):
        for b in champions[i + 1:]:
            la, lb = label_of(a, configs), label_of(b, configs)
            if la == lb or a.regime not in measured or b.regime not in measured:
                continue
            on_a = _gain(measured[a.regime][la], measured[a.regime][lb])
            on_b = _gain(measured[b.regime][lb], measured[b.regime][la])
            head_to_head.append({"regimes": [a.regime, b.regime], "configurations": [la, lb],
                                 f"{la}_vs_{lb}_on_{a.regime}": on_a, f"{lb}_vs_{la}_on_{b.regime}": on_b,
                                 "optimum_moves": bool((on_a["speedup"] or 0) > 1 and (on_b["speedup"] or 0) > 1),
                                 "beyond_noise": bool((on_a["low"] or 0) > 1 and (on_b["low"] or 0) > 1)})
    return {"matrix": matrix, "goodput": goodput, "geomean_vs_default": {k: round(v, 4) for k, v in geomean.items()},
            "best_static": best_static, "vs_best_static": vs_best,
            "head_to_head": head_to_head}

