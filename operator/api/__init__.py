"""Pydantic models of Shapeshift's custom resources (group shapeshift.dev, v1alpha1).

    models (this file) --crdgen.py--> crds/*.yaml (OpenAPI schema, CEL rules, columns)
    cluster object --parse_spec()/Status.model_validate()--> typed spec/status
    handlers --Status(...).to_patch()--> status subresource

One definition serves the API server and the operator: every bound and enum
here becomes an OpenAPI constraint, every cross-field rule is written twice,
once as a CEL rule (`x-kubernetes-validations`, enforced by the API server)
and once as a pydantic validator (enforced when the operator or a test builds
a spec in Python), next to each other so they stay the same rule.

Field names are snake_case in Python, camelCase on the wire.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from shapeshift.engine.contracts.traffic_profile import BUILTIN_PROFILES, TrafficProfile
from shapeshift.operator.hardware import ACCELERATORS, AcceleratorKind

GROUP = "shapeshift.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_ENGINE_IMAGE = "shapeshift/engine:0.1.0"

BuiltinTrafficProfile = Literal["chat", "agentic-long-context", "burst"]
assert set(BuiltinTrafficProfile.__args__) == set(BUILTIN_PROFILES)  # type: ignore[attr-defined]

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def cel(rule: str, message: str, **extra: str) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    return {"rule": rule, "message": message, **extra}


class WireModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown keys rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(WireModel):
    """Status is read back from the cluster, where the compile worker also writes:
    tolerate keys this version does not know instead of failing to parse."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def _default_of(model: type[WireModel]) -> dict[str, Any]:
    """CRD `default` of a nested object whose fields all default: the full default
    object, so the API server fills it in when the user omits it. (A bare `{}` is
    not enough: the API server checks defaults against CEL rules without applying
    the inner defaults first.)"""
    return {"default": model().to_wire()}


# ---- shared pieces ------------------------------------------------------------------------


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: str = Field(max_length=64, description="Condition type, e.g. Ready, Scheduled, Complete.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", max_length=128, description="CamelCase reason for the last transition.")
    message: str = Field(default="", max_length=4096, description="Human-readable detail.")
    last_transition_time: datetime | None = Field(default=None, description="When the status last changed.")
    observed_generation: int | None = Field(default=None, description="Generation the condition was computed for.")


def set_condition(
    conditions: list[Condition],
    type: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str = "",
    *,
    now: datetime | None = None,
    observed_generation: int | None = None,
) -> list[Condition]:
    """A new list with `type` set; the transition time only moves when the status does."""
    now = now or datetime.now(timezone.utc).replace(microsecond=0)
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type == type:
            found = True
            ltt = c.last_transition_time if c.status == status and c.last_transition_time else now
            out.append(Condition(type=type, status=status, reason=reason, message=message[:4096],
                                 last_transition_time=ltt, observed_generation=observed_generation))
        else:
            out.append(c)
    if not found:
        out.append(Condition(type=type, status=status, reason=reason, message=message[:4096],
                             last_transition_time=now, observed_generation=observed_generation))
    return out


def get_condition(conditions: list[Condition], type: str) -> Condition | None:
    return next((c for c in conditions if c.type == type), None)


class Toleration(WireModel):
    """A pod toleration (the subset of core/v1 Toleration Shapeshift passes through)."""

    key: str | None = Field(default=None, max_length=317, description="Taint key to tolerate; empty with Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty matches all."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="For NoExecute: how long to stay bound.")


class HardwareSpec(WireModel):
    """The accelerator pool pods run on."""

    accelerator: AcceleratorKind = Field(
        description="Accelerator kind: " + ", ".join(f"{k} ({a.description})" for k, a in ACCELERATORS.items()) + "."
    )
    count: int = Field(default=1, ge=1, le=64, description="Accelerators per pod (ignored for cpu).")
    node_selector: dict[str, str] | None = Field(
        default=None, max_length=32, description="Extra node labels, merged over the pool's own selector."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Extra tolerations, added to the pool's."
    )
    cpu: str | None = Field(default=None, max_length=32, description="CPU request per pod, e.g. '8'.")
    memory: str | None = Field(default=None, max_length=32, description="Memory request and limit per pod, e.g. '64Gi'.")


# ---- compile settings (a CompileRun's own, and the template of automatic ones) ----------


class SecretKeyRef(WireModel):
    name: str = Field(max_length=253, pattern=_DNS_SUBDOMAIN, description="Secret name.")
    key: str = Field(default="api-key", max_length=253, description="Key in the Secret.")


class LLMAgentSpec(WireModel):
    """An OpenAI-compatible endpoint for an LLM coding agent."""

    endpoint: str = Field(max_length=1024, pattern=r"^https?://", description="Base URL of an OpenAI-compatible API.")
    model: str = Field(max_length=256, description="Model name to ask.")
    api_key_secret_ref: SecretKeyRef | None = Field(default=None, description="Secret holding the API key.")


