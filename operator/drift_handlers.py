"""The drift timer: Prometheus -> observed traffic -> decision -> status (+ a CompileRun).

Data flow of one check of one InferenceDeployment:

    spec, status  --policy_from_spec / baseline_for / state_from_status-->  DriftPolicy, baseline, DriftState
    PrometheusTraffic(url).observe(selector, window)  --> ObservedTraffic | TrafficQueryError
    active CompileRuns of the deployment (listed from the API)
        --run_check (drift.decide)--> CheckResult(decision, next state, observed)
        --drift_status_update--> status.observedTraffic, status.drift, conditions TrafficObserved + Drifted
        --decision Compile and policy OnDrift--> build_drift_compile_run --> CompileRun owned by the
          deployment, spec.traffic.inline = the snapshot, spec.trigger = Drift + score,
          spec.budget = spec.compilation.budget, plus the fields set in spec.compilation.template

``drift_check`` is the kopf timer; everything it calls except the two API
calls (list CompileRuns, create one) and the Prometheus queries is pure and
tested without a cluster. The timer ticks every ``SHAPESHIFT_DRIFT_TIMER_SECONDS``
(default 10) and skips deployments whose ``spec.compilation.drift.checkIntervalSeconds``
has not passed since ``status.drift.lastCheckTime``, so each deployment keeps
its own pace with one timer.

Operator-wide settings come from the environment (the Helm chart sets them):
``SHAPESHIFT_PROMETHEUS_URL`` (the default Prometheus; ``spec.prometheusUrl``
overrides it per deployment), ``SHAPESHIFT_PROMETHEUS_NAMESPACE_LABEL`` and
``SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL`` (target label names, default
``namespace`` and ``deployment``), ``SHAPESHIFT_DRIFT_MIN_REQUESTS`` (default 20),
``SHAPESHIFT_PROMETHEUS_TIMEOUT_SECONDS`` (default 5).

A check that changes nothing but the check time (the usual case of a deployment
whose Prometheus stays unreachable, or one without traffic) writes nothing, so
resyncs of idle deployments do not churn their resourceVersion; the pace of
checks is then kept in memory.

This module registers its timer when imported; ``operator/handlers.py``
imports it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping

import kopf
from kubernetes.client import ApiException

from shapeshift.engine.contracts.traffic_profile import TrafficProfile, builtin_profile
from shapeshift.operator.builders import LABEL_DEPLOYMENT, MANAGED_BY, Parent
from shapeshift.operator.kube import Kube, kube_of
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
from shapeshift.operator.api import (
    API_VERSION,
    COMPILE_RUN,
    GROUP,
    INFERENCE_DEPLOYMENT,
    VERSION,
    Condition,
    DriftThresholds,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)
from shapeshift.operator.prometheus import (
    ObservedTraffic,
    PrometheusTraffic,
    SeriesSelector,
    TrafficQueryError,
)
from shapeshift.operator.status import StatusUpdate

__all__ = [
    "CheckResult",
    "DriftSettings",
    "active_compile_run",
    "baseline_for",
    "build_drift_compile_run",
    "drift_check",
    "drift_compile_run_name",
    "drift_status_update",
    "policy_from_spec",
    "run_check",
    "selector_for",
    "state_from_status",
]

CONDITION_TRAFFIC = "TrafficObserved"
CONDITION_DRIFT = "Drifted"
FINISHED_PHASES = ("Succeeded", "Failed")
TRAFFIC_REASONS = ("PrometheusUnreachable", "NoTraffic", "TooFewRequests")  # NoData reasons about the traffic
TIMER_SECONDS = float(os.environ.get("SHAPESHIFT_DRIFT_TIMER_SECONDS", "10"))
_LAST_CHECK: dict[str, datetime] = {}  # uid -> last check, for checks that wrote nothing


@dataclass(frozen=True)
class DriftSettings:
    """Operator-wide settings of the drift detector."""

    prometheus_url: str | None = None
    namespace_label: str = "namespace"
    deployment_label: str = "deployment"
    min_requests: int = 20
    query_timeout_seconds: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "DriftSettings":
        return cls(
            prometheus_url=env.get("SHAPESHIFT_PROMETHEUS_URL") or None,
            namespace_label=env.get("SHAPESHIFT_PROMETHEUS_NAMESPACE_LABEL") or "namespace",
            deployment_label=env.get("SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL") or "deployment",
            min_requests=int(env.get("SHAPESHIFT_DRIFT_MIN_REQUESTS") or 20),
            query_timeout_seconds=float(env.get("SHAPESHIFT_PROMETHEUS_TIMEOUT_SECONDS") or 5.0),
        )


@dataclass(frozen=True)
class CheckResult:
    decision: Decision
    state: DriftState
    observed: ObservedTraffic | None


# ---- pure pieces -----------------------------------------------------------------------------


def thresholds_of(spec: InferenceDeploymentSpec) -> DriftThresholds:
    """The spec's thresholds; a Manual deployment without them is still observed with the defaults."""
    return spec.compilation.drift or DriftThresholds()


def policy_from_spec(spec: InferenceDeploymentSpec, settings: DriftSettings) -> DriftPolicy:
    t = thresholds_of(spec)
    return DriftPolicy(
        prompt_length_relative=t.prompt_length_relative_change,
        prefix_cache_hit_rate_absolute=t.prefix_hit_rate_absolute_change,
        consecutive_checks=t.consecutive_checks,
        cooldown=timedelta(seconds=spec.compilation.cooldown_seconds),
        min_requests=settings.min_requests,
    )


