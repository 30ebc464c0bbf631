"""One drift check of one InferenceDeployment, without I/O: spec, status and observed traffic in,
the status to write and the CompileRun to create out.

    spec, status  --policy_from_spec / baseline_for / state_from_status-->  DriftPolicy, baseline, DriftState
    observe() (Prometheus, called once) --> ObservedTraffic | TrafficQueryError
    active CompileRun of the deployment (active_compile_run over the listed CompileRuns)
        --run_check (drift.decide)--> CheckResult(decision, next state, observed)
        --drift_status_update--> status.observedTraffic, status.drift, conditions TrafficObserved + Drifted
        --decision Compile and policy OnDrift--> build_drift_compile_run --> CompileRun owned by the
          deployment, spec.traffic.inline = the snapshot, spec.trigger = Drift + score,
          spec.budget = spec.compilation.budget, plus the fields set in spec.compilation.template
    the regime library (status.regimes, status.currentRegime; operator/regimes.py), when given:
        --regimes.decide--> a RegimeDecision: a switch to a known regime's verified champion
          instead of a CompileRun, no CompileRun before the traffic settled in a regime or while
          its champion is served, a CompileRun for a new regime (recorded as the regime's); the
          condition Regime and the library in status
    check_drift(...) composes these into a DriftCheck, which operator/handlers/drift.py applies.

A check that changes nothing but the check time (the usual case of a deployment whose
Prometheus stays unreachable, or one without traffic) has DriftCheck.write False, so
resyncs of idle deployments do not churn their resourceVersion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping

from shapeshift.engine.contracts.traffic_profile import TrafficProfile, builtin_profile
from shapeshift.operator.api import (
    API_VERSION,
    COMPILE_RUN,
    GROUP,
    Condition,
    DriftThresholds,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)
from shapeshift.operator.builders import LABEL_DEPLOYMENT, MANAGED_BY, Parent
from shapeshift.operator.drift import (
    Compile,
    CompileInProgress,
    CoolingDown,
    Decision,
    Drifting,
    DriftPolicy,
    DriftState,
    NoData,
    Observation,
    Stable,
    decide,
)
from shapeshift.operator.prometheus import ObservedTraffic, SeriesSelector, TrafficQueryError
from shapeshift.operator.regimes import (RegimeDecision, RegimeLibrary, decide as decide_regime, record_compile_run,
                                         record_rollback)
from shapeshift.operator.settings import OperatorSettings
from shapeshift.operator.status import StatusUpdate

__all__ = [
    "CheckResult",
    "DriftCheck",
    "active_compile_run",
    "baseline_for",
    "build_drift_compile_run",
    "check_drift",
    "drift_compile_run_name",
    "drift_status_update",
    "only_check_time_changed",
    "policy_from_spec",
    "run_check",
    "selector_for",
    "state_from_status",
    "thresholds_of",
]

CONDITION_TRAFFIC = "TrafficObserved"
CONDITION_DRIFT = "Drifted"
CONDITION_REGIME = "Regime"
REGIME_REASONS = {"Stay": "InRegime", "Settling": "Settling", "Switch": "SwitchedToChampion",
                  "Compile": "CompileNeeded", "CoolingDown": "SwitchCoolingDown", "Pinned": "Pinned",
                  "Uneconomic": "PaybackTooLong"}
REGIME_ANNOTATION = f"{GROUP}/regime"
FINISHED_PHASES = ("Succeeded", "Failed")
# NoData reasons about the traffic (the TrafficQueryError reasons, and too little of it)
TRAFFIC_REASONS = ("PrometheusUnreachable", "PrometheusAnswerMalformed", "OutboundRefused", "TrafficQueryFailed",
                   "NoTraffic", "TooFewRequests")
MANUAL_POLICY_NOTE = "policy Manual: create a CompileRun to act on it, or set spec.compilation.policy OnDrift"


@dataclass(frozen=True)
class CheckResult:
    decision: Decision
    state: DriftState
    observed: ObservedTraffic | None


def thresholds_of(spec: InferenceDeploymentSpec) -> DriftThresholds:
    """The spec's thresholds; a Manual deployment without them is still observed with the defaults."""
    return spec.compilation.drift or DriftThresholds()