class AgentSpec(WireModel):
    """One search agent."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [cel("self.kind != 'llm' || has(self.llm)", "an agent of kind llm needs llm settings")]
        }
    )
    kind: Literal["coordinate-sweep", "evolutionary", "model-based", "llm"] = Field(description="Agent strategy.")
    name: str | None = Field(default=None, max_length=63, pattern=_DNS_LABEL, description="Name on the message board (default: kind-index).")
    replicas: int = Field(default=1, ge=1, le=16, description="Concurrent instances of this agent.")
    llm: LLMAgentSpec | None = Field(default=None, description="Endpoint settings for kind llm.")

    @model_validator(mode="after")
    def _llm_settings(self) -> "AgentSpec":
        if self.kind == "llm" and self.llm is None:
            raise ValueError("an agent of kind llm needs llm settings")
        return self


class TierSpec(WireModel):
    """Measurement tiers of the persistent engine."""

    fast: bool = Field(default=True, description="Screen candidates on a few layers first.")
    fast_layers: int = Field(default=2, ge=1, le=256, description="Layers the fast tier loads.")
    full: bool = Field(default=True, description="Measure survivors on the whole model with traffic replay.")
    replay_requests: int = Field(default=64, ge=1, le=100000, description="Requests per replay.")
    repeats: int = Field(default=3, ge=1, le=50, description="Replays per measurement (gives the noise).")


class VerificationSpec(WireModel):
    """Checks a champion must pass before it is published."""

    greedy_steps: int = Field(default=64, ge=1, le=8192, description="Greedy decode steps compared against the stock forward pass.")
    fresh_prompts: int = Field(default=8, ge=1, le=1024, description="Fresh random prompts per comparison.")
    logprob_tolerance: float = Field(default=0.05, gt=0, le=10, description="Largest allowed absolute logprob difference.")
    kv_contamination: bool = Field(default=True, description="Run KV-cache contamination checks.")


class BaselineSpec(WireModel):
    """What a candidate must beat."""

    forward_pass: str | None = Field(default=None, max_length=253, description="ForwardPass to beat (default: the deployment's active one).")
    min_speedup: float = Field(default=1.02, ge=1, le=100, description="Least speedup over the baseline, beyond the noise, to publish.")


# ---- InferenceDeployment ------------------------------------------------------------------


class PVCModelSource(WireModel):
    """A Hugging Face style model folder on a PersistentVolumeClaim."""

    claim_name: str = Field(max_length=253, pattern=_DNS_SUBDOMAIN, description="Name of the PersistentVolumeClaim.")
    path: str = Field(default="", max_length=1024, description="Folder inside the claim that holds config.json and *.safetensors.")


class ModelSource(WireModel):
    """Where the weights come from: exactly one of `preset` or `pvc`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.preset) != has(self.pvc)",
                    "exactly one of spec.model.preset or spec.model.pvc must be set"),
            ]
        }
    )
    preset: str | None = Field(
        default=None, max_length=128, pattern=r"^[a-z0-9][a-z0-9.-]*$",
        description="A built-in engine preset (random weights of a known shape), e.g. llama-3.2-1b-shape.",
    )
    pvc: PVCModelSource | None = Field(default=None, description="A model folder on a PersistentVolumeClaim.")
    served_name: str | None = Field(
        default=None, max_length=128, description="Model name the OpenAI API reports (default: preset or folder name)."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSource":
        if (self.preset is None) == (self.pvc is None):
            raise ValueError("exactly one of spec.model.preset or spec.model.pvc must be set")
        return self

    @property
    def display_name(self) -> str:
        if self.served_name:
            return self.served_name
        if self.preset:
            return self.preset
        assert self.pvc is not None
        return self.pvc.path.rstrip("/").rsplit("/", 1)[-1] or self.pvc.claim_name


KV_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


class AdminTokenSecret(WireModel):
    """A Secret key holding the bearer token of the engine's admin API (/admin/forward-passes)."""

    name: str = Field(max_length=253, pattern=_DNS_SUBDOMAIN, description="Secret name (same namespace).")
    key: str = Field(default="token", max_length=253, description="Key in the Secret.")


# Environment variables the operator sets in engine and compile pods itself; a spec may not set
# them (the container's later entry would silently win over the user's, or the user's over ours).
RESERVED_ENV_NAMES = (
    "POD_NAME", "POD_NAMESPACE", "SHAPESHIFT_INFERENCE_DEPLOYMENT", "SHAPESHIFT_ENGINE_CONFIG",
    "SHAPESHIFT_NAMESPACE", "SHAPESHIFT_COMPILE_RUN", "SHAPESHIFT_ACCELERATOR", "SHAPESHIFT_BUDGET_WALL_CLOCK_SECONDS",
    "SHAPESHIFT_BUDGET_TRIALS", "SHAPESHIFT_WORK_DIR", "SHAPESHIFT_ARTIFACT_DIR", "SHAPESHIFT_ENGINE_ENV_NAMES",
)
RESERVED_ENV_PREFIX = "SHAPESHIFT_AGENT_"  # SHAPESHIFT_AGENT_<n>_API_KEY, from the agents' Secrets
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
MAX_ENV_VARS = 32
ENV_LIST_SCHEMA = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}  # keyed by name


