"""The rollout timer: a verified ForwardPass reaches the engine pods, canary first.

Data flow of one tick of one InferenceDeployment:

    spec.forwardPass, else the champion of its newest Succeeded CompileRun
        --resolve_target (GET ForwardPass: verified? same accelerator?)--> target identity
    status.rollout, status.activeForwardPass --state_from_status--> RolloutState, active
    engine pods (API: ready, annotations) + Prometheus (rollout_metrics.RolloutQueries:
        what each pod reports running, refused loads) --pod_views--> [PodView]
    Analyzing and the window is over --RolloutQueries.analysis--> CanaryAnalysis (canary vs the rest)
        --rollout.step--> next RolloutState
        HotReload: --rollout.desired_per_pod + pod_annotations--> merge-patch each pod whose
                   forward-pass annotations differ (the engine follows them, see
                   engine/contracts/pod_annotations.py)
        Restart:   --rollout.template_forward_pass--> the engine Deployment's pod template
                   annotations (kube.ensure replaces it; Kubernetes rolls the pods)
        --rollout_status_update--> status.rollout, status.pods, status.activeForwardPass and
                   status.compiledFor once complete, condition ForwardPassRolledOut; an event
                   for every phase transition and for a target it refuses
        --forward_pass_relations + status.forward_pass_usage--> each concerned ForwardPass's
                   status: phase (Available / Active / Refused), deployments that run it,
                   refusals (which deployment, why)

A ForwardPass is refused before any pod is asked for it when it did not pass verification,
was compiled for another accelerator, or carries shapeshift.dev/artifact-durable: "false"
(its archive was written to its compile pod's emptyDir and is gone: the deployment needs
spec.artifacts.pvc). The condition ForwardPassRolledOut says why and a Warning event is posted
once per refusal.

Under HotReload the pod template is left alone: changing it would restart every pod, the
very thing hot reloading avoids. Pods created later (a rescheduled pod, a scale-up) are
annotated by the next tick with what the current phase wants them to run, so they start
on stock and hot-reload the promoted pass within one tick.

Prometheus missing or unreachable holds the rollout where it is (a condition says why):
a rollout is never advanced, promoted or rolled back on missing data.

Everything above the kopf timer is pure and tested without a cluster. Settings from the
environment: SHAPESHIFT_ROLLOUT_TIMER_SECONDS (tick, default the resync interval),
SHAPESHIFT_ROLLOUT_MIN_REQUESTS (canary requests needed to judge, default 20),
SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS (p90 differences below it are noise, default 0.002),
SHAPESHIFT_PROMETHEUS_POD_LABEL (pod target label, default `pod`), and the drift timer's
Prometheus settings (address, namespace/deployment label names, timeout).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

import kopf
from kubernetes.client import ApiException
from pydantic import ValidationError

from shapeshift.engine.compile.worker import ARTIFACT_DURABLE_ANNOTATION
from shapeshift.engine.contracts.pod_annotations import (
    RESULT_DIGEST_MISMATCH,
    RESULT_REFUSED,
    STOCK_FORWARD_PASS,
    DesiredForwardPass,
)
from shapeshift.operator import builders
from shapeshift.operator.drift_handlers import DriftSettings, selector_for
from shapeshift.operator.kube import MERGE_PATCH, Kube, kube_of
from shapeshift.operator.api import (
    COMPILE_RUN,
    FORWARD_PASS,
    GROUP,
    INFERENCE_DEPLOYMENT,
    VERSION,
    ForwardPassRef,
    ForwardPassStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    RolloutStatus,
    parse_spec,
    parse_status,
)
from shapeshift.operator.prometheus import PrometheusTraffic, TrafficQueryError
from shapeshift.operator.rollout import (
    SETTLED,
    CanaryAnalysis,
    ForwardPassIdentity,
    PodView,
    RolloutSettings,
    RolloutState,
    desired_per_pod,
    pod_annotations,
    step,
    template_forward_pass,
)
from shapeshift.operator.rollout_metrics import PodReport, RolloutQueries
from shapeshift.operator.status import Relation, StatusUpdate, forward_pass_usage

__all__ = [
    "RolloutEnv",
    "Target",
    "annotation_patch",
    "champion_of",
    "forward_pass_relations",
    "pod_views",
    "resolve_target",
    "rollout_status_update",
    "rollout_tick",
    "settings_from_spec",
    "state_from_status",
    "template_annotations_for",
]

TIMER_SECONDS = float(os.environ.get("SHAPESHIFT_ROLLOUT_TIMER_SECONDS")
                      or os.environ.get("SHAPESHIFT_RESYNC_SECONDS") or "10")
CONDITION = "ForwardPassRolledOut"
REFUSALS = (RESULT_DIGEST_MISMATCH, RESULT_REFUSED)  # final for these annotations; fetch errors may pass
EVENT_REASONS = {"Canary": "CanaryStarted", "Analyzing": "CanaryInSync", "Promoting": "Promoting",
                 "Complete": "RolledOut", "RolledBack": "RolledBack", "Failed": "RolloutFailed"}


@dataclass(frozen=True)
class RolloutEnv:
    """Operator-wide rollout settings (the Helm chart sets the environment)."""

    prometheus_url: str | None = None
    namespace_label: str = "namespace"
    deployment_label: str = "deployment"
    pod_label: str = "pod"
    min_requests: float = 20
    # The engine's inter-token histogram has 0.5-2 ms wide buckets below 10 ms; p90 differences
    # smaller than that are interpolation noise.
    latency_resolution_seconds: float = 0.002
    query_timeout_seconds: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RolloutEnv":
        drift = DriftSettings.from_env(env)
        return cls(prometheus_url=drift.prometheus_url, namespace_label=drift.namespace_label,
                   deployment_label=drift.deployment_label,
                   pod_label=env.get("SHAPESHIFT_PROMETHEUS_POD_LABEL") or "pod",
                   min_requests=float(env.get("SHAPESHIFT_ROLLOUT_MIN_REQUESTS") or 20),
                   latency_resolution_seconds=float(
                       env.get("SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS") or 0.002),
                   query_timeout_seconds=drift.query_timeout_seconds)


REJECTED = "TargetRejected"  # not verified, wrong accelerator, other engine env, or not found
NOT_DURABLE = "ArtifactNotDurable"  # its archive lived in its compile pod only
REJECTION_REASONS = (REJECTED, NOT_DURABLE)


@dataclass(frozen=True)
class Target:
    """What the deployment should run, or why nothing can be rolled out."""

    identity: ForwardPassIdentity | None
    speedup: float | None = None
    traffic: dict[str, Any] | None = None  # the ForwardPass's spec.traffic (what it was compiled for)
    problem: str | None = None  # why the named forward pass cannot be rolled out
    reason: str = REJECTED  # condition and event reason of the problem
    refused: str | None = None  # the existing ForwardPass the problem refuses (None: not found)


# ---- pure pieces -----------------------------------------------------------------------------


def settings_from_spec(spec: InferenceDeploymentSpec) -> RolloutSettings:
    r = spec.rollout
    return RolloutSettings(strategy=r.strategy, canary_replicas=r.canary_replicas,
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


def champion_of(compile_runs: list[Mapping[str, Any]], deployment: str) -> str | None:
    """The champion of the deployment's most recently finished, successful CompileRun."""
    done = [run for run in compile_runs
            if (run.get("spec") or {}).get("deploymentRef", {}).get("name") == deployment
            and (run.get("status") or {}).get("phase") == "Succeeded" and (run.get("status") or {}).get("champion")]
    if not done:
        return None
    newest = max(done, key=lambda run: ((run.get("status") or {}).get("completionTime") or "",
                                        run["metadata"].get("creationTimestamp") or "", run["metadata"]["name"]))
    return newest["status"]["champion"]


