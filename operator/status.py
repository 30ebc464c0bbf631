"""What is really running -> status. Pure functions over the objects' JSON.

    Deployment + engine pods   --inference_deployment_status()--> StatusUpdate
                               (engine_status(): the same, named from the deployment)
    Job + compile pods + status --compile_run_status()----------> StatusUpdate
                               --compile_run_event()-----------> the event of a phase change
    stored conditions + update --newly_unschedulable()---------> a Warning to post, once
    ForwardPass status + one deployment's relation to it (from the rollout)
                               --forward_pass_usage()-----------> phase, deployments, refusals

A `StatusUpdate` names only the status fields the operator owns (other
writers, the compile worker and the rollout, own the rest) plus the
conditions it sets; `kube.write_status` merges it into what is stored. The
timers call these functions on every resync; the result depends only on the
observed objects, so an unchanged cluster gives an unchanged status and no
write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from shapeshift.operator import builders
from shapeshift.operator.api import (
    Condition,
    CompileRunStatus,
    ForwardPassStatus,
    InferenceDeploymentSpec,
    TERMINAL_PHASES,
    get_condition,
)


@dataclass
class StatusUpdate:
    fields: dict[str, Any]  # wire names -> values (None deletes the field)
    conditions: list[tuple[str, Literal["True", "False", "Unknown"], str, str]] = field(default_factory=list)
    # (type, status, reason, message)

    def condition(self, type: str) -> tuple[str, str, str, str] | None:
        return next((c for c in self.conditions if c[0] == type), None)


# ---- pods ----------------------------------------------------------------------------------


def _pod_condition(pod: dict[str, Any], type: str) -> dict[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == type), None)


def unschedulable_message(pods: list[dict[str, Any]]) -> str | None:
    """The scheduler's message for the first pod it could not place, if any."""
    for pod in pods:
        if (pod.get("spec") or {}).get("nodeName"):
            continue
        cond = _pod_condition(pod, "PodScheduled")
        if cond and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return f"pod {pod['metadata']['name']}: {cond.get('message') or 'no node fits'}"
    return None


# Container waiting reasons that mean the pod will not get better on its own.
FAILING_WAITING_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                           "CreateContainerConfigError", "CreateContainerError", "RunContainerError")


def _terminated_detail(terminated: dict[str, Any]) -> str:
    code = terminated.get("exitCode")
    detail = f"exit code {code}" + (f" ({terminated['reason']})" if terminated.get("reason") else "")
    if terminated.get("message"):
        detail += f", termination message: {str(terminated['message']).strip()[:1000]}"
    return detail


def pod_failure(pod: dict[str, Any]) -> str | None:
    """Why `pod` is failing: a container that exited non-zero (exit code, reason, termination
    message), one stuck in CrashLoopBackOff or an image pull error, or a Failed pod; with its
    node. None: nothing is failing."""
    st = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName")
    where = f" on node {node}" if node else ""
    name = pod["metadata"]["name"]
    for container in st.get("containerStatuses") or []:
        state = container.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        last = (container.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") in FAILING_WAITING_REASONS:
            detail = f"{waiting['reason']}" + (f": {waiting['message']}" if waiting.get("message") else "")
            if last:
                detail += f"; last run: {_terminated_detail(last)}"
            return f"pod {name} container {container.get('name')}{where}: {detail}"[:4096]
        if terminated and terminated.get("exitCode") not in (0, None):
            return f"pod {name} container {container.get('name')}{where}: {_terminated_detail(terminated)}"[:4096]
    if st.get("phase") == "Failed":
        return f"pod {name}{where} failed: {st.get('reason') or ''} {st.get('message') or ''}".strip()[:4096]
    return None


def first_pod_failure(pods: list[dict[str, Any]]) -> str | None:
    """pod_failure of the newest failing pod."""
    for pod in sorted(pods, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]),
                      reverse=True):
        failure = pod_failure(pod)
        if failure is not None:
            return failure
    return None


def newest(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not pods:
        return None
    return max(pods, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))


# ---- InferenceDeployment -------------------------------------------------------------------


