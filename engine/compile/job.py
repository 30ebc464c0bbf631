"""The compile job: what one compile run is asked to do, typed, with every default in one place.

    command-line flags --cli.py request_from_flags--> JobRequest (None: the flag is not given)
      with --compile-run: --worker.py CompileRunContext.job_request--> the same JobRequest,
        completed from the CompileRun (through operator.api CompileRunSpec), the pod's
        environment (contracts/compile_pod_env.py) and the deployment's engine.yaml;
        a value given on the command line wins
    JobRequest --CompileJob.from_request (the defaults below)--> CompileJob
      --cli.py run--> evaluator settings, agents, budget, registry, CompileLoop, report

Torch-free: settings that depend on the device (CPU or GPU) stay None here and are resolved
by `TierSettings.on(cpu)` once the run knows where it measures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from shapeshift.engine.contracts.traffic_profile import TrafficProfile, builtin_profile
from shapeshift.engine.replay.slo import SLO

DEFAULT_MODEL = "tiny-llama"
DEFAULT_PROFILE = "chat"
DEFAULT_AGENTS = ("sweep", "evolve", "bayes")
DEFAULT_OUT = "shapeshift-compile-out"
DEFAULT_REGISTRY = "shapeshift-registry"  # beside the output folder
DEFAULT_TRIALS = 12  # when no wall-clock limit is given either
DEFAULT_MIN_SPEEDUP = 1.0
DEFAULT_SCREEN_REPEATS = 3
DEFAULT_VERIFY_PROMPTS = 4
DEFAULT_VERIFY_STEPS = 16
DEFAULT_LLM_MODEL = "default"
# Defaults that depend on the device the run measures on: (on the CPU, on a GPU).
DEFAULT_MAX_MODEL_LEN = (512, 8192)  # (--max-model-len's help says 1024 on the CPU; runs have used 512)
DEFAULT_CONFIRM_REPEATS = (8, 3)
DEFAULT_SCREEN_REQUESTS = (96, 64)
DEFAULT_CONFIRM_REQUESTS = (192, 256)
DEFAULT_CPU_THREADS = (1, None)  # one torch thread, timed in thread CPU time; GPU: torch's default

# Where a CompileRun's CRD default and the command line's default differ: spec field ->
# (CRD default, command-line default). The API server writes the CRD's defaults into every
# CompileRun it stores, so a worker in a cluster runs with those; a field the run's object
# does not carry, or carries as 0, falls back to the command line's default (as it always
# has). tests/compile/test_compile_job.py holds both sides to this table.
CRD_DEFAULTS_THAT_DIFFER: dict[str, tuple[Any, Any]] = {
    "budget.wallClockSeconds": (3600, None),
    "budget.trials": (0, DEFAULT_TRIALS),
    "agents": (("coordinate-sweep", "evolutionary"), DEFAULT_AGENTS),
    "tiers.fastLayers": (2, None),  # None: a quarter of the model's layers
    "tiers.replayRequests": (64, DEFAULT_CONFIRM_REQUESTS),
    "tiers.repeats": (3, DEFAULT_CONFIRM_REPEATS),
    "verification.greedySteps": (64, DEFAULT_VERIFY_STEPS),
    "verification.freshPrompts": (8, DEFAULT_VERIFY_PROMPTS),
    "baseline.minSpeedup": (1.02, DEFAULT_MIN_SPEEDUP),
}


@dataclass(frozen=True)
class Budget:
    max_trials: int | None = DEFAULT_TRIALS  # screened candidates (the baseline is not counted)
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_trials is None and self.max_seconds is None:
            raise ValueError("a compile budget needs --budget-trials or --budget-seconds (or both)")
        if self.max_trials is not None and self.max_trials < 0:
            raise ValueError(f"budget trials must be >= 0, got {self.max_trials}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"budget seconds must be > 0, got {self.max_seconds}")


@dataclass(frozen=True)
class LLMEndpoint:
    """The OpenAI-compatible endpoint of the llm agent (used only when "llm" is among the agents)."""

    base_url: str | None = None
    model: str = DEFAULT_LLM_MODEL
    api_key_file: str | None = None  # a file holding the key (a mounted Secret, or one the worker wrote)


@dataclass(frozen=True)
class TierSettings:
    """Measurement tiers. None: the default of the device (`on`) or of the evaluator."""

    fast_layers: int | None = None  # None: a quarter of the layers (the evaluator's rule)
    screen_repeats: int = DEFAULT_SCREEN_REPEATS
    confirm_repeats: int | None = None
    final_repeats: int | None = None  # None: max(confirm repeats, 5) (the evaluator's rule)
    screen_requests: int | None = None
    confirm_requests: int | None = None
    cpu_threads: int | None = None
    timer: str | None = None  # None: wall on GPUs, thread CPU time on the CPU (the evaluator's rule)

    def on(self, cpu: bool) -> "TierSettings":
        """These settings with the device's defaults filled in (0 counts as not given, but for
        cpu_threads, as it always has)."""
        side = 0 if cpu else 1
        return dataclasses.replace(
            self, confirm_repeats=self.confirm_repeats or DEFAULT_CONFIRM_REPEATS[side],
            screen_requests=self.screen_requests or DEFAULT_SCREEN_REQUESTS[side],
            confirm_requests=self.confirm_requests or DEFAULT_CONFIRM_REQUESTS[side],
            cpu_threads=self.cpu_threads if self.cpu_threads is not None else DEFAULT_CPU_THREADS[side])


@dataclass(frozen=True)
class VerificationSettings:
    prompts: int = DEFAULT_VERIFY_PROMPTS  # fresh prompts per verification gate
    steps: int = DEFAULT_VERIFY_STEPS  # greedy decode steps compared per prompt


@dataclass(frozen=True)
class CompileJob:
    """One compile run, resolved: what the composition (cli.py `run`) reads, and nothing else."""

    model: str
    profile: TrafficProfile
    budget: Budget
    agents: tuple[str, ...]
    out: Path  # absolute; an existing board there is resumed
    llm: LLMEndpoint = field(default_factory=LLMEndpoint)
    device: str | None = None  # None: cuda when available
    dtype: str | None = None
    max_model_len: int | None = None  # None: the device's default (DEFAULT_MAX_MODEL_LEN)
    engine_base: Mapping[str, Any] = field(default_factory=dict)  # the deployment's engine.yaml fields
    tiers: TierSettings = field(default_factory=TierSettings)
    verification: VerificationSettings = field(default_factory=VerificationSettings)
    min_speedup: float = DEFAULT_MIN_SPEEDUP  # least speedup over the incumbent, beyond the noise
    # The objective is goodput under this SLO (engine/replay/slo.py: its defaults and why goodput).
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    deterministic: bool = False  # agents driven round-robin from the loop's thread
    registry: Path | None = None  # champion registry folder; None: neither seed from nor publish to one
    recipe_seeds: bool = True  # measure the engine's named recipes first
    compile_run: str | None = None  # NAMESPACE/NAME of the CompileRun it reports to
    artifact_dir: str | None = None  # where a CompileRun's champion archive is stored (a shared volume)
    command: tuple[str, ...] = ()  # the command line, as the report records it

    def max_model_len_on(self, cpu: bool) -> int:
        return self.max_model_len or DEFAULT_MAX_MODEL_LEN[0 if cpu else 1]

    @classmethod
    def from_request(cls, request: "JobRequest") -> "CompileJob":
        """The job a request asks for, with this module's defaults where it says nothing."""
        r = request
        seconds = r.budget_seconds
        trials = r.budget_trials if r.budget_trials is not None else (None if seconds else DEFAULT_TRIALS)
        out = Path(r.out or DEFAULT_OUT).resolve()
        registry = None
        if r.use_registry is not False:
            registry = Path(r.registry) if r.registry else out.parent / DEFAULT_REGISTRY
        return cls(
            model=r.model or DEFAULT_MODEL,
            profile=r.profile if r.profile is not None else builtin_profile(DEFAULT_PROFILE),
            budget=Budget(max_trials=trials, max_seconds=seconds),
            agents=r.agents or DEFAULT_AGENTS, out=out,
            llm=LLMEndpoint(r.llm_url, r.llm_model or DEFAULT_LLM_MODEL, r.llm_key_file),
            device=r.device, dtype=r.dtype, max_model_len=r.max_model_len, engine_base=dict(r.engine_base or {}),
            tiers=TierSettings(
                fast_layers=r.fast_layers,
                screen_repeats=r.screen_repeats if r.screen_repeats is not None else DEFAULT_SCREEN_REPEATS,
                confirm_repeats=r.confirm_repeats, final_repeats=r.final_repeats,
                screen_requests=r.screen_requests, confirm_requests=r.confirm_requests,
                cpu_threads=r.cpu_threads, timer=r.timer),
            verification=VerificationSettings(prompts=r.verify_prompts or DEFAULT_VERIFY_PROMPTS,
                                              steps=r.verify_steps or DEFAULT_VERIFY_STEPS),
            min_speedup=r.min_speedup or DEFAULT_MIN_SPEEDUP,
            slo=SLO(**{k: v for k, v in (("ttft_p90_s", r.slo_ttft_p90_s),
                                         ("per_user_tokens_per_s_p90", r.slo_per_user_tokens_per_s_p90)) if v is not None}),
            seed=r.seed or 0, deterministic=bool(r.deterministic),
            registry=registry, recipe_seeds=r.recipe_seeds is not False, compile_run=r.compile_run,
            artifact_dir=r.artifact_dir, command=tuple(r.command or ()))


