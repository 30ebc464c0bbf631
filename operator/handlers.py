"""kopf handlers: thin reactions that call the pure builders and status functions.

    InferenceDeployment create/update/resume -> ensure ConfigMap, Service, Deployment -> status
    InferenceDeployment timer (resync)       -> ensure children (recreate a deleted one) -> status
                                                from the Deployment's and pods' real state
    CompileRun create/resume                 -> read its InferenceDeployment -> ensure RBAC + Job -> status
    CompileRun timer (resync)                -> Job conditions and pod scheduling -> phase, conditions
    (imported at the end) drift_handlers     -> drift timer: Prometheus -> observed traffic -> CompileRun
    (imported at the end) rollout_handlers   -> rollout timer: desired ForwardPass -> canary pods ->
                                                analysis in Prometheus -> all pods (or back)

Edge handlers react; timers observe. Every write is get-or-create-then-update
keyed by a content hash (kube.Kube.ensure) and every status write merges only
when something changed (kube.Kube.write_status), so a resync or an operator
restart changes nothing that is already right. Children carry controller
owner references: deleting a parent is left to the garbage collector (no
finalizers). A CompileRun's Job is created once and never patched; the run's
spec is immutable (CEL rule) and its Job's fate is final.

Retries go through kopf's error types: TemporaryError for what time can fix
(the deployment of a CompileRun not created yet, API conflicts),
PermanentError for specs the models reject. Users see kopf events for
created children, unschedulable pods and finished runs.

The resync interval is SHAPESHIFT_RESYNC_SECONDS (default 10), read at import.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from kubernetes.client import ApiException
from pydantic import ValidationError

from shapeshift.operator import builders
from shapeshift.operator.kube import Kube, kube_of
from shapeshift.operator.api import (
    COMPILE_RUN,
    GROUP,
    INFERENCE_DEPLOYMENT,
    TERMINAL_PHASES,
    VERSION,
    CompileRunStatus,
    InferenceDeploymentSpec,
    Kind,
    parse_spec,
    parse_status,
    short_error,
)
from shapeshift.operator.status import StatusUpdate, compile_run_status, inference_deployment_status

RESYNC_SECONDS = float(os.environ.get("SHAPESHIFT_RESYNC_SECONDS", "10"))

IDEP = (GROUP, VERSION, INFERENCE_DEPLOYMENT.plural)
CRUN = (GROUP, VERSION, COMPILE_RUN.plural)


# ---- operator lifecycle ----------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations (status is schema-checked and ours), post INFO+ events."""
    del memo  # the API client is created lazily by kube_of()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the ServiceAccount. Elsewhere: $KUBECONFIG as it is now (the client
    library's own auto-login reads $KUBECONFIG once, when it is first imported)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


def _parse(kind: Kind, spec: Any, body: kopf.Body, kube: Kube) -> Any:
    try:
        return parse_spec(kind, spec)
    except ValidationError as error:
        message = f"invalid spec: {short_error(error)}"
        kube.write_status(kind, body["metadata"]["namespace"], body["metadata"]["name"],
                          StatusUpdate({"phase": "Failed", "message": message},
                                       [("Ready", "False", "InvalidSpec", message)]))
        raise kopf.PermanentError(f"{kind.kind} {body['metadata']['name']}: {message}")


def _api_errors(call):
    """Turn retryable API errors into kopf.TemporaryError (conflicts, throttling, server errors)."""
    try:
        return call()
    except ApiException as error:
        if error.status in (409, 429) or (error.status or 0) >= 500:
            raise kopf.TemporaryError(f"API server answered {error.status} {error.reason}; retrying", delay=5)
        raise


# ---- InferenceDeployment -------------------------------------------------------------------


def _engine_children(body: kopf.Body, spec: InferenceDeploymentSpec,
                     template_annotations: dict[str, str] | None = None) -> list[dict[str, Any]]:
    parent = builders.Parent.from_body(body)
    return [
        builders.build_engine_configmap(parent, spec),
        builders.build_engine_service(parent, spec),
        builders.build_engine_deployment(parent, spec, template_annotations),
    ]