def inference_deployment_status(
    *,
    generation: int | None,
    desired_replicas: int,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    deployment_name: str,
    service_name: str,
    selector: str,
) -> StatusUpdate:
    """Phase, replica counts and Ready/Scheduled conditions from the engine Deployment and pods."""
    st = (deployment or {}).get("status") or {}
    replicas = int(st.get("replicas") or 0)
    ready = int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    dep_generation = (deployment or {}).get("metadata", {}).get("generation")
    rolled = deployment is not None and st.get("observedGeneration") == dep_generation
    dep_conditions = {c.get("type"): c for c in st.get("conditions") or []}
    progressing = dep_conditions.get("Progressing") or {}
    replica_failure = dep_conditions.get("ReplicaFailure") or {}
    cannot_create = (f"Deployment {deployment_name} cannot create pods: {replica_failure.get('message') or ''}".strip()
                     if replica_failure.get("status") == "True" else None)
    unschedulable = unschedulable_message(pods)
    failing = first_pod_failure(pods)

    conditions: list[tuple[str, Literal["True", "False", "Unknown"], str, str]] = []
    if deployment is None:
        phase, message = "Pending", f"Deployment {deployment_name} does not exist yet"
    elif progressing.get("reason") == "ProgressDeadlineExceeded":
        phase, message = "Degraded", f"Deployment {deployment_name}: {progressing.get('message', 'progress deadline exceeded')}"
    elif rolled and ready >= desired_replicas and updated >= desired_replicas and replicas == desired_replicas:
        phase, message = "Ready", f"{ready}/{desired_replicas} engine pods ready"
    elif cannot_create:
        phase, message = "Degraded", f"{ready}/{desired_replicas} engine pods ready; {cannot_create}"
    elif failing:
        phase, message = "Degraded", f"{ready}/{desired_replicas} engine pods ready; {failing}"
    elif unschedulable:
        phase, message = "Degraded", f"{ready}/{desired_replicas} engine pods ready; {unschedulable}"
    else:
        phase, message = "Progressing", f"{ready}/{desired_replicas} engine pods ready"

    not_ready = ("ReplicaFailure" if cannot_create else "PodsFailing" if failing else
                 "Unschedulable" if unschedulable else "ReplicasNotReady")
    conditions.append(("Ready", "True" if phase == "Ready" else "False",
                       "AllReplicasReady" if phase == "Ready" else not_ready, message[:4096]))
    if deployment is not None:
        # Kept current on every resync: a pod that recovers, or a ReplicaSet that can create pods
        # again, turns these back to True.
        conditions.append(("PodsCreated", "False", "ReplicaFailure", cannot_create) if cannot_create else
                          ("PodsCreated", "True", "Created", f"Deployment {deployment_name} creates its pods"))
        conditions.append(("PodsHealthy", "False", "PodsFailing", failing) if failing else
                          ("PodsHealthy", "True", "NoFailures", "no engine container is failing"))
    if unschedulable:
        conditions.append(("Scheduled", "False", "Unschedulable", unschedulable))
    elif pods:
        conditions.append(("Scheduled", "True", "Bound", "every engine pod is bound to a node"))
    return StatusUpdate(
        fields={
            "observedGeneration": generation,
            "phase": phase,
            "replicas": replicas,
            "readyReplicas": ready,
            "selector": selector,
            "deployment": deployment_name,
            "service": service_name,
            "message": message,
        },
        conditions=conditions,
    )


def engine_status(*, name: str, spec: InferenceDeploymentSpec, generation: int | None,
                  deployment: dict[str, Any] | None, pods: list[dict[str, Any]]) -> StatusUpdate:
    """inference_deployment_status of the InferenceDeployment ``name``, its children named as
    the builders name them."""
    selector = builders.engine_selector(name)
    return inference_deployment_status(
        generation=generation,
        desired_replicas=spec.replicas,
        deployment=deployment,
        pods=pods,
        deployment_name=builders.engine_deployment_name(name),
        service_name=builders.engine_service_name(name),
        selector=",".join(f"{k}={v}" for k, v in sorted(selector.items())),
    )


def newly_unschedulable(before: list[Condition] | None, update: StatusUpdate) -> str | None:
    """The message of the update's Scheduled=False condition when the stored conditions did
    not say so already (so the Warning event is posted once, not on every resync)."""
    scheduled = update.condition("Scheduled")
    if not scheduled or scheduled[1] != "False":
        return None
    prior = next((c for c in before or [] if c.type == "Scheduled"), None)
    return scheduled[3] if prior is None or prior.status != "False" else None


# The conditions whose bad state posts a Warning event: type -> the status that is bad.
FAILURE_CONDITIONS: dict[str, str] = {"PodsCreated": "False", "PodsHealthy": "False", "PodFailed": "True"}


