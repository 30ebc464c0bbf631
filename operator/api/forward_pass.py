"""The ForwardPass kind: a verified forward pass, an entry of the champion registry.

    compile pod (engine/compile/champions.py) --ForwardPassSpec(...).to_wire()--> ForwardPass object
    operator rollout --reads spec.artifact, spec.hardware, spec.engine--> pod annotations
    operator rollout --ForwardPassStatus--> phase, deployments that run it, refusals
    spec validation: here, mirrored as CEL rules in crds/shapeshift.dev_forwardpasses.yaml
    provenance: the worker records ForwardPassSpec.digest() in its CompileRun's status and the run's
      uid in COMPILE_RUN_UID_ANNOTATION; operator/provenance.py trusts only a pass both agree on
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import datetime
from typing import Any, Literal, Mapping

from pydantic import Field, model_validator

from shapeshift.engine.contracts.traffic_profile import TrafficProfile
from shapeshift.operator.api.common import (ENV_LIST_SCHEMA, MAX_ENV_VARS, Condition, Dtype, EnvVar, StatusModel,
                                           WireModel, cel, default_of, cel_rules)
from shapeshift.operator.api.group import AGE_COLUMN, Kind, printer_column
from shapeshift.operator.api.hardware import AcceleratorKind


class ModelSignature(WireModel):
    """Which model a forward pass is for."""

    name: str = Field(max_length=253, description="Model or preset name.")
    architecture: str | None = Field(default=None, max_length=128, description="e.g. LlamaForCausalLM.")
    dtype: Dtype = Field(default="bfloat16", description="Dtype it was verified in.")
    config_sha256: str | None = Field(default=None, max_length=64, pattern=r"^[a-f0-9]{64}$",
                                      description="sha256 of the model's config.json in canonical JSON (sorted keys, no spaces).")


class ForwardPassHardware(WireModel):
    accelerator: AcceleratorKind = Field(description="Accelerator it was compiled and verified on.")
    count: int = Field(default=1, ge=1, le=64, description="Accelerators per engine.")


# The locations the engine's rollout agent fetches (engine/rollout/agent.py ArtifactFetcher): a local
# path, used in place, or an http(s) archive it downloads; nothing else.
ARTIFACT_URI_PREFIXES = ("/", "file:///", "file://localhost/", "https://", "http://")
_USERINFO = r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/]*@"
_DOT_DOT = r"(^|/)[.][.](/|$)"

# Where a local path may point: the artifact store (spec.artifacts.pvc, mounted at
# inference_deployment.ARTIFACT_MOUNT in compile and engine pods) and a compile pod's own work
# folder (operator/builders.py WORK_MOUNT), where the worker leaves a pass when no store is set; such
# a pass is annotated not durable and the rollout refuses it (ArtifactNotDurable). Anything else in an
# engine pod (/etc, /proc, the ServiceAccount token) is no bundle of ours.
STORE_ROOT = "/var/lib/shapeshift-artifacts/"
COMPILE_WORK_ROOT = "/var/lib/shapeshift/"
DEFAULT_ARTIFACT_ROOTS = (STORE_ROOT, COMPILE_WORK_ROOT)
# Further roots, comma-separated absolute folders: for a control plane whose pods run as local
# processes (the test suite, hack/run-pods-local.py), where a local folder stands in for the mount and
# the worker records that folder's path. The operator and the compile worker read it when they
# validate; the API server knows the roots its CRDs were generated with (hack/gen_crds.py
# --artifact-root; the committed CRDs and the chart's carry the defaults only).
ARTIFACT_ROOTS_ENV = "SHAPESHIFT_ARTIFACT_ROOTS"
_ROOT = re.compile(r"^/[A-Za-z0-9._+/-]*$")

# http(s) hosts the engine must not be sent to: link-local and cloud metadata addresses (169.254.0.0/16,
# fe80::/10, fd00:ec2::254, IPv4-mapped forms, Alibaba's 100.100.100.200, metadata.google.internal) and
# the numeric spellings a resolver also reads as an address (2852039166, 0xa9fea9fe, 0251.0376.0251.0376,
# 169.16689662). A name that resolves to such an address is past what a static rule can see. RE2 and
# Python alike; in CEL its backslashes are doubled (_cel_string).
_FORBIDDEN_HOST = (r"(?i)^https?://("
                   r"169\.254\.[0-9.]*"
                   r"|100\.100\.100\.200\.?"
                   r"|metadata\.google\.internal\.?"
                   r"|\[(fe[89ab][0-9a-f]*:[^\]]*|[0-9a-f:]*:(169\.254\.[0-9.]*|a9fe:[0-9a-f]*)|fd00:ec2::254)\]"
                   r"|[0-9]+|0x[0-9a-f]+|[0-9]+\.[0-9]+(\.[0-9]+)?"
                   r"|([0-9a-fx]*\.)*0[0-9x][0-9a-fx]*(\.[0-9a-fx]*)*"
                   r")(:[0-9]*)?(/|$)")
_FORBIDDEN_HOST_MESSAGE = ("spec.artifact.uri: an http(s) host must not be a link-local or cloud metadata address "
                           "(169.254.0.0/16, fe80::/10, fd00:ec2::254, 100.100.100.200, metadata.google.internal) "
                           "or a numeric spelling of an address other than a.b.c.d")


def _cel_string(pattern: str) -> str:
    """`pattern` inside a single-quoted CEL string literal (CEL reads \\ as one backslash)."""
    return pattern.replace("\\", "\\\\").replace("'", "\\'")


def parse_artifact_roots(text: str) -> tuple[str, ...]:
    """SHAPESHIFT_ARTIFACT_ROOTS' folders, each ending in '/' (ValueError on one that is not absolute,
    has '..' segments or characters other than letters, digits and ._+-/)."""
    roots = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if not _ROOT.match(item) or re.search(_DOT_DOT, item) or item == "/":
            raise ValueError(f"{ARTIFACT_ROOTS_ENV}: {item!r} is not an absolute folder below / "
                             "(letters, digits, ._+-/ and no '..')")
        roots.append(item.rstrip("/") + "/")
    return tuple(dict.fromkeys(roots))


def artifact_roots(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The folders a local artifact path may lie in: the defaults and SHAPESHIFT_ARTIFACT_ROOTS."""
    env = os.environ if env is None else env
    return tuple(dict.fromkeys(DEFAULT_ARTIFACT_ROOTS + parse_artifact_roots(env.get(ARTIFACT_ROOTS_ENV, ""))))


