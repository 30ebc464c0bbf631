"""The InferenceDeployment kind: what to serve and how to keep it fast.

    user --InferenceDeployment--> operator: engine Deployment and Service (builders.py),
                                  drift detection (spec.compilation), rollout (spec.rollout)
    operator --status--> phase, pods, active forward pass, observed traffic, drift, rollout
    spec defaults and validation: here, mirrored as CEL rules in
    crds/shapeshift.dev_inferencedeployments.yaml
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from shapeshift.engine.contracts.traffic_profile import TrafficProfile
from shapeshift.operator.api.common import (DNS_SUBDOMAIN, ENV_LIST_SCHEMA, MAX_ENV_VARS, BuiltinTrafficProfile,
                                           Condition, Dtype, EnvVar, HardwareSpec, StatusModel, WireModel, cel,
                                           check_outbound_url, outbound_url_rule, default_of, cel_rules)
from shapeshift.operator.api.compile_run import (AgentSpec, BaselineSpec, CompileBudget, CompileSLO, TierSpec,
                                                 VerificationSpec)
from shapeshift.operator.api.group import AGE_COLUMN, Kind, printer_column

DEFAULT_ENGINE_IMAGE = "shapeshift/engine:0.1.0"


class PVCModelSource(WireModel):
    """A Hugging Face style model folder on a PersistentVolumeClaim."""

    claim_name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="Name of the PersistentVolumeClaim.")
    path: str = Field(default="", max_length=1024, description="Folder inside the claim that holds config.json and *.safetensors.")


class ModelSource(WireModel):
    """Where the weights come from: exactly one of `preset` or `pvc`."""

    model_config = cel_rules(
        cel("has(self.preset) != has(self.pvc)",
            "exactly one of spec.model.preset or spec.model.pvc must be set"),
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

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="Secret name (same namespace).")
    key: str = Field(default="token", max_length=253, description="Key in the Secret.")


class EngineSettings(WireModel):
    """Engine server settings. The bounds mirror `shapeshift.engine.core.config.EngineConfig`
    (dtype choices, power-of-two block size, batched tokens >= batch size,
    memory fraction in (0, 1]), so a spec the API server accepts is one the engine starts with."""

    model_config = cel_rules(
        cel("!has(self.maxNumBatchedTokens) || self.maxNumBatchedTokens >= self.maxBatchSize",
            "spec.engine.maxNumBatchedTokens must be at least spec.engine.maxBatchSize, "
            "so every running sequence can decode each step"),
    )
    image: str = Field(default=DEFAULT_ENGINE_IMAGE, max_length=512, description="Engine container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of engine and compile pods."
    )
    dtype: Dtype = Field(default="bfloat16", description="Weight and activation dtype.")
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
    metrics_compat: Literal["vllm"] | None = Field(
        default=None,
        description="Also export vLLM's metric names on /metrics (vllm: vllm:num_requests_waiting, "
                    "vllm:kv_cache_usage_perc, ... with label model_name), so KEDA/HPA recipes written for vLLM "
                    "scale engine pods unchanged; default: the shapeshift_* series only.",
    )
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
    slo: CompileSLO | None = Field(
        default=None, description="The SLO automatic runs judge candidates by (default: the compile engine's).")


class CompilationPolicy(WireModel):
    """When Shapeshift compiles: only on request, or also when traffic drifts."""

    model_config = cel_rules(
        cel("self.policy != 'OnDrift' || has(self.drift)",
            "spec.compilation.policy OnDrift requires spec.compilation.drift thresholds"),
    )
    policy: Literal["Manual", "OnDrift"] = Field(default="Manual", description="Manual: only CompileRuns you create. OnDrift: also when traffic drifts.")
    drift: DriftThresholds | None = Field(default=None, description="Drift thresholds (required for OnDrift).")
    cooldown_seconds: int = Field(default=3600, ge=0, le=30 * 86400, description="Least time between two automatic CompileRuns.")
    max_payback_hours: float | None = Field(
        default=None, gt=0, le=8760,
        description="Skip an automatic CompileRun whose expected payback (the accelerator-seconds past compiles "
                    "spent over what their champions save) is longer than this, or longer than regimes have "
                    "lasted so far (status.regimes); default: compile regardless of cost.")
    budget: CompileBudget = Field(default_factory=CompileBudget, json_schema_extra=default_of(CompileBudget),
                                  description="Budget of automatic CompileRuns.")
    template: CompileRunTemplate | None = Field(
        default=None,
        description="Agents, tiers, verification, baseline, hardware, image, backoff limit and SLO of automatic "
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


# shapeshift.operator.regimes.regime_key: prompt, hit-rate, concurrency, output buckets, MoE routing
# signature; names written before the output and routing buckets (p1-h0-c2) stay valid
REGIME_NAME = r"^p[0-9]+-h[0-9]+-c[0-9]+(-o[0-9]+)?(-e(u|[0-9]+([.][0-9]+)?))?$"
REGIMES_KEPT = 16


class RegimeChampionPin(WireModel):
    """The ForwardPass to serve in one regime, whatever the library says."""

    regime: str = Field(max_length=32, pattern=REGIME_NAME,
                        description="Regime name, e.g. p1-h0-c2-o0 (an older name without the output bucket, "
                                    "p1-h0-c2, names every output bucket of its cell).")
    forward_pass: str = Field(max_length=253, description="ForwardPass to roll out while traffic is in that regime.")


class RegimePolicy(WireModel):
    """How the operator moves between the verified champions of the traffic regimes it has seen."""

    model_config = cel_rules(
        cel("!has(self.champions) || self.champions.all(a, self.champions.exists_one(b, b.regime == a.regime))",
            "spec.regimes.champions names each regime at most once"),
    )
    pin: str | None = Field(
        default=None, max_length=32, pattern=REGIME_NAME,
        description="Serve this regime's champion whatever the traffic does (no switches, no compiles for "
                    "other regimes' sake).")
    champions: list[RegimeChampionPin] | None = Field(
        default=None, max_length=REGIMES_KEPT,
        description="Pinned champions per regime; they win over the champions the library recorded.")
    switch_checks: int = Field(
        default=2, ge=1, le=100,
        description="Drift checks in a row that must observe a regime before the operator switches to it.")
    min_dwell_seconds: int = Field(
        default=0, ge=0, le=86400,
        description="Least time observed traffic must stay in a regime before the operator switches to it.")
    switch_cooldown_seconds: int = Field(
        default=300, ge=0, le=7 * 86400, description="Least time between two switches between regime champions.")
    champion_max_age_seconds: int | None = Field(
        default=None, ge=60, le=365 * 86400,
        description="A champion verified longer ago than this is stale: its regime is compiled again (default: "
                    "champions do not age).")

    @model_validator(mode="after")
    def _each_regime_once(self) -> "RegimePolicy":
        names = [c.regime for c in self.champions or []]
        if len(names) != len(set(names)):
            raise ValueError("spec.regimes.champions names each regime at most once")
        return self


ARTIFACT_MOUNT = "/var/lib/shapeshift-artifacts"
_SUB_PATH = r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$"


class ArtifactPVC(WireModel):
    """A PersistentVolumeClaim holding champion archives (<sha256>.tar.gz)."""

    model_config = cel_rules(
        cel("!has(self.subPath) || !self.subPath.matches('(^|/)[.][.](/|$)')",
            "spec.artifacts.pvc.subPath must stay inside the claim (no '..' segments)"),
    )
    claim_name: str = Field(
        max_length=253, pattern=DNS_SUBDOMAIN,
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

    model_config = cel_rules(
        cel("self.replicas == 0 || self.rollout.canaryReplicas <= self.replicas",
            "spec.rollout.canaryReplicas must not exceed spec.replicas"),
        outbound_url_rule("prometheusUrl", "spec.prometheusUrl"),
        cel("!has(self.forwardPass) || !has(self.regimes) || !has(self.regimes.pin)",
            "spec.forwardPass and spec.regimes.pin pin two different things: set one of them"),
    )
    model: ModelSource = Field(description="Model weights to serve.")
    engine: EngineSettings = Field(default_factory=EngineSettings, json_schema_extra=default_of(EngineSettings),
                                   description="Engine server settings.")
    hardware: HardwareSpec = Field(description="Accelerator pool of the serving pods.")
    replicas: int = Field(default=1, ge=0, le=1000, description="Number of engine server pods.")
    compilation: CompilationPolicy = Field(default_factory=CompilationPolicy, json_schema_extra=default_of(CompilationPolicy),
                                           description="When to compile new forward passes.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=default_of(RolloutSpec),
                                 description="How verified forward passes are rolled out.")
    traffic_profile: BuiltinTrafficProfile | None = Field(
        default=None, description="Traffic assumed before any is observed (a built-in profile)."
    )
    forward_pass: str | None = Field(
        default=None, max_length=253, description="Pin this ForwardPass instead of the latest verified champion."
    )
    prometheus_url: str | None = Field(
        default=None, max_length=1024, pattern=r"^https?://",
        description="Prometheus that scrapes this deployment (default: the operator's): http(s)://host[:port][/path], "
                    "no user:password@, query or fragment. The operator refuses link-local and cloud metadata "
                    "addresses unless the operator setting SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS allows them.",
    )
    regimes: RegimePolicy | None = Field(
        default=None,
        description="Switching between the verified champions of the traffic regimes seen before, without "
                    "compiling again; pins (default: switch after 2 checks, 300 s between switches).")
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
        check_outbound_url(self.prometheus_url, "spec.prometheusUrl")
        if self.forward_pass and self.regimes is not None and self.regimes.pin:
            raise ValueError("spec.forwardPass and spec.regimes.pin pin two different things: set one of them")
        return self


class ForwardPassRef(StatusModel):
    """A forward pass as a deployment or pod runs it."""

    name: str = Field(default="stock", max_length=253, description="ForwardPass name ('stock' for the built-in one).")
    sha256: str | None = Field(default=None, max_length=64, description="Bundle digest (manifest digest) the engine checks.")
    artifact: str | None = Field(default=None, max_length=2048, description="Where the bundle lives (the ForwardPass's artifact URI).")
    speedup: float | None = Field(default=None, ge=0, description="Measured speedup over the shipped serving default (the compile run's baseline).")


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


VERIFIED_FORWARD_PASSES_KEPT = 8


class VerifiedForwardPass(StatusModel):
    """A ForwardPass the operator accepted as verified because its CompileRun vouched for it
    (operator/provenance.py), recorded when accepted: the pass stays trusted, with this exact spec,
    after that CompileRun is deleted. Only the operator writes it (the status subresource)."""

    name: str = Field(max_length=253, description="The ForwardPass.")
    spec_sha256: str = Field(max_length=64, pattern=r"^[a-f0-9]{64}$",
                             description="Digest of its spec when accepted (ForwardPassSpec.digest).")
    compile_run: str = Field(max_length=253, description="The CompileRun that vouched for it.")
    compile_run_uid: str = Field(max_length=64, description="That CompileRun's uid (the pass's annotation).")
    completion_time: datetime | None = Field(default=None, description="When that CompileRun finished.")
    accepted_at: datetime | None = Field(default=None, description="When the operator accepted it.")


class RegimeChampion(StatusModel):
    """A regime's verified champion, and what it was verified for."""

    forward_pass: str = Field(max_length=253, description="The ForwardPass.")
    sha256: str | None = Field(default=None, max_length=64, description="Its bundle digest.")
    speedup: float | None = Field(default=None, ge=0,
                                  description="Measured speedup over the shipped default on the regime's replay.")
    accelerator: str | None = Field(default=None, max_length=64, description="Accelerator it was verified on.")
    model: str | None = Field(default=None, max_length=253, description="Model it was verified for.")
    dtype: str | None = Field(default=None, max_length=32, description="Dtype it was verified in.")
    model_config_sha256: str | None = Field(
        default=None, max_length=64, description="Digest of the model config it was verified for (its ForwardPass's "
                                                 "spec.model.configSha256; absent: not recorded).")
    engine_image: str | None = Field(
        default=None, max_length=512, description="The deployment's engine image when it was recorded (absent: not "
                                                  "recorded); another spec.engine.image does not switch to it.")
    engine_env_sha256: str | None = Field(default=None, max_length=64,
                                          description="Digest of the engine performance switches it was measured under.")
    compile_run: str | None = Field(default=None, max_length=253, description="The CompileRun that published it.")
    verified_at: datetime | None = Field(default=None, description="When that CompileRun finished.")
    compile_accelerator_seconds: float | None = Field(
        default=None, ge=0, description="What the CompileRun spent: accelerators x its Job's wall time (start to end).")
    saved_accelerator_seconds_per_hour: float | None = Field(
        default=None, ge=0,
        description="Serving accelerator-seconds it saves per hour in its regime at the load served when it was "
                    "last measured (savingsMeasuredAt): 3600 x (accelerators busy serving the Prometheus-measured output tokens/s at the old "
                    "speed) x (1 - 1/speedup); its CompileRun's status.economics says the same per day.")
    payback_seconds: float | None = Field(
        default=None, ge=0, description="Serving time in its regime after which the compile paid for itself.")
    savings_measured_at: datetime | None = Field(
        default=None, description="When the served load behind savedAcceleratorSecondsPerHour and paybackSeconds "
                                  "was read; while traffic is in its regime it is read again every "
                                  "SHAPESHIFT_SAVINGS_REFRESH_SECONDS (default 900).")
    rolled_back_at: datetime | None = Field(
        default=None, description="When this deployment's rollout rolled it back; the library no longer switches "
                                  "to it, and traffic in its regime compiles again.")
    rolled_back_reason: str | None = Field(default=None, max_length=1024, description="Why it was rolled back.")


