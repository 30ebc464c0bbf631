"""The real evaluator: candidates measured and verified on the engine itself.

Data flow:
    Candidate --materialize--> bundle folder (forward.py = base source + source edits,
        recipe.yaml = recipe knobs, manifest.json) under work_dir/bundles/<digest>
    fast tier:  LLMEngine(num_layers_override = a few layers) --ForwardPassManager.reload
        (import in isolation, build, smoke check vs the stock pass)--> replay of a small
        request set drawn from the profile (shapeshift.engine.replay.requests, the generator
        every replay uses), `screen_repeats` times
    full tier:  LLMEngine(all layers) --reload--> replay of the traffic profile, `confirm_repeats` times
        (each replay: the engine's closed-loop driver, shapeshift.engine.replay.driver.run_once, timed
        with the evaluator's clock: wall on GPUs, thread or process CPU time on the CPU)
    verify:     the verification gates (shapeshift.engine.verify) on the full model against
        the stock pass: greedy agreement, logprob tolerance, KV contamination, coverage, anti-cheat
    export:     the bundle copied to the output folder, re-verified against its manifest; it
        carries engine.json, the EngineConfig overrides (batch size, chunk budget, prefix
        caching, graph buckets) the candidate was measured with

Each tier keeps one persistent engine (weights loaded once) that never runs candidate code.
Each candidate is measured in a process of its own (engine/verify/measured_engine.py, the
default wherever it can run: the host, and CUDA where IPC works): an engine there, over the
tier engine's weights, with the candidate's engine knobs (``engine.*``: batch size, chunk
budget, prefix caching, graph buckets) and its pass hot-reloaded; this process drives the
replay and reads the clock (wall, or that process's CPU time from outside). In-process
measurement (``isolate_measurement`` False) hot-reloads the candidate into the tier engine and
applies engine knobs by rebuilding its scheduler and block manager over the same KV cache and
re-capturing graphs. Before every repeat the prefix cache is emptied, so no repeat is served
from blocks an earlier one left behind: prefix hits come only from sharing inside the replayed
traffic.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shapeshift.engine.forward_pass import patch_guard  # first: the clocks, before any candidate
from shapeshift.engine.forward_pass.bundle import ENGINE_SETTINGS_FILE  # engine.json: the EngineConfig overrides a candidate was measured with
from shapeshift.engine.replay.driver import ReplayRun, fresh_engine_cache, run_once
from shapeshift.engine.replay.requests import ReplayRequest, requests_from_profile
from shapeshift.engine.replay import routing as replay_routing
from shapeshift.engine.contracts.expert_routing import REPRESENTATIVE_TV
from shapeshift.engine.replay.slo import SLO
from shapeshift.engine.contracts.traffic_profile import TrafficProfile
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.measure import DEFAULT_NOISE_FLOOR, FAST, FULL, Measurement, Verification
from shapeshift.engine.compile.search_space import SearchSpace, build_search_space, engine_overrides, split_recipe
from shapeshift.engine.compile.source_edits import SourceEditError, apply_edits
from shapeshift.engine.verify.measured import check_measured_outputs

log = logging.getLogger(__name__)
# What a candidate hot-reloaded into this process could patch to pass or to look faster, besides the
# verifier's modules: guarded by patch_guard (checked and put back after every measurement).
HARNESS_MODULES = ("shapeshift.engine.compile.evaluator", "shapeshift.engine.compile.promotion",
                   "shapeshift.engine.compile.measure", "shapeshift.engine.replay.driver")



@dataclass
class EvaluatorSettings:
    model: str = "tiny-llama"
    device: str | None = None
    dtype: str | None = None
    max_model_len: int = 1024
    fast_layers: int | None = None  # None: max(1, layers // 4)
    screen_repeats: int = 3
    confirm_repeats: int = 3
    # The champion against the stock pass, once at the end: the figure a run reports. None:
    # max(confirm_repeats, 5). With 2 pairs the 95% bounds stretch by t(1) = 12.7 and a 2x
    # champion can read as noise (seen on an H200: 2.18x, bounds 0.55..8.58); 5 pairs: t(4) = 2.8.
    final_repeats: int | None = None
    screen_requests: int = 16  # requests per fast-tier run
    confirm_requests: int = 48  # requests per full-tier run
    length_scale: float | None = None  # None: fit the profile into max_model_len
    seed: int = 0
    noise_floor: float = DEFAULT_NOISE_FLOOR
    reload_timeout_s: float = 120.0
    verify_prompts: int = 4
    verify_steps: int = 16
    work_dir: str | None = None
    # "wall": time.perf_counter (GPUs: the engine synchronises every step when it reads tokens).
    # "thread": CPU seconds of the measuring thread (CPU runs with cpu_threads=1 on a shared
    # machine: time spent descheduled by other processes, and the agents' own threads, are not
    # charged to the candidate). "process": CPU seconds of the whole process.
    # None: "thread" on CPU with one torch thread, "process" on CPU otherwise, "wall" on CUDA.
    timer: str | None = None
    fast_tier_memory: float = 0.25  # CUDA: share of GPU memory for the fast tier's engine
    full_tier_memory: float = 0.55  # CUDA: share for the full tier's engine
    cpu_threads: int | None = None  # torch intra-op threads on CPU (None: leave torch's default)
    # EngineConfig fields the deployment serves with (its engine.yaml: max_num_seqs, block_size,
    # max_num_batched_tokens, enable_prefix_caching). Both tiers start from them, and they are
    # the defaults of the engine.* knobs, so the stock candidate is measured as it is deployed.
    engine_base: dict[str, Any] = field(default_factory=dict)
    # Recipe knobs over the stock recipe.yaml that the pass to beat runs with (the shipped
    # serving default's recipe: forward_pass/recipes.py serving_default): the defaults of the
    # recipe knobs, so the search space's default point is what serves.
    base_recipe: dict[str, Any] = field(default_factory=dict)
    # The objective: goodput under this SLO (engine/replay/slo.py); None: output tokens/s.
    slo: SLO | None = None
    # Open-loop profiles (an arrival rate) replay at this share of the engine's capacity where
    # the profile's own rate offers less: goodput of traffic the engine serves within the SLO is
    # bound by the arrivals, so no pass could beat another there (burst on the CPU: every
    # candidate 1.000x). The capacity is a closed-loop replay of the tier's first pass at the
    # profile's concurrency, once per tier and profile; the arrival pattern (Poisson gaps) is kept,
    # compressed. None: the profile's rate as given.
    open_loop_load: float | None = 0.9
    # MoE: a measured replay whose expert routing is further than this (max over layers of the total
    # variation) from the profile's expertRouting is marked not representative (engine/replay/routing.py).
    routing_threshold: float = REPRESENTATIVE_TV
    # Each candidate measured in a process of its own (its engine there, the replay and the clocks
    # here: engine/verify/measured_engine.py); None: wherever it can run (the host; CUDA with IPC).
    isolate_measurement: bool | None = None

    @property
    def closing_pairs(self) -> int:
        """Pairs in the closing champion-vs-stock comparison (final_repeats, see above)."""
        return self.final_repeats or max(self.confirm_repeats, 5)


def fit_profile(profile: TrafficProfile, max_model_len: int, scale: float | None = None) -> TrafficProfile:
    """The profile scaled so its longest prompt plus output fits `max_model_len` (never scaled up)."""
    if scale is None:
        longest = profile.prompt_length.upper + profile.output_length.upper
        scale = min(1.0, (max_model_len - 1) / longest)
    if scale >= 1.0:
        return profile
    return profile.scaled(scale, name=f"{profile.name}@x{scale:.3g}")


def replay(engine: Any, requests: list[ReplayRequest], concurrency: int | None,
           clock: Callable[[], float] = patch_guard.perf_counter, slo: SLO | None = None) -> ReplayRun:
    """One run (closed loop: `concurrency` requests in flight; None: open loop at the requests'
    arrival times; greedy, fixed lengths) through the
    engine's replay driver, shapeshift.engine.replay.driver.run_once. `clock` times everything
    (throughput, per-user speed, TTFT): wall, process or thread CPU time.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection pause inside one repeat would read as noise of the candidate
    try:
        return run_once(engine, requests, concurrency, clock, slo)
    finally:
        if gc_was_enabled:
            gc.enable()


