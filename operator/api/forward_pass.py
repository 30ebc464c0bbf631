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
import re
from datetime import datetime
from typing import Any, Literal

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
                                      description="sha256 of the model's config.json.")


class ForwardPassHardware(WireModel):
    accelerator: AcceleratorKind = Field(description="Accelerator it was compiled and verified on.")
    count: int = Field(default=1, ge=1, le=64, description="Accelerators per engine.")


# The locations the engine's rollout agent fetches (engine/rollout/agent.py ArtifactFetcher): a local
# path, used in place, or an http(s) archive it downloads; nothing else.
ARTIFACT_URI_PREFIXES = ("/", "file:///", "file://localhost/", "https://", "http://")
_USERINFO = r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/]*@"
_DOT_DOT = r"(^|/)[.][.](/|$)"


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
    )
    uri: str = Field(
        min_length=1, max_length=2048,
        description="Location of the bundle, one of the locations the engine fetches: an absolute path on a volume "
                    "the engine pods mount (the artifact store of spec.artifacts.pvc, mounted at "
                    "/var/lib/shapeshift-artifacts), the same as file:///path, or an http(s):// URL of a .tar.gz "
                    "it downloads. No other scheme. No user:password@, query string or fragment (the URI is copied "
                    "into pod annotations), no '..' segments.")
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