def _template_annotations(body: kopf.Body, spec: InferenceDeploymentSpec,
                          kube: Kube) -> tuple[dict[str, str], dict[str, Any] | None]:
    """The forward pass the Restart rollout put in the pod template, from the freshly read status
    (the rollout timer writes it; a stale body here would roll the pods back and forth).
    Returns (annotations, the InferenceDeployment as read; None when there was no need to read it)."""
    if spec.rollout.strategy != "Restart":
        return {}, None
    from shapeshift.operator.rollout_handlers import template_annotations_for

    stored = _api_errors(lambda: kube.get_custom(INFERENCE_DEPLOYMENT, body["metadata"]["namespace"],
                                                 body["metadata"]["name"]))
    return template_annotations_for(spec, parse_status(INFERENCE_DEPLOYMENT, (stored or body).get("status"))), stored


def _reconcile_engine(body: kopf.Body, spec: InferenceDeploymentSpec, kube: Kube,
                      logger: logging.Logger) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Ensure the engine children. Returns what this read on the way, for _observe_engine:
    (the InferenceDeployment if it was read afresh, else None; the engine Deployment as stored)."""
    annotations, stored = _template_annotations(body, spec, kube)
    by_kind: dict[str, dict[str, Any]] = {}
    for desired in _engine_children(body, spec, annotations):
        action, by_kind[desired["kind"]] = _api_errors(lambda: kube.ensure(desired))
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
    deployment_name = builders.engine_deployment_name(name)
    selector = builders.engine_selector(name)
    pods = kube.list("Pod", namespace, selector)
    update = inference_deployment_status(
        generation=body["metadata"].get("generation"),
        desired_replicas=spec.replicas,
        deployment=deployment,
        pods=pods,
        deployment_name=deployment_name,
        service_name=builders.engine_service_name(name),
        selector=",".join(f"{k}={v}" for k, v in sorted(selector.items())),
    )
    before = parse_status(INFERENCE_DEPLOYMENT, body.get("status"))
    changed, _ = kube.write_status(INFERENCE_DEPLOYMENT, namespace, name, update,
                                   generation=body["metadata"].get("generation"), read=stored)
    scheduled = update.condition("Scheduled")
    if changed and scheduled and scheduled[1] == "False":
        prior = next((c for c in before.conditions or [] if c.type == "Scheduled"), None)
        if prior is None or prior.status != "False":
            kopf.warn(body, reason="Unschedulable", message=scheduled[3])


@kopf.on.resume(*IDEP)
@kopf.on.create(*IDEP)
@kopf.on.update(*IDEP, field="spec")
def inference_deployment_reconcile(body: kopf.Body, spec: kopf.Spec, memo: kopf.Memo,
                                   logger: logging.Logger, **_: Any) -> None:
    """Make the engine ConfigMap, Service and Deployment match the spec, then report status."""
    kube = kube_of(memo)
    parsed = _parse(INFERENCE_DEPLOYMENT, spec, body, kube)
    read = _reconcile_engine(body, parsed, kube, logger)
    _api_errors(lambda: _observe_engine(body, parsed, kube, read))


@kopf.timer(*IDEP, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def inference_deployment_observe(body: kopf.Body, spec: kopf.Spec, memo: kopf.Memo,
                                 logger: logging.Logger, **_: Any) -> None:
    """Resync: recreate a missing child, then status from what is really running."""
    kube = kube_of(memo)
    try:
        parsed = parse_spec(INFERENCE_DEPLOYMENT, spec)
    except ValidationError:
        return  # the edge handler reported it and will not retry
    read = _reconcile_engine(body, parsed, kube, logger)
    _api_errors(lambda: _observe_engine(body, parsed, kube, read))


# ---- CompileRun ------------------------------------------------------------------------------


@kopf.on.resume(*CRUN)
@kopf.on.create(*CRUN)
def compile_run_start(body: kopf.Body, spec: kopf.Spec, memo: kopf.Memo,
                      logger: logging.Logger, **_: Any) -> None:
    """Create the run's ServiceAccount, Role, RoleBinding and Job (once), then report status."""
    kube = kube_of(memo)
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    current: CompileRunStatus = parse_status(COMPILE_RUN, body.get("status"))
    if current.phase in TERMINAL_PHASES:
        return  # a finished run is never started again
    run = _parse(COMPILE_RUN, spec, body, kube)
    dep_name = run.deployment_ref.name
    dep_body = _api_errors(lambda: kube.get_custom(INFERENCE_DEPLOYMENT, namespace, dep_name))
    if dep_body is None:
        message = f"InferenceDeployment {dep_name} not found in namespace {namespace}; waiting for it"
        kube.write_status(COMPILE_RUN, namespace, name,
                          StatusUpdate({"phase": "Pending", "message": message},
                                       [("DeploymentFound", "False", "NotFound", message)]))
        raise kopf.TemporaryError(message, delay=15)
    try:
        deployment = parse_spec(INFERENCE_DEPLOYMENT, dep_body.get("spec"))
    except ValidationError as error:
        message = f"InferenceDeployment {dep_name} has an invalid spec: {short_error(error)}"
        kube.write_status(COMPILE_RUN, namespace, name,
                          StatusUpdate({"phase": "Failed", "message": message},
                                       [("Failed", "True", "InvalidDeployment", message)]))
        raise kopf.PermanentError(message)

    parent = builders.Parent.from_body(body)
    for desired in builders.build_compile_rbac(parent, run):
        _api_errors(lambda: kube.ensure(desired))
    job = builders.build_compile_job(parent, run, deployment)
    action, _obj = _api_errors(lambda: kube.ensure(job, create_only=True))
    hardware = builders.compile_hardware(run, deployment)
    if action == "created":
        logger.info("created Job %s on %s", job["metadata"]["name"], hardware.accelerator)
        kopf.info(body, reason="JobCreated",
                  message=f"created Job {job['metadata']['name']} for accelerator {hardware.accelerator}")
    kube.write_status(COMPILE_RUN, namespace, name, StatusUpdate(
        {"accelerator": hardware.accelerator, "jobName": job["metadata"]["name"], "phase": current.phase or "Pending"},
        [("DeploymentFound", "True", "Found", f"InferenceDeployment {dep_name}")],
    ), generation=body["metadata"].get("generation"))
    _api_errors(lambda: _observe_run(body, kube))