def newly_failing(before: list[Condition] | None, update: StatusUpdate) -> list[tuple[str, str]]:
    """(reason, message) of each FAILURE_CONDITIONS condition the update puts in its bad state
    where the stored one was not already bad with that message: a Warning event each, posted once
    per distinct failure, not on every resync that finds it still there."""
    events = []
    for type_, bad in FAILURE_CONDITIONS.items():
        condition = update.condition(type_)
        if not condition or condition[1] != bad:
            continue
        prior = next((c for c in before or [] if c.type == type_), None)
        if prior is None or prior.status != bad or prior.message != condition[3]:
            events.append((condition[2], condition[3]))
    return events


# ---- CompileRun ----------------------------------------------------------------------------


def _job_condition(job: dict[str, Any], type: str) -> dict[str, Any] | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == type and c.get("status") == "True":
            return c
    return None


# The compile worker reports into status.message while it runs (progress, then its final word:
# "champion ...: 1.23x ..." or "no verified improvement ... (reason)"), and writes status.trials
# with every report; a worker that crashed writes a message starting with this prefix.
WORKER_FAILED_PREFIX = "compile worker failed"


def worker_message(current: CompileRunStatus) -> str | None:
    """The message the compile worker last wrote, or None when the worker has not reported."""
    if not current.message:
        return None
    if current.trials is not None or current.message.startswith(WORKER_FAILED_PREFIX):
        return current.message
    return None


def compile_run_status(
    *,
    current: CompileRunStatus,
    job: dict[str, Any] | None,
    job_name: str,
    pods: list[dict[str, Any]],
) -> StatusUpdate:
    """The run's phase from its Job (the Job's fate is final) and its newest pod.

    Phases only move forward: a worker-reported `Verifying` is not turned
    back into `Running`, and a terminal phase is never changed. Once the worker
    has reported, status.message is its own: the final phase keeps it (and the
    Complete or Failed condition quotes it), so "no verified improvement (...)"
    or the champion's speedup is what a user reads, not just "Job completed".
    """
    reported = worker_message(current)
    if current.phase in TERMINAL_PHASES:
        return StatusUpdate(fields={})
    if job is None:
        if current.job_name:
            return StatusUpdate(
                fields={"phase": "Failed", "message": f"Job {job_name} was deleted before it finished"},
                conditions=[("Failed", "True", "JobDeleted", f"Job {job_name} was deleted before it finished"),
                            ("Complete", "False", "JobDeleted", "")],
            )
        return StatusUpdate(fields={"phase": current.phase or "Pending"})

    job_status = job.get("status") or {}
    complete = _job_condition(job, "Complete")
    failed = _job_condition(job, "Failed")
    pod = newest(pods)
    fields: dict[str, Any] = {"jobName": job_name}
    if pod is not None:
        fields["podName"] = pod["metadata"]["name"]
        if (pod.get("spec") or {}).get("nodeName"):
            fields["nodeName"] = pod["spec"]["nodeName"]
    if job_status.get("startTime"):
        fields["startTime"] = job_status["startTime"]

    if complete is not None:
        done = job_status.get("completionTime") or complete.get("lastTransitionTime")
        fields.update(phase="Succeeded", completionTime=done)
        if reported is not None:
            msg = f"Job {job_name} completed: {reported}"  # status.message stays the worker's
        else:
            champion = f"; champion {current.champion}" if current.champion else ""
            msg = f"Job {job_name} completed{champion}"
            fields["message"] = msg
        return StatusUpdate(fields, [("Complete", "True", complete.get("reason") or "Completed", msg[:4096]),
                                     ("Failed", "False", "Completed", "")])
    failing = first_pod_failure(pods)
    if failed is not None:
        reason = failed.get("reason") or "JobFailed"
        detail = failed.get("message") or "the compile Job failed"
        msg = f"Job {job_name} failed ({reason}): {detail}"
        if failing is not None:
            msg += f"; {failing}"
        if reported is not None:
            msg += f"; last report of the worker: {reported}"
        fields.update(phase="Failed", completionTime=failed.get("lastTransitionTime"), message=msg[:4096])
        return StatusUpdate(fields, [("Failed", "True", reason, msg[:4096]), ("Complete", "False", reason, "")])

    # A pod of an earlier attempt failed and the Job retries (backoffLimit): say why, and keep it
    # current: the newest pod's failure, or none once it is past where the last one failed.
    retry = (("PodFailed", "True", "ContainerFailed", failing) if failing is not None else
             ("PodFailed", "False", "NoFailure", ""))
    unschedulable = unschedulable_message(pods)
    if unschedulable:
        msg = f"compile pod cannot be scheduled: {unschedulable}"
        fields.update(phase="Pending", message=msg)
        return StatusUpdate(fields, [("Scheduled", "False", "Unschedulable", msg)])
    if pod is None or not (pod.get("spec") or {}).get("nodeName"):
        fields.update(phase=current.phase or "Pending", message=f"Job {job_name} created; waiting for its pod to be scheduled")
        return StatusUpdate(fields, [])
    node = pod["spec"]["nodeName"]
    bound = ("Scheduled", "True", "Bound", f"pod {pod['metadata']['name']} bound to node {node}")
    pod_phase = (pod.get("status") or {}).get("phase")
    if pod_phase == "Running":
        phase = current.phase if current.phase in ("Running", "Verifying") else "Running"
        message = f"compiling on node {node}"
    else:
        phase = current.phase if current.phase in ("Running", "Verifying") else "Scheduled"
        message = f"pod {pod['metadata']['name']} bound to node {node}; starting"
    fields["phase"] = phase
    # While the worker runs it owns the message (progress); the operator writes one only
    # when it moves the phase and the worker has not reported yet (a late resync must not
    # replace a short run's final word with "compiling on node ...").
    if phase != current.phase and reported is None:
        fields["message"] = message
    if failing is not None and reported is None:
        fields["message"] = f"retrying after a failed attempt: {failing}"[:4096]
    return StatusUpdate(fields, [bound, retry])