def policy_from_spec(spec: InferenceDeploymentSpec, settings: OperatorSettings) -> DriftPolicy:
    t = thresholds_of(spec)
    return DriftPolicy(
        prompt_length_relative=t.prompt_length_relative_change,
        prefix_cache_hit_rate_absolute=t.prefix_hit_rate_absolute_change,
        consecutive_checks=t.consecutive_checks,
        cooldown=timedelta(seconds=spec.compilation.cooldown_seconds),
        min_requests=settings.drift_min_requests,
    )


def selector_for(namespace: str, name: str, spec: InferenceDeploymentSpec, settings: OperatorSettings) -> SeriesSelector:
    return SeriesSelector(
        namespace=namespace, deployment=name, model=spec.model.display_name,
        namespace_label=settings.prometheus_namespace_label,
        deployment_label=settings.prometheus_deployment_label,
    )


def baseline_for(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus) -> TrafficProfile | None:
    """What the active forward pass was compiled for; before any compile, the spec's assumed profile."""
    if status.compiled_for is not None:
        return status.compiled_for
    if spec.traffic_profile is not None:
        return builtin_profile(spec.traffic_profile)
    return None


def state_from_status(status: InferenceDeploymentStatus) -> DriftState:
    return DriftState(
        consecutive=status.drift.consecutive_checks if status.drift else 0,
        last_compile_at=status.last_compile_time,
    )


def run_check(
    *,
    observe: Callable[[], ObservedTraffic],
    baseline: TrafficProfile | None,
    policy: DriftPolicy,
    state: DriftState,
    active_compile_run: str | None,
    now: datetime,
) -> CheckResult:
    """One check: call ``observe`` (Prometheus), then decide. Query errors become NoData."""
    try:
        observed = observe()
    except TrafficQueryError as err:
        no_data = NoData(err.reason, str(err))  # type: ignore[arg-type]
        decision, next_state = decide(observation=None, baseline=baseline, policy=policy, state=state,
                                      active_compile_run=active_compile_run, now=now, no_data=no_data)
        return CheckResult(decision, next_state, None)
    decision, next_state = decide(
        observation=Observation(observed.profile, observed.quality.requests), baseline=baseline, policy=policy,
        state=state, active_compile_run=active_compile_run, now=now,
    )
    return CheckResult(decision, next_state, observed)


def _drift_message(decision: Decision) -> tuple[str, str, str]:
    """(status, reason, message) of the Drifted condition."""
    if isinstance(decision, NoData):
        return "Unknown", decision.reason, decision.message
    over = "; ".join(f"{d.name} {d.change:+.2f}" for d in decision.dimensions if d.exceeded)
    if isinstance(decision, Stable):
        return "False", "WithinThresholds", f"traffic within thresholds (severity {decision.severity:.2f} of 1)"
    if isinstance(decision, Drifting):
        return "True", "Drifting", (f"over a threshold for {decision.consecutive} of {decision.required} "
                                    f"consecutive checks: {over}")
    if isinstance(decision, CompileInProgress):
        return "True", "CompileInProgress", f"drift persists; CompileRun {decision.compile_run} is still running: {over}"
    if isinstance(decision, CoolingDown):
        return "True", "CoolingDown", (f"drift persists; next automatic CompileRun allowed after "
                                       f"{decision.until.isoformat()}: {over}")
    assert isinstance(decision, Compile)
    return "True", "DriftPersisted", decision.reason