def artifact_root_message(roots: tuple[str, ...]) -> str:
    return ("spec.artifact.uri: a local path (/path or file:///path) must lie inside the artifact store "
            f"{STORE_ROOT} (spec.artifacts.pvc) or a compile pod's own {COMPILE_WORK_ROOT}"
            + (f" or {', '.join(r for r in roots if r not in DEFAULT_ARTIFACT_ROOTS)}"
               if set(roots) - set(DEFAULT_ARTIFACT_ROOTS) else "")
            + ", with no %-escapes")


def artifact_root_rule(roots: tuple[str, ...] = DEFAULT_ARTIFACT_ROOTS) -> dict[str, str]:
    """The CEL rule of Artifact confining local paths to `roots` (crdgen.render_all swaps it for the
    roots it is given)."""
    inside = " || ".join(f"self.uri.startsWith('{form}{root}')"
                         for root in roots for form in ("", "file://", "file://localhost"))
    return cel(f"!(self.uri.startsWith('/') || self.uri.startsWith('file:')) || "
               f"(!self.uri.contains('%') && ({inside}))", artifact_root_message(roots))


def _local_path_problem(uri: str, roots: tuple[str, ...]) -> str | None:
    if not uri.startswith(("/", "file:")):
        return None
    inside = any(uri.startswith(form + root) for root in roots for form in ("", "file://", "file://localhost"))
    return None if inside and "%" not in uri else artifact_root_message(roots)