def compile_run_event(before_phase: str | None,
                      after: dict[str, Any]) -> tuple[Literal["Normal", "Warning"], str, str] | None:
    """(type, reason, message) of the event a phase change of a CompileRun posts, if any."""
    phase = after.get("phase")
    if phase == before_phase:
        return None
    message = after.get("message", "")
    if phase == "Succeeded":
        return "Normal", "Succeeded", message
    if phase == "Failed":
        return "Warning", "Failed", message
    if phase in ("Scheduled", "Running"):
        return "Normal", phase, message
    return None


# ---- ForwardPass ---------------------------------------------------------------------------

# How one InferenceDeployment stands to a ForwardPass after a rollout tick:
#   runs     it is the deployment's active forward pass
#   refused  the deployment rolled it back, or cannot roll it out (not verified, wrong
#            accelerator, artifact not durable)
#   left     the deployment ran it and now runs another one
#   seen     it is being rolled out (canary, analysis): no list changes, the phase gets set
#   gone     the deployment was deleted
Relation = Literal["runs", "refused", "left", "seen", "gone"]


def forward_pass_phase(deployments: list[str], refusals: list[Any]) -> str:
    """Active while any deployment runs it; Refused when none does and some refused it."""
    if deployments:
        return "Active"
    return "Refused" if refusals else "Available"


def forward_pass_usage(current: ForwardPassStatus, deployment: str, relation: Relation, *, reason: str = "",
                       message: str = "", now: str | None = None) -> dict[str, Any] | None:
    """The ForwardPass status fields (phase, deployments, refusals) after recording one
    deployment's relation to it; None when that changes nothing. Lists are kept sorted by
    deployment, so the result does not depend on which deployment wrote first."""
    running = sorted(set(current.deployments or []))
    refusals = [r.to_wire() for r in current.refusals or []]
    others = [r for r in refusals if r["deployment"] != deployment]
    mine = next((r for r in refusals if r["deployment"] == deployment), None)
    if relation == "runs":
        running = sorted({*running, deployment})
        refusals = others
    elif relation == "refused":
        running = [d for d in running if d != deployment]
        if mine is None or (mine.get("reason"), mine.get("message", "")) != (reason, message[:4096]):
            mine = {k: v for k, v in {"deployment": deployment, "reason": reason, "message": message[:4096],
                                      "time": now}.items() if v is not None}
        refusals = sorted([*others, mine], key=lambda r: r["deployment"])
    elif relation in ("left", "gone"):
        running = [d for d in running if d != deployment]
        if relation == "gone":
            refusals = others
    phase = forward_pass_phase(running, refusals)
    before = ForwardPassStatus.model_validate({k: v for k, v in current.to_wire().items()
                                               if k in ("phase", "deployments", "refusals")})
    after = ForwardPassStatus.model_validate({"phase": phase, "deployments": running or None,
                                              "refusals": refusals or None})
    if before.to_wire() == after.to_wire():
        return None
    return {"phase": phase, "deployments": running or None, "refusals": refusals or None}


def merged_conditions(existing: list[Condition], update: StatusUpdate, generation: int | None) -> list[Condition]:
    from shapeshift.operator.api import set_condition

    out = list(existing)
    for type_, status_, reason, message in update.conditions:
        prior = get_condition(out, type_)
        if prior is not None and (prior.status, prior.reason, prior.message) == (status_, reason, message):
            continue
        out = set_condition(out, type_, status_, reason, message, observed_generation=generation)
    return out