def drift_status_update(
    result: CheckResult,
    status: InferenceDeploymentStatus,
    *,
    now: datetime,
    compile_run: str | None = None,
    compile_blocked: str | None = None,
) -> StatusUpdate:
    """The status fields and conditions one check writes (camelCase wire names).

    ``compile_run``: the CompileRun created by this check. ``compile_blocked``:
    why a Compile decision created nothing (policy Manual).
    """
    decision = result.decision
    fields: dict[str, Any] = {}
    conditions: list[tuple[str, Any, str, str]] = []
    if result.observed is not None:
        fields["observedTraffic"] = result.observed.profile.to_dict()
        q = result.observed.quality
        conditions.append((CONDITION_TRAFFIC, "True", "Observed",
                           f"{q.requests:.0f} requests from {q.targets} target(s) over {q.window_seconds}s"))
    elif isinstance(decision, NoData) and decision.reason in TRAFFIC_REASONS:
        conditions.append((CONDITION_TRAFFIC, "False", decision.reason, decision.message))

    status_value, reason, message = _drift_message(decision)
    if isinstance(decision, Compile):
        if compile_run is not None:
            reason, message = "CompileRunCreated", f"created CompileRun {compile_run}: {decision.reason}"
        elif compile_blocked is not None:
            message = f"{decision.reason} ({compile_blocked})"
    conditions.append((CONDITION_DRIFT, status_value, reason, message))

    # Missing data keeps the last score and changes on display (with their check time);
    # only the counter, the check time and `exceeded` say that this check judged nothing.
    drift: dict[str, Any] = status.drift.to_wire() if status.drift else {}
    drift.update({"consecutiveChecks": result.state.consecutive, "lastCheckTime": _iso(now)})
    if isinstance(decision, NoData):
        drift.pop("exceeded", None)
    else:
        by_name = {d.name: d for d in decision.dimensions}
        drift.update({
            "score": round(decision.score, 6),
            "promptLengthRelativeChange": {
                key: round(by_name[f"promptLength.{key}"].change, 6) for key in ("p50", "p90", "p99")},
            "exceeded": any(d.exceeded for d in decision.dimensions),
        })
        hit = by_name.get("prefixCacheHitRate")
        if hit is None:
            drift.pop("prefixCacheHitRateChange", None)
        else:
            drift["prefixCacheHitRateChange"] = round(hit.change, 6)
    fields["drift"] = drift
    if compile_run is not None:
        fields["lastCompileRun"] = compile_run
        fields["lastCompileTime"] = _iso(now)
    return StatusUpdate(fields=fields, conditions=conditions)


def drift_compile_run_name(deployment: str, now: datetime) -> str:
    """``<deployment>-drift-<yymmddHHMMSS>``: deterministic per check, within the CompileRun name limit."""
    return f"{deployment[:30].rstrip('-')}-drift-{now.astimezone(timezone.utc):%y%m%d%H%M%S}"


def build_drift_compile_run(parent: Parent, spec: InferenceDeploymentSpec, decision: Compile,
                            now: datetime, regime: str | None = None) -> dict[str, Any]:
    """A CompileRun owned by the deployment, carrying the traffic that triggered it.

    Its budget is ``spec.compilation.budget``; the fields set in ``spec.compilation.template``
    (agents, tiers, verification, baseline, hardware, image, backoffLimit, slo) are copied as they
    are, and the fields left out of the template stay out of the run, so the CompileRun's
    defaults apply to them.
    """
    template = spec.compilation.template.to_wire() if spec.compilation.template else {}
    return {
        "apiVersion": API_VERSION,
        "kind": COMPILE_RUN.kind,
        "metadata": {
            "name": drift_compile_run_name(parent.name, now),
            "namespace": parent.namespace,
            "labels": {**MANAGED_BY, LABEL_DEPLOYMENT: parent.name, f"{GROUP}/trigger": "drift"},
            "annotations": {f"{GROUP}/drift-reason": decision.reason[:1024],
                            **({REGIME_ANNOTATION: regime} if regime else {})},
            "ownerReferences": [parent.owner_reference()],
        },
        "spec": {
            **template,
            "deploymentRef": {"name": parent.name},
            "traffic": {"inline": decision.snapshot.to_dict()},
            "budget": spec.compilation.budget.to_wire(),
            "trigger": {"reason": "Drift", "driftScore": round(decision.score, 6), "observedAt": _iso(now)},
        },
    }


def active_compile_run(compile_runs: list[Mapping[str, Any]], deployment: str) -> str | None:
    """The oldest unfinished CompileRun of ``deployment`` among ``compile_runs`` (any trigger)."""
    mine = [
        run for run in compile_runs
        if (run.get("spec") or {}).get("deploymentRef", {}).get("name") == deployment
        and (run.get("status") or {}).get("phase") not in FINISHED_PHASES
    ]
    mine.sort(key=lambda run: (run["metadata"].get("creationTimestamp") or "", run["metadata"]["name"]))
    return mine[0]["metadata"]["name"] if mine else None


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def only_check_time_changed(update: StatusUpdate, status: InferenceDeploymentStatus) -> bool:
    """True when writing ``update`` would change nothing but ``drift.lastCheckTime``."""
    if set(update.fields) != {"drift"}:
        return False
    current = status.drift.to_wire() if status.drift else {}
    wanted = dict(update.fields["drift"])
    current.pop("lastCheckTime", None)
    wanted.pop("lastCheckTime", None)
    if json.loads(json.dumps(wanted, sort_keys=True)) != json.loads(json.dumps(current, sort_keys=True)):
        return False
    existing = {c.type: (c.status, c.reason, c.message) for c in status.conditions or []}
    return all(existing.get(type_) == (value, reason, message) for type_, value, reason, message in update.conditions)