class EngineEvaluator:
    """`Evaluator` over the engine: persistent fast and full tiers, hot reload, replay, gates."""

    def __init__(self, profile: TrafficProfile, settings: EvaluatorSettings | None = None):
        from shapeshift.engine.core.config import EngineConfig

        settings = settings or EvaluatorSettings()
        if settings.device is None:
            # Resolved once, by the engine's own rule, so the timer, the warm-up and the GPU
            # memory split follow the device the tiers' engines really run on.
            settings = dataclasses.replace(settings, device=EngineConfig().resolved_device())
        self.settings = settings
        self.on_cuda = settings.device.startswith("cuda")
        self.profile = profile
        self.noise_floor = self.settings.noise_floor
        self.work_dir = Path(self.settings.work_dir or tempfile.mkdtemp(prefix="shapeshift-compile-"))
        (self.work_dir / "bundles").mkdir(parents=True, exist_ok=True)
        from shapeshift.engine.forward_pass.bundle import stock_bundle_dir

        self.stock_dir = Path(stock_bundle_dir())
        self.stock_source = (self.stock_dir / "forward.py").read_text()
        self._engines: dict[str, Any] = {}
        self._managers: dict[str, Any] = {}
        self._engine_knobs: dict[str, dict[str, Any]] = {}
        self._loaded: dict[str, str | None] = {}  # tier -> bundle path currently active
        self._model_config = None
        self.fitted = None
        self._draws = 0  # prompt draws so far: each repeat replays fresh prompts
        self._weights: dict[str, Any] = {}  # tier -> WeightsBaseline taken before any candidate loaded
        self._arrival_scale: dict[str, float] = {}  # tier -> open-loop arrival-rate factor (calibrated once)
        # tier -> the SLO its replays are scored by where it is not settings.slo (the fast tier's,
        # scaled by calibrate_tier_slo to the stock pass's speed on that tier)
        self._tier_slo: dict[str, SLO] = {}
        self._bandwidth: float | None = None  # bytes/s of a device copy, measured before any candidate ran
        self._isolation: tuple[bool, str] | None = None  # (isolated?, why not) once decided
        from shapeshift.engine.verify.measured_engine import MeasuringProcesses

        self._processes = MeasuringProcesses(keep=3 if not self.on_cuda else 2,
                                             build_timeout_s=settings.reload_timeout_s,
                                             step_timeout_s=settings.reload_timeout_s)
        from shapeshift.engine.verify.anticheat import HARNESS_MODULES as VERIFIER

        patch_guard.capture_harness(VERIFIER + HARNESS_MODULES)  # before any candidate is hot-reloaded here

    # ------------------------------------------------------------------ engines
    def _base_config(self, tier: str, overrides: dict[str, Any], gpu_memory_utilization: float | None = None):
        from shapeshift.engine.core.config import EngineConfig

        s = self.settings
        kwargs: dict[str, Any] = dict(model=s.model, device=s.device, dtype=s.dtype, max_model_len=s.max_model_len,
                                      seed=s.seed)
        kwargs.update(s.engine_base)
        if tier == FAST:
            kwargs["num_layers_override"] = self.fast_layers()
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(overrides)
        return EngineConfig(**EngineConfig.fit_token_budget(kwargs))

    def model_config(self):
        if self._model_config is None:
            self._model_config = self._engine(FULL, {}).model_config
        return self._model_config

    def fast_layers(self) -> int:
        if self.settings.fast_layers is not None:
            return self.settings.fast_layers
        from shapeshift.engine.models.presets import resolve_model

        resolved = resolve_model(self.settings.model)
        layers = None
        if hasattr(resolved, "hf_config") and resolved.hf_config:
            layers = resolved.hf_config.get("num_hidden_layers")
        else:
            cfg = Path(resolved if not hasattr(resolved, "folder") else resolved.folder()) / "config.json"
            if cfg.is_file():
                layers = json.loads(cfg.read_text()).get("num_hidden_layers")
        return max(1, int(layers or 4) // 4)

    def _engine(self, tier: str, overrides: dict[str, Any]):
        from shapeshift.engine.forward_pass.swap import ForwardPassManager
        from shapeshift.engine.core.llm_engine import LLMEngine

        eng = self._engines.get(tier)
        if eng is None:
            memory = self._gpu_memory_utilization(tier) if self.on_cuda else None
            eng = LLMEngine(self._base_config(tier, overrides, memory))
            self._engines[tier] = eng
            from shapeshift.engine.forward_pass.weights_guard import WeightsBaseline

            self._weights[tier] = WeightsBaseline(eng.weights)
            # The device's copy bandwidth, measured before any candidate runs in this process
            # (engine/verify/measured.py: the speed-of-light check of every measured replay).
            from shapeshift.engine.verify.measured import measure_bandwidth

            self._bandwidth = measure_bandwidth(eng.device)
            # Each candidate is a swap: their lines are debug chatter here (a rollout logs at INFO).
            self._managers[tier] = ForwardPassManager(eng, build_timeout_s=self.settings.reload_timeout_s,
                                                      smoke_timeout_s=self.settings.reload_timeout_s,
                                                      swap_log_level=logging.DEBUG)
            self._engine_knobs[tier] = dict(overrides)
            self._loaded[tier] = None
        elif self._engine_knobs[tier] != overrides:
            self._reconfigure(tier, overrides)
        return self._engines[tier]

    def _gpu_memory_utilization(self, tier: str) -> float:
        """gpu_memory_utilization for a tier's engine about to be built on the GPU.

        Both tiers live on one GPU. The engine reads gpu_memory_utilization as the share of
        the whole device this process may fill, so a tier built second must count what the
        first already holds on top of its own share. Read only when an engine is built:
        a reconfigured engine keeps its KV cache and the figure it was built with.
        """
        import torch

        s = self.settings
        free, total = torch.cuda.mem_get_info(torch.device(s.device))
        share = s.fast_tier_memory if tier == FAST else s.full_tier_memory
        if self.isolated():  # the tier engine and up to `keep` measuring processes, each with its KV cache
            share /= 1 + self._processes.keep
        return min(0.95, (total - free) / total + share)

    def _reconfigure(self, tier: str, overrides: dict[str, Any]) -> None:
        """Apply engine knobs to the idle engine: new scheduler + block manager, graphs re-captured."""
        eng = self._engines[tier]
        eng.drain_inflight()  # decode steps in flight finish under the settings that launched them
        new_config = self._base_config(tier, overrides, eng.config.gpu_memory_utilization)
        new_config = dataclasses.replace(new_config, num_kv_blocks=eng.block_manager.num_blocks)
        eng.config = new_config
        eng.runner.config = new_config
        self._engine_knobs[tier] = dict(overrides)
        fresh_engine_cache(eng)
        eng.runner.capture_cudagraphs()

    @staticmethod
    def _fresh_cache(eng: Any) -> None:
        """An empty prefix cache (in the candidate's process, for an engine measured there)."""
        (eng.fresh_cache if hasattr(eng, "fresh_cache") else lambda: fresh_engine_cache(eng))()

    def isolated(self) -> bool:
        """Whether candidates are measured in processes of their own (decided once)."""
        if self._isolation is None:
            from shapeshift.engine.verify.measured_engine import isolation_problem

            why = isolation_problem(self.settings.isolate_measurement, self.settings.device)
            self._isolation = (not why, why)
        return self._isolation[0]

    # ------------------------------------------------------------------ bundles
    def space(self) -> SearchSpace:
        """The search space for this model on this device."""
        from shapeshift.engine.forward_pass.bundle import load_recipe

        eng = self._engine(FULL, {})
        stock_recipe = {**load_recipe(self.stock_dir), **self.settings.base_recipe}
        return build_search_space(device=str(eng.device), model_family=eng.model_config.family,
                                  stock_recipe=stock_recipe,
                                  concurrency=self.profile.concurrency,
                                  prompt_tokens_p90=int(self._profile().prompt_length.p90),
                                  max_model_len=self.settings.max_model_len,
                                  engine_defaults=self.settings.engine_base,
                                  qk_norm=bool(getattr(eng.model_config, "qk_norm", False)),
                                  head_dim=getattr(eng.model_config, "head_dim", None))

    def materialize(self, cand: Candidate) -> Path:
        """The candidate as a bundle folder with a manifest (cached by digest)."""
        from shapeshift.engine.forward_pass.bundle import create_bundle

        out = self.work_dir / "bundles" / cand.digest[:16]
        if (out / "manifest.json").is_file():
            return out
        recipe, engine_knobs, edits = split_recipe(cand.recipe)
        source = apply_edits(cand.source if cand.source is not None else self.stock_source, edits)
        with tempfile.TemporaryDirectory(prefix="shapeshift-src-") as tmp:
            src = Path(tmp) / "src"
            shutil.copytree(self.stock_dir, src, ignore=shutil.ignore_patterns("__pycache__", "manifest.json"))
            (src / "forward.py").write_text(source)
            # The engine settings the candidate was measured with travel in the bundle (hashed
            # like every file): EngineConfig keyword arguments for the serving engine.
            (src / ENGINE_SETTINGS_FILE).write_text(json.dumps(engine_overrides(engine_knobs), indent=2,
                                                                sort_keys=True) + "\n")
            if out.exists():
                shutil.rmtree(out)
            create_bundle(src, recipe, out, name=f"compiled-{cand.digest[:12]}",
                          parent=cand.parent, description=(cand.note or "")[:200])
        return out

    def _activate(self, tier: str, cand: Candidate) -> Any:
        """Engine of `tier` with the candidate's engine knobs and forward pass active: in the
        candidate's own process where measurement is isolated, else the tier engine here."""
        _, engine_knobs, _ = split_recipe(cand.recipe)
        if self.isolated():
            ref = self._engine(tier, {})
            config = self._base_config(tier, engine_overrides(engine_knobs), ref.config.gpu_memory_utilization)
            return self._processes.engine(tier, ref, config, self.materialize(cand))
        eng = self._engine(tier, engine_overrides(engine_knobs))
        path = self.materialize(cand)
        if self._loaded.get(tier) != str(path):
            self._managers[tier].reload(path)
            self._loaded[tier] = str(path)
        return eng

    # ------------------------------------------------------------------ measuring
    def _profile(self) -> TrafficProfile:
        if self.fitted is None:
            self.fitted = fit_profile(self.profile, self.settings.max_model_len, self.settings.length_scale)
        return self.fitted

    def _clock(self, eng: Any = None) -> Any:
        """What times `eng`'s replays: on the host, an engine in its own process by that process's
        CPU time read from here; else the clocks captured before any candidate loaded
        (patch_guard), so a candidate that patches time.* cannot speed up its own measurement."""
        timer = self.timer()
        if timer != "wall" and getattr(eng, "cpu_clock", None) is not None:
            return eng.cpu_clock
        return {"wall": patch_guard.perf_counter, "process": patch_guard.process_time,
                "thread": patch_guard.thread_time}[timer]

    def timer(self) -> str:
        timer = self.settings.timer
        if timer is None:
            if self.on_cuda:
                timer = "wall"
            else:
                timer = "thread" if self.settings.cpu_threads == 1 else "process"
        if timer not in ("wall", "process", "thread"):
            raise ValueError(f"evaluator timer must be 'wall', 'process' or 'thread', got {timer!r}")
        return timer

    def _measure(self, tier: str, cand: Candidate, requests: int, repeats: int) -> Measurement:
        return self._interleaved(tier, [cand], requests, repeats)[0]

    def tier_slo(self, tier: str) -> SLO | None:
        """The SLO that `tier`'s replays are scored by: the objective's own on the full tier; on the
        fast tier the calibrated one (calibrate_tier_slo) once it exists."""
        return self._tier_slo.get(tier, self.settings.slo)

    def set_tier_slo(self, tier: str, slo: SLO) -> None:
        """Use `slo` for `tier` (a resumed run restores its calibration from the board)."""
        self._tier_slo[tier] = slo

    def calibrate_tier_slo(self, stock: Candidate, full: Measurement) -> SLO | None:
        """The fast tier's SLO: the objective's thresholds scaled by how much faster the stock pass
        is there than on the full tier (`full`: its full-tier measurement), so that a promise that
        binds on the full model binds as much on the truncated one. Without it the fast tier, a few
        layers deep and several times faster per user, met every SLO and ranked candidates by raw
        throughput: on an H200 the stock pass's chat p90 per-user speed is 767 tok/s on the fast
        tier against 243 on the full one, its TTFT p90 0.054 s against 0.086 s. One unscored replay
        of the stock pass on the fast tier (after its warm-up); None where there is no SLO, no
        usable full-tier figure, or the fast tier is the full model."""
        slo = self.settings.slo
        if slo is None or not full.ok or not full.per_user_p90 or not full.ttft_p90:
            return None
        if self.fast_layers() >= int(getattr(self.model_config(), "num_hidden_layers", 0) or 0):
            return None
        fast = self._interleaved(FAST, [stock], self.settings.screen_requests, 1, scored=False)[0]
        if not fast.ok or not fast.per_user_p90 or not fast.ttft_p90:
            log.warning("fast-tier SLO not calibrated (the stock pass's calibration replay: %s); the fast tier "
                        "keeps %s", fast.error or "no latency figures", slo.describe())
            return None
        from shapeshift.engine.compile.tier_slo import slo_scaled_to_tier

        scaled = slo_scaled_to_tier(slo, fast, full)
        self._tier_slo[FAST] = scaled
        log.info("fast-tier SLO %s (the stock pass: p90 per-user %.1f tok/s there against %.1f on the full tier, "
                 "p90 TTFT %.4f s against %.4f s; the full tier keeps %s)", scaled.describe(),
                 statistics.fmean(fast.per_user_p90), statistics.fmean(full.per_user_p90),
                 statistics.fmean(fast.ttft_p90), statistics.fmean(full.ttft_p90), slo.describe())
        return scaled

    def _interleaved(self, tier: str, cands: list[Candidate], requests: int, repeats: int,
                     scored: bool = True) -> list[Measurement]:
        """Measure candidates in alternation, the order reversed every repeat (A B, B A, A B, ...:
        ABBA), so a change in machine load, and whatever the second slot of a pair inherits from
        the first, hits all of them alike. Every candidate is warmed up on its own prompts before
        anything counts; every repeat replays the same traffic shapes with fresh prompts (one
        draw per repeat, shared by the candidates of that repeat). A candidate that fails is
        marked failed; the others go on. `scored` False: no SLO (samples are output tokens/s)."""
        slo = self.tier_slo(tier) if scored else None
        if self.settings.cpu_threads is not None and not self.on_cuda:
            import torch

            torch.set_num_threads(self.settings.cpu_threads)
        profile = self._profile()
        out = [Measurement(noise_floor=self.noise_floor, details={"tier": tier, "requests": requests,
                                                                  "profile": profile.name}) for _ in cands]
        spent = [0.0] * len(cands)
        # Open loop at the profile's arrival times where it has a rate; closed loop at its concurrency otherwise.
        concurrency = None if profile.arrival_rate else profile.concurrency
        prompts: list[ReplayRequest] | None = None
        warm_up: list[ReplayRequest] = []
        routing_checks: list[list[dict[str, Any]]] = [[] for _ in cands]  # per candidate, per repeat
        for rep in range(-1, repeats):  # rep -1: warm-up run, not recorded
            order = list(enumerate(cands))
            prompts = None  # fresh prompts for this repeat (drawn at its first activation)
            tokens: dict[int, list[list[int]] | None] = {}  # candidate index -> its tokens this repeat
            for i, cand in (order if rep % 2 == 0 else order[::-1]):
                m = out[i]
                if m.error is not None:
                    continue
                self._guard(None)  # a reference patched since the last check is put back, no one's fault
                t0 = patch_guard.perf_counter()
                try:
                    eng = self._activate(tier, cand)
                except (SourceEditError, ValueError, RuntimeError, TimeoutError, OSError, ImportError,
                        SyntaxError) as exc:
                    self._loaded[tier] = None
                    m.error = f"refused at load: {type(exc).__name__}: {exc}"
                    self._check_weights(tier, m)
                    self._guard(m)
                    spent[i] += patch_guard.perf_counter() - t0
                    continue
                run_clock = self._clock(eng)
                if prompts is None:
                    if profile.arrival_rate and self.settings.open_loop_load and tier not in self._arrival_scale:
                        self._calibrate_arrivals(tier, eng, profile, requests, run_clock)
                    drawn_from = profile
                    if profile.arrival_rate and self._arrival_scale.get(tier, 1.0) != 1.0:
                        drawn_from = profile.model_copy(
                            update={"arrival_rate": profile.arrival_rate * self._arrival_scale[tier]})
                    prompts = self._fresh_prompts(drawn_from, eng, requests)
                    # On CUDA the warm-up replays every prompt: the first H200 run showed a
                    # quarter-length warm-up leaves the first measured repeat 12x slower
                    # (505 vs 6272 tok/s: graph buckets and Triton compiles still cold).
                    warm_up = prompts if self.on_cuda else prompts[: max(2, len(prompts) // 4)]
                try:
                    self._fresh_cache(eng)
                    if rep < 0:
                        replay(eng, warm_up, concurrency, run_clock)
                    else:
                        routed_before = replay_routing.routing_snapshot(eng)  # outside the timed replay
                        run = replay(eng, prompts, concurrency, run_clock, slo)
                        tokens[i] = run.output_token_ids
                        check = replay_routing.check_routing(
                            getattr(profile, "expert_routing", None),
                            replay_routing.routing_between(routed_before, replay_routing.routing_snapshot(eng)),
                            self.settings.routing_threshold)
                        if check is not None:
                            routing_checks[i].append(check)
                        faster_than_light = self._faster_than_light(eng, run, concurrency or len(prompts))
                        if faster_than_light:
                            m.error = f"speed of light: {faster_than_light}"
                        m.record(run, slo)
                except Exception as exc:  # noqa: BLE001 - a candidate that crashes mid-replay is a failed trial
                    log.warning("candidate %s failed during replay on the %s tier: %s", cand.short, tier, exc)
                    self._recover(tier, eng)
                    m.error = f"failed during replay: {type(exc).__name__}: {exc}"
                self._check_process(tier, eng, m)
                self._check_weights(tier, m)
                self._guard(m)
                spent[i] += patch_guard.perf_counter() - t0
            check_measured_outputs(out, tokens, getattr(self._engines.get(tier), "dtype", None))
        for m, sec, checks in zip(out, spent, routing_checks):
            m.seconds = sec
            verdict = replay_routing.merge_checks(checks)
            if verdict is not None:
                m.details["routing"] = verdict
                if not verdict["representative"]:
                    log.warning("%s tier, %s: %s", tier, profile.name, replay_routing.describe(verdict))
        return out

    def _fresh_prompts(self, profile: TrafficProfile, eng: Any, requests: int) -> list[ReplayRequest]:
        """`requests` of the profile's shapes with prompts never drawn before in this evaluator
        (one token seed per draw, so no memo of an earlier replay can pay)."""
        self._draws += 1
        return requests_from_profile(profile, eng, requests, self.settings.seed,
                                     token_seed=self.settings.seed * 1_000_003 + self._draws)

    def _faster_than_light(self, eng: Any, run: ReplayRun, in_flight: int) -> str | None:
        """Why the replay's output tokens/s is more than the device allows (None when it is not):
        decode steps at the widest batch the replay could form, the shortest context, against the
        bandwidth measured before any candidate ran (engine/verify/measured.py). A result faster
        than that is a measurement fault (a clock slowed, work skipped), never a speedup."""
        if self._bandwidth is None or not run.output_tokens_per_s > 0:
            return None
        from shapeshift.engine.verify.measured import measured_speed_possible

        batch = max(1, min(int(eng.config.max_num_seqs), int(in_flight)))
        ev = measured_speed_possible(run.output_tokens_per_s, eng.model_config, eng.weights, eng.dtype, batch, 1,
                                     self._bandwidth, device=eng.device)
        return None if ev["ok"] else ev["reason"]

    def _calibrate_arrivals(self, tier: str, eng: Any, profile: TrafficProfile, requests: int, clock: Any) -> None:
        """The open-loop arrival-rate factor of `tier`: the engine's capacity (a closed-loop replay
        of fresh prompts at the profile's concurrency, with the pass now active) times
        open_loop_load, over the output tokens/s the profile's own rate offers; never below 1."""
        probe = self._fresh_prompts(profile, eng, requests)
        self._fresh_cache(eng)
        capacity = replay(eng, probe, max(1, profile.concurrency), clock).output_tokens_per_s
        offered = profile.arrival_rate * sum(r.max_tokens for r in probe) / max(1, len(probe))
        scale = 1.0
        if offered > 0 and capacity > 0:
            scale = max(1.0, self.settings.open_loop_load * capacity / offered)
        self._arrival_scale[tier] = scale
        log.info("open-loop %s on the %s tier: capacity %.1f output tok/s against %.1f offered at %.3g req/s; "
                 "arrivals compressed %.2fx (load %.2f)", profile.name, tier, capacity, offered,
                 profile.arrival_rate, scale, self.settings.open_loop_load)

    def compare(self, candidate: Candidate, incumbent: Candidate,
                repeats: int | None = None) -> tuple[Measurement, Measurement]:
        """Full-tier replay of candidate and incumbent in alternation: (candidate, incumbent)."""
        s = self.settings
        cand_m, inc_m = self._interleaved(FULL, [candidate, incumbent], s.confirm_requests,
                                          repeats or s.confirm_repeats)
        return cand_m, inc_m

    def measure_together(self, cands: list[Candidate], repeats: int | None = None,
                         requests: int | None = None) -> list[Measurement]:
        """Full-tier replays of every candidate in alternation (ABBA), one Measurement each, their
        samples paired repeat by repeat (the regime matrix, engine/compile/regime_matrix.py)."""
        s = self.settings
        return self._interleaved(FULL, list(cands), requests or s.confirm_requests, repeats or s.closing_pairs)

    def retarget(self, profile: TrafficProfile) -> None:
        """Replay `profile`'s traffic from now on; the engines, their weights and the loaded pass
        stay (one model load measures every regime's traffic)."""
        self.profile = profile
        self.fitted = None
        self._arrival_scale.clear()
        self._tier_slo.clear()

    def screen_paired(self, candidate: Candidate, incumbent: Candidate) -> tuple[Measurement, Measurement]:
        """Fast-tier replays of candidate and incumbent in alternation (ABBA): (candidate, incumbent)."""
        s = self.settings
        return tuple(self._interleaved(FAST, [candidate, incumbent], s.screen_requests, s.screen_repeats))

    def compare_final(self, champion: Candidate, stock: Candidate) -> tuple[Measurement, Measurement]:
        """The run's closing comparison (champion, stock), with final_repeats pairs."""
        return self.compare(champion, stock, self.settings.closing_pairs)

    def _check_weights(self, tier: str, m: Measurement) -> None:
        """The tier's weights against their contents before any candidate loaded: a candidate that
        wrote to them is not a result, and the engine is discarded (rebuilt from the checkpoint)."""
        base, eng = self._weights.get(tier), self._engines.get(tier)
        changed = base.changed(eng.weights) if base is not None and eng is not None else []
        if changed:
            m.error = (f"weights: the candidate changed the engine's weights ({', '.join(changed[:4])}); "
                       "the engine is discarded")
            self._recover(tier)

    def _guard(self, m: Measurement | None) -> list[str]:
        """The clocks, math functions and harness captured before any candidate loaded, checked and
        put back (patch_guard.put_back); what had changed. With `m`, its measurement is no result."""
        patched = patch_guard.put_back()
        if patched and m is not None:
            m.error = (f"{m.error}; " if m.error else "") + ("measured.no_patching: the candidate replaced "
                                                             f"{', '.join(patched[:8])} in the measuring process")
        elif patched:
            log.warning("put back %s, patched outside any measurement", ", ".join(patched[:6]))
        return patched

    def _check_process(self, tier: str, eng: Any, m: Measurement) -> None:
        """After a replay in the candidate's own process: what voids it (measured_engine.py)."""
        problems = self._processes.check(tier, eng)
        if problems:
            m.error = "; ".join(([m.error] if m.error else []) + problems)

    def _recover(self, tier: str, eng: Any = None) -> None:
        """After a candidate broke its engine mid-run: its own process closed where it had one, else
        the tier's engine dropped (rebuilt on next use)."""
        if hasattr(eng, "tells"):
            self._processes.discard(tier, eng)
            return
        self._processes.close(tier)
        self._weights.pop(tier, None)
        self._engines.pop(tier, None)
        self._managers.pop(tier, None)
        self._loaded.pop(tier, None)

    def screen(self, candidate: Candidate) -> Measurement:
        s = self.settings
        return self._measure(FAST, candidate, s.screen_requests, s.screen_repeats)

    def confirm(self, candidate: Candidate) -> Measurement:
        s = self.settings
        return self._measure(FULL, candidate, s.confirm_requests, s.confirm_repeats)

    # ------------------------------------------------------------------ verification
    def verify(self, candidate: Candidate) -> Verification:
        t0 = patch_guard.perf_counter()
        path = self.materialize(candidate)
        patched = self._guard(None)  # what a measured candidate left patched: put back before the verifier runs
        from shapeshift.engine.compile.promotion import verify_for_promotion

        eng = self._engine(FULL, {})
        lengths = self._profile().prompt_length
        verdict = verify_for_promotion(eng, path, prompts=self.settings.verify_prompts, steps=self.settings.verify_steps,
                                       weights_baseline=self._weights.get(FULL),
                                       traffic_prompt_lens=(int(lengths.p50), int(lengths.p90), int(lengths.p99)))
        patched += self._guard(None)  # the in-process path (CUDA without IPC): the candidate ran here
        verdict.seconds = patch_guard.perf_counter() - t0
        if verdict.report.get("discard_engine"):  # the weights could not be restored (promotion.py)
            log.warning("verification: %s", verdict.report["discard_engine"])
            self._recover(FULL)
        if patched:
            verdict.passed, verdict.gates["anti_cheat.no_patching"] = False, False
            verdict.report["patched"] = patched[:8]
        return verdict

    def export(self, candidate: Candidate, out_dir: Path) -> dict[str, Any]:
        from shapeshift.engine.forward_pass.bundle import verify_bundle

        src = self.materialize(candidate)
        out_dir = Path(out_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.copytree(src, out_dir)
        manifest = verify_bundle(out_dir)
        return {"path": str(out_dir), "digest": manifest.digest, "name": manifest.name}

    def describe(self) -> dict[str, Any]:
        s = self.settings
        eng = self._engines.get(FULL)
        return {"model": s.model, "device": str(eng.device) if eng is not None else s.device,
                "dtype": str(eng.dtype) if eng is not None else s.dtype, "fast_layers": self.fast_layers(),
                "profile": self.profile.name, "fitted_profile": self._profile().name, "timer": self.timer(),
                "measurement": ("in the candidate's own process" if self._isolation and self._isolation[0]
                                else f"in this process ({self._isolation[1]})" if self._isolation else "not yet"),
                "cpu_threads": s.cpu_threads, "engine_base": dict(s.engine_base), "base_recipe": dict(s.base_recipe),
                "verify": {"prompts": s.verify_prompts, "steps": s.verify_steps},
                "screen": {"requests": s.screen_requests, "repeats": s.screen_repeats},
                "confirm": {"requests": s.confirm_requests, "repeats": s.confirm_repeats},
                "final_repeats": s.closing_pairs,
                "open_loop": {"load": s.open_loop_load, "arrival_scale": dict(self._arrival_scale)},
                "objective": "output tokens/s" if s.slo is None else f"goodput at {s.slo.describe()}",
                "slo": None if s.slo is None else s.slo.to_dict(),
                "fast_tier_slo": self._tier_slo[FAST].to_dict() if FAST in self._tier_slo else None}

    def hardware(self) -> str:
        """Coarse hardware key for the registry: the GPU name, or 'cpu'."""
        eng = self._engine(FULL, {})
        if eng.device.type == "cuda":
            import torch

            return torch.cuda.get_device_name(eng.device).lower().replace(" ", "-")
        return "cpu"

    def close(self) -> None:
        self._processes.close()
        self._engines.clear()
        self._managers.clear()