class RegimeStatus(StatusModel):
    """One traffic regime the deployment has seen."""

    name: str = Field(max_length=32, description="Regime name: prompt-length, hit-rate, concurrency and output-length "
                                                 "buckets, and for MoE traffic the dominant experts.")
    prompt_length_p50: float | None = Field(default=None, ge=0, description="Median prompt tokens last seen in it.")
    prefix_cache_hit_rate: float | None = Field(default=None, ge=0, le=1, description="Hit rate last seen in it.")
    concurrency: float | None = Field(default=None, ge=0, description="Concurrency last seen in it.")
    output_length_p50: float | None = Field(default=None, ge=0, description="Median output tokens last seen in it.")
    first_seen: datetime | None = Field(default=None, description="First drift check that observed it.")
    last_seen: datetime | None = Field(default=None, description="Last drift check that observed it.")
    dwell_seconds: int = Field(default=0, ge=0, description="How long traffic sat in it, over all visits.")
    checks: int = Field(default=0, ge=0, description="Drift checks that observed it.")
    visits: int = Field(default=0, ge=0, description="Times traffic came into it.")
    compile_run: str | None = Field(default=None, max_length=253, description="The last CompileRun started for it.")
    champion: RegimeChampion | None = Field(default=None, description="Its verified champion.")


