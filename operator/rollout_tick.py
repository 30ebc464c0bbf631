"""One rollout tick of one InferenceDeployment, without I/O: what the cluster and Prometheus show
in, the next rollout state and every write that follows from it out.

    spec.rollout --policy_from_spec--> RolloutPolicy
    status.rollout, status.activeForwardPass --state_from_status, identity_of--> RolloutState, active
    engine pods (serving_pods) + what each reports in Prometheus (rollout_metrics.PodReport)
        --pod_views--> [PodView]
    Analyzing and the window is over --analyze (RolloutQueries.analysis)--> CanaryAnalysis
        --rollout.step--> next RolloutState
        HotReload: --rollout.desired_per_pod + annotation_patch--> a merge patch for each pod whose
                   forward-pass annotations differ (the engine follows them, see
                   engine/contracts/pod_annotations.py)
        Restart:   --template_annotations--> the engine Deployment's pod-template annotations
                   (operator/handlers/children.py writes the Deployment; Kubernetes rolls the pods)
        --rollout_status_update--> status.rollout, status.pods, status.activeForwardPass and
                   status.compiledFor once complete, condition ForwardPassRolledOut
        --forward_pass_relations--> how the deployment stands to each ForwardPass it concerns
    plan_rollout_tick(...) composes these into a RolloutTick, which operator/handlers/rollout.py applies.

Under HotReload the pod template is left alone: changing it would restart every pod, the
very thing hot reloading avoids. Pods created later (a rescheduled pod, a scale-up) are
annotated by the next tick with what the current phase wants them to run, so they start
on stock and hot-reload the promoted pass within one tick.

Prometheus missing or unreachable holds the rollout where it is (a condition says why):
a rollout is never advanced, promoted or rolled back on missing data.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Literal, Mapping

from shapeshift.engine.contracts.pod_annotations import (
    RESULT_DIGEST_MISMATCH,
    RESULT_REFUSED,
    RESULT_UNREADABLE,
    STOCK_FORWARD_PASS,
    DesiredForwardPass,
)
from shapeshift.operator.api import (
    ForwardPassRef,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    RolloutStatus,
)
from shapeshift.operator.rollout import (
    SETTLED,
    CanaryAnalysis,
    ForwardPassIdentity,
    PodView,
    RolloutPolicy,
    RolloutState,
    desired_per_pod,
    pod_annotations,
    step,
    template_forward_pass,
)
from shapeshift.operator.prometheus import TrafficQueryError
from shapeshift.operator.rollout_metrics import PodReport
from shapeshift.operator.provenance import remembered
from shapeshift.operator.rollout_target import REJECTION_REASONS, Target
from shapeshift.operator.settings import OperatorSettings
from shapeshift.operator.status import Relation, StatusUpdate

__all__ = [
    "RolloutTick",
    "annotation_patch",
    "forward_pass_relations",
    "identity_of",
    "plan_rollout_tick",
    "pod_views",
    "policy_from_spec",
    "rollout_status_update",
    "serving_pods",
    "state_from_status",
    "template_annotations",
    "template_annotations_for",
]

CONDITION = "ForwardPassRolledOut"
# Final for these annotations; fetch errors may pass. An unreadable artifact stays so until someone
# changes the store's file modes: the rollout does not wait the load timeout for that.
REFUSALS = (RESULT_DIGEST_MISMATCH, RESULT_REFUSED, RESULT_UNREADABLE)
EVENT_REASONS = {"Canary": "CanaryStarted", "Analyzing": "CanaryInSync", "Promoting": "Promoting",
                 "Complete": "RolledOut", "RolledBack": "RolledBack", "Failed": "RolloutFailed"}


def policy_from_spec(spec: InferenceDeploymentSpec) -> RolloutPolicy:
    r = spec.rollout
    return RolloutPolicy(strategy=r.strategy, canary_replicas=r.canary_replicas,
                         analysis_window=timedelta(seconds=r.analysis_window_seconds),
                         allowed_regression=r.allowed_regression,
                         load_timeout=timedelta(seconds=r.load_timeout_seconds))


def identity_of(ref: ForwardPassRef | None) -> ForwardPassIdentity | None:
    if ref is None:
        return None
    return ForwardPassIdentity(ref.name, ref.sha256, ref.artifact)


def ref_of(identity: ForwardPassIdentity | None, speedup: float | None = None) -> dict[str, Any] | None:
    if identity is None:
        return None
    ref = {"name": identity.name, "sha256": identity.sha256, "artifact": identity.artifact, "speedup": speedup}
    return {k: v for k, v in ref.items() if v is not None}


def state_from_status(rollout: RolloutStatus | None) -> RolloutState:
    if rollout is None:
        return RolloutState()
    return RolloutState(phase=rollout.phase, desired=identity_of(rollout.desired),
                        previous=identity_of(rollout.previous), canary_pods=tuple(rollout.canary_pods or ()),
                        started_at=rollout.start_time, phase_since=rollout.phase_since,
                        message=rollout.message or "")


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def serving_pods(pods: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods that count for the rollout: bound to a node and not being deleted."""
    return [p for p in pods if (p.get("spec") or {}).get("nodeName") and not p["metadata"].get("deletionTimestamp")]