class EnvVar(WireModel):
    """An environment variable of the engine and compile containers (a literal value)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!(self.name in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV_NAMES) + "]) && "
                    f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
                    "spec.engine.env: this name is set by the operator itself"),
            ]
        }
    )
    name: str = Field(max_length=128, pattern=_ENV_NAME, description="Variable name (a C identifier).")
    value: str = Field(default="", max_length=4096, description="Its value.")

    @model_validator(mode="after")
    def _not_reserved(self) -> "EnvVar":
        if self.name in RESERVED_ENV_NAMES or self.name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(f"spec.engine.env: {self.name} is set by the operator itself")
        return self


class EngineSettings(WireModel):
    """Engine server settings. The bounds mirror `shapeshift.engine.core.config.EngineConfig`
    (dtype choices, power-of-two block size, batched tokens >= batch size,
    memory fraction in (0, 1]), so a spec the API server accepts is one the engine starts with."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxBatchSize",
                    "spec.engine.maxNumBatchedTokens must be at least spec.engine.maxBatchSize, "
                    "so every running sequence can decode each step"),
            ]
        }
    )
    image: str = Field(default=DEFAULT_ENGINE_IMAGE, max_length=512, description="Engine container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of engine and compile pods."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(default="bfloat16", description="Weight and activation dtype.")
    max_batch_size: int = Field(default=64, ge=1, le=1024, description="Most sequences decoded in one step.")
    max_model_len: int = Field(default=8192, ge=64, le=1048576, description="Longest prompt plus output, in tokens.")
    kv_block_size: Literal[8, 16, 32, 64, 128, 256] = Field(default=16, description="Tokens per paged KV-cache block.")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, le=1048576, description="Token budget of one step (chunked prefill); default the engine's."
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of accelerator memory the engine may use (weights plus KV cache)."
    )
    prefix_caching: bool = Field(default=True, description="Reuse KV blocks of shared prompt prefixes.")
    cuda_graphs: bool = Field(default=True, description="Capture CUDA graphs per batch bucket (GPU only).")
    port: int = Field(default=8000, ge=1024, le=65535, description="HTTP port of the OpenAI API, /health and /metrics.")
    admin_token_secret: AdminTokenSecret | None = Field(
        default=None,
        description="Secret with the admin API's bearer token, mounted into the engine (no Secret: admin API off).",
    )
    env: list[EnvVar] | None = Field(
        default=None,
        max_length=MAX_ENV_VARS,
        description="Extra environment variables of the engine and compile containers, e.g. SHAPESHIFT_PDL=0 "
                    "(kernel launch switches; compile pods get them too, so candidates are measured as they "
                    "will serve). Changing them rolls the engine pods.",
        json_schema_extra=ENV_LIST_SCHEMA,
    )

    @model_validator(mode="after")
    def _consistent(self) -> "EngineSettings":
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_batch_size:
            raise ValueError("spec.engine.maxNumBatchedTokens must be at least spec.engine.maxBatchSize, "
                             "so every running sequence can decode each step")
        names = [e.name for e in self.env or []]
        if len(names) != len(set(names)):
            raise ValueError(f"spec.engine.env: duplicate names {sorted({n for n in names if names.count(n) > 1})}")
        return self


class DriftThresholds(WireModel):
    """When observed traffic counts as drifted from what the active forward pass was compiled for."""

    prompt_length_relative_change: float = Field(
        default=0.3, gt=0, le=10,
        description="Relative change of any prompt-length quantile (p50/p90/p99) that counts as drift, e.g. 0.3 = 30%.",
    )
    prefix_hit_rate_absolute_change: float = Field(
        default=0.15, gt=0, le=1,
        description="Absolute change of the prefix-cache hit rate that counts as drift, e.g. 0.15.",
    )
    window_seconds: int = Field(default=900, ge=60, le=86400, description="Prometheus window the observed profile is taken over.")
    check_interval_seconds: int = Field(default=60, ge=10, le=3600, description="Seconds between drift checks.")
    consecutive_checks: int = Field(default=3, ge=1, le=100, description="Checks in a row that must see drift before compiling.")