class CurrentRegime(StatusModel):
    """Where traffic is, and which champion the library chose for it."""

    name: str | None = Field(default=None, max_length=32, description="The regime traffic settled in.")
    since: datetime | None = Field(default=None, description="When it settled there.")
    observed: str | None = Field(default=None, max_length=32, description="The regime the last check observed.")
    observed_checks: int = Field(default=0, ge=0, description="Checks in a row that observed it.")
    observed_since: datetime | None = Field(default=None, description="First of those checks.")
    forward_pass: str | None = Field(default=None, max_length=253,
                                     description="Champion the last switch chose (the rollout's target until a "
                                                 "CompileRun finishes later).")
    sha256: str | None = Field(default=None, max_length=64, description="Its bundle digest.")
    last_switch_time: datetime | None = Field(default=None, description="When the last switch happened.")
    reason: str | None = Field(default=None, max_length=1024, description="Why the library did what it did last.")
    saved_accelerator_hours_per_day: float | None = Field(
        default=None, ge=0, description="What the champion of the current regime saves: accelerator-hours a day at "
                                        "the load served when it was recorded (its savedAcceleratorSecondsPerHour / "
                                        "150).")
    payback_hours: float | None = Field(
        default=None, ge=0, description="Serving hours in the current regime after which its champion's compile paid "
                                        "for itself (its paybackSeconds / 3600).")


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
    verified_forward_passes: list[VerifiedForwardPass] | None = Field(
        default=None, max_length=VERIFIED_FORWARD_PASSES_KEPT,
        description="ForwardPasses the operator accepted because their CompileRun vouched for them (newest "
                    "last); they stay trusted, unchanged, after that CompileRun is deleted.")
    regimes: list[RegimeStatus] | None = Field(
        default=None, max_length=REGIMES_KEPT,
        description="Traffic regimes seen, with their verified champions (the regime library).")
    current_regime: CurrentRegime | None = Field(default=None, description="The regime traffic is in now.")
    pods: list[PodForwardPass] | None = Field(default=None, max_length=1000, description="What each pod runs.")
    conditions: list[Condition] | None = Field(default=None, max_length=32, description="Ready, Progressing, TrafficObserved, Drifted ...")
    message: str | None = Field(default=None, max_length=4096, description="Human-readable summary.")