def requested(pod: Mapping[str, Any]) -> DesiredForwardPass:
    """What the pod's annotations ask its engine to run."""
    return DesiredForwardPass.from_annotations((pod["metadata"].get("annotations") or {}))


def pod_views(pods: list[Mapping[str, Any]], reports: Mapping[str, PodReport],
              state: RolloutState) -> list[PodView]:
    """PodViews for the state machine. A refusal counts only when it happened in this phase and
    the pod's annotations already ask for the rollout's target (not a leftover of an older one)."""
    since = state.phase_since.timestamp() if state.phase_since else None
    views = []
    for pod in pods:
        name = pod["metadata"]["name"]
        report = reports.get(name, PodReport())
        refused = None
        asked = requested(pod)
        if (state.desired is not None and report.in_sync is False and report.last_reload_result in REFUSALS
                and report.last_reload_at is not None and since is not None and report.last_reload_at >= since
                and asked.name == state.desired.name and asked.sha256 == (state.desired.sha256 or "")):
            refused = report.last_reload_result
        views.append(PodView(name, _ready(pod), report.running, refused))
    return views


def annotation_patch(pod: Mapping[str, Any], wanted: ForwardPassIdentity | None) -> dict[str, str | None] | None:
    """The merge patch of the pod's annotations that asks for ``wanted``; None when it already does."""
    desired = pod_annotations(wanted)
    current = pod["metadata"].get("annotations") or {}
    if all((current.get(key) or None) == value for key, value in desired.items()):
        return None
    return desired


def template_annotations(spec: InferenceDeploymentSpec, state: RolloutState,
                         active: ForwardPassIdentity | None) -> dict[str, str]:
    """Pod-template annotations of the engine Deployment: under Restart, the forward pass the
    rollout in ``state`` wants every pod on; under HotReload none (pods are patched one by one)."""
    if spec.rollout.strategy != "Restart":
        return {}
    chosen = template_forward_pass(state, active)
    return {key: value for key, value in pod_annotations(chosen).items() if value is not None}


def template_annotations_for(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus) -> dict[str, str]:
    """template_annotations of the rollout as ``status`` records it."""
    return template_annotations(spec, state_from_status(status.rollout), identity_of(status.active_forward_pass))


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def rollout_wire(state: RolloutState, desired_speedup: float | None = None) -> dict[str, Any]:
    wire = {
        "phase": state.phase,
        "desired": ref_of(state.desired, desired_speedup),
        "previous": ref_of(state.previous),
        "canaryPods": list(state.canary_pods) or None,
        "startTime": _iso(state.started_at),
        "phaseSince": _iso(state.phase_since),
        "message": state.message[:4096] or None,
    }
    return {k: v for k, v in wire.items() if v is not None}