def resolve_target(name: str | None, forward_pass: Mapping[str, Any] | None,
                   spec: InferenceDeploymentSpec) -> Target:
    """The identity to roll out from the named ForwardPass object (None: not found)."""
    if name is None:
        return Target(None)
    if forward_pass is None:
        if name == STOCK_FORWARD_PASS:
            return Target(ForwardPassIdentity(STOCK_FORWARD_PASS, None))
        return Target(None, problem=f"ForwardPass {name} not found in this namespace; create it or fix "
                                    "spec.forwardPass")
    fp = forward_pass.get("spec") or {}
    if not (fp.get("verification") or {}).get("passed"):
        return Target(None, refused=name, problem=f"ForwardPass {name} did not pass verification; only verified "
                                                  "forward passes are rolled out")
    accelerator = (fp.get("hardware") or {}).get("accelerator")
    if accelerator != spec.hardware.accelerator:
        return Target(None, refused=name, problem=f"ForwardPass {name} is for accelerator {accelerator}, the "
                                                  f"deployment runs on {spec.hardware.accelerator}")
    changed = engine_env_changes(fp, spec)
    if changed:
        return Target(None, refused=name, problem=(
            f"ForwardPass {name} was measured with another spec.engine.env than the deployment sets now "
            f"({'; '.join(changed)}): kernel launch switches change what is fastest. Set spec.engine.env back, "
            "or compile again (a CompileRun) under the new one"))
    artifact = fp.get("artifact") or {}
    annotations = (forward_pass.get("metadata") or {}).get("annotations") or {}
    if annotations.get(ARTIFACT_DURABLE_ANNOTATION) == "false":
        # Asking pods to fetch it would only produce fetch errors until the load timeout.
        return Target(None, refused=name, reason=NOT_DURABLE, problem=(
            f"ForwardPass {name} is not rolled out: its artifact {artifact.get('uri') or '(none)'} was written "
            f"to its compile pod's own emptyDir ({ARTIFACT_DURABLE_ANNOTATION}: \"false\") and no engine pod can "
            "fetch it. Set spec.artifacts.pvc to a ReadWriteMany PersistentVolumeClaim, so compile Jobs write "
            "forward passes where engine pods read them, and compile again"))
    return Target(ForwardPassIdentity(name, artifact.get("sha256"), artifact.get("uri")),
                  speedup=(fp.get("metrics") or {}).get("speedup"), traffic=fp.get("traffic"))


