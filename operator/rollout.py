"""Rollout of a verified forward pass: a pure state machine, one step per observation.

Data flow (one step, driven by a timer of the InferenceDeployment):

    RolloutPolicy        (spec.rollout: strategy, canary size, analysis window, allowed regression)
    RolloutState         (persisted in status.rollout between steps)
    target               (the ForwardPass to run: the verified champion or spec.forwardPass)
    active               (what the deployment ran before; status.activeForwardPass)
    pods                 (name, ready, what each engine reports running, and a load it refused)
    analysis             (canary vs the rest from Prometheus over the analysis window, or None)
        --step(...)--> RolloutState (next)
        --desired_per_pod(state, pods)--> {pod: forward pass}
        --pod_annotations(forward pass)--> the shapeshift.dev/forward-pass* annotations of
          engine/contracts/pod_annotations.py, merge-patched onto each pod (HotReload); the engine reads
          them through the downward API, fetches the bundle, checks the sha256, hot-reloads
          and reports shapeshift_forward_pass_info{name, sha256}
        --template_forward_pass(state)--> forward pass for the pod template (Restart)

Phases (HotReload):

    Idle/Complete/RolledBack --target differs--> Canary: the first `canary_replicas` ready pods
        (by name) are told to load the target; the others keep the previous one
    Canary --every canary pod reports the target--> Analyzing (the window starts)
    Canary --a canary pod still not on the target after the load timeout--> RolledBack
    Canary --a canary pod refused the target (digest mismatch, invalid bundle)--> RolledBack
    Canary/Analyzing --a canary pod gone or no longer ready--> RolledBack (a canary that stopped
        serving is not judged on the traffic it served before it stopped)
    Analyzing --window over, canary within the allowed regression--> Promoting: every pod
    Analyzing --window over, canary regressed--> RolledBack: canary pods back to the previous one
    Analyzing --no canary traffic for 3 windows--> RolledBack (never promote on no evidence)
    Promoting --every ready pod reports the target--> Complete (the target becomes active)

Restart skips canary and analysis: the pod template names the target (Kubernetes
rolls the pods) and the phase is Promoting until every ready pod reports it.

A target that was rolled back is not retried until the target changes. Every
function here is pure: no clock, no I/O. Regressions: p90 latency and tokens/s
relative to the non-canary pods, error rate as an absolute increase of the share
of failed requests (relative change of a near-zero rate means nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Literal

__all__ = [
    "CanaryAnalysis",
    "ForwardPassIdentity",
    "PodView",
    "RolloutPolicy",
    "RolloutState",
    "ServingMetrics",
    "desired_per_pod",
    "judge",
    "pod_annotations",
    "step",
    "template_forward_pass",
]

Phase = Literal["Idle", "Canary", "Analyzing", "Promoting", "Complete", "RolledBack", "Failed"]
SETTLED: tuple[Phase, ...] = ("Idle", "Complete", "RolledBack", "Failed")
NO_TRAFFIC_WINDOWS = 3  # analysis windows without canary traffic before giving up


@dataclass(frozen=True)
class ForwardPassIdentity:
    name: str
    sha256: str | None  # None only for the stock forward pass before it reported its hash
    artifact: str | None = field(default=None, compare=False)  # where the bundle lives (ForwardPass spec)

    def matches(self, other: "ForwardPassIdentity | None") -> bool:
        """Same forward pass: same name, and the same sha256 whenever both sides know it."""
        if other is None or other.name != self.name:
            return False
        return self.sha256 is None or other.sha256 is None or self.sha256 == other.sha256


@dataclass(frozen=True)
class PodView:
    name: str
    ready: bool
    running: ForwardPassIdentity | None  # what the engine in the pod reports; None: not reported yet
    # Why the engine refused the forward pass it was asked for during this rollout phase
    # (e.g. "digest_mismatch"); None: no refusal seen. Fetch errors are not refusals: they
    # may pass, and the load timeout covers them.
    load_refused: str | None = None


@dataclass(frozen=True)
class RolloutPolicy:
    """spec.rollout as the state machine reads it (operator/rollout_tick.py maps the spec)."""

    strategy: Literal["HotReload", "Restart"] = "HotReload"
    canary_replicas: int = 1
    analysis_window: timedelta = timedelta(minutes=5)
    allowed_regression: float = 0.05
    load_timeout: timedelta = timedelta(minutes=10)  # canary pods must report the target within this

    def __post_init__(self) -> None:
        if self.canary_replicas < 0:
            raise ValueError(f"canary_replicas must be >= 0, got {self.canary_replicas}")
        if self.analysis_window <= timedelta(0):
            raise ValueError(f"analysis_window must be positive, got {self.analysis_window}")
        if not 0 <= self.allowed_regression <= 1:
            raise ValueError(f"allowed_regression must be in [0, 1], got {self.allowed_regression}")


@dataclass(frozen=True)
class RolloutState:
    phase: Phase = "Idle"
    desired: ForwardPassIdentity | None = None  # the target of the current or last rollout
    previous: ForwardPassIdentity | None = None  # what to roll back to
    canary_pods: tuple[str, ...] = ()
    started_at: datetime | None = None  # when the rollout started
    phase_since: datetime | None = None  # when the current phase started
    message: str = ""


@dataclass(frozen=True)
class ServingMetrics:
    """One group of pods over the analysis window (from Prometheus, by forward-pass label)."""

    requests: float
    p90_latency_seconds: float | None  # e.g. inter-token or e2e latency p90; None without requests
    error_rate: float  # share of requests that failed
    tokens_per_second: float  # generated tokens per second per pod


@dataclass(frozen=True)
class CanaryAnalysis:
    canary: ServingMetrics
    baseline: ServingMetrics  # the pods still on the previous forward pass
    min_requests: float = 20
    # Latency differences smaller than this are noise, whatever their relative size: a p90
    # interpolated inside millisecond-wide histogram buckets cannot resolve less.
    latency_resolution_seconds: float = 0.0


@dataclass(frozen=True)
class Verdict:
    promote: bool | None  # None: not enough canary traffic to judge
    reasons: tuple[str, ...]


def judge(analysis: CanaryAnalysis, allowed_regression: float) -> Verdict:
    """Promote unless the canary regressed beyond ``allowed_regression`` in any signal."""
    canary, base = analysis.canary, analysis.baseline
    if canary.requests < analysis.min_requests or canary.p90_latency_seconds is None:
        return Verdict(None, (f"{canary.requests:.0f} canary requests, need {analysis.min_requests:.0f}",))
    reasons: list[str] = []
    if base.p90_latency_seconds:
        change = canary.p90_latency_seconds / base.p90_latency_seconds - 1
        delta = canary.p90_latency_seconds - base.p90_latency_seconds
        if change > allowed_regression and delta > analysis.latency_resolution_seconds:
            reasons.append(f"p90 latency {base.p90_latency_seconds * 1000:.1f} ms -> "
                           f"{canary.p90_latency_seconds * 1000:.1f} ms ({change:+.0%})")
    if canary.error_rate - base.error_rate > allowed_regression:
        reasons.append(f"error rate {base.error_rate:.1%} -> {canary.error_rate:.1%}")
    if base.tokens_per_second > 0:
        change = canary.tokens_per_second / base.tokens_per_second - 1
        if change < -allowed_regression:
            reasons.append(f"tokens/s {base.tokens_per_second:.1f} -> {canary.tokens_per_second:.1f} ({change:+.0%})")
    return Verdict(not reasons, tuple(reasons))


def _start(policy: RolloutPolicy, state: RolloutState, target: ForwardPassIdentity,
           active: ForwardPassIdentity | None, pods: list[PodView], now: datetime) -> RolloutState:
    base = RolloutState(desired=target, previous=active, started_at=now, phase_since=now)
    if policy.strategy == "Restart" or policy.canary_replicas == 0:
        return replace(base, phase="Promoting",
                       message=f"rolling {target.name} out to every pod ({policy.strategy})")
    ready = sorted(p.name for p in pods if p.ready)
    canary = tuple(ready[: policy.canary_replicas])
    if not canary:
        return replace(state, message=f"waiting for a ready pod to canary {target.name} on")
    return replace(base, phase="Canary", canary_pods=canary,
                   message=f"canary {', '.join(canary)} loading {target.name}")


def step(
    *,
    policy: RolloutPolicy,
    state: RolloutState,
    target: ForwardPassIdentity | None,
    active: ForwardPassIdentity | None,
    pods: list[PodView],
    analysis: CanaryAnalysis | None,
    now: datetime,
) -> RolloutState:
    """The next state. Call it on every observation; it is idempotent when nothing changed."""
    by_name = {p.name: p for p in pods}

    if state.phase in SETTLED:
        if target is None or target.matches(active):
            return state
        if state.phase in ("Complete", "RolledBack", "Failed") and target.matches(state.desired):
            # Complete: already rolled out (status.activeForwardPass may lag one step behind).
            # RolledBack/Failed: this target already failed here; wait for a new one.
            return state
        return _start(policy, state, target, active, pods, now)

    if target is not None and state.desired is not None and not target.matches(state.desired):
        # A newer champion arrived mid-rollout: start over from what is active.
        return _start(policy, state, target, active, pods, now)
    assert state.desired is not None

    if state.phase in ("Canary", "Analyzing"):
        stopped = [name for name in state.canary_pods if by_name.get(name) is None or not by_name[name].ready]
        if stopped:
            return _rolled_back(state, now, f"canary {', '.join(stopped)} stopped serving {state.desired.name} "
                                            "(pod gone or not ready)")

    if state.phase == "Canary":
        canary = [by_name.get(name) for name in state.canary_pods]
        if all(p is not None and p.ready and state.desired.matches(p.running) for p in canary):
            return replace(state, phase="Analyzing", phase_since=now,
                           message=f"canary runs {state.desired.name}; analysing for "
                                   f"{int(policy.analysis_window.total_seconds())} s")
        refused = [f"{p.name} ({p.load_refused})" for p in canary
                   if p is not None and p.load_refused and not state.desired.matches(p.running)]
        if refused:
            return _rolled_back(state, now, f"canary {', '.join(refused)} refused {state.desired.name}")
        if state.phase_since is not None and now - state.phase_since >= policy.load_timeout:
            late = [name for name, p in zip(state.canary_pods, canary)
                    if p is None or not state.desired.matches(p.running)]
            return _rolled_back(state, now, f"canary {', '.join(late)} did not report {state.desired.name} "
                                            f"within {int(policy.load_timeout.total_seconds())} s")
        return state

    if state.phase == "Analyzing":
        since = state.phase_since or now
        if now - since < policy.analysis_window or analysis is None:
            return state
        verdict = judge(analysis, policy.allowed_regression)
        if verdict.promote is None:
            if now - since >= policy.analysis_window * NO_TRAFFIC_WINDOWS:
                return _rolled_back(state, now, f"no evidence to promote on: {verdict.reasons[0]}")
            return replace(state, message=f"analysis waits for traffic: {verdict.reasons[0]}")
        if not verdict.promote:
            return _rolled_back(state, now, "canary regressed: " + "; ".join(verdict.reasons))
        return replace(state, phase="Promoting", phase_since=now,
                       message=f"canary within {policy.allowed_regression:.0%}; promoting {state.desired.name}")

    if state.phase == "Promoting":
        ready = [p for p in pods if p.ready]
        if ready and all(state.desired.matches(p.running) for p in ready):
            return replace(state, phase="Complete", phase_since=now,
                           message=f"all {len(ready)} ready pods run {state.desired.name}")
        return state

    raise AssertionError(f"unknown rollout phase {state.phase!r}")


def _rolled_back(state: RolloutState, now: datetime, why: str) -> RolloutState:
    return replace(state, phase="RolledBack", phase_since=now,
                   message=f"rolled back to {state.previous.name if state.previous else 'stock'}: "
                           f"{why}")


def desired_per_pod(state: RolloutState, pods: list[PodView],
                    active: ForwardPassIdentity | None) -> dict[str, ForwardPassIdentity | None]:
    """What each pod should run now (HotReload). None: leave the pod on what it runs."""
    previous = state.previous or active
    out: dict[str, ForwardPassIdentity | None] = {}
    for pod in pods:
        if state.phase in ("Canary", "Analyzing"):
            out[pod.name] = state.desired if pod.name in state.canary_pods else previous
        elif state.phase in ("Promoting", "Complete"):
            out[pod.name] = state.desired
        elif state.phase in ("RolledBack", "Failed"):
            out[pod.name] = previous
        else:
            out[pod.name] = active
    return out


def template_forward_pass(state: RolloutState,
                          active: ForwardPassIdentity | None) -> ForwardPassIdentity | None:
    """What the pod template should name (Restart, and new pods under HotReload)."""
    if state.phase in ("Promoting", "Complete"):
        return state.desired
    return state.previous or active


def pod_annotations(desired: ForwardPassIdentity | None) -> dict[str, str | None]:
    """The pod annotations that ask the engine for ``desired`` (a merge patch: None removes).

    None or the stock pass removes all three, which the engine reads as "run stock".
    """
    from shapeshift.engine.contracts.pod_annotations import (
        ROLLOUT_ANNOTATIONS,
        STOCK_FORWARD_PASS,
        DesiredForwardPass,
    )

    if desired is None or (desired.name == STOCK_FORWARD_PASS and not desired.artifact):
        return {key: None for key in ROLLOUT_ANNOTATIONS}
    wanted = DesiredForwardPass(name=desired.name, sha256=desired.sha256 or "", artifact=desired.artifact or "")
    problems = wanted.problems()
    if problems:
        raise ValueError(f"cannot ask pods for forward pass {desired.name!r}: {'; '.join(problems)}")
    annotations = wanted.to_annotations()
    return {key: annotations.get(key) or None for key in ROLLOUT_ANNOTATIONS}