class Artifact(WireModel):
    """Where the bundle lives."""

    model_config = cel_rules(
        cel(" || ".join(f"self.uri.startsWith('{p}')" for p in ARTIFACT_URI_PREFIXES),
            "spec.artifact.uri must be an absolute path, file:///path or an http(s):// URL: the engine "
            "fetches no other location"),
        cel(f"!self.uri.matches('{_USERINFO}') && !self.uri.contains('?') && !self.uri.contains('#')",
            "spec.artifact.uri must carry no credentials: no user:password@, query string or fragment "
            "(the URI is copied into pod annotations that anyone who may get pods reads)"),
        cel(f"!self.uri.matches('{_DOT_DOT}')",
            "spec.artifact.uri must not contain '..' segments: a path stays inside the folder it names"),
        artifact_root_rule(),
        cel(f"!self.uri.matches('{_cel_string(_FORBIDDEN_HOST)}')", _FORBIDDEN_HOST_MESSAGE),
    )
    uri: str = Field(
        min_length=1, max_length=2048,
        description="Location of the bundle, one of the locations the engine fetches: an absolute path inside the "
                    "artifact store the engine pods mount (spec.artifacts.pvc, mounted at "
                    "/var/lib/shapeshift-artifacts/; a compile pod's own /var/lib/shapeshift/ is accepted too, "
                    "and never rolled out), the same as file:///path, or an http(s):// URL of a .tar.gz it "
                    "downloads from a host that is not a link-local or cloud metadata address. No other scheme. "
                    "No user:password@, query string or fragment (the URI is copied into pod annotations), no "
                    "'..' segments or %-escapes in a path.")
    sha256: str = Field(pattern=r"^[a-f0-9]{64}$", max_length=64,
                        description="Bundle digest (the manifest digest, independent of packing) the engine checks before loading.")
    size_bytes: int | None = Field(default=None, ge=0, description="Size of the bundle.")

    @model_validator(mode="after")
    def _fetchable_without_credentials(self) -> "Artifact":
        if not self.uri.startswith(ARTIFACT_URI_PREFIXES):
            raise ValueError("spec.artifact.uri must be an absolute path, file:///path or an http(s):// URL: the "
                             "engine fetches no other location")
        if re.match(_USERINFO, self.uri) or "?" in self.uri or "#" in self.uri:
            raise ValueError("spec.artifact.uri must carry no credentials: no user:password@, query string or "
                             "fragment (the URI is copied into pod annotations that anyone who may get pods reads)")
        if re.search(_DOT_DOT, self.uri):
            raise ValueError("spec.artifact.uri must not contain '..' segments: a path stays inside the folder it "
                             "names")
        problem = _local_path_problem(self.uri, artifact_roots())
        if problem is not None:
            raise ValueError(problem)
        if re.search(_FORBIDDEN_HOST, self.uri):
            raise ValueError(_FORBIDDEN_HOST_MESSAGE)
        return self


class ForwardPassMetrics(WireModel):
    """Measured on the replay of the traffic profile."""

    tokens_per_second: float | None = Field(default=None, ge=0, description="Output tokens/s.")
    baseline_tokens_per_second: float | None = Field(default=None, ge=0, description="Output tokens/s of the baseline.")
    speedup: float | None = Field(default=None, ge=0, description="tokensPerSecond / baselineTokensPerSecond.")
    per_user_tokens_per_second_p50: float | None = Field(default=None, ge=0, description="Per-user tokens/s, median.")
    per_user_tokens_per_second_p90: float | None = Field(default=None, ge=0, description="Per-user tokens/s, p90.")
    ttft_p50_seconds: float | None = Field(default=None, ge=0, description="Time to first token, median.")
    ttft_p90_seconds: float | None = Field(default=None, ge=0, description="Time to first token, p90.")
    noise: float | None = Field(default=None, ge=0, description="Run-to-run relative noise of the measurement.")


class GateResult(WireModel):
    name: str = Field(max_length=128, description="Gate name.")
    passed: bool = Field(description="Whether it passed.")
    message: str | None = Field(default=None, max_length=4096, description="Detail.")


class VerificationReport(WireModel):
    model_config = cel_rules(
        cel("!self.passed || self.gates.all(g, g.passed)",
            "spec.verification.passed is true but a gate in spec.verification.gates failed"),
    )
    passed: bool = Field(description="Whether every gate passed.")
    gates: list[GateResult] = Field(default_factory=list, max_length=64, description="Per-gate results.")
    artifact_sha256: str | None = Field(
        default=None, pattern=r"^[a-f0-9]{64}$", max_length=64,
        description="Digest of the bundle the gates ran on; must equal spec.artifact.sha256.")

    @model_validator(mode="after")
    def _agrees_with_itself(self) -> "VerificationReport":
        failed = [g.name for g in self.gates if not g.passed]
        if self.passed and failed:
            raise ValueError("spec.verification.passed is true but a gate in spec.verification.gates failed "
                             f"({', '.join(failed)})")
        return self


class ReasoningNote(WireModel):
    agent: str = Field(max_length=63, description="Agent that wrote it.")
    note: str = Field(max_length=8192, description="Why the change should help.")


class ForwardPassEngine(WireModel):
    """The engine settings a forward pass was measured under, beyond its recipe."""

    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV_VARS,
        description="The deployment's spec.engine.env in the compile pod (kernel launch switches such as "
                    "SHAPESHIFT_PDL); empty: none set. Rollout refuses the forward pass for a deployment "
                    "whose spec.engine.env differs.",
        json_schema_extra=ENV_LIST_SCHEMA,
    )