def engine_env_changes(forward_pass_spec: Mapping[str, Any], spec: InferenceDeploymentSpec) -> list[str]:
    """How the deployment's spec.engine.env differs from the one the forward pass was measured
    under (its spec.engine.env), one line a variable; empty when equal or not recorded."""
    recorded = (forward_pass_spec.get("engine") or {}).get("env")
    if recorded is None:
        return []
    then = {e["name"]: e.get("value", "") for e in recorded}
    now = {e.name: e.value for e in spec.engine.env or []}
    lines = []
    for key in sorted(then.keys() | now.keys()):
        if key not in now:
            lines.append(f"{key}={then[key]!r} then, unset now")
        elif key not in then:
            lines.append(f"{key} unset then, {now[key]!r} now")
        elif then[key] != now[key]:
            lines.append(f"{key}={then[key]!r} then, {now[key]!r} now")
    return lines


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


def template_annotations_for(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus) -> dict[str, str]:
    """Pod-template annotations of the engine Deployment: under Restart, the forward pass the
    rollout wants every pod on; under HotReload none (pods are patched one by one)."""
    if spec.rollout.strategy != "Restart":
        return {}
    state = state_from_status(status.rollout)
    chosen = template_forward_pass(state, identity_of(status.active_forward_pass))
    return {key: value for key, value in pod_annotations(chosen).items() if value is not None}


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


# ---- the kopf timer --------------------------------------------------------------------------


def _target_name(kube: Kube, namespace: str, name: str, spec: InferenceDeploymentSpec) -> str | None:
    if spec.forward_pass:
        return spec.forward_pass
    runs = kube.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, COMPILE_RUN.plural)["items"]
    return champion_of(runs, name)


def _reports(url: str | None, env: RolloutEnv, namespace: str, name: str,
             spec: InferenceDeploymentSpec) -> tuple[RolloutQueries | None, dict[str, PodReport], str | None]:
    if not url:
        return None, {}, ("no Prometheus address: set the chart value prometheus.url "
                          "(SHAPESHIFT_PROMETHEUS_URL) or spec.prometheusUrl")
    selector = selector_for(namespace, name, spec, DriftSettings(
        prometheus_url=url, namespace_label=env.namespace_label, deployment_label=env.deployment_label))
    prometheus = PrometheusTraffic(url, timeout_seconds=env.query_timeout_seconds)
    queries = RolloutQueries(prometheus, selector, env.pod_label)
    try:
        return queries, queries.reports(), None
    except TrafficQueryError as err:
        prometheus.close()
        return None, {}, str(err)