class CompileBudget(WireModel):
    """How much one compile run may spend; at least one limit must be positive."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.wallClockSeconds > 0 || self.trials > 0",
                    "a compile budget needs wallClockSeconds > 0 or trials > 0"),
            ]
        }
    )
    wall_clock_seconds: int = Field(default=3600, ge=0, le=7 * 86400, description="Wall-clock limit of the search in seconds (0: no limit).")
    trials: int = Field(default=0, ge=0, le=1_000_000, description="Candidate measurements allowed (0: no limit).")
    deadline_grace_seconds: int = Field(
        default=600, ge=0, le=86400,
        description="Time on top of wallClockSeconds for loading, verification and publishing before the Job is stopped.",
    )

    @model_validator(mode="after")
    def _positive(self) -> "CompileBudget":
        if self.wall_clock_seconds <= 0 and self.trials <= 0:
            raise ValueError("a compile budget needs wallClockSeconds > 0 or trials > 0")
        return self

    @property
    def active_deadline_seconds(self) -> int | None:
        """Job deadline: the wall clock plus grace, or none when only trials limit the run."""
        if self.wall_clock_seconds <= 0:
            return None
        return self.wall_clock_seconds + self.deadline_grace_seconds


class CompileRunTemplate(WireModel):
    """Settings copied into every automatic (drift-triggered) CompileRun of the deployment.

    Each field is the CompileRun spec field of the same name; a field left out here is
    left out of the run too, so the CompileRun's own default applies to it. The budget
    is spec.compilation.budget, the traffic is the snapshot that triggered the run."""

    agents: list[AgentSpec] | None = Field(
        default=None, min_length=1, max_length=16,
        description="Search agents of automatic runs (default: the CompileRun default, coordinate-sweep and evolutionary).",
    )
    tiers: TierSpec | None = Field(default=None, description="Measurement tiers of automatic runs.")
    verification: VerificationSpec | None = Field(default=None, description="Verification of automatic runs' champions.")
    baseline: BaselineSpec | None = Field(
        default=None, description="What automatic runs must beat (minSpeedup; forwardPass).")
    hardware: HardwareSpec | None = Field(
        default=None, description="Pool automatic runs compile on (default: the deployment's).")
    image: str | None = Field(
        default=None, max_length=512, description="Compile worker image (default: the deployment's engine image).")
    backoff_limit: int | None = Field(
        default=None, ge=0, le=10, description="Retries of the compile pod before an automatic run fails.")


class CompilationPolicy(WireModel):
    """When Shapeshift compiles: only on request, or also when traffic drifts."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.policy != 'OnDrift' || has(self.drift)",
                    "spec.compilation.policy OnDrift requires spec.compilation.drift thresholds"),
            ]
        }
    )
    policy: Literal["Manual", "OnDrift"] = Field(default="Manual", description="Manual: only CompileRuns you create. OnDrift: also when traffic drifts.")
    drift: DriftThresholds | None = Field(default=None, description="Drift thresholds (required for OnDrift).")
    cooldown_seconds: int = Field(default=3600, ge=0, le=30 * 86400, description="Least time between two automatic CompileRuns.")
    budget: CompileBudget = Field(default_factory=CompileBudget, json_schema_extra=_default_of(CompileBudget),
                                  description="Budget of automatic CompileRuns.")
    template: CompileRunTemplate | None = Field(
        default=None,
        description="Agents, tiers, verification, baseline, hardware, image and backoff limit of automatic "
                    "CompileRuns (each field left out takes the CompileRun default).",
    )

    @model_validator(mode="after")
    def _drift_needs_thresholds(self) -> "CompilationPolicy":
        if self.policy == "OnDrift" and self.drift is None:
            raise ValueError("spec.compilation.policy OnDrift requires spec.compilation.drift thresholds")
        return self


class RolloutSpec(WireModel):
    """How a verified forward pass reaches the serving pods."""

    strategy: Literal["HotReload", "Restart"] = Field(
        default="HotReload", description="HotReload: engines swap in place. Restart: roll the pod template."
    )
    canary_replicas: int = Field(default=1, ge=0, le=1000, description="Pods that take a new forward pass first.")
    analysis_window_seconds: int = Field(default=300, ge=10, le=86400, description="How long the canary is watched before promotion.")
    allowed_regression: float = Field(
        default=0.05, ge=0, le=1, description="Largest relative regression (p90 latency, error rate, tokens/s) still promoted."
    )
    load_timeout_seconds: int = Field(
        default=600, ge=10, le=86400,
        description="How long canary pods may take to report the new forward pass before it is rolled back.",
    )


ARTIFACT_MOUNT = "/var/lib/shapeshift-artifacts"
_SUB_PATH = r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$"


class ArtifactPVC(WireModel):
    """A PersistentVolumeClaim holding champion archives (<sha256>.tar.gz)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("!has(self.subPath) || !self.subPath.matches('(^|/)[.][.](/|$)')",
                    "spec.artifacts.pvc.subPath must stay inside the claim (no '..' segments)"),
            ]
        }
    )
    claim_name: str = Field(
        max_length=253, pattern=_DNS_SUBDOMAIN,
        description="Name of the claim (same namespace). Compile pods and engine pods may run on different "
                    "nodes, so in a real cluster it must be ReadWriteMany (e.g. NFS, EFS, Filestore, CephFS).",
    )
    sub_path: str | None = Field(
        default=None, max_length=1024, pattern=_SUB_PATH,
        description="Folder inside the claim to use (relative, e.g. 'shapeshift/llama'); default the claim's root.",
    )

    @model_validator(mode="after")
    def _inside_claim(self) -> "ArtifactPVC":
        if self.sub_path is not None and ".." in self.sub_path.split("/"):
            raise ValueError("spec.artifacts.pvc.subPath must stay inside the claim (no '..' segments)")
        return self


class ArtifactStore(WireModel):
    """Where compiled forward passes are kept so that engine pods can load them.

    The compile Job mounts the store read-write at /var/lib/shapeshift-artifacts and writes
    the champion there as <sha256>.tar.gz; the engine pods mount it read-only at the same
    path, so the ForwardPass's artifact path is valid in both."""

    pvc: ArtifactPVC | None = Field(default=None, description="A shared PersistentVolumeClaim.")