def _condition(status: InferenceDeploymentStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions or [] if c.type == type_), None)


@dataclass(frozen=True)
class DriftCheck:
    """What one check decided, and what the timer does about it, in this order."""

    result: CheckResult
    compile_run: dict[str, Any] | None  # the CompileRun to create: a Compile decision under OnDrift
    warning: tuple[str, str] | None  # (reason, message) of a Warning event: the traffic newly unobservable
    update: StatusUpdate
    write: bool  # False: the update would change nothing but drift.lastCheckTime
    regime: RegimeDecision | None = None  # the regime library's decision (None: no library given)


def check_drift(
    *,
    spec: InferenceDeploymentSpec,
    status: InferenceDeploymentStatus,
    parent: Parent,
    observe: Callable[[], ObservedTraffic],
    active_compile_run: str | None,
    settings: OperatorSettings,
    now: datetime,
    library: RegimeLibrary | None = None,
) -> DriftCheck:
    """One check: observe, decide, and what to create and write. The CompileRun's name is
    deterministic per check, so the status can name it before it is created. ``library``: the
    regime library (with the champions of finished CompileRuns recorded); None leaves it out."""
    policy = policy_from_spec(spec, settings)
    result = run_check(observe=observe, baseline=baseline_for(spec, status), policy=policy,
                       state=state_from_status(status), active_compile_run=active_compile_run, now=now)
    decision = result.decision
    regime: RegimeDecision | None = None
    if library is not None:
        active = status.active_forward_pass.name if status.active_forward_pass else None
        rollout = status.rollout
        if rollout is not None and rollout.phase == "RolledBack" and rollout.desired is not None:
            library = record_rollback(library, rollout.desired.name, rollout.phase_since or now, rollout.message)
        regime = decide_regime(library, result.observed.profile if result.observed is not None else None, spec=spec,
                               now=now, interval=timedelta(seconds=thresholds_of(spec).check_interval_seconds),
                               active_forward_pass=active)
    compile_run: dict[str, Any] | None = None
    blocked: str | None = None
    if isinstance(decision, Compile):
        if regime is not None and regime.blocks_compile:
            blocked = f"no CompileRun: {regime.reason}"
            # As under Manual, nothing starts a cooldown: the counter stays at its ceiling.
            result = CheckResult(decision, DriftState(consecutive=policy.consecutive_checks,
                                                      last_compile_at=status.last_compile_time),
                                 result.observed)
        elif spec.compilation.policy == "OnDrift":
            compile_run = build_drift_compile_run(parent, spec, decision, now,
                                                  regime=regime.regime if regime is not None else None)
        else:
            blocked = MANUAL_POLICY_NOTE
            # Under Manual nothing starts a cooldown: keep the counter at its ceiling instead.
            result = CheckResult(decision, DriftState(consecutive=policy.consecutive_checks,
                                                      last_compile_at=status.last_compile_time),
                                 result.observed)
    warning: tuple[str, str] | None = None
    previous = _condition(status, CONDITION_TRAFFIC)
    if (isinstance(decision, NoData) and decision.reason in TRAFFIC_REASONS
            and (previous is None or previous.reason != decision.reason)):
        warning = (decision.reason, decision.message[:1000])
    created = compile_run["metadata"]["name"] if compile_run is not None else None
    update = drift_status_update(result, status, now=now, compile_run=created, compile_blocked=blocked)
    if regime is not None:
        _regime_status(update, regime, status, created, now)
    return DriftCheck(result, compile_run, warning, update, write=not only_check_time_changed(update, status),
                      regime=regime)


def _regime_status(update: StatusUpdate, regime: RegimeDecision, status: InferenceDeploymentStatus,
                   compile_run: str | None, now: datetime) -> None:
    """The library's fields (when they changed) and the Regime condition (when the check observed traffic)."""
    library = regime.library
    if compile_run is not None and regime.regime is not None:
        library = record_compile_run(library, regime.regime, compile_run, now)
    if library != RegimeLibrary.of(status):
        update.fields.update(library.to_wire())
    if regime.kind == "NoData":
        return
    serving = regime.kind in ("Stay", "Switch", "Pinned") and regime.champion is not None
    message = regime.reason
    if compile_run is not None:
        message = f"{message}: created CompileRun {compile_run}"
    update.conditions.append((CONDITION_REGIME, "True" if serving else "False", REGIME_REASONS[regime.kind],
                              message[:1024]))
