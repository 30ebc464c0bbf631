"""CompileRun handlers: its least-privilege RBAC and Job, and the Job's fate as the run's status.

    create/resume -> read its InferenceDeployment -> owner reference to it (deleting the
                     deployment deletes the run, its Job and pod) -> ensure ServiceAccount, Role,
                     RoleBinding, Job (once) -> status
    resync timer  -> Job conditions and pod scheduling -> phase, conditions
                     (status.compile_run_status), events (status.compile_run_event)

A CompileRun's Job is created once and never patched; the run's spec is immutable (CEL
rule) and its Job's fate is final. A run whose deployment does not exist yet waits for it
(TemporaryError); one whose deployment's spec is invalid fails for good.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from pydantic import ValidationError

from shapeshift.operator import builders
from shapeshift.operator.api import (
    COMPILE_RUN,
    GROUP,
    INFERENCE_DEPLOYMENT,
    TERMINAL_PHASES,
    VERSION,
    CompileRunStatus,
    parse_spec,
    parse_status,
    short_error,
)
from shapeshift.operator.handlers.errors import api_errors, parse_or_fail
from shapeshift.operator.kube import Kube, kube_of
from shapeshift.operator.outbound import outbound_problem
from shapeshift.operator.settings import OperatorSettings, registered_timers
from shapeshift.operator.status import (StatusUpdate, compile_run_event, compile_run_status, newly_failing,
                                        newly_unschedulable)

CRUN = (GROUP, VERSION, COMPILE_RUN.plural)
RESYNC_SECONDS = registered_timers().resync_seconds


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
    run = parse_or_fail(COMPILE_RUN, spec, body, kube)
    dep_name = run.deployment_ref.name
    dep_body = api_errors(lambda: kube.get_custom(INFERENCE_DEPLOYMENT, namespace, dep_name))
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

    api_errors(lambda: _owned_by_deployment(kube, body, dep_body))
    refused = _refused_endpoints(run)
    if refused:
        message = "; ".join(refused)
        kube.write_status(COMPILE_RUN, namespace, name,
                          StatusUpdate({"phase": "Failed", "message": message},
                                       [("Failed", "True", "OutboundRefused", message)]))
        kopf.warn(body, reason="OutboundRefused", message=message[:1000])
        raise kopf.PermanentError(message)

    parent = builders.Parent.from_body(body)
    for desired in builders.build_compile_rbac(parent, run):
        api_errors(lambda: kube.ensure(desired))
    job = builders.build_compile_job(parent, run, deployment)
    action, _obj = api_errors(lambda: kube.ensure(job, create_only=True))
    hardware = builders.compile_hardware(run, deployment)
    if action == "created":
        logger.info("created Job %s on %s", job["metadata"]["name"], hardware.accelerator)
        kopf.info(body, reason="JobCreated",
                  message=f"created Job {job['metadata']['name']} for accelerator {hardware.accelerator}")
    kube.write_status(COMPILE_RUN, namespace, name, StatusUpdate(
        {"accelerator": hardware.accelerator, "jobName": job["metadata"]["name"], "phase": current.phase or "Pending"},
        [("DeploymentFound", "True", "Found", f"InferenceDeployment {dep_name}")],
    ), generation=body["metadata"].get("generation"))
    api_errors(lambda: _observe_run(body, kube))


def _owned_by_deployment(kube: Kube, body: kopf.Body, deployment: dict[str, Any]) -> None:
    """Make the run a dependent of its InferenceDeployment (drift runs already are), so deleting
    the deployment deletes the run, its Job and its pod through the garbage collector, freeing
    the accelerators. Not a controller reference: a run created by hand stays the user's."""
    refs = list(body["metadata"].get("ownerReferences") or [])
    uid = deployment["metadata"]["uid"]
    if any(ref.get("uid") == uid for ref in refs):
        return
    refs.append({"apiVersion": deployment["apiVersion"], "kind": deployment["kind"],
                 "name": deployment["metadata"]["name"], "uid": uid})
    kube.custom.patch_namespaced_custom_object(GROUP, VERSION, body["metadata"]["namespace"], COMPILE_RUN.plural,
                                               body["metadata"]["name"], {"metadata": {"ownerReferences": refs}})


def _refused_endpoints(run: Any) -> list[str]:
    """The agents' LLM endpoints the outbound policy refuses (checked before the Job exists, so
    no compile pod is started to call them)."""
    allowed = OperatorSettings.from_environ().outbound_allowed_cidrs
    problems = (outbound_problem(agent.llm.endpoint, allowed, what=f"spec.agents[{i}].llm.endpoint")
                for i, agent in enumerate(run.agents) if agent.llm is not None)
    return [p for p in problems if p is not None]


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
    unschedulable = newly_unschedulable(current.conditions, update)
    if unschedulable:
        kopf.warn(body, reason="Unschedulable", message=unschedulable)
    for reason, message in newly_failing(current.conditions, update):
        kopf.warn(body, reason=reason, message=message[:1000])  # PodFailed: a retried attempt's pod failed
    event = compile_run_event(current.phase, after)
    if event is not None:
        kind, reason, message = event
        (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason, message=message)


@kopf.timer(*CRUN, interval=RESYNC_SECONDS, initial_delay=min(RESYNC_SECONDS, 5.0), backoff=RESYNC_SECONDS)
def compile_run_observe(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Resync: the Job's conditions and the pod's scheduling become phase and conditions."""
    current: CompileRunStatus = parse_status(COMPILE_RUN, body.get("status"))
    if current.phase in TERMINAL_PHASES:
        return
    api_errors(lambda: _observe_run(body, kube_of(memo)))