class InferenceDeploymentSpec(WireModel):
    """What to serve and how to keep it fast."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.replicas == 0 || self.rollout.canaryReplicas <= self.replicas",
                    "spec.rollout.canaryReplicas must not exceed spec.replicas"),
            ]
        }
    )
    model: ModelSource = Field(description="Model weights to serve.")
    engine: EngineSettings = Field(default_factory=EngineSettings, json_schema_extra=_default_of(EngineSettings),
                                   description="Engine server settings.")
    hardware: HardwareSpec = Field(description="Accelerator pool of the serving pods.")
    replicas: int = Field(default=1, ge=0, le=1000, description="Number of engine server pods.")
    compilation: CompilationPolicy = Field(default_factory=CompilationPolicy, json_schema_extra=_default_of(CompilationPolicy),
                                           description="When to compile new forward passes.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=_default_of(RolloutSpec),
                                 description="How verified forward passes are rolled out.")
    traffic_profile: BuiltinTrafficProfile | None = Field(
        default=None, description="Traffic assumed before any is observed (a built-in profile)."
    )
    forward_pass: str | None = Field(
        default=None, max_length=253, description="Pin this ForwardPass instead of the latest verified champion."
    )
    prometheus_url: str | None = Field(
        default=None, max_length=1024, pattern=r"^https?://",
        description="Prometheus that scrapes this deployment (default: the operator's).",
    )
    artifacts: ArtifactStore | None = Field(
        default=None,
        description="Shared store for compiled forward passes, mounted read-write by compile Jobs and read-only "
                    f"by engine pods at {ARTIFACT_MOUNT}. Without it a compiled forward pass lives only in its "
                    "compile pod and is not rolled out.",
    )

    @model_validator(mode="after")
    def _canary_fits(self) -> "InferenceDeploymentSpec":
        if self.replicas and self.rollout.canary_replicas > self.replicas:
            raise ValueError("spec.rollout.canaryReplicas must not exceed spec.replicas")
        return self


class ForwardPassRef(StatusModel):
    """A forward pass as a deployment or pod runs it."""

    name: str = Field(default="stock", max_length=253, description="ForwardPass name ('stock' for the built-in one).")
    sha256: str | None = Field(default=None, max_length=64, description="Bundle digest (manifest digest) the engine checks.")
    artifact: str | None = Field(default=None, max_length=2048, description="Where the bundle lives (the ForwardPass's artifact URI).")
    speedup: float | None = Field(default=None, ge=0, description="Measured speedup over the stock forward pass.")


class DriftStatus(StatusModel):
    """The last drift check."""

    score: float | None = Field(default=None, description="Larger of the prompt-length and hit-rate changes.")
    prompt_length_relative_change: dict[str, float] | None = Field(
        default=None, max_length=8, description="Relative change per prompt-length quantile (p50, p90, p99)."
    )
    prefix_cache_hit_rate_change: float | None = Field(default=None, description="Absolute change of the hit rate.")
    exceeded: bool | None = Field(default=None, description="Whether the last check passed a threshold.")
    consecutive_checks: int = Field(default=0, ge=0, description="Checks in a row that saw drift.")
    last_check_time: datetime | None = Field(default=None, description="When traffic was last read.")


class PodForwardPass(StatusModel):
    """What one serving pod runs."""

    name: str = Field(max_length=253, description="Pod name.")
    forward_pass: str | None = Field(default=None, max_length=253, description="ForwardPass the pod reports running.")
    sha256: str | None = Field(default=None, max_length=64, description="sha256 the pod reports.")
    desired: str | None = Field(default=None, max_length=253, description="ForwardPass the operator asks the pod to run ('stock' for none).")
    canary: bool = Field(default=False, description="Whether the pod is in the canary group.")
    ready: bool = Field(default=False, description="Whether the pod is ready.")


class RolloutStatus(StatusModel):
    """Where a rollout stands."""

    phase: Literal["Idle", "Canary", "Analyzing", "Promoting", "Complete", "RolledBack", "Failed"] = Field(
        default="Idle", description="Rollout phase.")
    desired: ForwardPassRef | None = Field(default=None, description="Forward pass being rolled out.")
    previous: ForwardPassRef | None = Field(default=None, description="Forward pass to roll back to.")
    canary_pods: list[str] | None = Field(default=None, max_length=1000, description="Pods in the canary group.")
    start_time: datetime | None = Field(default=None, description="When the rollout started.")
    phase_since: datetime | None = Field(default=None, description="When the current phase started.")
    message: str | None = Field(default=None, max_length=4096, description="Why the rollout is where it is.")


class InferenceDeploymentStatus(StatusModel):
    """What is running, observed by the operator."""

    observed_generation: int | None = Field(default=None, description="Generation of the spec last reconciled.")
    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"] | None = Field(
        default=None, description="Pending, Progressing, Ready, Degraded or Failed.")
    replicas: int | None = Field(default=None, ge=0, description="Engine pods that exist.")
    ready_replicas: int | None = Field(default=None, ge=0, description="Engine pods that are ready.")
    selector: str | None = Field(default=None, max_length=1024, description="Label selector of the engine pods (for the scale subresource).")
    deployment: str | None = Field(default=None, max_length=253, description="Name of the engine Deployment.")
    service: str | None = Field(default=None, max_length=63, description="Name of the engine Service.")
    active_forward_pass: ForwardPassRef | None = Field(default=None, description="Forward pass all ready pods run.")
    compiled_for: TrafficProfile | None = Field(default=None, description="Traffic profile the active forward pass was compiled for.")
    observed_traffic: TrafficProfile | None = Field(default=None, description="Traffic observed over the last drift window.")
    drift: DriftStatus | None = Field(default=None, description="The last drift check.")
    last_compile_run: str | None = Field(default=None, max_length=253, description="Name of the most recent CompileRun.")
    last_compile_time: datetime | None = Field(default=None, description="When the most recent CompileRun was created.")
    rollout: RolloutStatus | None = Field(default=None, description="Rollout of a new forward pass.")
    pods: list[PodForwardPass] | None = Field(default=None, max_length=1000, description="What each pod runs.")
    conditions: list[Condition] | None = Field(default=None, max_length=32, description="Ready, Progressing, TrafficObserved, Drifted ...")
    message: str | None = Field(default=None, max_length=4096, description="Human-readable summary.")


# ---- CompileRun ---------------------------------------------------------------------------


class DeploymentRef(WireModel):
    name: str = Field(min_length=1, max_length=253, description="Name of the InferenceDeployment in the same namespace.")


class PrometheusWindow(WireModel):
    """Snapshot the deployment's traffic from Prometheus when the run starts."""

    window_seconds: int = Field(default=900, ge=60, le=30 * 86400, description="Window to read, ending when the run starts.")