INFERENCE_DEPLOYMENT = Kind(
    kind="InferenceDeployment",
    plural="inferencedeployments",
    short_names=["infd"],
    spec=InferenceDeploymentSpec,
    status=InferenceDeploymentStatus,
    columns=[
        printer_column("Phase", ".status.phase", description="Pending, Progressing, Ready, Degraded or Failed."),
        printer_column("Ready", ".status.readyReplicas", "integer", description="Ready engine pods."),
        printer_column("Replicas", ".spec.replicas", "integer", description="Desired engine pods."),
        printer_column("Accelerator", ".spec.hardware.accelerator"),
        printer_column("Forward-Pass", ".status.activeForwardPass.name", description="Forward pass the pods run."),
        printer_column("Speedup", ".status.activeForwardPass.speedup", "number", description="Over the stock forward pass."),
        printer_column("Drift", ".status.drift.score", "number", description="Last drift score."),
        printer_column("Regime", ".status.currentRegime.name", description="Traffic regime the deployment serves."),
        printer_column("Rollout", ".status.rollout.phase", description="Idle, Canary, Analyzing, Promoting, Complete, RolledBack."),
        printer_column("Saved/Day", ".status.currentRegime.savedAcceleratorHoursPerDay", "number", priority=1,
                       description="Accelerator-hours a day the current regime's champion saves at its recorded load."),
        printer_column("Payback", ".status.currentRegime.paybackHours", "number", priority=1,
                       description="Hours of serving after which the current regime's champion paid for its compile."),
        printer_column("Policy", ".spec.compilation.policy", priority=1),
        printer_column("Last-Compile", ".status.lastCompileRun", priority=1),
        printer_column("Message", ".status.message", priority=1),
        AGE_COLUMN,
    ],
    root_rules=[
        cel("self.metadata.name.size() <= 50 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
            "InferenceDeployment names must be DNS labels of at most 50 characters starting with a letter "
            "(they name a Service and a Deployment)"),
    ],
    description="An LLM served by Shapeshift engine pods, kept fast by continuous compilation.",
    scale=True,
)
