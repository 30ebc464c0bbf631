"""The rollout timer: a verified ForwardPass reaches the engine pods, canary first.

    the deployment (read fresh), its CompileRuns, the target ForwardPass and the CompileRun that
    published it, its engine pods (API)
        --rollout_target.resolve_target--> Target (trusted when its CompileRun vouches for it, or the
          operator recorded that it did in status.verifiedForwardPasses: operator/provenance.py)
    Prometheus (rollout_metrics.RolloutQueries): what each pod reports running
        --rollout_tick.plan_rollout_tick--> RolloutTick
        --apply--> HotReload: merge-patch each pod's forward-pass annotations;
                   Restart: the engine Deployment's pod template (handlers/children.py);
                   status.rollout and the rest; a Warning for a target it refuses; each
                   concerned ForwardPass's status (status.forward_pass_usage); an event for
                   every phase transition

Deleting a deployment takes it off the ForwardPasses that list it (best effort). The tick
interval is SHAPESHIFT_ROLLOUT_TIMER_SECONDS (default: the resync interval); the Prometheus
and analysis settings are operator/settings.py's, read on every tick.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any, Mapping

import kopf
from kubernetes.client import ApiException
from pydantic import ValidationError

from shapeshift.engine.contracts.pod_annotations import STOCK_FORWARD_PASS
from shapeshift.operator import builders
from shapeshift.operator.api import (
    COMPILE_RUN,
    FORWARD_PASS,
    GROUP,
    INFERENCE_DEPLOYMENT,
    VERSION,
    ForwardPassStatus,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    parse_spec,
    parse_status,
)
from shapeshift.operator.drift_check import selector_for
from shapeshift.operator.handlers.children import ensure_engine_deployment
from shapeshift.operator.handlers.errors import api_errors
from shapeshift.operator.kube import MERGE_PATCH, Kube, kube_of
from shapeshift.operator.provenance import publishing_run
from shapeshift.operator.prometheus import PrometheusTraffic, TrafficQueryError
from shapeshift.operator.rollout import template_forward_pass
from shapeshift.operator.rollout_metrics import PodReport, RolloutQueries
from shapeshift.operator.regimes import newest_champion, target_forward_pass
from shapeshift.operator.rollout_target import resolve_target
from shapeshift.operator.rollout_tick import RolloutTick, plan_rollout_tick, serving_pods
from shapeshift.operator.settings import NO_PROMETHEUS_ADDRESS, OperatorSettings, registered_timers
from shapeshift.operator.status import Relation, forward_pass_usage

TIMER_SECONDS = registered_timers().rollout_timer_seconds


def _target_name(kube: Kube, namespace: str, name: str, spec: InferenceDeploymentSpec,
                 status: InferenceDeploymentStatus) -> str | None:
    if spec.forward_pass:
        return spec.forward_pass
    runs = kube.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, COMPILE_RUN.plural)["items"]
    # the regime library's switch, unless a CompileRun finished after it (operator/regimes.py)
    return target_forward_pass(spec, status, newest_champion(runs, name, status.verified_forward_passes or []))


def _reports(url: str | None, settings: OperatorSettings, namespace: str, name: str,
             spec: InferenceDeploymentSpec) -> tuple[RolloutQueries | None, dict[str, PodReport], str | None]:
    if not url:
        return None, {}, NO_PROMETHEUS_ADDRESS
    selector = selector_for(namespace, name, spec, settings)
    prometheus = PrometheusTraffic(url, timeout_seconds=settings.prometheus_timeout_seconds,
                                   allowed_cidrs=settings.outbound_allowed_cidrs)
    queries = RolloutQueries(prometheus, selector, settings.prometheus_pod_label)
    try:
        return queries, queries.reports(), None
    except TrafficQueryError as err:
        prometheus.close()
        return None, {}, str(err)


@kopf.timer(GROUP, VERSION, INFERENCE_DEPLOYMENT.plural, interval=TIMER_SECONDS, initial_delay=1.0,
            backoff=TIMER_SECONDS)
def rollout_tick(name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Advance the rollout of the deployment's desired ForwardPass by one observation."""
    api_errors(lambda: _rollout_tick(name, namespace, memo, logger), retry_s=TIMER_SECONDS)