def selector_for(namespace: str, name: str, spec: InferenceDeploymentSpec, settings: DriftSettings) -> SeriesSelector:
    return SeriesSelector(
        namespace=namespace, deployment=name, model=spec.model.display_name,
        namespace_label=settings.namespace_label, deployment_label=settings.deployment_label,
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
                            now: datetime) -> dict[str, Any]:
    """A CompileRun owned by the deployment, carrying the traffic that triggered it.

    Its budget is ``spec.compilation.budget``; the fields set in ``spec.compilation.template``
    (agents, tiers, verification, baseline, hardware, image, backoffLimit) are copied as they
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
            "annotations": {f"{GROUP}/drift-reason": decision.reason[:1024]},
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


def _due(status: InferenceDeploymentStatus, spec: InferenceDeploymentSpec, now: datetime,
         last_in_memory: datetime | None = None) -> bool:
    last = status.drift.last_check_time if status.drift else None
    if last_in_memory is not None and (last is None or last_in_memory > last):
        last = last_in_memory
    if last is None:
        return True
    # Half a timer tick of slack, so a 60 s interval on a 10 s timer is not stretched to 70 s.
    slack = timedelta(seconds=TIMER_SECONDS / 2)
    return now - last >= timedelta(seconds=thresholds_of(spec).check_interval_seconds) - slack


# ---- the kopf timer --------------------------------------------------------------------------


@kopf.timer(GROUP, VERSION, INFERENCE_DEPLOYMENT.plural, interval=TIMER_SECONDS, initial_delay=1.0)
def drift_check(
    spec: kopf.Spec,
    status: kopf.Status,
    name: str,
    namespace: str,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Observe traffic in Prometheus, judge drift, write status; under OnDrift, compile on persisting drift."""
    try:
        typed_spec = InferenceDeploymentSpec.model_validate(dict(spec))
    except ValueError as err:  # the API server's schema should have refused it; nothing to observe
        raise kopf.PermanentError(f"spec does not parse: {err}") from err
    typed_status = InferenceDeploymentStatus.model_validate(dict(status or {}))
    now = datetime.now(timezone.utc).replace(microsecond=0)
    uid = body["metadata"].get("uid", f"{namespace}/{name}")
    if not _due(typed_status, typed_spec, now, _LAST_CHECK.get(uid)):
        return
    _LAST_CHECK[uid] = now
    settings = DriftSettings.from_env()
    kube = kube_of(memo)
    try:
        runs = kube.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, COMPILE_RUN.plural)["items"]
    except ApiException as err:
        raise kopf.TemporaryError(f"listing CompileRuns in {namespace} failed ({err.status} {err.reason})",
                                  delay=15) from err
    active = active_compile_run(runs, name)
    url = typed_spec.prometheus_url or settings.prometheus_url
    window = timedelta(seconds=thresholds_of(typed_spec).window_seconds)
    selector = selector_for(namespace, name, typed_spec, settings)

    def observe() -> ObservedTraffic:
        if not url:
            raise _NoPrometheusAddress(
                "no Prometheus address: set the chart value prometheus.url (SHAPESHIFT_PROMETHEUS_URL) "
                "or spec.prometheusUrl")
        with PrometheusTraffic(url, timeout_seconds=settings.query_timeout_seconds) as prom:
            return prom.observe(selector, window, at=now, name=f"{name}-observed")

    policy = policy_from_spec(typed_spec, settings)
    result = run_check(
        observe=observe,
        baseline=baseline_for(typed_spec, typed_status),
        policy=policy,
        state=state_from_status(typed_status),
        active_compile_run=active,
        now=now,
    )
    decision = result.decision
    created: str | None = None
    blocked: str | None = None
    if isinstance(decision, Compile):
        if typed_spec.compilation.policy == "OnDrift":
            run = build_drift_compile_run(Parent.from_body(body), typed_spec, decision, now)
            created = _create_compile_run(kube, run)
            kopf.info(body, reason="CompileRunCreated",
                      message=f"drift persisted, created CompileRun {created}: {decision.reason}"[:1000])
        else:
            blocked = "policy Manual: create a CompileRun to act on it, or set spec.compilation.policy OnDrift"
            # Under Manual nothing starts a cooldown: keep the counter at its ceiling instead.
            result = CheckResult(decision, DriftState(consecutive=policy.consecutive_checks,
                                                      last_compile_at=typed_status.last_compile_time),
                                 result.observed)
    previous = _condition(typed_status, CONDITION_TRAFFIC)
    if (isinstance(decision, NoData) and decision.reason in TRAFFIC_REASONS
            and (previous is None or previous.reason != decision.reason)):
        kopf.warn(body, reason=decision.reason, message=decision.message[:1000])
    update = drift_status_update(result, typed_status, now=now, compile_run=created, compile_blocked=blocked)
    if only_check_time_changed(update, typed_status):
        logger.debug("drift check: %s, status unchanged", decision.kind)
        return
    try:
        kube.write_status(INFERENCE_DEPLOYMENT, namespace, name, update, generation=body["metadata"].get("generation"))
    except ApiException as err:
        raise kopf.TemporaryError(f"writing drift status failed ({err.status} {err.reason})", delay=15) from err
    logger.info("drift check: %s%s", decision.kind, f" -> CompileRun {created}" if created else "")


class _NoPrometheusAddress(TrafficQueryError):
    reason = "PrometheusUnreachable"


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


def _create_compile_run(kube: Kube, body: dict[str, Any]) -> str:
    """Create the CompileRun; one that already exists under the same name (a retried check) is kept."""
    meta = body["metadata"]
    try:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, meta["namespace"], COMPILE_RUN.plural, body)
    except ApiException as err:
        if err.status != 409:
            raise kopf.TemporaryError(
                f"creating CompileRun {meta['name']} failed ({err.status} {err.reason}): {err.body}", delay=30
            ) from err
    return meta["name"]
