"""Measurements and verdicts the loop reasons about, and the `Evaluator` protocol that makes them.

Data flow:
    Candidate --Evaluator.screen()--> Measurement (fast tier: a few layers, repeated runs)
    Candidate --Evaluator.confirm()--> Measurement (full tier: the traffic replay, repeated)
    Candidate --Evaluator.verify()--> Verification (named gates against the stock pass)
    Candidate --Evaluator.export()--> a bundle folder with a manifest (the champion)

Noise: every measurement keeps its per-repeat samples. Its interval is the range of the
samples widened to at least +-`noise_floor` of the mean, so one lucky repeat can never
look like a gain: measured apart, a candidate beats the incumbent only when its *lower*
bound is above the incumbent's *upper* bound (`beats`). Measured in alternation (the
evaluator's `compare`), the test is on the per-pair speed ratios: the lower 95% bound of
their mean must clear 1 + the noise floor (`beats_paired`), so load that changes between
pairs cannot fake a gain and noise inside pairs widens the bound.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shapeshift.engine.compile.candidate import Candidate

FAST, FULL = "fast", "full"  # the tiers: screens on a few layers, confirmations on the whole model
DEFAULT_NOISE_FLOOR = 0.01  # +-1% even when the repeats agree perfectly


@dataclass
class Measurement:
    """Repeated runs of one candidate on one tier. `samples`: the objective per repeat: goodput
    (output tokens/s of the requests that met the SLO, engine/replay/slo.py) when the evaluator
    has an SLO, else output tokens/s."""

    samples: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)  # output tokens/s per repeat, every request counted
    slo_attainment: list[float] = field(default_factory=list)  # share of requests that met the SLO, per repeat
    # shares of requests whose first token came late / that streamed slower than the SLO, per repeat
    slo_missed_ttft: list[float] = field(default_factory=list)
    slo_missed_per_user: list[float] = field(default_factory=list)
    per_user_p50: list[float] = field(default_factory=list)  # per-user tokens/s, per repeat
    per_user_p90: list[float] = field(default_factory=list)
    # per-user end-to-end tokens/s (submission to last token, queueing included), p90 per repeat
    e2e_per_user_p90: list[float] = field(default_factory=list)
    ttft_p50: list[float] = field(default_factory=list)  # seconds, per repeat
    ttft_p90: list[float] = field(default_factory=list)
    error: str | None = None  # the candidate failed: crash, NaN, refused by the smoke check, or missed the SLO
    # the error is a measured outcome, not a fault: it ran, and no request of a repeat met the SLO
    # (goodput 0). Counted among the rejected candidates, not the failed ones.
    missed_slo: bool = False
    seconds: float = 0.0  # wall time spent measuring
    noise_floor: float = DEFAULT_NOISE_FLOOR
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.samples) and all(math.isfinite(s) and s > 0 for s in self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def cv(self) -> float:
        """Coefficient of variation of the repeats (0 for fewer than two)."""
        if len(self.samples) < 2 or self.mean == 0:
            return 0.0
        return statistics.stdev(self.samples) / self.mean

    @property
    def low(self) -> float:
        return min(min(self.samples), self.mean * (1 - self.noise_floor)) if self.samples else 0.0

    @property
    def high(self) -> float:
        return max(max(self.samples), self.mean * (1 + self.noise_floor)) if self.samples else 0.0

    def extended(self, more: Measurement) -> Measurement:
        """This measurement with `more`'s repeats appended (the same candidate, tier and request set)."""
        return Measurement(
            samples=self.samples + more.samples, throughput=self.throughput + more.throughput,
            slo_attainment=self.slo_attainment + more.slo_attainment,
            slo_missed_ttft=self.slo_missed_ttft + more.slo_missed_ttft,
            slo_missed_per_user=self.slo_missed_per_user + more.slo_missed_per_user, per_user_p50=self.per_user_p50 + more.per_user_p50,
            per_user_p90=self.per_user_p90 + more.per_user_p90,
            e2e_per_user_p90=self.e2e_per_user_p90 + more.e2e_per_user_p90,
            ttft_p50=self.ttft_p50 + more.ttft_p50, ttft_p90=self.ttft_p90 + more.ttft_p90,
            error=self.error or more.error, missed_slo=self.missed_slo or more.missed_slo,
            seconds=self.seconds + more.seconds, noise_floor=self.noise_floor,
            details=dict(self.details))

    def per_user_p90_mean(self) -> float | None:
        return statistics.fmean(self.per_user_p90) if self.per_user_p90 else None

    def user_speed_p90(self) -> tuple[str, float | None]:
        """The p90 per-user speed the veto judges: end to end (queueing included) where measured,
        else decode-only. Returns (which, tokens/s)."""
        if self.e2e_per_user_p90:
            return "end-to-end", statistics.fmean(self.e2e_per_user_p90)
        return "decode", self.per_user_p90_mean()

    def metrics(self, baseline: "Measurement | None" = None) -> dict[str, Any]:
        """The board form."""
        out: dict[str, Any] = {
            "throughput": self.mean, "low": self.low, "high": self.high, "cv": self.cv,
            "samples": list(self.samples), "seconds": self.seconds,
        }
        for name in ("per_user_p50", "per_user_p90", "e2e_per_user_p90", "ttft_p50", "ttft_p90"):
            values = getattr(self, name)
            if values:
                out[name] = statistics.fmean(values)
        if self.slo_attainment:  # the objective is goodput: say so, and keep the raw throughput
            out["objective"] = "goodput"
            out["output_tokens_per_s"] = statistics.fmean(self.throughput)
            out["slo_attainment"] = statistics.fmean(self.slo_attainment)
            for name in ("slo_missed_ttft", "slo_missed_per_user"):
                values = [v for v in getattr(self, name) if math.isfinite(v)]
                if values:
                    out[name] = statistics.fmean(values)
        if baseline is not None and baseline.ok and self.ok:
            out["speedup"] = self.mean / baseline.mean
        return out

    def record(self, run: Any, slo: Any = None) -> None:
        """One measured replay (engine/replay/driver.py ReplayRun) appended: the objective (goodput
        under `slo`, else output tokens/s) and the latencies. A replay where no request met the SLO
        is a measured outcome, not a crash: the measurement fails as missed_slo."""
        self.throughput.append(run.output_tokens_per_s)
        if slo is not None:
            self.slo_attainment.append(run.slo_attainment)
            self.slo_missed_ttft.append(run.slo_missed_ttft)
            self.slo_missed_per_user.append(run.slo_missed_per_user)
            if not run.goodput_tokens_per_s > 0:
                self.error = (f"no request met the SLO ({slo.describe()}): goodput 0; "
                              "loosen the SLO (--slo-ttft-p90, --slo-per-user-p90)")
                self.missed_slo = True
        self.samples.append(run.output_tokens_per_s if slo is None else run.goodput_tokens_per_s)
        # NaN (a percentile of no values: every request one token long) reads as 0, no per-user data
        for name, value in (("per_user_p50", run.per_user_tokens_per_s_p50),
                            # "p90 per-user speed": the speed that 90% of users get at least (10th percentile)
                            ("per_user_p90", run.per_user_tokens_per_s_p90),
                            ("e2e_per_user_p90", run.per_user_e2e_tokens_per_s_p90),
                            ("ttft_p50", run.ttft_s_p50), ("ttft_p90", run.ttft_s_p90)):
            getattr(self, name).append(0.0 if math.isnan(value) else value)

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any], noise_floor: float = DEFAULT_NOISE_FLOOR) -> "Measurement":
        """Rebuild from a board entry (resume): samples are kept there."""
        m = cls(samples=[float(s) for s in metrics.get("samples") or [metrics["throughput"]]],
                seconds=float(metrics.get("seconds", 0.0)), noise_floor=noise_floor)
        for name in ("per_user_p50", "per_user_p90", "e2e_per_user_p90", "ttft_p50", "ttft_p90"):
            if metrics.get(name) is not None:
                getattr(m, name).append(float(metrics[name]))
        return m