class TrafficSource(WireModel):
    """The traffic to optimise for: at most one of builtin, inline, prometheus
    (none: the deployment's observed traffic, else its traffic profile)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("(has(self.builtin) ? 1 : 0) + (has(self.inline) ? 1 : 0) + (has(self.prometheus) ? 1 : 0) <= 1",
                    "set at most one of spec.traffic.builtin, spec.traffic.inline, spec.traffic.prometheus"),
            ]
        }
    )
    builtin: BuiltinTrafficProfile | None = Field(default=None, description="A built-in profile.")
    inline: TrafficProfile | None = Field(default=None, description="A profile given in full (drift-triggered runs carry their snapshot here).")
    prometheus: PrometheusWindow | None = Field(default=None, description="Snapshot from Prometheus.")

    @model_validator(mode="after")
    def _at_most_one(self) -> "TrafficSource":
        if sum(x is not None for x in (self.builtin, self.inline, self.prometheus)) > 1:
            raise ValueError("set at most one of spec.traffic.builtin, spec.traffic.inline, spec.traffic.prometheus")
        return self


class CompileTrigger(WireModel):
    """Why the run exists."""

    reason: Literal["Manual", "Drift"] = Field(default="Manual", description="Manual or Drift.")
    drift_score: float | None = Field(default=None, ge=0, description="Drift score that triggered the run.")
    observed_at: datetime | None = Field(default=None, description="When the drift was confirmed.")


_RUN_NAME_MAX = 52  # the Job is "<run>-compile"; Job names feed a 63-character pod label


class CompileRunSpec(WireModel):
    """One search for a faster forward pass. Immutable once created."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self == oldSelf", "spec of a CompileRun is immutable; create a new CompileRun"),
            ]
        }
    )
    deployment_ref: DeploymentRef = Field(description="The InferenceDeployment to compile for.")
    hardware: HardwareSpec | None = Field(default=None, description="Pool to compile on (default: the deployment's).")
    traffic: TrafficSource = Field(default_factory=TrafficSource, json_schema_extra=_default_of(TrafficSource),
                                   description="Traffic to optimise for.")
    budget: CompileBudget = Field(default_factory=CompileBudget, json_schema_extra=_default_of(CompileBudget), description="Limits of the search.")
    agents: list[AgentSpec] = Field(
        default_factory=lambda: [AgentSpec(kind="coordinate-sweep"), AgentSpec(kind="evolutionary")],
        max_length=16,
        json_schema_extra={"default": [{"kind": "coordinate-sweep", "replicas": 1}, {"kind": "evolutionary", "replicas": 1}]},
        description="Search agents, run concurrently on one message board.",
    )
    tiers: TierSpec = Field(default_factory=TierSpec, json_schema_extra=_default_of(TierSpec), description="Measurement tiers.")
    verification: VerificationSpec = Field(default_factory=VerificationSpec, json_schema_extra=_default_of(VerificationSpec),
                                           description="Verification of the champion.")
    baseline: BaselineSpec = Field(default_factory=BaselineSpec, json_schema_extra=_default_of(BaselineSpec), description="What to beat.")
    backoff_limit: int = Field(default=1, ge=0, le=10, description="Retries of the compile pod before the run fails.")
    trigger: CompileTrigger = Field(default_factory=CompileTrigger, json_schema_extra=_default_of(CompileTrigger), description="Why the run exists.")
    image: str | None = Field(default=None, max_length=512, description="Compile worker image (default: the deployment's engine image).")


