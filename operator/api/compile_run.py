"""The CompileRun kind: one search for a faster forward pass, and the compile settings
an InferenceDeployment's automatic runs copy (agents, tiers, verification, baseline, budget).

    user or drift detector --CompileRun--> operator: compile Job (builders.py)
                                       --> compile pod (engine/compile/worker.py) reads the spec,
                                           writes trials, leaderboard, bestSpeedup, champion
    spec defaults and validation: here, mirrored as CEL rules in crds/shapeshift.dev_compileruns.yaml
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field, model_validator

from shapeshift.engine.contracts.traffic_profile import TrafficProfile
from shapeshift.operator.api.common import (DNS_SUBDOMAIN, BuiltinTrafficProfile, Condition, HardwareSpec,
                                           StatusModel, WireModel, cel, check_outbound_url, default_of,
                                           outbound_url_rule, cel_rules)
from shapeshift.operator.api.group import AGE_COLUMN, Kind, printer_column
from shapeshift.operator.api.hardware import AcceleratorKind


# ---- compile settings (a CompileRun's own, and the template of automatic ones) ----------


class SecretKeyRef(WireModel):
    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="Secret name.")
    key: str = Field(default="api-key", max_length=253, description="Key in the Secret.")


# Where an API key may travel over plain http: a Service of the cluster (one label, or *.svc[.cluster.local]).
IN_CLUSTER_HTTP = r"^http://([a-z0-9]([-a-z0-9]*[a-z0-9])?|[^/:]+[.]svc([.]cluster[.]local)?)(:[0-9]+)?(/|$)"


class LLMAgentSpec(WireModel):
    """An OpenAI-compatible endpoint for an LLM coding agent."""

    model_config = cel_rules(
        outbound_url_rule("endpoint", "spec.agents[].llm.endpoint"),
        cel(f"!has(self.apiKeySecretRef) || self.endpoint.startsWith('https://') || "
            f"self.endpoint.matches('{IN_CLUSTER_HTTP}')",
            "spec.agents[].llm.endpoint must be https:// when spec.agents[].llm.apiKeySecretRef is set "
            "(plain http only to a Service of the cluster)"),
    )
    endpoint: str = Field(max_length=1024, pattern=r"^https?://",
                          description="Base URL of an OpenAI-compatible API: http(s)://host[:port][/path], no "
                                      "user:password@, query or fragment; https when an API key is sent (plain http "
                                      "only to a Service of the cluster). The operator refuses link-local and cloud "
                                      "metadata addresses unless SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS allows them.")
    model: str = Field(max_length=256, description="Model name to ask.")
    api_key_secret_ref: SecretKeyRef | None = Field(default=None, description="Secret holding the API key.")

    @model_validator(mode="after")
    def _no_credentials_in_the_clear(self) -> "LLMAgentSpec":
        import re

        check_outbound_url(self.endpoint, "spec.agents[].llm.endpoint")
        if (self.api_key_secret_ref is not None and not self.endpoint.startswith("https://")
                and not re.match(IN_CLUSTER_HTTP, self.endpoint)):
            raise ValueError("spec.agents[].llm.endpoint must be https:// when spec.agents[].llm.apiKeySecretRef is "
                             "set (plain http only to a Service of the cluster)")
        return self


class AgentSpec(WireModel):
    """One search agent."""

    model_config = cel_rules(cel("self.kind != 'llm' || has(self.llm)", "an agent of kind llm needs llm settings"))
    kind: Literal["coordinate-sweep", "evolutionary", "model-based", "llm"] = Field(
        description="Agent strategy. On the run's message board an agent is named by its kind (sweep, evolve, "
                    "bayes, llm) and its later replicas <kind>-2, <kind>-3, ...")
    replicas: int = Field(default=1, ge=1, le=16, description="Concurrent instances of this agent.")
    llm: LLMAgentSpec | None = Field(default=None, description="Endpoint settings for kind llm.")

    @model_validator(mode="after")
    def _llm_settings(self) -> "AgentSpec":
        if self.kind == "llm" and self.llm is None:
            raise ValueError("an agent of kind llm needs llm settings")
        return self


AGENTS_NOT_EMPTY = ("spec.agents must name at least one agent; leave spec.agents out for the default agents "
                    "(coordinate-sweep and evolutionary)")


def check_agents(agents: list[AgentSpec] | None, where: str) -> None:
    """An empty agent list is refused, never read as "the defaults" (the CEL twin: AGENTS_NOT_EMPTY)."""
    if agents is not None and not agents:
        raise ValueError(AGENTS_NOT_EMPTY.replace("spec.agents", where))


# The compile engine's defaults (engine/replay/slo.py; tests/compile/test_compile_job.py holds these to them).
SLO_DEFAULT_TTFT_P90_SECONDS = 1.0
SLO_DEFAULT_PER_USER_TOKENS_PER_SECOND_P90 = 10.0


class CompileSLO(WireModel):
    """The service-level objective candidates are judged by: the compile loop maximises goodput,
    the output tokens/s of the replayed requests that meet it. A field left out takes the compile
    engine's default."""

    ttft_p90_seconds: float | None = Field(
        default=None, gt=0, le=3600,
        description=f"p90 time to first token, in seconds (> 0; default {SLO_DEFAULT_TTFT_P90_SECONDS:g}).")
    per_user_tokens_per_second_p90: float | None = Field(
        default=None, ge=0, le=100000,
        description="Output tokens per second each user streams at, met by 90% of requests (>= 0, 0: no "
                    f"streaming-rate promise; default {SLO_DEFAULT_PER_USER_TOKENS_PER_SECOND_P90:g}).")


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


