"""Hot reload: swap forward passes into a running engine, keep their history, roll back.

Data flow:

    bundle path / archive --importer.load_bundle (manifest and sha256s checked on a private
      copy, own package)--> LoadedBundle
      --module.build(model_config, engine weights, recipe) [worker thread, deadline]--> ForwardPass
      --smoke.smoke_check [deadline]; the shared weights unchanged (weights_guard)
      --(CUDA) graphs captured on a second runner, off the serving path--> Prepared
      --commit, on the engine thread between two steps: kv_handover.decide keeps the KV cache
        (same KV layout and the incoming pass's prefix hits on blocks the outgoing pass wrote
        equal a miss) or flushes it (running sequences preempted and recomputed, cached blocks
        forgotten); LLMEngine.install_forward_pass (runner, pass, KV tag, ActiveForwardPass),
        the bundle's runtime engine settings--> serving; the decision is in the reply
        (``kvCache``), logged, and counted (shapeshift_kv_swaps_total)

A compiled bundle carries engine.json, the EngineConfig overrides it was measured with. The
ones that can change between two steps of a running engine (LLMEngine.RUNTIME_SETTINGS) are
applied on install and put back to the engine's own values when a pass without them is
installed (rollback included); the others size buffers and graphs at start-up, so they are
reported, not applied: they take a restart with the deployment's engine settings.

Failure anywhere before the swap (bad manifest, import error, exception in build,
non-finite or disagreeing logits, a hang past the deadline) raises ReloadError and
leaves the incumbent serving. Every accepted pass goes into a history for rollback.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shapeshift.engine.forward_pass.bundle import BundleError, read_engine_settings
from shapeshift.engine.forward_pass.deadline import DeadlineExceeded, run_with_deadline
from shapeshift.engine.forward_pass.identity import ActiveForwardPass
from shapeshift.engine.forward_pass.importer import LoadedBundle, ReloadError, load_bundle
from shapeshift.engine.forward_pass.kv_handover import KVCheckSettings, KVDecision, decide
from shapeshift.engine.forward_pass.smoke import smoke_check
from shapeshift.engine.forward_pass.weights_guard import fingerprint_diff, weights_fingerprint

logger = logging.getLogger("shapeshift.engine.forward_pass.swap")

DEFAULT_BUILD_TIMEOUT_S = 120.0
DEFAULT_SMOKE_TIMEOUT_S = 120.0


# What the manager uses of the engine (an LLMEngine): weights, model_config, config, device,
# dtype, kv_cache, block_manager (.tag), scheduler (.running, ._preempt(seq) or
# .preempt_all()), runner (for off-path capture), drain_inflight(), active_forward_pass,
# install_forward_pass(...), name_forward_pass(resource), RUNTIME_SETTINGS and
# set_runtime_settings(dict), where present.


@dataclass
class PassRecord:
    """One forward pass the engine has run (the incumbent, or an accepted candidate)."""

    identity: ActiveForwardPass
    forward_pass: Any
    loaded: LoadedBundle  # what LLMEngine.bundle holds while this pass runs
    imported_here: bool = True  # False for the pass the engine started with: never unloaded here
    activated_unix: float = field(default_factory=time.time)
    timings_s: dict[str, float] = field(default_factory=dict)
    smoke: dict[str, Any] = field(default_factory=dict)
    # The bundle's engine.json (EngineConfig overrides it was measured with).
    engine_settings: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        who = self.identity
        return {"name": who.name, "digest": who.digest, "cacheFormat": who.cache_format, "kvLayout": who.kv_layout,
                "forwardPass": who.resource, "source": who.source, "activatedUnix": self.activated_unix,
                "engineSettings": dict(self.engine_settings),
                "timingsSeconds": {k: round(v, 4) for k, v in self.timings_s.items()}, "smoke": self.smoke}


@dataclass
class Prepared:
    """A candidate that passed import, build and smoke off the serving path, ready to swap."""

    record: PassRecord
    runner: Any = None  # a runner with graphs already captured (off-path capture), or None


@dataclass
class ReloadResult:
    name: str
    digest: str
    cache_format: str
    flushed_kv: bool  # the old pass's cache was dropped (layouts differ, or the KV check failed)
    preempted: int  # running sequences recomputed under the new pass
    timings_s: dict[str, float]
    smoke: dict[str, Any]
    kv: dict[str, Any] = field(default_factory=dict)  # KVDecision.to_dict(): kept or flushed, and why

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "cacheFormat": self.cache_format,
                "flushedKv": self.flushed_kv, "preempted": self.preempted, "kvCache": dict(self.kv),
                "timingsSeconds": {k: round(v, 4) for k, v in self.timings_s.items()}, "smoke": self.smoke}


class ForwardPassManager:
    """Loads, checks and swaps forward passes into one running engine; keeps history."""

    def __init__(self, engine: Any, *, build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
                 smoke_timeout_s: float = DEFAULT_SMOKE_TIMEOUT_S, smoke_prompts: int = 3,
                 smoke_steps: int = 6, smoke_min_agreement: float = 0.9,
                 smoke_logit_tolerance: float | None = None, history_limit: int = 8,
                 offpath_capture: bool | None = None, check_weights: bool = True,
                 kv_check: KVCheckSettings | None = None, swap_log_level: int = logging.INFO) -> None:
        self.engine = engine
        # The "forward pass ... active" line of each swap: INFO where a swap is an event (a
        # serving pod's rollout), DEBUG where swaps are routine (a compile run's candidates).
        self.swap_log_level = swap_log_level
        self.build_timeout_s = build_timeout_s
        self.smoke_timeout_s = smoke_timeout_s
        self.smoke_prompts = smoke_prompts
        self.smoke_steps = smoke_steps
        self.smoke_min_agreement = smoke_min_agreement
        # A greedy token the candidate picks differently counts against it only when the
        # incumbent prefers its own token by more than this many logits: in bf16 two correct
        # passes (another reduction order, a fused kernel) flip near-ties, and on random
        # weights a fifth of positions have a top-2 gap under 0.05. None: 0.25 for 16-bit
        # dtypes, 1e-3 for float32 (where reduction order moves logits by ~1e-5).
        self.smoke_logit_tolerance = smoke_logit_tolerance
        self.history_limit = history_limit
        # Off-path capture builds a second runner and captures its graphs on the worker
        # thread while the engine keeps serving (CUDA only); None -> on when CUDA.
        self.offpath_capture = offpath_capture
        self.check_weights = check_weights
        # The check a swap between passes of one KV layout runs before the cache is kept.
        self.kv_check = kv_check or KVCheckSettings()
        self._lock = threading.Lock()  # one reload at a time
        # The engine's own values of the settings it can change while running: what a pass
        # without engine.json runs with.
        self.base_engine_settings = {k: getattr(engine.config, k) for k in getattr(engine, "RUNTIME_SETTINGS", ())}
        self.history: list[PassRecord] = [PassRecord(
            identity=engine.active_forward_pass, forward_pass=engine.forward_pass, loaded=engine.bundle,
            imported_here=False)]

    # ------------------------------------------------------------------ queries
    @property
    def active(self) -> PassRecord:
        return self.history[-1]

    def listing(self) -> dict[str, Any]:
        return {"active": self.active.summary(), "history": [r.summary() for r in self.history]}

    # ------------------------------------------------------------------ reload
    def reload(self, path: str | Path, expected_digest: str | None = None) -> ReloadResult:
        """prepare + commit on the calling thread (the caller owns the engine between steps)."""
        prepared = self.prepare(path, expected_digest)
        return self.commit(prepared)

    def prepare(self, path: str | Path, expected_digest: str | None = None, *,
                resource: str | None = None) -> Prepared:
        """Everything that can happen while the engine keeps serving: open, import, build,
        smoke, (CUDA) graph capture. Raises ReloadError; nothing of the engine changes.
        ``resource``: the ForwardPass resource the pass is rolled out as."""
        with self._lock:
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            loaded = load_bundle(path, expected_digest=expected_digest)
            timings["import"] = time.perf_counter() - t0
            try:
                identity = ActiveForwardPass.of(loaded, str(path), resource, kv=self.engine.kv_context())
                record, runner = self._build_and_check(loaded, timings, identity)
                record.engine_settings = read_engine_settings(loaded.bundle.folder)
            except BundleError as exc:
                loaded.unload()
                raise ReloadError("open", str(exc)) from exc
            except BaseException:
                loaded.unload()
                raise
            return Prepared(record=record, runner=runner)

    def name_active(self, resource: str | None) -> None:
        """The active pass is now known as ForwardPass ``resource`` (a rollout renamed it)."""
        self.engine.name_forward_pass(resource)
        self.active.identity = self.engine.active_forward_pass

    def _build_and_check(self, loaded: LoadedBundle, timings: dict[str, float],
                         identity: ActiveForwardPass) -> tuple[PassRecord, Any]:
        eng = self.engine
        before = weights_fingerprint(eng.weights) if self.check_weights else None
        t0 = time.perf_counter()
        try:
            fp = run_with_deadline(lambda: loaded.module.build(eng.model_config, eng.weights, dict(loaded.recipe)),
                                   self.build_timeout_s, "build")
        except DeadlineExceeded as exc:
            raise ReloadError("build", f"{loaded.manifest.name}: {exc}") from exc
        except BaseException as exc:
            raise ReloadError("build", f"{loaded.manifest.name}: build() raised {type(exc).__name__}: {exc}") from exc
        if not callable(getattr(fp, "forward", None)):
            raise ReloadError("build", f"{loaded.manifest.name}: build() returned {type(fp).__name__} "
                                       "without a forward() method")
        timings["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            smoke = run_with_deadline(lambda: self._smoke(fp), self.smoke_timeout_s, "smoke")
        except DeadlineExceeded as exc:
            raise ReloadError("smoke", f"{loaded.manifest.name}: {exc}") from exc
        except ReloadError:
            raise
        except BaseException as exc:
            raise ReloadError("smoke", f"{loaded.manifest.name}: forward() raised {type(exc).__name__}: {exc}") from exc
        timings["smoke"] = time.perf_counter() - t0
        if before is not None:
            changed = fingerprint_diff(before, weights_fingerprint(eng.weights))
            if changed:
                raise ReloadError("smoke", f"{loaded.manifest.name} modified the engine's shared weights "
                                           f"({changed[:5]}...); a forward pass must only read them")
        runner = None
        if self._offpath_enabled():
            t0 = time.perf_counter()
            try:
                runner = self._capture_offpath(fp)
            except BaseException as exc:  # fall back to capture during the swap
                logger.warning("off-path graph capture failed (%r); capturing during the swap", exc)
                runner = None
            timings["capture_offpath"] = time.perf_counter() - t0
        record = PassRecord(identity=identity, forward_pass=fp, loaded=loaded, timings_s=timings, smoke=smoke)
        return record, runner

    def _smoke(self, fp: Any) -> dict[str, Any]:
        return smoke_check(self.engine, self.active.forward_pass, fp, prompts=self.smoke_prompts,
                           steps=self.smoke_steps, min_agreement=self.smoke_min_agreement,
                           logit_tolerance=self.smoke_logit_tolerance)

    def _offpath_enabled(self) -> bool:
        eng = self.engine
        if getattr(getattr(eng, "config", None), "enforce_eager", False):
            return False
        on_cuda = getattr(getattr(eng, "device", None), "type", "cpu") == "cuda"
        return on_cuda if self.offpath_capture is None else (self.offpath_capture and on_cuda)

    def _capture_offpath(self, fp: Any) -> Any:
        """A second ModelRunner over the same KV cache with the candidate's graphs captured.

        Warm-up and capture write only the cache's null block, so serving is unaffected.
        """
        eng = self.engine
        runner_cls = type(eng.runner)
        runner = runner_cls(eng.model_config, eng.config, fp, eng.kv_cache, eng.device)
        runner.capture_cudagraphs()
        return runner

    # ------------------------------------------------------------------ swap
    def commit(self, prepared: Prepared) -> ReloadResult:
        """Install a prepared pass. Call on the engine thread between two steps."""
        with self._lock:
            t0 = time.perf_counter()
            kv, preempted = self._install(prepared.record, prepared.runner)
            prepared.record.timings_s["swap"] = time.perf_counter() - t0
            prepared.record.activated_unix = time.time()
            self.history.append(prepared.record)
            self._trim_history()
            r, who = prepared.record, prepared.record.identity
            return ReloadResult(name=who.name, digest=who.digest, cache_format=who.cache_format,
                                flushed_kv=not kv.kept, preempted=preempted, timings_s=dict(r.timings_s),
                                smoke=dict(r.smoke), kv=kv.to_dict())

    def rollback(self, steps: int = 1) -> ReloadResult:
        """Re-activate the pass ``steps`` entries back in history. Call between steps."""
        with self._lock:
            if steps < 1 or steps >= len(self.history):
                names = [r.identity.name for r in self.history]
                raise ReloadError("rollback", f"cannot roll back {steps} step(s): history holds "
                                              f"{len(self.history)} pass(es) ({names})")
            target = self.history[-1 - steps]
            t0 = time.perf_counter()
            again = PassRecord(identity=target.identity, forward_pass=target.forward_pass, loaded=target.loaded,
                               imported_here=target.imported_here, smoke=dict(target.smoke),
                               engine_settings=dict(target.engine_settings))
            kv, preempted = self._install(again, None)
            again.timings_s["swap"] = time.perf_counter() - t0
            self.history.append(again)
            self._trim_history()
            who = again.identity
            return ReloadResult(name=who.name, digest=who.digest, cache_format=who.cache_format,
                                flushed_kv=not kv.kept, preempted=preempted, timings_s=dict(again.timings_s),
                                smoke={"rollback": True}, kv=kv.to_dict())

    def _install(self, record: PassRecord, runner: Any) -> tuple[KVDecision, int]:
        eng = self.engine
        drain = getattr(eng, "drain_inflight", None)
        if drain is not None:  # decode steps in flight finish on the pass and runner that launched them
            drain()
        outgoing = self.active
        kv = decide(eng, outgoing.identity, outgoing.forward_pass, record.identity, record.forward_pass, self.kv_check)
        preempted = 0
        if not kv.kept:
            # Running sequences hold KV the new pass must not read: recompute them under it
            # (same tokens: greedy/seeded resume exactly), and forget every cached block.
            preempted = _preempt_running(eng.scheduler)
            if record.identity.cache_format == eng.block_manager.tag:
                eng.block_manager.flush()  # same tag, so installing the pass would keep them
        eng.install_forward_pass(record.loaded, record.forward_pass, record.identity, runner=runner)
        self._apply_engine_settings(record)
        eng.kv_swaps[(kv.outcome, kv.reason)] += 1
        who = record.identity
        logger.log(self.swap_log_level, "forward pass %s (%s) active; KV cache %s (%s): %s; "
                   "%d running sequence(s) preempted, check %.1f ms", who.name, who.digest[:12], kv.outcome,
                   kv.reason, kv.detail, preempted,
                   kv.seconds * 1e3)
        return kv, preempted

    def _apply_engine_settings(self, record: PassRecord) -> None:
        if not self.base_engine_settings:
            return  # an engine that cannot change settings while running
        wanted = {name: record.engine_settings.get(name, base) for name, base in self.base_engine_settings.items()}
        if {"max_num_seqs", "max_num_batched_tokens"} <= wanted.keys():
            wanted = type(self.engine.config).fit_token_budget(wanted)  # a wider batch from engine.json alone
        self.engine.set_runtime_settings(wanted)
        deferred = {k: v for k, v in record.engine_settings.items()
                    if k not in wanted and getattr(self.engine.config, k, v) != v}
        if deferred:
            logger.warning("forward pass %s was measured with engine settings %s that a running engine cannot "
                           "take; they apply when the engine starts with them (engine settings of the deployment)",
                           record.identity.name, deferred)

    def _trim_history(self) -> None:
        while len(self.history) > self.history_limit:
            dropped = self.history.pop(0)
            still_used = any(r.loaded is dropped.loaded for r in self.history)
            if dropped.imported_here and not still_used:
                dropped.loaded.unload()


def _preempt_running(scheduler: Any) -> int:
    if hasattr(scheduler, "preempt_all"):
        return int(scheduler.preempt_all())
    running = list(scheduler.running)
    # Preempt from the back so the waiting queue keeps admission order (appendleft).
    for seq in reversed(running):
        scheduler.running.remove(seq)
        scheduler._preempt(seq)
    return len(running)
