"""Whether a ForwardPass came from a verified compile of a CompileRun, or was written by hand.

    ForwardPass (spec, metadata.annotations[COMPILE_RUN_UID_ANNOTATION])
    + the CompileRun its spec.compileRun names (metadata.uid, status.champion, status.championSpecSha256)
        --provenance_problem--> None (trusted) or why it is not

The run identity is the CompileRun's status: the compile worker's Role lets it patch the status of
its own CompileRun only (resourceNames), and nobody else but the operator and cluster admins may
patch compileruns/status. The worker records there the name and the spec digest
(ForwardPassSpec.digest) of the ForwardPass it published, and stamps the run's uid on the pass. A
ForwardPass is trusted when

  - its verification report agrees with itself (passed, at least one gate, no failed gate) and with
    its artifact (spec.verification.artifactSha256 == spec.artifact.sha256);
  - spec.compileRun names a CompileRun of its namespace whose uid is the pass's annotation (a run
    deleted and created again under the same name does not vouch for the old run's passes);
  - that run's status names this ForwardPass as its champion with this spec's digest.

When the operator accepts a pass on that evidence it records its own vouching in the deployment's
status (status.verifiedForwardPasses: name, spec digest, run and run uid; only the operator writes
that status): the pass stays trusted, with exactly that spec, after its CompileRun is deleted by a
user cleaning up or by garbage collection, so a champion already rolled out is not refused (or
replaced by an older run's champion) for that alone. The record is written only where the run
vouched, so it never makes a hand-written pass trusted.

So a hand-written ForwardPass, a copy of a published one under another name or with another field
changed, and one created by another run's worker are never rolled out. (Kubernetes cannot
restrict `create` by resourceNames, so every compile worker's Role lets it create ForwardPasses of
any name; the chart's ValidatingAdmissionPolicy refuses to store one whose spec.compileRun is not
the worker's own run, and this check does not rely on it being installed.)
What it cannot cover: a run's own worker vouches for what it verified, so a compile
image that lies about its gates is trusted as much as the image the deployment's editor chose.
Pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from pydantic import ValidationError

from shapeshift.operator.api import (COMPILE_RUN_UID_ANNOTATION, VERIFIED_FORWARD_PASSES_KEPT, ForwardPassSpec,
                                     VerifiedForwardPass, short_error)

__all__ = ["publishing_run", "provenance_problem", "remembered", "vouching_record"]


def publishing_run(forward_pass: Mapping[str, Any] | None, namespace: str) -> str | None:
    """The CompileRun name in the pass's spec.compileRun (the worker writes NAMESPACE/NAME; a bare
    NAME means this namespace); None when it names none, or a run of another namespace."""
    value = ((forward_pass or {}).get("spec") or {}).get("compileRun")
    if not isinstance(value, str) or not value:
        return None
    run_namespace, _, run = value.rpartition("/")
    return run if run_namespace in ("", namespace) and run else None


def provenance_problem(name: str, forward_pass: Mapping[str, Any], compile_run: Mapping[str, Any] | None,
                       verified: Sequence[VerifiedForwardPass] = ()) -> str | None:
    """Why ForwardPass `name` cannot be trusted as verified (None: it can). ``compile_run``: the
    CompileRun its spec.compileRun names, as read from the cluster (None: not found); ``verified``:
    the deployment's status.verifiedForwardPasses (what the operator accepted before)."""
    spec, problem = _checked(name, forward_pass)
    if problem is not None or spec is None:
        return problem
    problem = _run_problem(name, forward_pass, spec, compile_run)
    if problem is not None and _recorded(name, forward_pass, spec, verified):
        return None
    return problem


def vouching_record(name: str, forward_pass: Mapping[str, Any] | None, compile_run: Mapping[str, Any] | None,
                    now: datetime) -> VerifiedForwardPass | None:
    """The record of the operator's acceptance of ForwardPass `name` when its CompileRun vouches for
    it now (None: it does not, or there is no run)."""
    if forward_pass is None or compile_run is None:
        return None
    spec, problem = _checked(name, forward_pass)
    if problem is not None or spec is None or _run_problem(name, forward_pass, spec, compile_run) is not None:
        return None
    meta = compile_run.get("metadata") or {}
    return VerifiedForwardPass(name=name, spec_sha256=spec.digest(), compile_run=meta["name"],
                               compile_run_uid=meta["uid"],
                               completion_time=(compile_run.get("status") or {}).get("completionTime"),
                               accepted_at=now)