def _observe_run(body: kopf.Body, kube: Kube) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    stored = kube.get_custom(COMPILE_RUN, namespace, name)
    if stored is None:
        return
    current: CompileRunStatus = parse_status(COMPILE_RUN, stored.get("status"))
    if current.phase in TERMINAL_PHASES:
        return
    job_name = builders.compile_job_name(name)
    job = kube.get("Job", namespace, job_name)
    if job is not None and not any(ref.get("uid") == stored["metadata"]["uid"]
                                   for ref in job["metadata"].get("ownerReferences") or []):
        raise kopf.PermanentError(f"Job {job_name} exists but is not owned by CompileRun {name}; rename one of them")
    pods = kube.list("Pod", namespace, {builders.LABEL_RUN: name}) if job is not None else []
    update = compile_run_status(current=current, job=job, job_name=job_name, pods=pods)
    changed, after = kube.write_status(COMPILE_RUN, namespace, name, update,
                                       generation=stored["metadata"].get("generation"), read=stored)
    if not changed:
        return
    phase = after.get("phase")
    before_sched = next((c for c in current.conditions or [] if c.type == "Scheduled"), None)
    scheduled = update.condition("Scheduled")
    if scheduled and scheduled[1] == "False" and (before_sched is None or before_sched.status != "False"):
        kopf.warn(body, reason="Unschedulable", message=scheduled[3])
    if phase != current.phase:
        if phase == "Succeeded":
            kopf.info(body, reason="Succeeded", message=after.get("message", ""))
        elif phase == "Failed":
            kopf.warn(body, reason="Failed", message=after.get("message", ""))
        elif phase in ("Scheduled", "Running"):
            kopf.info(body, reason=phase, message=after.get("message", ""))


@kopf.timer(*CRUN, interval=RESYNC_SECONDS, initial_delay=min(RESYNC_SECONDS, 5.0))
def compile_run_observe(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Resync: the Job's conditions and the pod's scheduling become phase and conditions."""
    current: CompileRunStatus = parse_status(COMPILE_RUN, body.get("status"))
    if current.phase in TERMINAL_PHASES:
        return
    _api_errors(lambda: _observe_run(body, kube_of(memo)))


# ---- the rest of the operator ------------------------------------------------------------------
# The drift timer (Prometheus -> observed traffic -> CompileRun) registers itself on import,
# so `kopf run -m shapeshift.operator.handlers` and `shapeshift operator` run the whole operator.
from shapeshift.operator import drift_handlers  # noqa: E402,F401
from shapeshift.operator import rollout_handlers  # noqa: E402,F401