@kopf.timer(GROUP, VERSION, INFERENCE_DEPLOYMENT.plural, interval=TIMER_SECONDS, initial_delay=1.0)
def rollout_tick(name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Advance the rollout of the deployment's desired ForwardPass by one observation."""
    kube = kube_of(memo)
    # Read fresh: the timer's body can lag behind this timer's own last status write.
    body = kube.get_custom(INFERENCE_DEPLOYMENT, namespace, name)
    if body is None:
        return
    try:
        spec = parse_spec(INFERENCE_DEPLOYMENT, body.get("spec"))
    except ValidationError:
        return  # the reconcile handler reports invalid specs
    status: InferenceDeploymentStatus = parse_status(INFERENCE_DEPLOYMENT, body.get("status"))
    now = datetime.now(timezone.utc).replace(microsecond=0)
    env = RolloutEnv.from_env()
    try:
        target_name = _target_name(kube, namespace, name, spec)
        forward_pass = kube.get_custom(FORWARD_PASS, namespace, target_name) if target_name else None
        pods = serving_pods(kube.list("Pod", namespace, builders.engine_selector(name)))
    except ApiException as err:
        raise kopf.TemporaryError(f"reading the rollout's inputs failed ({err.status} {err.reason})", delay=10)
    target = resolve_target(target_name, forward_pass, spec)
    settings = settings_from_spec(spec)
    state = state_from_status(status.rollout)
    active = identity_of(status.active_forward_pass)

    # Settled with nothing new to roll out: Prometheus is read only to show what pods run.
    busy = state.phase not in SETTLED or step(settings=settings, state=state, target=target.identity,
                                              active=active, pods=pod_views(pods, {}, state), analysis=None,
                                              now=now) != state
    queries, reports, problem = _reports(spec.prometheus_url or env.prometheus_url, env, namespace, name, spec)
    try:
        views = pod_views(pods, reports, state)
        next_state = state
        if problem is None:
            analysis: CanaryAnalysis | None = None
            if (state.phase == "Analyzing" and state.phase_since is not None
                    and now - state.phase_since >= settings.analysis_window and queries is not None):
                baseline = [v.name for v in views if v.ready and v.name not in state.canary_pods]
                try:
                    analysis = queries.analysis(state.canary_pods, baseline, settings.analysis_window,
                                                min_requests=env.min_requests,
                                                latency_resolution_seconds=env.latency_resolution_seconds, at=now)
                except TrafficQueryError as err:
                    problem = str(err)
            if problem is None:
                next_state = step(settings=settings, state=state, target=target.identity, active=active,
                                  pods=views, analysis=analysis, now=now)
    finally:
        if queries is not None:
            queries.prometheus.close()

    wanted = desired_per_pod(next_state, views, active)
    parent = builders.Parent.from_body(body)
    if settings.strategy == "HotReload":
        for pod in pods:
            patch = annotation_patch(pod, wanted.get(pod["metadata"]["name"]))
            if patch is None:
                continue
            try:
                kube.core.patch_namespaced_pod(pod["metadata"]["name"], namespace, {"metadata": {"annotations": patch}},
                                               _content_type=MERGE_PATCH)
                logger.info("pod %s asked for %s", pod["metadata"]["name"],
                            patch.get("shapeshift.dev/forward-pass") or STOCK_FORWARD_PASS)
            except ApiException as err:
                if err.status != 404:  # a pod deleted meanwhile needs nothing
                    raise kopf.TemporaryError(f"patching pod {pod['metadata']['name']} failed "
                                              f"({err.status} {err.reason})", delay=5)
    else:
        chosen = template_forward_pass(next_state, active)
        annotations = {k: v for k, v in pod_annotations(chosen).items() if v is not None}
        try:
            action, _ = kube.ensure(builders.build_engine_deployment(parent, spec, annotations))
        except ApiException as err:
            raise kopf.TemporaryError(f"updating the engine pod template failed ({err.status} {err.reason})",
                                      delay=5)
        if action == "updated":
            logger.info("engine pod template now asks for %s", chosen.name if chosen else STOCK_FORWARD_PASS)

    update = rollout_status_update(state=next_state, previous_state=state, status=status, target=target,
                                   views=views, wanted=wanted, prometheus_problem=problem if busy else None)
    if problem is not None and not busy:
        # Nothing to roll out and nothing known about the pods: record the phase, nothing else,
        # so idle deployments without Prometheus are not rewritten on every tick.
        update = StatusUpdate(fields={"rollout": update.fields["rollout"]},
                              conditions=[c for c in update.conditions if c[2] in REJECTION_REASONS])
    try:
        kube.write_status(INFERENCE_DEPLOYMENT, namespace, name, update, generation=body["metadata"].get("generation"),
                          read=body)
    except ApiException as err:
        raise kopf.TemporaryError(f"writing rollout status failed ({err.status} {err.reason})", delay=5)
    if target.problem is not None:
        prior = next((c for c in status.conditions or [] if c.type == CONDITION), None)
        if prior is None or (prior.reason, prior.message) != (target.reason, target.problem):
            kopf.warn(body, reason=target.reason, message=target.problem[:1000])
            logger.warning("not rolling out: %s", target.problem)

    relations = forward_pass_relations(active_before=active, state=next_state, target=target)
    _record_forward_pass_usage(kube, namespace, name, relations, {target_name: forward_pass} if target_name else {},
                               now, logger)

    if next_state.phase != state.phase or (next_state.desired != state.desired and next_state.phase not in SETTLED):
        reason = EVENT_REASONS.get(next_state.phase, next_state.phase)
        if next_state.phase in ("RolledBack", "Failed"):
            kopf.warn(body, reason=reason, message=next_state.message[:1000])
        else:
            kopf.info(body, reason=reason, message=next_state.message[:1000])
        logger.info("rollout %s -> %s: %s", state.phase, next_state.phase, next_state.message)


def _record_forward_pass_usage(kube: Kube, namespace: str, deployment: str,
                               relations: Mapping[str, tuple[Relation, str, str]],
                               already_read: Mapping[str, Mapping[str, Any] | None], now: datetime,
                               logger: logging.Logger) -> None:
    """Apply the deployment's relations to each ForwardPass's status; read-compute-patch, so
    deployments sharing a ForwardPass do not overwrite each other. A ForwardPass read this tick
    whose status already says so costs no request."""
    for fp_name, (relation, reason, message) in sorted(relations.items()):
        def compute(stored: Mapping[str, Any], relation=relation, reason=reason, message=message):
            return forward_pass_usage(ForwardPassStatus.model_validate(dict(stored)), deployment, relation,
                                      reason=reason, message=message, now=_iso(now))

        known = already_read.get(fp_name)
        if known is not None and compute(known.get("status") or {}) is None:
            continue
        try:
            if kube.update_status(FORWARD_PASS, namespace, fp_name, compute):
                logger.info("ForwardPass %s: %s by %s", fp_name, relation, deployment)
        except ApiException as err:
            raise kopf.TemporaryError(f"writing the status of ForwardPass {fp_name} failed "
                                      f"({err.status} {err.reason})", delay=5)


@kopf.on.delete(GROUP, VERSION, INFERENCE_DEPLOYMENT.plural, optional=True)
def forget_deleted_deployment(name: str, namespace: str, status: kopf.Status, memo: kopf.Memo,
                              logger: logging.Logger, **_: Any) -> None:
    """A deleted deployment runs nothing: take it off the ForwardPasses that list it. Best effort
    (optional: no finalizer of its own, and a failure never blocks the deletion)."""
    parsed: InferenceDeploymentStatus = parse_status(INFERENCE_DEPLOYMENT, status)
    names = {parsed.active_forward_pass.name if parsed.active_forward_pass else None,
             parsed.rollout.desired.name if parsed.rollout and parsed.rollout.desired else None}
    relations: dict[str, tuple[Relation, str, str]] = {
        fp: ("gone", "", "") for fp in names if fp and fp != STOCK_FORWARD_PASS}
    try:
        _record_forward_pass_usage(kube_of(memo), namespace, name, relations, {},
                                   datetime.now(timezone.utc).replace(microsecond=0), logger)
    except kopf.TemporaryError as err:
        logger.warning("InferenceDeployment %s deleted; %s", name, err)