def remembered(records: Sequence[VerifiedForwardPass], record: VerifiedForwardPass | None,
               keep: Iterable[str | None] = ()) -> list[VerifiedForwardPass] | None:
    """``records`` with ``record`` added (one entry a ForwardPass name, newest last), at most
    VERIFIED_FORWARD_PASSES_KEPT, the oldest dropped first except the names in ``keep`` (what the
    deployment runs or rolls out); None when nothing changes."""
    if record is None:
        return None
    same = next((r for r in records if r.name == record.name), None)
    if same is not None and (same.spec_sha256, same.compile_run_uid) == (record.spec_sha256, record.compile_run_uid):
        return None
    out = [r for r in records if r.name != record.name] + [record]
    kept = {k for k in keep if k}
    while len(out) > VERIFIED_FORWARD_PASSES_KEPT:
        drop = next((r for r in out[:-1] if r.name not in kept), out[0])
        out.remove(drop)
    return out


def _recorded(name: str, forward_pass: Mapping[str, Any], spec: ForwardPassSpec,
              verified: Sequence[VerifiedForwardPass]) -> bool:
    """Whether the operator accepted this pass, with this spec and run identity, before."""
    uid = ((forward_pass.get("metadata") or {}).get("annotations") or {}).get(COMPILE_RUN_UID_ANNOTATION)
    run = (spec.compile_run or "").rpartition("/")[2]
    digest = spec.digest()
    return any(r.name == name and r.spec_sha256 == digest and r.compile_run_uid == uid and r.compile_run == run
               for r in verified)


def _checked(name: str, forward_pass: Mapping[str, Any]) -> tuple[ForwardPassSpec | None, str | None]:
    """The pass's spec, or why its own report already refuses it."""
    raw = forward_pass.get("spec") or {}
    try:
        spec = ForwardPassSpec.model_validate(dict(raw))
    except ValidationError as err:
        return None, f"ForwardPass {name} has a spec this operator cannot read ({short_error(err)})"
    # The model refuses a passed report with a failed gate, and a report about another bundle.
    report = spec.verification
    if not report.passed:
        return None, f"ForwardPass {name} did not pass verification (spec.verification.passed is false)"
    if not report.gates:
        return None, (f"ForwardPass {name} claims spec.verification.passed with no gate results "
                      "(spec.verification.gates)")
    if report.artifact_sha256 is None:
        return None, (f"ForwardPass {name}: spec.verification.artifactSha256 is absent, so the report does not "
                      "name the bundle it verified")
    return spec, None


def _run_problem(name: str, forward_pass: Mapping[str, Any], spec: ForwardPassSpec,
                 compile_run: Mapping[str, Any] | None) -> str | None:
    """Why the CompileRun does not vouch for the pass (None: it does)."""
    hand_written = ("only forward passes published by the compile worker of a CompileRun are rolled out; "
                    "compile one with a CompileRun instead of writing a ForwardPass by hand")
    if not spec.compile_run:
        return f"ForwardPass {name} names no CompileRun (spec.compileRun): {hand_written}"
    run_name = (compile_run or {}).get("metadata", {}).get("name")
    if compile_run is None or spec.compile_run.rpartition("/")[2] != run_name:
        return (f"ForwardPass {name}: its CompileRun {spec.compile_run} (spec.compileRun) is not in this "
                f"namespace, so nothing vouches for it: {hand_written}")
    uid = ((forward_pass.get("metadata") or {}).get("annotations") or {}).get(COMPILE_RUN_UID_ANNOTATION)
    if uid != (compile_run.get("metadata") or {}).get("uid"):
        return (f"ForwardPass {name}: its {COMPILE_RUN_UID_ANNOTATION} annotation does not match CompileRun "
                f"{spec.compile_run} (spec.compileRun): it was not published by that run")
    status = compile_run.get("status") or {}
    if status.get("champion") != name or status.get("championSpecSha256") != spec.digest():
        return (f"ForwardPass {name}: CompileRun {spec.compile_run} (spec.compileRun) does not record this "
                "ForwardPass with this spec as its champion (status.champion, status.championSpecSha256): it was "
                f"written or changed by someone other than that run's compile worker; {hand_written}")
    return None