def _rollout_tick(name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger) -> None:
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
    settings = OperatorSettings.from_environ()
    try:
        target_name = _target_name(kube, namespace, name, spec, status)
        forward_pass = kube.get_custom(FORWARD_PASS, namespace, target_name) if target_name else None
        publisher = publishing_run(forward_pass, namespace)
        compile_run = kube.get_custom(COMPILE_RUN, namespace, publisher) if publisher else None
        pods = serving_pods(kube.list("Pod", namespace, builders.engine_selector(name)))
    except ApiException as err:
        raise kopf.TemporaryError(f"reading the rollout's inputs failed ({err.status} {err.reason})", delay=10)
    queries, reports, problem = _reports(spec.prometheus_url or settings.prometheus_url, settings, namespace,
                                         name, spec)
    try:
        target = resolve_target(target_name, forward_pass, spec, compile_run, status.verified_forward_passes or [],
                                now=now)
        tick = plan_rollout_tick(spec=spec, status=status, target=target,
                                 pods=pods, reports=reports, prometheus_problem=problem,
                                 analyze=queries.analysis if queries is not None else None,
                                 settings=settings, now=now)
    finally:
        if queries is not None:
            queries.prometheus.close()
    _apply(kube, body, spec, tick, logger)
    _record_forward_pass_usage(kube, namespace, name, tick.relations,
                               {target_name: forward_pass} if target_name else {}, now, logger)
    if tick.event is not None:
        kind, reason, message = tick.event
        (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason, message=message[:1000])
        logger.info("rollout %s -> %s: %s", tick.state.phase, tick.next_state.phase, tick.next_state.message)


def _apply(kube: Kube, body: Mapping[str, Any], spec: InferenceDeploymentSpec, tick: RolloutTick,
           logger: logging.Logger) -> None:
    """The tick's writes to the pods (or the pod template) and to the deployment's status."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    if tick.policy.strategy == "HotReload":
        for pod_name, patch in tick.pod_patches.items():
            try:
                kube.core.patch_namespaced_pod(pod_name, namespace, {"metadata": {"annotations": patch}},
                                               _content_type=MERGE_PATCH)
                logger.info("pod %s asked for %s", pod_name,
                            patch.get("shapeshift.dev/forward-pass") or STOCK_FORWARD_PASS)
            except ApiException as err:
                if err.status != 404:  # a pod deleted meanwhile needs nothing
                    raise kopf.TemporaryError(f"patching pod {pod_name} failed ({err.status} {err.reason})", delay=5)
    else:
        try:
            action, _, _ = ensure_engine_deployment(kube, builders.Parent.from_body(body), spec, tick.next_state,
                                                    tick.active)
        except ApiException as err:
            raise kopf.TemporaryError(f"updating the engine pod template failed ({err.status} {err.reason})",
                                      delay=5)
        if action == "updated":
            chosen = template_forward_pass(tick.next_state, tick.active)
            logger.info("engine pod template now asks for %s", chosen.name if chosen else STOCK_FORWARD_PASS)
    try:
        kube.write_status(INFERENCE_DEPLOYMENT, namespace, name, tick.update,
                          generation=body["metadata"].get("generation"), read=body)
    except ApiException as err:
        raise kopf.TemporaryError(f"writing rollout status failed ({err.status} {err.reason})", delay=5)
    if tick.warning is not None:
        reason, problem = tick.warning
        kopf.warn(body, reason=reason, message=problem[:1000])
        logger.warning("not rolling out: %s", problem)


def _record_forward_pass_usage(kube: Kube, namespace: str, deployment: str,
                               relations: Mapping[str, tuple[Relation, str, str]],
                               already_read: Mapping[str, Mapping[str, Any] | None], now: datetime,
                               logger: logging.Logger) -> None:
    """Apply the deployment's relations to each ForwardPass's status; read-compute-patch, so
    deployments sharing a ForwardPass do not overwrite each other. A ForwardPass read this tick
    whose status already says so costs no request."""
    stamp = now.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    for fp_name, (relation, reason, message) in sorted(relations.items()):
        def compute(stored: Mapping[str, Any], relation=relation, reason=reason, message=message):
            return forward_pass_usage(ForwardPassStatus.model_validate(dict(stored)), deployment, relation,
                                      reason=reason, message=message, now=stamp)

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