class LeaderboardEntry(StatusModel):
    candidate: str = Field(max_length=253, description="Candidate id.")
    agent: str | None = Field(default=None, max_length=63, description="Agent that proposed it.")
    speedup: float | None = Field(default=None, description="Speedup over the baseline.")
    tokens_per_second: float | None = Field(default=None, description="Output tokens/s in replay.")
    verified: bool | None = Field(default=None, description="Whether it passed verification.")


class TrialCounts(StatusModel):
    total: int = Field(default=0, ge=0, description="Candidates measured.")
    improved: int = Field(default=0, ge=0, description="Candidates that beat the incumbent by more than the noise.")
    rejected: int = Field(default=0, ge=0, description="Candidates rejected by a check.")
    failed: int = Field(default=0, ge=0, description="Candidates that crashed, hung or did not build.")


CompileRunPhase = Literal["Pending", "Scheduled", "Running", "Verifying", "Succeeded", "Failed"]
TERMINAL_PHASES = ("Succeeded", "Failed")


class CompileRunStatus(StatusModel):
    """Where the search stands. The operator writes phase, job, pod and conditions;
    the compile worker writes trials, leaderboard, bestSpeedup and champion."""

    observed_generation: int | None = Field(default=None, description="Generation of the spec last reconciled.")
    phase: CompileRunPhase | None = Field(default=None, description="Pending, Scheduled, Running, Verifying, Succeeded or Failed.")
    accelerator: AcceleratorKind | None = Field(default=None, description="Accelerator the run compiles on.")
    job_name: str | None = Field(default=None, max_length=63, description="The compile Job.")
    pod_name: str | None = Field(default=None, max_length=253, description="The compile pod last seen.")
    node_name: str | None = Field(default=None, max_length=253, description="Node the compile pod is bound to.")
    start_time: datetime | None = Field(default=None, description="When the compile pod started.")
    completion_time: datetime | None = Field(default=None, description="When the run ended.")
    trials: TrialCounts | None = Field(default=None, description="Candidate counts.")
    best_speedup: float | None = Field(default=None, description="Best verified speedup so far.")
    leaderboard: list[LeaderboardEntry] | None = Field(default=None, max_length=20, description="Best candidates so far.")
    champion: str | None = Field(default=None, max_length=253, description="The ForwardPass published by this run.")
    conditions: list[Condition] | None = Field(default=None, max_length=32, description="Scheduled, Complete, Failed ...")
    message: str | None = Field(default=None, max_length=4096, description="Human-readable summary.")


# ---- ForwardPass --------------------------------------------------------------------------