def rollout_status_update(
    *,
    state: RolloutState,
    previous_state: RolloutState,
    status: InferenceDeploymentStatus,
    target: Target,
    views: list[PodView],
    wanted: Mapping[str, ForwardPassIdentity | None],
    prometheus_problem: str | None = None,
) -> StatusUpdate:
    """status.rollout, status.pods, and on completion status.activeForwardPass and compiledFor."""
    fields: dict[str, Any] = {}
    rollout = rollout_wire(state, target.speedup if target.identity and target.identity.matches(state.desired)
                           else None)
    stored = status.rollout.to_wire() if status.rollout else {}
    # Merge-patch semantics: a key the new value lacks must be sent as null to disappear.
    fields["rollout"] = {**{key: None for key in stored if key not in rollout}, **rollout}
    fields["pods"] = [
        {k: v for k, v in {
            "name": view.name,
            "forwardPass": view.running.name if view.running else None,
            "sha256": view.running.sha256 if view.running else None,
            "desired": (wanted.get(view.name).name if wanted.get(view.name) else STOCK_FORWARD_PASS),
            "canary": view.name in state.canary_pods and state.phase in ("Canary", "Analyzing"),
            "ready": view.ready,
        }.items() if v is not None}
        for view in sorted(views, key=lambda v: v.name)
    ]
    if state.phase == "Complete" and previous_state.phase != "Complete" and state.desired is not None:
        speedup = target.speedup if target.identity and target.identity.matches(state.desired) else None
        fields["activeForwardPass"] = ref_of(state.desired, speedup)
        if target.traffic and target.identity and target.identity.matches(state.desired):
            fields["compiledFor"] = target.traffic
    conditions: list[tuple[str, Any, str, str]] = []
    if prometheus_problem is not None:
        conditions.append((CONDITION, "Unknown", "PrometheusUnavailable",
                           f"rollout held in phase {state.phase}: {prometheus_problem}"))
    elif target.problem is not None:
        conditions.append((CONDITION, "False", target.reason, target.problem))
    elif state.phase == "Complete":
        conditions.append((CONDITION, "True", "RolledOut", state.message))
    elif state.phase == "Idle":
        conditions.append((CONDITION, "True", "NothingToRollOut", "the pods run the active forward pass"))
    else:
        conditions.append((CONDITION, "False", EVENT_REASONS.get(state.phase, state.phase), state.message))
    return StatusUpdate(fields=fields, conditions=conditions)


def forward_pass_relations(*, active_before: ForwardPassIdentity | None, state: RolloutState,
                           target: Target) -> dict[str, tuple[Relation, str, str]]:
    """{ForwardPass name: (relation, reason, message)} of this deployment after a tick, for the
    ForwardPasses whose status it concerns (status.forward_pass_usage applies them). The stock
    forward pass has no ForwardPass object and is left out."""
    active_after = state.desired if state.phase == "Complete" and state.desired is not None else active_before
    out: dict[str, tuple[Relation, str, str]] = {}

    def put(name: str | None, relation: Relation, reason: str = "", message: str = "") -> None:
        if name and name != STOCK_FORWARD_PASS and name not in out:
            out[name] = (relation, reason, message)

    put(active_after.name if active_after else None, "runs")
    if active_before is not None and (active_after is None or active_before.name != active_after.name):
        put(active_before.name, "left")
    if state.phase in ("RolledBack", "Failed") and state.desired is not None:
        put(state.desired.name, "refused", EVENT_REASONS[state.phase], state.message)
    elif state.phase not in SETTLED and state.desired is not None:
        put(state.desired.name, "seen")
    if target.problem is not None and target.refused:
        put(target.refused, "refused", target.reason, target.problem)
    return out


# RolloutQueries.analysis(canary, baseline, window, *, min_requests, latency_resolution_seconds, at);
# raises TrafficQueryError when Prometheus cannot answer.
Analyze = Callable[..., CanaryAnalysis]


@dataclass(frozen=True)
class RolloutTick:
    """What one tick decided, and the writes that follow, in the order the timer makes them."""

    policy: RolloutPolicy
    state: RolloutState  # as the tick found it
    next_state: RolloutState
    active: ForwardPassIdentity | None  # status.activeForwardPass as the tick found it
    pod_patches: dict[str, dict[str, str | None]]  # HotReload: pod -> merge patch of its annotations
    update: StatusUpdate
    warning: tuple[str, str] | None  # (reason, problem): a target newly refused
    relations: dict[str, tuple[Relation, str, str]]  # for status.forward_pass_usage
    event: tuple[Literal["Normal", "Warning"], str, str] | None  # a phase transition or a new target


