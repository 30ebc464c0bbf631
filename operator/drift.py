"""Drift decisions: should this deployment compile a new forward pass now?

Data flow (one check of the drift timer):

    observed TrafficProfile + data quality   (operator.prometheus, or the error it raised)
    baseline TrafficProfile                   (what the active forward pass was compiled for)
    DriftPolicy                               (thresholds, checks, cooldown from the spec)
    DriftState                                (carried in the deployment's status between checks)
    active CompileRun name, if any
        --> decide(...) --> (Decision, next DriftState)

Everything here is pure: no clock (``now`` is an argument), no I/O, no cluster.
``operator/drift_check.py`` turns the decision into status, a condition and,
under policy ``OnDrift``, a CompileRun; ``operator/handlers/drift.py`` is the
timer that applies them.

The decision is one of:

- ``NoData``: nothing trustworthy to compare (Prometheus unreachable, no
  traffic in the window, too few requests, no baseline). Never compiles; the
  consecutive-check counter restarts, because a gap breaks "persisting".
- ``Stable``: every dimension within its threshold.
- ``Drifting``: over a threshold for ``consecutive`` of ``required`` checks.
- ``CompileInProgress``: drifting, but a CompileRun of this deployment is
  still active (at most one at a time).
- ``CoolingDown``: drifting long enough, but the last compile started less
  than the cooldown ago.
- ``Compile``: drifting long enough, nothing running, cooldown over: create a
  CompileRun carrying ``snapshot`` (the observed profile that triggered it).

Every decision that compared something carries ``dimensions`` (each
quantile and the hit rate, with baseline, observed, change and threshold) and
two summaries: ``score``, the larger of the largest relative prompt-length
change and the absolute hit-rate change (``TrafficProfile.drift().score``, what
``status.drift.score`` shows), and ``severity``, the largest change divided by
its threshold, so ``1.0`` means "exactly at a threshold" whatever the dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal, Union

from shapeshift.engine.contracts.traffic_profile import TrafficProfile

__all__ = [
    "Comparison",
    "Compile",
    "CompileInProgress",
    "CoolingDown",
    "Decision",
    "DimensionDrift",
    "DriftPolicy",
    "DriftState",
    "Drifting",
    "NoData",
    "NoDataReason",
    "Observation",
    "Stable",
    "compare",
    "describe",
    "decide",
]

QUANTILE_KEYS = ("p50", "p90", "p99")

NoDataReason = Literal["PrometheusUnreachable", "PrometheusAnswerMalformed", "OutboundRefused", "TrafficQueryFailed",
                       "NoTraffic", "TooFewRequests", "NoBaseline"]


@dataclass(frozen=True)
class DriftPolicy:
    """Thresholds and pacing, taken from ``InferenceDeployment.spec``.

    A threshold of ``None`` switches that dimension off.
    """

    prompt_length_relative: float | None = 0.25  # |observed - baseline| / baseline of any prompt quantile
    output_length_relative: float | None = None  # same for output lengths; off unless asked for
    prefix_cache_hit_rate_absolute: float | None = 0.15  # |observed - baseline| of the hit rate
    consecutive_checks: int = 2  # checks in a row over a threshold before acting
    cooldown: timedelta = timedelta(minutes=30)  # from one compile's start to the next
    min_requests: int = 20  # fewer requests in the window than this is not evidence

    def __post_init__(self) -> None:
        for name in ("prompt_length_relative", "output_length_relative", "prefix_cache_hit_rate_absolute"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"drift threshold {name} must be a positive number or None, got {value!r}")
        if self.prefix_cache_hit_rate_absolute is not None and self.prefix_cache_hit_rate_absolute > 1:
            raise ValueError(
                "drift threshold prefix_cache_hit_rate_absolute is an absolute change of a rate in [0, 1]; "
                f"got {self.prefix_cache_hit_rate_absolute}"
            )
        if self.consecutive_checks < 1:
            raise ValueError(f"consecutive_checks must be >= 1, got {self.consecutive_checks}")
        if self.cooldown < timedelta(0):
            raise ValueError(f"cooldown must not be negative, got {self.cooldown}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be >= 1, got {self.min_requests}")


@dataclass(frozen=True)
class DriftState:
    """What one check hands to the next (persisted in the deployment's status)."""

    consecutive: int = 0  # checks in a row over a threshold
    last_compile_at: datetime | None = None  # when the last drift-triggered CompileRun was created


@dataclass(frozen=True)
class Observation:
    """An observed profile and how much it can be trusted."""

    profile: TrafficProfile
    requests: float  # requests counted in the window (from Prometheus increase(), so may be fractional)


@dataclass(frozen=True)
class DimensionDrift:
    """One compared dimension: ``change`` is relative for lengths, absolute for the hit rate."""

    name: str  # e.g. "promptLength.p90", "prefixCacheHitRate"
    baseline: float
    observed: float
    change: float
    threshold: float | None  # None: this dimension is reported but not acted on

    @property
    def ratio(self) -> float:
        """|change| / threshold; 0 for a dimension without a threshold."""
        if self.threshold is None:
            return 0.0
        return abs(self.change) / self.threshold

    @property
    def exceeded(self) -> bool:
        return self.threshold is not None and abs(self.change) > self.threshold


@dataclass(frozen=True)
class Comparison:
    """Every compared dimension with the two summaries (see the module docstring)."""

    score: float
    severity: float
    dimensions: tuple[DimensionDrift, ...]

    @property
    def exceeded(self) -> tuple[DimensionDrift, ...]:
        return tuple(d for d in self.dimensions if d.exceeded)


@dataclass(frozen=True)
class NoData:
    reason: NoDataReason
    message: str
    kind: Literal["NoData"] = "NoData"


@dataclass(frozen=True)
class Stable:
    score: float
    severity: float
    dimensions: tuple[DimensionDrift, ...]
    kind: Literal["Stable"] = "Stable"


@dataclass(frozen=True)
class Drifting:
    score: float
    severity: float
    dimensions: tuple[DimensionDrift, ...]
    consecutive: int
    required: int
    kind: Literal["Drifting"] = "Drifting"


@dataclass(frozen=True)
class CompileInProgress:
    score: float
    severity: float
    dimensions: tuple[DimensionDrift, ...]
    compile_run: str
    kind: Literal["CompileInProgress"] = "CompileInProgress"


@dataclass(frozen=True)
class CoolingDown:
    score: float
    severity: float
    dimensions: tuple[DimensionDrift, ...]
    until: datetime
    kind: Literal["CoolingDown"] = "CoolingDown"


@dataclass(frozen=True)
class Compile:
    score: float
    severity: float
    dimensions: tuple[DimensionDrift, ...]
    reason: str  # one line for the CompileRun and the event, e.g. "promptLength.p90 +180% (threshold 25%)"
    snapshot: TrafficProfile  # the observed traffic that triggered it
    kind: Literal["Compile"] = "Compile"


Decision = Union[NoData, Stable, Drifting, CompileInProgress, CoolingDown, Compile]


def compare(baseline: TrafficProfile, observed: TrafficProfile, policy: DriftPolicy) -> Comparison:
    """Per-dimension drift of ``observed`` against ``baseline`` under ``policy``'s thresholds."""
    report = baseline.drift(observed)
    dims: list[DimensionDrift] = []
    for prefix, dist_b, dist_o, changes, threshold in (
        ("promptLength", baseline.prompt_length, observed.prompt_length,
         report.prompt_length_relative_change, policy.prompt_length_relative),
        ("outputLength", baseline.output_length, observed.output_length,
         report.output_length_relative_change, policy.output_length_relative),
    ):
        for key in QUANTILE_KEYS:
            dims.append(DimensionDrift(
                name=f"{prefix}.{key}",
                baseline=float(getattr(dist_b, key)),
                observed=float(getattr(dist_o, key)),
                change=float(changes[key]),
                threshold=threshold,
            ))
    if report.prefix_cache_hit_rate_change is not None:
        dims.append(DimensionDrift(
            name="prefixCacheHitRate",
            baseline=float(baseline.prefix_cache_hit_rate),  # type: ignore[arg-type]
            observed=float(observed.prefix_cache_hit_rate),  # type: ignore[arg-type]
            change=float(report.prefix_cache_hit_rate_change),
            threshold=policy.prefix_cache_hit_rate_absolute,
        ))
    severity = max((d.ratio for d in dims), default=0.0)
    return Comparison(score=report.score, severity=severity, dimensions=tuple(dims))


def describe(dimension: DimensionDrift) -> str:
    """``promptLength.p90 512 -> 1434 (+180%, threshold 25%)``; the hit rate in points."""
    if dimension.name == "prefixCacheHitRate":
        thr = "" if dimension.threshold is None else f", threshold {dimension.threshold:.2f}"
        return (f"{dimension.name} {dimension.baseline:.2f} -> {dimension.observed:.2f} "
                f"({dimension.change:+.2f}{thr})")
    thr = "" if dimension.threshold is None else f", threshold {dimension.threshold:.0%}"
    return (f"{dimension.name} {dimension.baseline:g} -> {dimension.observed:g} "
            f"({dimension.change:+.0%}{thr})")


def decide(
    *,
    observation: Observation | None,
    baseline: TrafficProfile | None,
    policy: DriftPolicy,
    state: DriftState,
    active_compile_run: str | None,
    now: datetime,
    no_data: NoData | None = None,
) -> tuple[Decision, DriftState]:
    """One drift check. Returns the decision and the state for the next check.

    ``observation`` is None when Prometheus gave nothing usable; ``no_data``
    then says why (default: ``NoTraffic``).
    """
    if observation is None:
        return (no_data or NoData("NoTraffic", "no traffic observed in the window")), replace(state, consecutive=0)
    if observation.requests < policy.min_requests:
        return (
            NoData("TooFewRequests",
                   f"{observation.requests:.0f} requests in the window, fewer than the {policy.min_requests} "
                   "needed to judge drift; waiting for more traffic"),
            replace(state, consecutive=0),
        )
    if baseline is None:
        return (
            NoData("NoBaseline",
                   "no traffic profile to compare with: the active forward pass records none and the spec "
                   "names none; set spec.traffic or compile once (policy Manual) to set a baseline"),
            replace(state, consecutive=0),
        )

    compared = compare(baseline, observation.profile, policy)
    over = compared.exceeded
    if not over:
        return Stable(compared.score, compared.severity, compared.dimensions), replace(state, consecutive=0)

    # Count up to `required` and stay there: once drift has persisted long
    # enough, it stays "long enough" while we wait on a run or the cooldown.
    consecutive = min(state.consecutive + 1, policy.consecutive_checks)
    counted = replace(state, consecutive=consecutive)
    if consecutive < policy.consecutive_checks:
        return Drifting(compared.score, compared.severity, compared.dimensions, consecutive, policy.consecutive_checks), counted
    if active_compile_run is not None:
        return CompileInProgress(compared.score, compared.severity, compared.dimensions, active_compile_run), counted
    if state.last_compile_at is not None and now < state.last_compile_at + policy.cooldown:
        return CoolingDown(compared.score, compared.severity, compared.dimensions, state.last_compile_at + policy.cooldown), counted

    reason = "; ".join(describe(d) for d in sorted(over, key=lambda d: -d.ratio))
    snapshot = observation.profile
    return (
        Compile(compared.score, compared.severity, compared.dimensions, reason, snapshot),
        DriftState(consecutive=0, last_compile_at=now),
    )