class ModelSignature(WireModel):
    """Which model a forward pass is for."""

    name: str = Field(max_length=253, description="Model or preset name.")
    architecture: str | None = Field(default=None, max_length=128, description="e.g. LlamaForCausalLM.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(default="bfloat16", description="Dtype it was verified in.")
    config_sha256: str | None = Field(default=None, max_length=64, pattern=r"^[a-f0-9]{64}$",
                                      description="sha256 of the model's config.json.")


class ForwardPassHardware(WireModel):
    accelerator: AcceleratorKind = Field(description="Accelerator it was compiled and verified on.")
    count: int = Field(default=1, ge=1, le=64, description="Accelerators per engine.")


class Artifact(WireModel):
    """Where the bundle lives."""

    uri: str = Field(max_length=2048, description="Location of the bundle (file://, s3://, http(s)://, configmap://).")
    sha256: str = Field(pattern=r"^[a-f0-9]{64}$", max_length=64,
                        description="Bundle digest (the manifest digest, independent of packing) the engine checks before loading.")
    size_bytes: int | None = Field(default=None, ge=0, description="Size of the bundle.")


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
    passed: bool = Field(description="Whether every gate passed.")
    gates: list[GateResult] = Field(default_factory=list, max_length=64, description="Per-gate results.")


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


class ForwardPassSpec(WireModel):
    """A verified champion: an entry of the registry. Immutable once created."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self == oldSelf", "spec of a ForwardPass is immutable; publish a new ForwardPass"),
            ]
        }
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
    metrics: ForwardPassMetrics = Field(default_factory=ForwardPassMetrics, json_schema_extra=_default_of(ForwardPassMetrics),
                                        description="Measured performance.")
    verification: VerificationReport = Field(description="Verification report.")
    engine: ForwardPassEngine | None = Field(
        default=None, description="Engine environment it was measured under (absent: not recorded, as for "
                                  "forward passes published outside a cluster).")
    reasoning: list[ReasoningNote] | None = Field(default=None, max_length=64, description="The agents' reasoning.")
    parent: str | None = Field(default=None, max_length=253, description="ForwardPass this one was derived from.")
    compile_run: str | None = Field(default=None, max_length=253, description="CompileRun that produced it.")


class ForwardPassRefusal(StatusModel):
    """One InferenceDeployment that would not or could not run this forward pass."""

    deployment: str = Field(max_length=253, description="The InferenceDeployment.")
    reason: str = Field(max_length=128, description="RolledBack, RolloutFailed, ArtifactNotDurable or TargetRejected.")
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


# ---- kinds --------------------------------------------------------------------------------


class Kind:
    """What crdgen and the handlers need to know about one custom resource."""

    def __init__(self, kind: str, plural: str, short_names: list[str], spec: type[WireModel],
                 status: type[StatusModel], columns: list[dict[str, Any]], root_rules: list[dict[str, str]],
                 description: str, scale: bool = False):
        self.kind, self.plural, self.short_names = kind, plural, short_names
        self.singular = kind.lower()
        self.spec, self.status, self.columns = spec, status, columns
        self.root_rules, self.description, self.scale = root_rules, description, scale

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


def _col(name: str, path: str, type: str = "string", priority: int = 0, description: str = "") -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "type": type, "jsonPath": path}
    if priority:
        c["priority"] = priority
    if description:
        c["description"] = description
    return c


_AGE = _col("Age", ".metadata.creationTimestamp", "date")

INFERENCE_DEPLOYMENT = Kind(
    kind="InferenceDeployment",
    plural="inferencedeployments",
    short_names=["infd"],
    spec=InferenceDeploymentSpec,
    status=InferenceDeploymentStatus,
    columns=[
        _col("Phase", ".status.phase", description="Pending, Progressing, Ready, Degraded or Failed."),
        _col("Ready", ".status.readyReplicas", "integer", description="Ready engine pods."),
        _col("Replicas", ".spec.replicas", "integer", description="Desired engine pods."),
        _col("Accelerator", ".spec.hardware.accelerator"),
        _col("Forward-Pass", ".status.activeForwardPass.name", description="Forward pass the pods run."),
        _col("Speedup", ".status.activeForwardPass.speedup", "number", description="Over the stock forward pass."),
        _col("Drift", ".status.drift.score", "number", description="Last drift score."),
        _col("Rollout", ".status.rollout.phase", description="Idle, Canary, Analyzing, Promoting, Complete, RolledBack."),
        _col("Policy", ".spec.compilation.policy", priority=1),
        _col("Last-Compile", ".status.lastCompileRun", priority=1),
        _col("Message", ".status.message", priority=1),
        _AGE,
    ],
    root_rules=[
        cel("self.metadata.name.size() <= 50 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
            "InferenceDeployment names must be DNS labels of at most 50 characters starting with a letter "
            "(they name a Service and a Deployment)"),
    ],
    description="An LLM served by Shapeshift engine pods, kept fast by continuous compilation.",
    scale=True,
)

COMPILE_RUN = Kind(
    kind="CompileRun",
    plural="compileruns",
    short_names=["cr", "crun"],
    spec=CompileRunSpec,
    status=CompileRunStatus,
    columns=[
        _col("Phase", ".status.phase", description="Pending, Scheduled, Running, Verifying, Succeeded or Failed."),
        _col("Deployment", ".spec.deploymentRef.name"),
        _col("Accelerator", ".status.accelerator"),
        _col("Trials", ".status.trials.total", "integer"),
        _col("Speedup", ".status.bestSpeedup", "number", description="Best verified speedup."),
        _col("Champion", ".status.champion"),
        _col("Trigger", ".spec.trigger.reason", priority=1),
        _col("Node", ".status.nodeName", priority=1),
        _col("Message", ".status.message", priority=1),
        _AGE,
    ],
    root_rules=[
        cel(f"self.metadata.name.size() <= {_RUN_NAME_MAX}",
            f"CompileRun names must be at most {_RUN_NAME_MAX} characters (the Job is named <name>-compile)"),
    ],
    description="One search for a faster forward pass of an InferenceDeployment.",
)

FORWARD_PASS = Kind(
    kind="ForwardPass",
    plural="forwardpasses",
    short_names=["fp"],
    spec=ForwardPassSpec,
    status=ForwardPassStatus,
    columns=[
        _col("Model", ".spec.model.name"),
        _col("Accelerator", ".spec.hardware.accelerator"),
        _col("Speedup", ".spec.metrics.speedup", "number"),
        _col("Verified", ".spec.verification.passed", "boolean"),
        _col("Phase", ".status.phase", description="Available, Active or Refused."),
        _col("SHA256", ".spec.artifact.sha256", priority=1),
        _col("Deployments", ".status.deployments", priority=1, description="InferenceDeployments that run it."),
        _col("Parent", ".spec.parent", priority=1),
        _AGE,
    ],
    root_rules=[],
    description="A verified forward pass: an entry of the champion registry.",
)

KINDS: tuple[Kind, ...] = (INFERENCE_DEPLOYMENT, COMPILE_RUN, FORWARD_PASS)


# ---- parsing helpers ------------------------------------------------------------------------


def parse_spec(kind: Kind, spec: Any) -> Any:
    """Typed spec from a cluster object's spec mapping (pydantic ValidationError on bad input)."""
    return kind.spec.model_validate(dict(spec or {}))


def parse_status(kind: Kind, status: Any) -> Any:
    return kind.status.model_validate(dict(status or {}))


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def short_error(exc: Exception) -> str:
    """A pydantic ValidationError as one line per error, with the wire field path."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for e in errors():
        loc = ".".join(str(p) for p in e.get("loc", ()))
        lines.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(lines)