def plan_rollout_tick(
    *,
    spec: InferenceDeploymentSpec,
    status: InferenceDeploymentStatus,
    target: Target,
    pods: list[Mapping[str, Any]],
    reports: Mapping[str, PodReport],
    prometheus_problem: str | None,
    analyze: Analyze | None,
    settings: OperatorSettings,
    now: datetime,
) -> RolloutTick:
    """One observation of the rollout. ``pods``: the serving pods; ``reports``: what they report
    in Prometheus, or ``prometheus_problem`` why that could not be read; ``analyze`` is called
    only when an analysis window is over (a TrafficQueryError it raises holds the rollout)."""
    policy = policy_from_spec(spec)
    state = state_from_status(status.rollout)
    active = identity_of(status.active_forward_pass)
    problem = prometheus_problem
    # Settled with nothing new to roll out: Prometheus is read only to show what pods run.
    busy = state.phase not in SETTLED or step(policy=policy, state=state, target=target.identity, active=active,
                                              pods=pod_views(pods, {}, state), analysis=None, now=now) != state
    views = pod_views(pods, reports, state)
    next_state = state
    if problem is None:
        analysis: CanaryAnalysis | None = None
        if (state.phase == "Analyzing" and state.phase_since is not None
                and now - state.phase_since >= policy.analysis_window and analyze is not None):
            baseline = [v.name for v in views if v.ready and v.name not in state.canary_pods]
            try:
                analysis = analyze(state.canary_pods, baseline, policy.analysis_window,
                                   min_requests=settings.rollout_min_requests,
                                   latency_resolution_seconds=settings.rollout_latency_resolution_seconds, at=now)
            except TrafficQueryError as err:
                problem = str(err)
        if problem is None:
            next_state = step(policy=policy, state=state, target=target.identity, active=active,
                              pods=views, analysis=analysis, now=now)

    wanted = desired_per_pod(next_state, views, active)
    patches: dict[str, dict[str, str | None]] = {}
    if policy.strategy == "HotReload":
        for pod in pods:
            patch = annotation_patch(pod, wanted.get(pod["metadata"]["name"]))
            if patch is not None:
                patches[pod["metadata"]["name"]] = patch

    update = rollout_status_update(state=next_state, previous_state=state, status=status, target=target,
                                   views=views, wanted=wanted, prometheus_problem=problem if busy else None)
    if problem is not None and not busy:
        # Nothing to roll out and nothing known about the pods: record the phase, nothing else,
        # so idle deployments without Prometheus are not rewritten on every tick.
        update = StatusUpdate(fields={"rollout": update.fields["rollout"]},
                              conditions=[c for c in update.conditions if c[2] in REJECTION_REASONS])

    records = remembered(status.verified_forward_passes or [], target.vouched,
                         keep=[x.name if x else None for x in (active, next_state.desired, next_state.previous)])
    if records is not None:
        update.fields["verifiedForwardPasses"] = [r.to_wire() for r in records]

    warning: tuple[str, str] | None = None
    if target.problem is not None:
        prior = next((c for c in status.conditions or [] if c.type == CONDITION), None)
        if prior is None or (prior.reason, prior.message) != (target.reason, target.problem):
            warning = (target.reason, target.problem)

    event: tuple[Literal["Normal", "Warning"], str, str] | None = None
    if next_state.phase != state.phase or (next_state.desired != state.desired and next_state.phase not in SETTLED):
        reason = EVENT_REASONS.get(next_state.phase, next_state.phase)
        event = ("Warning" if next_state.phase in ("RolledBack", "Failed") else "Normal", reason, next_state.message)

    return RolloutTick(policy=policy, state=state, next_state=next_state, active=active, pod_patches=patches,
                       update=update, warning=warning,
                       relations=forward_pass_relations(active_before=active, state=next_state, target=target),
                       event=event)