@dataclass(frozen=True)
class JobRequest:
    """What one source asks of a compile run; None: it does not say (a default or another source
    decides). The command line fills one; a CompileRun completes it (worker.py)."""

    model: str | None = None
    profile: TrafficProfile | None = None
    budget_trials: int | None = None
    budget_seconds: float | None = None
    agents: tuple[str, ...] | None = None
    llm_url: str | None = None
    llm_model: str | None = None
    llm_key_file: str | None = None
    out: str | None = None
    device: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    engine_base: Mapping[str, Any] | None = None
    fast_layers: int | None = None
    screen_repeats: int | None = None
    confirm_repeats: int | None = None
    final_repeats: int | None = None
    screen_requests: int | None = None
    confirm_requests: int | None = None
    verify_prompts: int | None = None
    verify_steps: int | None = None
    cpu_threads: int | None = None
    timer: str | None = None
    min_speedup: float | None = None
    slo_ttft_p90_s: float | None = None
    slo_per_user_tokens_per_s_p90: float | None = None
    seed: int | None = None
    deterministic: bool | None = None
    registry: str | None = None
    use_registry: bool | None = None
    recipe_seeds: bool | None = None
    compile_run: str | None = None
    artifact_dir: str | None = None
    command: tuple[str, ...] | None = None
