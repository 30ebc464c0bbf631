"""InferenceDeployment handlers: the engine children and the status of what really runs.

    create/update/resume -> ensure ConfigMap, Service, Deployment -> status
    resync timer         -> ensure children (recreate a deleted one) -> status from the
                            Deployment's and pods' real state (status.engine_status)

Under the Restart rollout strategy the pod template names the forward pass the rollout
wants; it is read from the freshly read status (the rollout timer writes it; a stale body
here would roll the pods back and forth), and written through handlers/children.py, the
engine Deployment's one writer.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes.client import ApiException
from pydantic import ValidationError

from shapeshift.operator import builders
from shapeshift.operator.api import GROUP, INFERENCE_DEPLOYMENT, VERSION, InferenceDeploymentSpec, parse_spec, parse_status
from shapeshift.operator.handlers.children import engine_child_writers
from shapeshift.operator.handlers.errors import api_errors, api_message, parse_or_fail
from shapeshift.operator.kube import Kube, kube_of
from shapeshift.operator.rollout import RolloutState
from shapeshift.operator.rollout_tick import identity_of, state_from_status
from shapeshift.operator.settings import registered_timers
from shapeshift.operator.status import StatusUpdate, engine_status, newly_failing, newly_unschedulable

IDEP = (GROUP, VERSION, INFERENCE_DEPLOYMENT.plural)
RESYNC_SECONDS = registered_timers().resync_seconds


CHILDREN_CONDITION = "ChildrenApplied"


def _write_child(body: kopf.Body, kube: Kube, write):
    """One child's write; a child the API server refuses (invalid, forbidden) becomes phase Failed,
    condition ChildrenApplied=False with the API server's message, and a Warning event (once per
    message), then a retry: the condition stays current until a write succeeds."""
    try:
        return api_errors(write)
    except ApiException as error:
        name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        message = f"the API server refused a child of this InferenceDeployment: {api_message(error)}"[:4096]
        before = parse_status(INFERENCE_DEPLOYMENT, body.get("status"))
        prior = next((c for c in before.conditions or [] if c.type == CHILDREN_CONDITION), None)
        kube.write_status(INFERENCE_DEPLOYMENT, namespace, name, StatusUpdate(
            {"phase": "Failed", "message": message}, [(CHILDREN_CONDITION, "False", "ChildRefused", message),
                                                      ("Ready", "False", "ChildRefused", message)]))
        if prior is None or prior.message != message:
            kopf.warn(body, reason="ChildRefused", message=message[:1000])
        raise kopf.TemporaryError(message, delay=30) from error


def _reconcile_engine(body: kopf.Body, spec: InferenceDeploymentSpec, kube: Kube,
                      logger: logging.Logger) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Ensure the engine children. Returns what this read on the way, for _observe_engine:
    (the InferenceDeployment if it was read afresh, else None; the engine Deployment as stored)."""
    stored: dict[str, Any] | None = None
    rollout, active = RolloutState(), None
    if spec.rollout.strategy == "Restart":
        stored = api_errors(lambda: kube.get_custom(INFERENCE_DEPLOYMENT, body["metadata"]["namespace"],
                                                    body["metadata"]["name"]))
        status = parse_status(INFERENCE_DEPLOYMENT, (stored or body).get("status"))
        rollout, active = state_from_status(status.rollout), identity_of(status.active_forward_pass)
    by_kind: dict[str, dict[str, Any]] = {}
    for write in engine_child_writers(kube, builders.Parent.from_body(body), spec, rollout, active):
        action, desired, by_kind[desired["kind"]] = _write_child(body, kube, write)
        if action != "unchanged":
            what = f"{desired['kind']} {desired['metadata']['name']}"
            logger.info("%s %s", action, what)
            kopf.info(body, reason=action.capitalize(), message=f"{action} {what}")
    return stored, by_kind["Deployment"]


def _observe_engine(body: kopf.Body, spec: InferenceDeploymentSpec, kube: Kube,
                    read: tuple[dict[str, Any] | None, dict[str, Any]]) -> None:
    """Status from the engine Deployment (as _reconcile_engine just stored or found it) and its pods."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    stored, deployment = read
    update = engine_status(name=name, spec=spec, generation=body["metadata"].get("generation"),
                           deployment=deployment,
                           pods=kube.list("Pod", namespace, builders.engine_selector(name)))
    update.conditions.append((CHILDREN_CONDITION, "True", "Applied",
                              "the engine ConfigMap, Service and Deployment match the spec"))
    before = parse_status(INFERENCE_DEPLOYMENT, body.get("status"))
    changed, _ = kube.write_status(INFERENCE_DEPLOYMENT, namespace, name, update,
                                   generation=body["metadata"].get("generation"), read=stored)
    unschedulable = newly_unschedulable(before.conditions, update)
    if changed and unschedulable:
        kopf.warn(body, reason="Unschedulable", message=unschedulable)
    for reason, message in newly_failing(before.conditions, update) if changed else ():
        kopf.warn(body, reason=reason, message=message[:1000])  # PodsCreated / PodsHealthy turned False


@kopf.on.resume(*IDEP)
@kopf.on.create(*IDEP)
@kopf.on.update(*IDEP, field="spec")
def inference_deployment_reconcile(body: kopf.Body, spec: kopf.Spec, memo: kopf.Memo,
                                   logger: logging.Logger, **_: Any) -> None:
    """Make the engine ConfigMap, Service and Deployment match the spec, then report status."""
    kube = kube_of(memo)
    parsed = parse_or_fail(INFERENCE_DEPLOYMENT, spec, body, kube)
    read = _reconcile_engine(body, parsed, kube, logger)
    api_errors(lambda: _observe_engine(body, parsed, kube, read))


@kopf.timer(*IDEP, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, backoff=RESYNC_SECONDS)
def inference_deployment_observe(body: kopf.Body, spec: kopf.Spec, memo: kopf.Memo,
                                 logger: logging.Logger, **_: Any) -> None:
    """Resync: recreate a missing child, then status from what is really running."""
    kube = kube_of(memo)
    try:
        parsed = parse_spec(INFERENCE_DEPLOYMENT, spec)
    except ValidationError:
        return  # the edge handler reported it and will not retry
    read = _reconcile_engine(body, parsed, kube, logger)
    api_errors(lambda: _observe_engine(body, parsed, kube, read))
