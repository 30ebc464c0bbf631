"""Which forward pass a deployment should run, and whether it may be rolled out at all.

    spec.forwardPass, else the champion of the deployment's newest Succeeded CompileRun (champion_of;
      a run since deleted counts through the champion the operator accepted from it,
      status.verifiedForwardPasses)
    the named ForwardPass object (or None: not found), the CompileRun its spec.compileRun names
        --resolve_target--> Target: its identity, speedup and traffic, or the problem that refuses it

A ForwardPass is refused before any pod is asked for it when nothing proves it came from a
verified compile of a CompileRun (operator/provenance.py: a report that contradicts itself or its
artifact, a pass written by hand or changed after its run published it), when it was compiled for another accelerator or under another spec.engine.env, or carries
shapeshift.dev/artifact-durable: "false" (its archive was written to its compile pod's
emptyDir and is gone: the deployment needs spec.artifacts.pvc). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

from shapeshift.engine.contracts.compile_pod_env import ARTIFACT_DURABLE_ANNOTATION
from shapeshift.engine.contracts.engine_env import PERFORMANCE_ENV
from shapeshift.engine.contracts.pod_annotations import STOCK_FORWARD_PASS
from shapeshift.operator.api import InferenceDeploymentSpec, VerifiedForwardPass
from shapeshift.operator.provenance import provenance_problem, vouching_record
from shapeshift.operator.rollout import ForwardPassIdentity

__all__ = ["NOT_DURABLE", "REJECTED", "UNTRUSTED", "REJECTION_REASONS", "Target", "champion_of", "engine_env_changes",
           "resolve_target"]

REJECTED = "TargetRejected"  # wrong accelerator, other engine env, or not found
UNTRUSTED = "NotVerifiedByCompileRun"  # no proof it came from a verified compile (operator/provenance.py)
NOT_DURABLE = "ArtifactNotDurable"  # its archive lived in its compile pod only
REJECTION_REASONS = (REJECTED, UNTRUSTED, NOT_DURABLE)


@dataclass(frozen=True)
class Target:
    """What the deployment should run, or why nothing can be rolled out."""

    identity: ForwardPassIdentity | None
    speedup: float | None = None
    traffic: dict[str, Any] | None = None  # the ForwardPass's spec.traffic (what it was compiled for)
    problem: str | None = None  # why the named forward pass cannot be rolled out
    reason: str = REJECTED  # condition and event reason of the problem
    refused: str | None = None  # the existing ForwardPass the problem refuses (None: not found)
    # The operator's record of accepting it when its CompileRun vouches for it now (kept in
    # status.verifiedForwardPasses, so it stays trusted after that run is deleted).
    vouched: VerifiedForwardPass | None = None


def champion_of(compile_runs: list[Mapping[str, Any]], deployment: str,
                verified: Sequence[VerifiedForwardPass] = ()) -> str | None:
    """The champion of the deployment's most recently finished, successful CompileRun; a run that
    is gone counts with the champion the operator accepted from it (``verified``: the deployment's
    status.verifiedForwardPasses), so deleting the newest run does not make an older run's champion
    the target."""
    done = [(((run.get("status") or {}).get("completionTime") or ""), run["metadata"].get("creationTimestamp") or "",
             run["metadata"]["name"], run["status"]["champion"])
            for run in compile_runs
            if (run.get("spec") or {}).get("deploymentRef", {}).get("name") == deployment
            and (run.get("status") or {}).get("phase") == "Succeeded" and (run.get("status") or {}).get("champion")]
    present = {run["metadata"].get("uid") for run in compile_runs}
    done += [(_iso(r.completion_time), "", r.compile_run, r.name) for r in verified
             if r.compile_run_uid not in present and r.completion_time is not None]
    if not done:
        return None
    return max(done)[3]


def _iso(moment: datetime) -> str:
    """A completion time as the API server writes it (seconds, Z), comparable with its strings."""
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def resolve_target(name: str | None, forward_pass: Mapping[str, Any] | None,
                   spec: InferenceDeploymentSpec, compile_run: Mapping[str, Any] | None = None,
                   verified: Sequence[VerifiedForwardPass] = (), now: datetime | None = None) -> Target:
    """The identity to roll out from the named ForwardPass object (None: not found) and the
    CompileRun its spec.compileRun names (None: none, or not found); ``verified``: the passes the
    operator accepted before (status.verifiedForwardPasses); ``now``: when a pass its run vouches
    for is accepted (the record's time; None: no record is made)."""
    if name is None:
        return Target(None)
    if forward_pass is None:
        if name == STOCK_FORWARD_PASS:
            return Target(ForwardPassIdentity(STOCK_FORWARD_PASS, None))
        return Target(None, problem=f"ForwardPass {name} not found in this namespace; create it or fix "
                                    "spec.forwardPass")
    fp = forward_pass.get("spec") or {}
    untrusted = provenance_problem(name, forward_pass, compile_run, verified)
    if untrusted is not None:
        return Target(None, refused=name, reason=UNTRUSTED, problem=untrusted)
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
                  speedup=(fp.get("metrics") or {}).get("speedup"), traffic=fp.get("traffic"),
                  vouched=vouching_record(name, forward_pass, compile_run, now) if now is not None else None)


def engine_env_changes(forward_pass_spec: Mapping[str, Any], spec: InferenceDeploymentSpec) -> list[str]:
    """How the deployment's performance switches in spec.engine.env (contracts/engine_env.py
    PERFORMANCE_ENV) differ from those the forward pass was measured under (its spec.engine.env),
    one line a variable; empty when equal or not recorded."""
    recorded = (forward_pass_spec.get("engine") or {}).get("env")
    if recorded is None:
        return []
    # Only the engine's performance switches count (the only names a compile worker records).
    then = {e["name"]: e.get("value", "") for e in recorded if e.get("name") in PERFORMANCE_ENV}
    now = {e.name: e.value for e in spec.engine.env or [] if e.name in PERFORMANCE_ENV}
    lines = []
    for key in sorted(then.keys() | now.keys()):
        if key not in now:
            lines.append(f"{key}={then[key]!r} then, unset now")
        elif key not in then:
            lines.append(f"{key} unset then, {now[key]!r} now")
        elif then[key] != now[key]:
            lines.append(f"{key}={then[key]!r} then, {now[key]!r} now")
    return lines