MISSED_SLO = "missed-slo"  # a result's status where no request of a repeat met the SLO


def result_status(m: Measurement) -> str:
    """A result's status on the board: "ok"; MISSED_SLO (it ran, and met the SLO for no request of
    a repeat: rejected by the SLO, like a failed gate); "failed" (crashed, hung, refused, did not build)."""
    if m.ok:
        return "ok"
    return MISSED_SLO if m.missed_slo else "failed"


def beats(candidate: Measurement, incumbent: Measurement) -> bool:
    """True when the candidate is faster beyond the noise: its lower bound > the incumbent's upper bound."""
    return candidate.ok and incumbent.ok and candidate.low - incumbent.high > 0


# Two-sided 95% Student t quantiles by degrees of freedom (n - 1); 1.96 beyond the table.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


# Two-sided 97.5% quantiles, for a second look at a confirmation's pairs (an undecided first
# round, pooled with another): with the first look at 2.5% one-sided and the second at 1.25%,
# the two together accept a no-op at most 3.75% of the time (Bonferroni), not the 5% that two
# uncorrected looks allow.
_T975 = {1: 25.452, 2: 6.205, 3: 4.177, 4: 3.495, 5: 3.163, 6: 2.969, 7: 2.841, 8: 2.752, 9: 2.685,
         10: 2.634, 12: 2.560, 15: 2.490, 20: 2.423, 30: 2.360}


