"""Verification gates: named checks that a candidate forward pass must pass before it is served;
this module runs them in order (the gates themselves live in outputs.py, sampling_gate.py,
kv_isolation.py, concurrency.py, serving_paths.py and anti_cheat_gates.py, their common ground in context.py, the
report types in report.py).

Data flow:

    candidate bundle --open_bundle (private copy, digest)--> IsolatedCandidate: a process of its
      own (isolated.py) imports and builds it over the weights it maps; reference pass (stock)
      built here over the same weights
    each gate: fresh random prompts (a new seed every run) -> PagedDriver (KV in shared memory)
      runs the reference here and the candidate there (forward() crosses as JSON + raw bytes)
      -> evidence (numbers, computed here) -> GateReport(name, passed, evidence)
    -> GateSuiteReport(passed = every gate passed, gates=[...])

Gates (names are stable; reports and tests refer to them):
  smoke                       build + one prefill + one decode within a deadline, float32 [B, V]
  outputs.finite              no NaN/Inf logits, including long prompts
  outputs.agreement           greedy tokens over many steps (teacher-forced on the reference's
                              tokens; a flip is forgiven only at a near-tie) and logprob tolerance
                              (in half precision the bounds and the near-tie margin calibrated on
                              the reference's own rounding error)
  outputs.sampling            seeded sampled decoding (temperature, top-p, top-k, a seed per row)
                              through the engine's samplers gives the reference's tokens: the
                              candidate teacher-forced on the reference's sampled tokens, drawn
                              with the same noise (a flip forgiven only at a near-tie of the race)
  kv.prefix_hit_equals_miss   a prompt computed over a shared cached prefix == computed fresh
  kv.batched_equals_alone     each sequence's outputs do not depend on its batch mates
  kv.canary_isolation         a canary secret in one request never reaches another: outputs of a
                              request are the same next to a canary-carrying neighbour and in
                              blocks freed by it, and never contain the canary
  kv.swap_compatibility       same declared cache format -> each pass reads the other's cache;
                              different format -> the engine flushes on swap (recorded)
  coverage.shapes             every decode batch size up to the largest batch, every graph
                              bucket and sizes between the buckets past it, odd prompt lengths
                              for prefill, chunked prefill
  coverage.long_context       contexts at the deployment's max model length and at the replayed
                              traffic's prompt lengths (p50, p90, p99; else one drawn from the
                              upper half), over a KV pool they fill
  coverage.mixed_steps        decode rows next to prefills and prefill chunks in one step; a prefix
                              donor batched with the child sharing its blocks, re-checked after
  coverage.concurrent_calls   two request groups decoded by the candidate on two KV caches, their
                              calls interleaved and then overlapping (two threads at once) ==
                              each group decoded alone by the reference
  coverage.padded_batches     decode steps shaped as CUDA-graph replays (batches padded to their
                              bucket, padded rows on the null slot, tables max_model_len wide, no
                              host copies) == the reference on the same steps; no KV slot written
                              outside the step's own
  coverage.block_pool         sequences on block ids across the serving engine's whole KV pool
                              (its last block, block 0, the rest drawn; capped by memory, said so)
  anti_cheat.fresh_inputs     reused input buffers with new contents, same tokens in new contexts
  anti_cheat.poisoned_outputs returned logits are not changed after return; poisoned previous
                              outputs never leak into new ones
  anti_cheat.inputs_unchanged input tensors, context and the shared weights' contents are unchanged
                              (against a baseline taken before the candidate was first loaded
                              when the caller has one; checked again after every gate, and the
                              weights restored when they changed)
  anti_cheat.no_patching      no clock, sync, math or harness function replaced; no stray threads
  anti_cheat.speed_of_light   harness-timed decode step is not faster than bytes/bandwidth or
                              FLOPs/peak allow
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from shapeshift.engine.verify import anticheat  # noqa: F401  (first: captures clocks and function identities before any candidate)
from shapeshift.engine.forward_pass.deadline import DeadlineExceeded, run_with_deadline
from shapeshift.engine.forward_pass.bundle import STOCK_BUNDLE_DIR, Bundle, declared_cache_format, open_bundle
from shapeshift.engine.forward_pass.importer import LoadedBundle, ReloadError, load_bundle
from shapeshift.engine.forward_pass.weights_guard import WeightsBaseline, fingerprint_diff, weights_fingerprint
from shapeshift.engine.verify.anti_cheat_gates import (gate_fresh_inputs, gate_inputs_unchanged, gate_no_patching,
                                                     gate_poisoned_outputs, gate_speed_of_light)
from shapeshift.engine.verify.concurrency import gate_concurrent_calls
from shapeshift.engine.verify.context import GateContext, GateFailure, GateSettings
from shapeshift.engine.verify.isolated import CandidateDied, IsolatedCandidate, cuda_ipc_problem
from shapeshift.engine.verify.kv_isolation import gate_batched_alone, gate_canary, gate_prefix_hit, gate_swap
from shapeshift.engine.verify.outputs import (calibrate, gate_agreement, gate_coverage, gate_finite, gate_long_context,
                                             gate_mixed_steps, gate_smoke)
from shapeshift.engine.verify.report import GATE_NAMES, GateReport, GateSuiteReport
from shapeshift.engine.verify.sampling_gate import gate_sampling
from shapeshift.engine.verify.serving_paths import gate_block_pool, gate_padded_batches


def _run_gate(name: str, fn: Callable[[], dict[str, Any]], timeout_s: float) -> GateReport:
    def in_inference_mode() -> dict[str, Any]:
        with torch.inference_mode():  # as the runner calls passes (thread-local, so set in the worker)
            return fn()

    try:
        evidence = run_with_deadline(in_inference_mode, timeout_s, f"gate-{name}")
        return GateReport(name, True, evidence or {})
    except GateFailure as exc:
        return GateReport(name, False, {"reason": str(exc), **exc.evidence})
    except DeadlineExceeded as exc:
        return GateReport(name, False, {"reason": str(exc), "timeout": True})
    except CandidateDied as exc:
        return GateReport(name, False, {"reason": str(exc), "died": True})
    except BaseException as exc:
        return GateReport(name, False, {"reason": f"{type(exc).__name__}: {exc}"})


def verify_candidate(candidate: str | Path | LoadedBundle, model_config: Any, weights: dict[str, torch.Tensor],
                     *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     reference: Any = None, reference_cache_format: str | None = None,
                     settings: GateSettings | None = None, only: tuple[str, ...] | None = None,
                     weights_baseline: WeightsBaseline | None = None) -> GateSuiteReport:
    """Run every gate (or ``only`` these) on a candidate bundle against the reference pass.

    The candidate runs in a process of its own (engine/verify/isolated.py): this process holds
    the reference, the tolerances, the comparisons and the verdict, and never imports the
    candidate's code. A LoadedBundle (already imported by the caller) is verified from its
    private folder in such a process too.

    ``reference`` defaults to the stock pass built over ``weights``. A candidate that
    fails ``smoke`` (import, build, crash, hang) gets every other gate marked failed
    and skipped: nothing else can be learned from it.

    ``weights_baseline``: the weights' fingerprint from before the candidate was first loaded
    (the compile loop takes it before measuring); without one it is taken here, with a copy to
    restore from. Weights found changed fail anti_cheat.inputs_unchanged and are restored; where
    they cannot be (a baseline without a copy, as the compile loop's on CUDA, where the candidate's
    process maps the engine's own tensors), that gate's evidence says ``discard_engine``: the
    caller must drop the engine that holds them (EngineEvaluator.verify does).
    """
    settings = settings or GateSettings()
    first = next(iter(weights.values()))
    dtype = dtype or first.dtype
    device = torch.device(device) if device is not None else first.device
    seed = settings.seed if settings.seed is not None else int.from_bytes(os.urandom(4), "little")
    threads_before = {t.ident for t in threading.enumerate()}
    baseline = weights_baseline or WeightsBaseline(weights, keep_copy=True)
    weights_before = baseline.fingerprint
    # Damage done before verification (while the candidate was measured in this process): put
    # back first, so the reference and the candidate run over the pristine weights.
    early = baseline.changed(weights)
    early_restored = baseline.restore(weights) if early else []
    reports: list[GateReport] = []
    want = set(only or GATE_NAMES)

    stock: LoadedBundle | None = None  # the reference's bundle when loaded here (unloaded at the end)
    if reference is None:
        from shapeshift.engine.forward_pass.importer import load_stock as load_stock_isolated

        stock = load_stock_isolated()
        reference = stock.module.build(model_config, weights, dict(stock.recipe))
        reference_cache_format = stock.cache_format
    # A reference given without its format: the stock pass's tag (what "kv-format-1" was before
    # tags carried the layout's hash), so a candidate declaring the stock layout is swap-checked.
    reference_cache_format = reference_cache_format or declared_cache_format(STOCK_BUNDLE_DIR)

    opened: Bundle | None = None
    loaded: LoadedBundle | None = None
    isolation: dict[str, Any] = {}
    candidate_cache_format = ""
    label, digest = str(candidate), None
    session: IsolatedCandidate | None = None
    fp = None
    try:
        # The files verified are the files hashed: the candidate's process imports this private copy.
        if isinstance(candidate, LoadedBundle):
            folder = candidate.bundle.folder
            label, digest = candidate.manifest.name, candidate.manifest.digest
        else:
            opened = open_bundle(candidate, allow_unmanifested=True)
            folder = opened.folder
            label, digest = opened.manifest.name, opened.manifest.digest
        problem = _isolation_problem(device)
        if problem is None:
            session = IsolatedCandidate(folder, model_config, weights, dtype, device, settings.gate_timeout_s)
            session.start(settings.build_timeout_s)
            fp = session
        else:
            # The one in-process path: a GPU whose tensors a child cannot map (CUDA IPC refused).
            # The report says so; the candidate then shares this process, as before isolation.
            isolation = {"process": "in-process", "reason": problem}
            loaded = load_bundle(folder, allow_unmanifested=True)
            fp = run_with_deadline(lambda: loaded.module.build(model_config, weights, dict(loaded.recipe)),
                                   settings.build_timeout_s, "build")
            if not callable(getattr(fp, "forward", None)):
                raise ReloadError("build", f"build() returned {type(fp).__name__} without forward()")
            candidate_cache_format = loaded.cache_format
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        reports.append(GateReport("smoke", False, {"reason": reason, "stage": getattr(exc, "stage", "build"),
                                                   "timeout": isinstance(exc, DeadlineExceeded)}))
    shared = session.weights if session is not None else weights  # what the candidate's process maps
    ctx = GateContext(model_config=model_config, weights=shared, dtype=dtype, device=device, reference=reference,
                      candidate=fp, reference_cache_format=reference_cache_format,
                      candidate_cache_format=session.cache_format if session is not None else candidate_cache_format,
                      settings=settings, rng=random.Random(seed), seed=seed,
                      driver_factory=session.driver if session is not None and fp is not None else None)
    tolerance = calibrate(ctx, model_config, weights, stock, weights_before) if fp is not None else {}
    plan: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("smoke", lambda: gate_smoke(ctx)),
        ("outputs.finite", lambda: gate_finite(ctx)),
        ("outputs.agreement", lambda: gate_agreement(ctx)),
        ("outputs.sampling", lambda: gate_sampling(ctx)),
        ("kv.prefix_hit_equals_miss", lambda: gate_prefix_hit(ctx)),
        ("kv.batched_equals_alone", lambda: gate_batched_alone(ctx)),
        ("kv.canary_isolation", lambda: gate_canary(ctx)),
        ("kv.swap_compatibility", lambda: gate_swap(ctx)),
        ("coverage.shapes", lambda: gate_coverage(ctx)),
        ("coverage.long_context", lambda: gate_long_context(ctx)),
        ("coverage.mixed_steps", lambda: gate_mixed_steps(ctx)),
        ("coverage.concurrent_calls", lambda: gate_concurrent_calls(ctx)),
        ("coverage.padded_batches", lambda: gate_padded_batches(ctx)),
        ("coverage.block_pool", lambda: gate_block_pool(ctx)),
        ("anti_cheat.fresh_inputs", lambda: gate_fresh_inputs(ctx)),
        ("anti_cheat.poisoned_outputs", lambda: gate_poisoned_outputs(ctx)),
        ("anti_cheat.inputs_unchanged", lambda: gate_inputs_unchanged(ctx, weights_before, by_content=True)),
        ("anti_cheat.speed_of_light", lambda: gate_speed_of_light(ctx)),
        ("anti_cheat.no_patching", lambda: gate_no_patching(threads_before, session)),
    ]
    smoke_failed = bool(reports)
    for name, fn in plan:
        if name == "smoke" and smoke_failed:
            continue
        if name not in want and name != "smoke":
            continue
        if smoke_failed and name != "anti_cheat.no_patching":
            reports.append(GateReport(name, False, {"reason": "not run: the candidate failed smoke"}, skipped=True))
            continue
        report = _run_gate(name, fn, settings.gate_timeout_s + 1.0)
        reports.append(report)
        if name == "smoke" and not report.passed:
            smoke_failed = True
        if report.evidence.get("timeout") or (session is not None and session.dead):
            smoke_failed = True  # a hung or dead candidate: its process is gone, nothing more to learn
            if session is not None:
                session._kill(session.dead or f"{name} timed out")
    # Written after anti_cheat.inputs_unchanged ran, or before it ran at all: the caller's weights
    # (this process's, and on CUDA the candidate's process maps the same tensors) and the copy the
    # candidate's process mapped on the host.
    if session is not None and shared is not weights:
        # The caller's tensors were out of the candidate's reach (its process mapped a copy): the
        # copy is what it could write.
        written = fingerprint_diff(_contents(weights_before), _contents(weights_fingerprint(shared)))
        late = sorted(set(early) | set(written))
        reached = bool(early)  # the caller's tensors: damaged only before verification
    else:
        late = sorted(set(early) | set(baseline.changed(weights)))
        reached = bool(late)
    if late:
        restored = sorted(set(early_restored) | (set(baseline.restore(weights)) if shared is weights else set()))
        # What of the caller's weights is still not what it was (no copy to restore from, a tensor
        # added or reshaped): the engine holding them must be discarded, not served or measured.
        left = baseline.changed(weights) if reached else []
        i = next((k for k, r in enumerate(reports) if r.name == "anti_cheat.inputs_unchanged"), None)
        failed = GateReport("anti_cheat.inputs_unchanged", False,
                            {"reason": "the shared weights differ from their contents before the candidate ran",
                             "weights": late[:8], "restored": restored[:8],
                             **({"before_verification": early[:8]} if early else {}),
                             **({"discard_engine": True, "not_restored": left[:8]} if left else {})})
        if i is None:
            reports.append(failed)
        elif reports[i].passed or reports[i].skipped:
            reports[i] = failed
        else:
            reports[i].evidence["restored"] = restored[:8]
            if left:
                reports[i].evidence.update(discard_engine=True, not_restored=left[:8])
    if session is not None:
        isolation = {"process": "the candidate's own (forked from a clean zygote)",
                     "start_s": round(session.start_s, 3), "share_weights_s": round(session.share_s, 3),
                     "forward_calls": session.calls}
        session.close()
    if loaded is not None:
        loaded.unload()
    if opened is not None:
        opened.close()
    if stock is not None:
        stock.unload()
    return GateSuiteReport(candidate=label, digest=digest, seed=seed, gates=reports, tolerance=tolerance,
                           isolation=isolation)


def _isolation_problem(device: torch.device) -> str | None:
    """Why the candidate cannot have a process of its own on ``device`` (None: it can)."""
    return cuda_ipc_problem(device) if device.type == "cuda" else None


def _contents(fingerprint: dict[str, tuple]) -> dict[str, tuple]:
    """A fingerprint without data pointers: the same contents in another mapping compare equal."""
    return {name: entry[1:] for name, entry in fingerprint.items()}