class CompileBudget(WireModel):
    """How much one compile run may spend; at least one limit must be positive."""

    model_config = cel_rules(
        cel("self.wallClockSeconds > 0 || self.trials > 0",
            "a compile budget needs wallClockSeconds > 0 or trials > 0"),
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


# ---- CompileRun ---------------------------------------------------------------------------


class DeploymentRef(WireModel):
    name: str = Field(min_length=1, max_length=253, description="Name of the InferenceDeployment in the same namespace.")


class PrometheusWindow(WireModel):
    """Snapshot the deployment's traffic from Prometheus when the run starts."""

    window_seconds: int = Field(default=900, ge=60, le=30 * 86400, description="Window to read, ending when the run starts.")


class TrafficSource(WireModel):
    """The traffic to optimise for: at most one of builtin, inline, prometheus
    (none: the deployment's observed traffic, else its traffic profile)."""

    model_config = cel_rules(
        cel("(has(self.builtin) ? 1 : 0) + (has(self.inline) ? 1 : 0) + (has(self.prometheus) ? 1 : 0) <= 1",
            "set at most one of spec.traffic.builtin, spec.traffic.inline, spec.traffic.prometheus"),
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

    model_config = cel_rules(
        cel("self == oldSelf", "spec of a CompileRun is immutable; create a new CompileRun"),
        cel("!has(self.agents) || self.agents.size() > 0", AGENTS_NOT_EMPTY),
    )
    deployment_ref: DeploymentRef = Field(description="The InferenceDeployment to compile for.")
    hardware: HardwareSpec | None = Field(default=None, description="Pool to compile on (default: the deployment's).")
    traffic: TrafficSource = Field(default_factory=TrafficSource, json_schema_extra=default_of(TrafficSource),
                                   description="Traffic to optimise for.")
    budget: CompileBudget = Field(default_factory=CompileBudget, json_schema_extra=default_of(CompileBudget), description="Limits of the search.")
    agents: list[AgentSpec] = Field(
        default_factory=lambda: [AgentSpec(kind="coordinate-sweep"), AgentSpec(kind="evolutionary")],
        max_length=16,
        json_schema_extra={"default": [{"kind": "coordinate-sweep", "replicas": 1}, {"kind": "evolutionary", "replicas": 1}]},
        description="Search agents, run concurrently on one message board (at least one; left out: "
                    "coordinate-sweep and evolutionary).",
    )
    tiers: TierSpec = Field(default_factory=TierSpec, json_schema_extra=default_of(TierSpec), description="Measurement tiers.")
    verification: VerificationSpec = Field(default_factory=VerificationSpec, json_schema_extra=default_of(VerificationSpec),
                                           description="Verification of the champion.")
    baseline: BaselineSpec = Field(default_factory=BaselineSpec, json_schema_extra=default_of(BaselineSpec), description="What to beat.")
    backoff_limit: int = Field(default=1, ge=0, le=10, description="Retries of the compile pod before the run fails.")
    trigger: CompileTrigger = Field(default_factory=CompileTrigger, json_schema_extra=default_of(CompileTrigger), description="Why the run exists.")
    image: str | None = Field(default=None, max_length=512, description="Compile worker image (default: the deployment's engine image).")
    slo: CompileSLO | None = Field(default=None, description="The SLO candidates are judged by (goodput under it); "
                                                              "left out: the compile engine's defaults.")

    @model_validator(mode="after")
    def _agents(self) -> "CompileRunSpec":
        check_agents(self.agents, "spec.agents")
        return self


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


class CompileEconomics(StatusModel):
    """What the run spent and what its champion saves, written by the operator when it records the
    champion (operator/compile_economics.py): spent from the Job's times, saved from the
    deployment's served tokens/s in Prometheus at that moment and the champion's measured speedup;
    the served rate, saved and payback read again while traffic is in the champion's regime
    (every SHAPESHIFT_SAVINGS_REFRESH_SECONDS), spent never."""

    accelerators: int = Field(ge=0, description="Accelerators the compile Job held.")
    job_start_time: datetime | None = Field(default=None, description="The compile Job's status.startTime.")
    job_completion_time: datetime | None = Field(default=None, description="The compile Job's status.completionTime.")
    accelerator_seconds: float | None = Field(
        default=None, ge=0, description="Spent: accelerators x the Job's wall time (start to completion).")
    served_tokens_per_second: float | None = Field(
        default=None, ge=0, description="The deployment's served output tokens/s (Prometheus: sum over its pods "
                                        "of rate(shapeshift_generated_tokens_total[window])).")
    served_window_seconds: int | None = Field(default=None, ge=0, description="The rate's window.")
    measured_at: datetime | None = Field(default=None, description="When the served rate was read (the query's time).")
    baseline_tokens_per_second_per_accelerator: float | None = Field(
        default=None, ge=0, description="What one accelerator served at the old speed on the champion's replay "
                                        "(its baselineTokensPerSecond over its hardware.count).")
    serving_accelerators: int | None = Field(default=None, ge=0, description="The deployment's accelerators "
                                                                             "(replicas x per pod).")
    speedup: float | None = Field(default=None, ge=0, description="The champion's measured speedup.")
    saved_accelerator_hours_per_day: float | None = Field(
        default=None, ge=0, description="24 x (accelerators busy serving the served rate at the old speed, at "
                                        "most the serving accelerators) x (1 - 1/speedup).")
    payback_hours: float | None = Field(
        default=None, ge=0, description="Serving time after which the compile paid for itself: spent over saved "
                                        "(none where the champion saves nothing at this load).")
    message: str | None = Field(default=None, max_length=1024, description="What is unknown, and why.")


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
    champion_spec_sha256: str | None = Field(
        default=None, max_length=64, pattern=r"^[a-f0-9]{64}$",
        description="Digest of the champion ForwardPass's spec as the worker published it; the rollout trusts "
                    "that ForwardPass only while its spec has this digest.")
    economics: CompileEconomics | None = Field(
        default=None, description="What the run spent and what its champion saves (written once the operator "
                                  "records the champion).")
    conditions: list[Condition] | None = Field(default=None, max_length=32, description="Scheduled, Complete, Failed ...")
    message: str | None = Field(default=None, max_length=4096, description="Human-readable summary.")


COMPILE_RUN = Kind(
    kind="CompileRun",
    plural="compileruns",
    short_names=["cr", "crun"],
    spec=CompileRunSpec,
    status=CompileRunStatus,
    columns=[
        printer_column("Phase", ".status.phase", description="Pending, Scheduled, Running, Verifying, Succeeded or Failed."),
        printer_column("Deployment", ".spec.deploymentRef.name"),
        printer_column("Accelerator", ".status.accelerator"),
        printer_column("Trials", ".status.trials.total", "integer"),
        printer_column("Speedup", ".status.bestSpeedup", "number", description="Best verified speedup."),
        printer_column("Champion", ".status.champion"),
        printer_column("Spent", ".status.economics.acceleratorSeconds", "number",
                       description="Accelerator-seconds the compile Job spent."),
        printer_column("Payback", ".status.economics.paybackHours", "number",
                       description="Hours of serving at the measured load after which the compile paid for itself."),
        printer_column("Saved/Day", ".status.economics.savedAcceleratorHoursPerDay", "number", priority=1,
                       description="Accelerator-hours the champion saves per day at the measured load."),
        printer_column("Trigger", ".spec.trigger.reason", priority=1),
        printer_column("Node", ".status.nodeName", priority=1),
        printer_column("Message", ".status.message", priority=1),
        AGE_COLUMN,
    ],
    root_rules=[
        cel(f"self.metadata.name.size() <= {_RUN_NAME_MAX}",
            f"CompileRun names must be at most {_RUN_NAME_MAX} characters (the Job is named <name>-compile)"),
    ],
    description="One search for a faster forward pass of an InferenceDeployment.",
)