def _t95(dof: int, table: dict[int, float] = _T95) -> float:
    if dof <= 0:
        return math.inf
    known = [d for d in table if d <= dof]
    return table[max(known)] if dof <= 30 else (1.96 if table is _T95 else 2.241)


def paired_gain(candidate: Measurement, incumbent: Measurement, looks: int = 1) -> tuple[float, float, float]:
    """Repeats measured in alternation (candidate_i next to incumbent_i): the per-pair log ratio's
    mean, and its 95% lower and upper bounds, as speed ratios (exp of the log bounds).

    Pairing cancels load changes that hit both members of a pair alike; the spread of the
    ratios is the measured noise. ``looks`` = 2: the bounds of a second look at pooled pairs
    (97.5% two-sided, see _T975).
    """
    pairs = [(c, i) for c, i in zip(candidate.samples, incumbent.samples) if c > 0 and i > 0]
    if not pairs:
        return 0.0, 0.0, 0.0
    logs = [math.log(c / i) for c, i in pairs]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf  # one pair says nothing about the noise
    half = _t95(len(logs) - 1, _T95 if looks <= 1 else _T975) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def beats_paired(candidate: Measurement, incumbent: Measurement, min_gain: float | None = None,
                 looks: int = 1) -> bool:
    """True when the lower 95% bound of the paired speed ratio exceeds 1 + max(noise floor, min_gain)
    (``looks`` = 2: the stricter bound of a second look, see paired_gain)."""
    if not (candidate.ok and incumbent.ok) or len(candidate.samples) != len(incumbent.samples):
        return False
    _, low, _ = paired_gain(candidate, incumbent, looks)
    return low > 1 + max(incumbent.noise_floor, min_gain or 0.0)


def drift_summary(series: list[dict[str, Any]]) -> dict[str, Any]:
    """How far one pass's own figure moved over the run, per tier: of the pass measured most
    often there (the stock pass wins ties), its first, last, lowest and highest mean, last/first
    and highest/lowest. ``series``: {"tier", "digest", "mean", "stock", ...} in time order.
    Paired comparisons cancel this drift; unpaired ones would read it as a gain or a loss."""
    out: dict[str, Any] = {}
    for tier in sorted({e["tier"] for e in series}):
        runs: dict[str, list[dict[str, Any]]] = {}
        for e in series:
            if e["tier"] == tier:
                runs.setdefault(e["digest"], []).append(e)
        digest, points = max(runs.items(), key=lambda kv: (len(kv[1]), kv[1][0].get("stock", False)))
        means = [p["mean"] for p in points]
        out[tier] = {"digest": digest, "stock": bool(points[0].get("stock")), "measurements": len(means),
                     "first": means[0], "last": means[-1], "low": min(means), "high": max(means),
                     "last_over_first": means[-1] / means[0] if means[0] else None,
                     "high_over_low": max(means) / min(means) if min(means) else None,
                     "elapsed_s": [p.get("elapsed_s") for p in points]}
    return out


def per_user_not_worse(candidate: Measurement, incumbent: Measurement) -> bool:
    """Per-user p90 speed at least the incumbent's, within the incumbent's noise (absent data: no veto).

    Judged end to end (output tokens over submission to last token) when both measured it: the
    replay runs the traffic's concurrency, so with a narrow batch some requests queue, and a
    decode-only speed would credit the narrow batch with the fast decoding of those it admitted
    while ignoring the ones waiting. A wider batch that decodes each row slower but lets nobody
    wait is then judged by what users get.
    """
    kind_c, cand = candidate.user_speed_p90()
    kind_i, inc = incumbent.user_speed_p90()
    if kind_c != kind_i:
        cand, inc = candidate.per_user_p90_mean(), incumbent.per_user_p90_mean()
    if cand is None or inc is None:
        return True
    tolerance = max(incumbent.noise_floor, incumbent.cv)
    return cand >= inc * (1 - tolerance)


@dataclass
class Verification:
    passed: bool
    gates: dict[str, bool] = field(default_factory=dict)  # gate name -> passed
    report: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def failed_gates(self) -> list[str]:
        return [name for name, ok in self.gates.items() if not ok]


@runtime_checkable
class Evaluator(Protocol):
    """Measures and verifies candidates on real hardware (see engine/compile/evaluator.py)."""

    def screen(self, candidate: Candidate) -> Measurement: ...

    def confirm(self, candidate: Candidate) -> Measurement: ...

    def verify(self, candidate: Candidate) -> Verification: ...

    def export(self, candidate: Candidate, out_dir: Path) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...