# On a ForwardPass a compile worker publishes: the metadata.uid of its CompileRun (spec.compileRun).
COMPILE_RUN_UID_ANNOTATION = "shapeshift.dev/compile-run-uid"


def _canonical(value: Any) -> Any:
    """Integral floats as ints: the API server may hand 2.0 back as 2 in free-form fields."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


class ForwardPassSpec(WireModel):
    """A verified champion: an entry of the registry. Immutable once created."""

    model_config = cel_rules(
        cel("self == oldSelf", "spec of a ForwardPass is immutable; publish a new ForwardPass"),
        cel("!has(self.verification.artifactSha256) || self.verification.artifactSha256 == self.artifact.sha256",
            "spec.verification.artifactSha256 differs from spec.artifact.sha256: the report is about another "
            "bundle"),
    )
    model: ModelSignature = Field(description="Model it is for.")
    hardware: ForwardPassHardware = Field(description="Hardware it is for.")
    traffic: TrafficProfile | None = Field(default=None, description="Traffic profile it was compiled for.")
    artifact: Artifact = Field(description="The bundle.")
    recipe: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
        description="Knob values (free-form: kernel variants, tile configs, batch buckets ...).",
    )
    metrics: ForwardPassMetrics = Field(default_factory=ForwardPassMetrics, json_schema_extra=default_of(ForwardPassMetrics),
                                        description="Measured performance.")
    verification: VerificationReport = Field(description="Verification report.")
    engine: ForwardPassEngine | None = Field(
        default=None, description="Engine environment it was measured under (absent: not recorded, as for "
                                  "forward passes published outside a cluster).")
    reasoning: list[ReasoningNote] | None = Field(default=None, max_length=64, description="The agents' reasoning.")
    parent: str | None = Field(default=None, max_length=253, description="ForwardPass this one was derived from.")
    compile_run: str | None = Field(default=None, max_length=253, description="CompileRun that produced it.")

    @model_validator(mode="after")
    def _report_is_about_this_artifact(self) -> "ForwardPassSpec":
        verified = self.verification.artifact_sha256
        if verified is not None and verified != self.artifact.sha256:
            raise ValueError("spec.verification.artifactSha256 differs from spec.artifact.sha256: the report is "
                             "about another bundle")
        return self

    def digest(self) -> str:
        """sha256 of the spec's canonical wire form: what the compile worker records in its
        CompileRun's status (championSpecSha256) and the rollout compares."""
        text = json.dumps(_canonical(self.to_wire()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


class ForwardPassRefusal(StatusModel):
    """One InferenceDeployment that would not or could not run this forward pass."""

    deployment: str = Field(max_length=253, description="The InferenceDeployment.")
    reason: str = Field(max_length=128, description="RolledBack, RolloutFailed, ArtifactNotDurable, NotVerifiedByCompileRun or TargetRejected.")
    message: str = Field(default="", max_length=4096, description="Why (the rollout's message).")
    time: datetime | None = Field(default=None, description="When the refusal was first recorded.")


ForwardPassPhase = Literal["Available", "Active", "Refused"]


class ForwardPassStatus(StatusModel):
    """Written by the operator's rollout from each InferenceDeployment's outcome."""

    phase: ForwardPassPhase | None = Field(
        default=None,
        description="Active: at least one InferenceDeployment runs it. Refused: none runs it and at least one "
                    "refused it (rolled back, or not rollable). Available: neither.")
    deployments: list[str] | None = Field(default=None, max_length=256, description="InferenceDeployments that run it.")
    refusals: list[ForwardPassRefusal] | None = Field(
        default=None, max_length=256, description="InferenceDeployments that refused it, and why.")
    conditions: list[Condition] | None = Field(default=None, max_length=32, description="Conditions.")


FORWARD_PASS = Kind(
    kind="ForwardPass",
    plural="forwardpasses",
    short_names=["fp"],
    spec=ForwardPassSpec,
    status=ForwardPassStatus,
    columns=[
        printer_column("Model", ".spec.model.name"),
        printer_column("Accelerator", ".spec.hardware.accelerator"),
        printer_column("Speedup", ".spec.metrics.speedup", "number"),
        printer_column("Verified", ".spec.verification.passed", "boolean"),
        printer_column("Phase", ".status.phase", description="Available, Active or Refused."),
        printer_column("SHA256", ".spec.artifact.sha256", priority=1),
        printer_column("Deployments", ".status.deployments", priority=1, description="InferenceDeployments that run it."),
        printer_column("Parent", ".spec.parent", priority=1),
        AGE_COLUMN,
    ],
    root_rules=[],
    description="A verified forward pass: an entry of the champion registry.",
)
