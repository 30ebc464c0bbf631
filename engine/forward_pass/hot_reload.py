"""Hot reload of forward passes into a running engine.

Data flow:

    bundle path / archive --open_bundle (verify sha256s, private copy)--> OpenedBundle
      --import_bundle (own package name per load)--> LoadedBundle(module, recipe, manifest)
      --module.build(model_config, engine weights, recipe) [worker thread, deadline]--> ForwardPass
      --smoke (finite logits, greedy agreement with the incumbent on fresh prompts) [deadline]
      --engine thread, between two steps: install pass, flush KV blocks whose tag differs,
        re-capture CUDA graphs, apply the bundle's runtime engine settings--> serving

A compiled bundle carries engine.json, the EngineConfig overrides it was measured with. The
ones that can change between two steps of a running engine (LLMEngine.RUNTIME_SETTINGS: decode
steps per host round trip, the scheduler's batch width and token budget) are applied on install
and put back to the engine's own values when a pass without them is installed (rollback
included), through the engine's ``set_runtime_settings``. The others (KV block size,
graph buckets, prefix caching ...) size buffers and graphs at start-up, so they are reported,
not applied: they take a restart with the deployment's engine settings.

Isolation: every load gets its own synthetic package ``shapeshift_fp_<digest>_<n>``
whose ``__path__`` is the bundle's private folder, so ``forward.py`` may import its
helper modules relatively (``from . import fused``) and nothing is shared between two
candidates, or between a candidate and the incumbent, through ``sys.modules``.
Absolute imports of other packages (torch, shapeshift.*) work as usual.

Failure anywhere before the swap (bad manifest, import error, exception in build,
non-finite or disagreeing logits, a hang past the deadline) raises ReloadError and
leaves the incumbent serving. Every accepted pass goes into a history for rollback.

Engine hooks used (duck-typed, see ENGINE_HOOKS below): the engine's weights dict,
model config, KV cache and block manager, and the runner's active forward pass and
``capture_cudagraphs()``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from shapeshift.engine.forward_pass.bundle import ENGINE_SETTINGS_FILE, BundleError, Manifest, OpenedBundle, open_bundle, stock_bundle_dir

logger = logging.getLogger("shapeshift.engine.forward_pass.hot_reload")

_load_counter = itertools.count()
DEFAULT_BUILD_TIMEOUT_S = 120.0
DEFAULT_SMOKE_TIMEOUT_S = 120.0


def bundle_engine_settings(folder: str | Path) -> dict[str, Any]:
    """The bundle's engine.json (EngineConfig overrides it was measured with); {} without one."""
    path = Path(folder) / ENGINE_SETTINGS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ReloadError("open", f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ReloadError("open", f"{path}: expected an object of EngineConfig fields, got {type(data).__name__}")
    return data


class ReloadError(RuntimeError):
    """A candidate was refused; ``stage`` says where (open, import, build, smoke, swap)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage


class DeadlineExceeded(TimeoutError):
    pass


def run_with_deadline(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run ``fn`` in a daemon worker thread; raise DeadlineExceeded if it outlives ``timeout_s``.

    Python cannot kill a thread: a hung candidate's thread stays blocked in the
    background (harmless when it waits on a lock or sleeps; a busy loop keeps one
    core). Compile workers that run untrusted code at scale should verify in a
    subprocess for hard isolation.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # delivered to the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=target, name=f"shapeshift-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise DeadlineExceeded(f"{what} did not finish within {timeout_s:.1f} s (hung?)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


# ---------------------------------------------------------------------- importing


@dataclass
class LoadedBundle:
    """An imported bundle: its module lives under its own package name."""

    opened: OpenedBundle
    package: str  # sys.modules key of the synthetic package
    module: ModuleType  # the entry module (forward.py)

    @property
    def manifest(self) -> Manifest:
        return self.opened.manifest

    @property
    def recipe(self) -> dict[str, Any]:
        return self.opened.recipe

    @property
    def name(self) -> str:
        return str(getattr(self.module, "FORWARD_PASS_NAME", None) or self.manifest.name)

    @property
    def cache_format(self) -> str:
        """What the KV contents mean; passes with equal formats read each other's cache.

        The module's ``CACHE_FORMAT_VERSION`` (what the engine core tags blocks with);
        a module that declares none gets a format of its own (its digest), so its
        cache is never shared.
        """
        declared = getattr(self.module, "CACHE_FORMAT_VERSION", None)
        # Same rule as the engine core's Bundle.cache_tag (the digest stands in for the source hash).
        return f"kv-format-{declared if declared is not None else self.manifest.digest}"

    def unload(self) -> None:
        """Drop the package and its submodules from sys.modules and delete the private copy."""
        for key in [k for k in sys.modules if k == self.package or k.startswith(self.package + ".")]:
            sys.modules.pop(key, None)
        self.opened.close()


def import_bundle(opened: OpenedBundle) -> LoadedBundle:
    """Import an opened bundle's entry module under a package name used by nothing else."""
    # Capture the clocks and functions a candidate could patch before its top-level code
    # runs: every candidate is imported here, so this is the one place that sees them all.
    # (Imported in the function: shapeshift.engine.verify imports this module.)
    from shapeshift.engine.verify import anticheat  # noqa: F401

    package = f"shapeshift_fp_{opened.manifest.digest[:12]}_{next(_load_counter)}"
    pkg = ModuleType(package)
    pkg.__path__ = [str(opened.folder)]  # type: ignore[attr-defined]  # relative imports resolve here
    pkg.__package__ = package
    pkg.__file__ = None
    sys.modules[package] = pkg
    entry = opened.entry_path
    modname = f"{package}.{entry.stem}"
    try:
        spec = importlib.util.spec_from_file_location(modname, entry)
        if spec is None or spec.loader is None:
            raise ReloadError("import", f"cannot import {entry}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    except ReloadError:
        _drop_package(package)
        raise
    except BaseException as exc:
        _drop_package(package)
        raise ReloadError("import", f"{opened.source}: importing {entry.name} failed: "
                                    f"{type(exc).__name__}: {exc}") from exc
    if not callable(getattr(module, "build", None)):
        _drop_package(package)
        raise ReloadError("import", f"{opened.source}: {entry.name} defines no "
                                    "build(model_config, weights, recipe) function")
    return LoadedBundle(opened=opened, package=package, module=module)


def _drop_package(package: str) -> None:
    for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
        sys.modules.pop(key, None)


def load_bundle_isolated(path: str | Path, expected_digest: str | None = None,
                         allow_unmanifested: bool = False, ignore_manifest: bool = False) -> LoadedBundle:
    """open_bundle + import_bundle, with errors as ReloadError(stage="open"/"import")."""
    try:
        opened = open_bundle(path, expected_digest, allow_unmanifested=allow_unmanifested,
                             ignore_manifest=ignore_manifest)
    except BundleError as exc:
        raise ReloadError("open", str(exc)) from exc
    try:
        return import_bundle(opened)
    except BaseException:
        opened.close()
        raise


def load_stock_isolated() -> LoadedBundle:
    """The stock pass as a bundle.

    Its committed manifest is verified when present; a stale one (the stock source was
    edited without running hack/gen_stock_manifest.py) is logged and the files are hashed
    as they are: the stock pass is part of the engine package, as trusted as the engine.
    """
    try:
        return load_bundle_isolated(stock_bundle_dir(), allow_unmanifested=True)
    except ReloadError as exc:
        if exc.stage != "open":
            raise
        logger.warning("stock forward pass: %s; run python hack/gen_stock_manifest.py", exc)
        return load_bundle_isolated(stock_bundle_dir(), ignore_manifest=True)


# ---------------------------------------------------------------------- the manager

ENGINE_HOOKS = """\
engine.weights: dict[str, Tensor]; engine.model_config; engine.config (EngineConfig);
engine.device; engine.dtype; engine.kv_cache; engine.block_manager (.tag, .set_tag(tag));
engine.scheduler (.running, ._preempt(seq) or .preempt_all()); engine.runner
(.forward_pass, .capture_cudagraphs()); engine.bundle / engine.forward_pass (what runs);
engine.RUNTIME_SETTINGS and engine.set_runtime_settings(dict), where present."""


@dataclass
class PassRecord:
    """One forward pass the engine has run (the incumbent, or an accepted candidate)."""

    name: str
    digest: str
    cache_format: str
    source: str
    forward_pass: Any
    engine_bundle: Any  # shapeshift.engine.forward_pass.importer.Bundle handed to the engine
    loaded: LoadedBundle | None  # None for the pass the engine started with
    activated_unix: float = field(default_factory=time.time)
    timings_s: dict[str, float] = field(default_factory=dict)
    smoke: dict[str, Any] = field(default_factory=dict)
    # The ForwardPass resource this pass was rolled out as (pod annotation), if any.
    resource: str | None = None
    # The bundle's engine.json (EngineConfig overrides it was measured with).
    engine_settings: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The name the server reports (metrics info label): the resource's, else the module's."""
        return self.resource or self.name

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "cacheFormat": self.cache_format,
                "forwardPass": self.resource, "source": self.source, "activatedUnix": self.activated_unix,
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
    flushed_kv: bool  # the old pass's cache was dropped (formats differ)
    preempted: int  # running sequences recomputed under the new pass
    timings_s: dict[str, float]
    smoke: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "cacheFormat": self.cache_format,
                "flushedKv": self.flushed_kv, "preempted": self.preempted,
                "timingsSeconds": {k: round(v, 4) for k, v in self.timings_s.items()}, "smoke": self.smoke}


def weights_fingerprint(weights: dict[str, Any]) -> dict[str, tuple]:
    """Per tensor (data pointer, shape, dtype, version counter, float64 sum).

    In-place writes bump the version counter; the sum also catches writes that
    bypass autograd bookkeeping. A candidate must never change the shared weights:
    the incumbent and later candidates read them too.
    """
    import torch

    out = {}
    with torch.no_grad():
        for name, t in weights.items():
            out[name] = (t.data_ptr(), tuple(t.shape), str(t.dtype), getattr(t, "_version", 0),
                         float(t.double().sum().item()))
    return out


def fingerprint_diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    changed = [k for k in before if after.get(k) != before[k]]
    added = [k for k in after if k not in before]
    return sorted(changed) + [f"+{k}" for k in sorted(added)]


class ForwardPassManager:
    """Loads, checks and swaps forward passes into one running engine; keeps history."""

    def __init__(self, engine: Any, *, build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
                 smoke_timeout_s: float = DEFAULT_SMOKE_TIMEOUT_S, smoke_prompts: int = 3,
                 smoke_steps: int = 6, smoke_min_agreement: float = 0.9,
                 smoke_logit_tolerance: float | None = None, history_limit: int = 8,
                 offpath_capture: bool | None = None, check_weights: bool = True) -> None:
        self.engine = engine
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
        self._lock = threading.Lock()  # one reload at a time
        # The engine's own values of the settings it can change while running: what a pass
        # without engine.json runs with.
        self.base_engine_settings = {k: getattr(engine.config, k) for k in getattr(engine, "RUNTIME_SETTINGS", ())}
        bundle = getattr(engine, "bundle", None)
        digest = _engine_bundle_digest(bundle)
        tag = getattr(getattr(engine, "block_manager", None), "tag", "") or ""
        self.history: list[PassRecord] = [PassRecord(
            name=str(getattr(bundle, "name", "unknown")), digest=digest, cache_format=str(tag),
            source=str(getattr(bundle, "path", "")), forward_pass=getattr(engine, "forward_pass", None),
            engine_bundle=bundle, loaded=None)]

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

    def prepare(self, path: str | Path, expected_digest: str | None = None) -> Prepared:
        """Everything that can happen while the engine keeps serving: open, import, build,
        smoke, (CUDA) graph capture. Raises ReloadError; nothing of the engine changes."""
        with self._lock:
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            loaded = load_bundle_isolated(path, expected_digest)
            timings["import"] = time.perf_counter() - t0
            try:
                record, runner = self._build_and_check(loaded, timings)
            except BaseException:
                loaded.unload()
                raise
            record.source = str(path)
            record.engine_settings = bundle_engine_settings(loaded.opened.folder)
            return Prepared(record=record, runner=runner)

    def _build_and_check(self, loaded: LoadedBundle, timings: dict[str, float]) -> tuple[PassRecord, Any]:
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
        engine_bundle = self._engine_bundle(loaded)
        record = PassRecord(name=loaded.name, digest=loaded.manifest.digest, cache_format=loaded.cache_format,
                            source=loaded.opened.source, forward_pass=fp, engine_bundle=engine_bundle,
                            loaded=loaded, timings_s=timings, smoke=smoke)
        return record, runner

    def _smoke(self, fp: Any) -> dict[str, Any]:
        """Fresh random prompts through candidate and incumbent on a private KV cache:
        finite logits, greedy agreement (teacher-forced on the incumbent's tokens)."""
        import torch

        from shapeshift.engine.verify.driver import PagedDriver, Seq

        eng = self.engine
        cfg = eng.model_config
        seed = int.from_bytes(__import__("os").urandom(4), "little")  # fresh every time
        gen = torch.Generator().manual_seed(seed)
        block_size = eng.kv_cache.block_size
        lengths = [int(x) for x in torch.randint(3, 4 * block_size, (self.smoke_prompts,), generator=gen)]
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        need = sum(-(-(n + self.smoke_steps) // block_size) for n in lengths) + 2
        incumbent = self.active.forward_pass
        with torch.inference_mode():
            ref_driver = PagedDriver(cfg, eng.dtype, eng.device, num_blocks=need, block_size=block_size, seed=seed)
            ref_tokens, ref_logits = ref_driver.greedy(incumbent, [Seq(list(p)) for p in prompts], self.smoke_steps)
            cand_driver = PagedDriver(cfg, eng.dtype, eng.device, num_blocks=need, block_size=block_size, seed=seed + 1)
            cand_tokens, cand_logits = cand_driver.greedy(fp, [Seq(list(p)) for p in prompts], self.smoke_steps,
                                                          forced=ref_tokens)
        finite = all(bool(torch.isfinite(x).all()) for x in cand_logits)
        if not finite:
            raise ReloadError("smoke", "candidate produced NaN/Inf logits on fresh prompts")
        shape_ok = all(tuple(c.shape) == tuple(r.shape) for c, r in zip(cand_logits, ref_logits))
        if not shape_ok:
            raise ReloadError("smoke", f"candidate logits have shape {tuple(cand_logits[0].shape)}, "
                                       f"expected {tuple(ref_logits[0].shape)}")
        tolerance = self.smoke_logit_tolerance
        if tolerance is None:
            tolerance = 0.25 if eng.dtype in (torch.bfloat16, torch.float16) else 1e-3
        # Teacher-forced positions where the candidate's token is worse than the incumbent's
        # own by more than the tolerance, under the incumbent's logits (counted on the device).
        logits = torch.stack(ref_logits).float()  # [steps, B, V]
        mine = torch.tensor(ref_tokens, device=logits.device).T  # [steps, B]
        theirs = torch.tensor(cand_tokens, device=logits.device).T
        deficit = logits.gather(2, mine[..., None]) - logits.gather(2, theirs[..., None])  # [steps, B, 1]
        total, agree = mine.numel(), int((mine == theirs).sum())
        clear = int((deficit > tolerance).sum())  # equal tokens have deficit 0
        agreement = 1.0 - clear / max(total, 1)
        if agreement < self.smoke_min_agreement:
            raise ReloadError("smoke", f"candidate's greedy token is worse than the incumbent's by more than "
                                       f"{tolerance:g} logits at {clear} of {total} positions (at most "
                                       f"{1 - self.smoke_min_agreement:.0%} allowed; {agree} of {total} tokens equal)")
        return {"seed": seed, "prompts": len(prompts), "tokens": total, "agreement": round(agreement, 4),
                "equal_tokens": agree, "logit_tolerance": tolerance}

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

    def _engine_bundle(self, loaded: LoadedBundle) -> Any:
        """The engine core's Bundle record for a loaded bundle (what LLMEngine.bundle holds)."""
        try:
            from shapeshift.engine.forward_pass.importer import Bundle
        except ImportError:
            return loaded
        return Bundle(path=loaded.opened.folder, module=loaded.module, recipe=dict(loaded.recipe),
                      source_sha256=loaded.manifest.digest)

    # ------------------------------------------------------------------ swap
    def commit(self, prepared: Prepared) -> ReloadResult:
        """Install a prepared pass. Call on the engine thread between two steps."""
        with self._lock:
            t0 = time.perf_counter()
            flushed, preempted = self._install(prepared.record, prepared.runner)
            prepared.record.timings_s["swap"] = time.perf_counter() - t0
            prepared.record.activated_unix = time.time()
            self.history.append(prepared.record)
            self._trim_history()
            r = prepared.record
            logger.info("forward pass %s (%s) active; kv flushed=%s preempted=%d", r.name, r.digest[:12],
                        flushed, preempted)
            return ReloadResult(name=r.name, digest=r.digest, cache_format=r.cache_format, flushed_kv=flushed,
                                preempted=preempted, timings_s=dict(r.timings_s), smoke=dict(r.smoke))

    def rollback(self, steps: int = 1) -> ReloadResult:
        """Re-activate the pass ``steps`` entries back in history. Call between steps."""
        with self._lock:
            if steps < 1 or steps >= len(self.history):
                raise ReloadError("rollback", f"cannot roll back {steps} step(s): history holds "
                                              f"{len(self.history)} pass(es) ({[r.name for r in self.history]})")
            target = self.history[-1 - steps]
            t0 = time.perf_counter()
            again = PassRecord(name=target.name, digest=target.digest, cache_format=target.cache_format,
                               source=target.source, forward_pass=target.forward_pass,
                               engine_bundle=target.engine_bundle, loaded=target.loaded,
                               smoke=dict(target.smoke), resource=target.resource,
                               engine_settings=dict(target.engine_settings))
            flushed, preempted = self._install(again, None)
            again.timings_s["swap"] = time.perf_counter() - t0
            self.history.append(again)
            self._trim_history()
            return ReloadResult(name=again.name, digest=again.digest, cache_format=again.cache_format,
                                flushed_kv=flushed, preempted=preempted, timings_s=dict(again.timings_s),
                                smoke={"rollback": True})

    def _install(self, record: PassRecord, runner: Any) -> tuple[bool, int]:
        eng = self.engine
        drain = getattr(eng, "drain_inflight", None)
        if drain is not None:  # decode steps in flight finish on the pass and runner that launched them
            drain()
        bm = eng.block_manager
        old_tag = bm.tag
        new_tag = record.cache_format
        flushed = new_tag != old_tag
        preempted = 0
        if flushed:
            # Running sequences hold KV written by the old pass in another format:
            # recompute them under the new one (same tokens: greedy/seeded resume exactly).
            preempted = _preempt_running(eng.scheduler)
        if runner is not None:
            eng.runner = runner
        else:
            eng.runner.forward_pass = record.forward_pass
            eng.runner.capture_cudagraphs()
        eng.forward_pass = record.forward_pass
        eng.bundle = record.engine_bundle
        eng.forward_pass_sha256 = record.digest  # reported by the server's info metric
        eng.forward_pass_label = record.label
        bm.set_tag(new_tag)
        self._apply_engine_settings(record)
        return flushed, preempted

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
                           record.name, deferred)

    def _trim_history(self) -> None:
        while len(self.history) > self.history_limit:
            dropped = self.history.pop(0)
            still_used = any(r.loaded is dropped.loaded for r in self.history)
            if dropped.loaded is not None and not still_used:
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


def _engine_bundle_digest(bundle: Any) -> str:
    path = getattr(bundle, "path", None)
    if path is not None:
        try:
            from shapeshift.engine.forward_pass.bundle import load_manifest

            return load_manifest(path).digest
        except Exception:
            pass
    return str(getattr(bundle, "source_sha256", "") or "unknown")


def import_stock_module() -> ModuleType:
    """A private, isolated import of the stock forward.py (for passes derived from it)."""
    return load_stock_isolated().module
