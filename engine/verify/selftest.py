"""A gate that tests itself: a short form of the adversarial corpus, run when a compile worker starts.

Data flow: eight small candidates written here (seven known-bad, each aimed at one gate: one
widening the verifier's tolerance table from inside, which only a candidate in a process of its
own cannot do; one exact only off the main thread, as verification used to call it; one wrong
only on mixed prefill+decode steps; one whose CUDA-graph padding rows write a live block; and
the stock pass with a comment added) --verify_candidate
on the tiny-llama preset, float32 on the host, only the gate each targets--> SelfTestReport(passed,
results, seconds). A worker whose gates let a known-bad candidate through, or reject the good
one, must not publish anything: engine/compile/cli.py asks this before the search and reports
why through the CompileRun's status. The full corpus (tests/fixtures/candidates, tests/verify) runs in CI.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HEAD = '''from shapeshift.engine.forward_pass.importer import import_stock_module

stock = import_stock_module()
CACHE_FORMAT_VERSION = stock.CACHE_FORMAT_VERSION
'''

# name -> (forward.py, the gate that must reject it; None: must pass)
SHORT_CORPUS: dict[str, tuple[str, str | None]] = {
    "reversed_logits": (_HEAD + '''

class Reversed(stock.StockForwardPass):
    def forward(self, input_ids, positions, ctx, kv_cache):
        return super().forward(input_ids, positions, ctx, kv_cache).flip(-1).contiguous()


def build(model_config, weights, recipe):
    return Reversed(model_config, weights, recipe)
''', "outputs.agreement"),
    "tamper_tolerances": ('import torch\nfrom shapeshift.engine.verify import context\n' + _HEAD + '''
for dtype in list(context.TOLERANCES) + [torch.float64]:
    context.TOLERANCES[dtype] = (1e30, 1e30, 1e30)


class Reversed(stock.StockForwardPass):
    def forward(self, input_ids, positions, ctx, kv_cache):
        return super().forward(input_ids, positions, ctx, kv_cache).flip(-1).contiguous()


def build(model_config, weights, recipe):
    return Reversed(model_config, weights, recipe)
''', "outputs.agreement"),
    "weights_swap_keeps_sum": ('import torch\n' + _HEAD + '''

def build(model_config, weights, recipe):
    emb = weights["model.embed_tokens.weight"].data
    with torch.no_grad():
        rows = emb[[3, 4]].clone()
        emb[3], emb[4] = rows[1], rows[0]
    return stock.build(model_config, weights, recipe)
''', "anti_cheat.inputs_unchanged"),
    # class 2: tells measurement from verification by the thread (exact off the main thread, one
    # layer short on it); the candidate's process calls forward on its main thread, as measurement does
    "lazy_off_main_thread": ('import threading\n' + _HEAD + '''

class Lazy(stock.StockForwardPass):
    def forward(self, input_ids, positions, ctx, kv_cache):
        if threading.current_thread() is not threading.main_thread():
            return super().forward(input_ids, positions, ctx, kv_cache)
        full, self.layers = self.layers, self.layers[:-1]
        try:
            return super().forward(input_ids, positions, ctx, kv_cache)
        finally:
            self.layers = full


def build(model_config, weights, recipe):
    return Lazy(model_config, weights, recipe)
''', "outputs.agreement"),
    # class 3: wrong only on a step that mixes decode rows with prefills, which no other gate builds
    "wrong_on_mixed_steps": (_HEAD + '''

class MixedWrong(stock.StockForwardPass):
    def forward(self, input_ids, positions, ctx, kv_cache):
        qsl, lens = ctx.query_start_loc_cpu, ctx.context_lens_cpu
        new = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        logits = super().forward(input_ids, positions, ctx, kv_cache)
        if any(n == 1 and c > 1 for n, c in zip(new, lens)) and any(n > 1 for n in new):
            return logits.flip(-1).contiguous()
        return logits


def build(model_config, weights, recipe):
    return MixedWrong(model_config, weights, recipe)
''', "coverage.mixed_steps"),
    "half_speed_thread_clock": ('import time\n' + _HEAD + '''
_real = time.thread_time
time.thread_time = lambda: _real() * 0.5


def build(model_config, weights, recipe):
    return stock.build(model_config, weights, recipe)
''', "anti_cheat.no_patching"),
    "padded_rows_on_live_cache": ('import dataclasses\n' + _HEAD + '''

class WrappedSlots(stock.StockForwardPass):
    def forward(self, input_ids, positions, ctx, kv_cache):
        slots = ctx.slot_mapping % (kv_cache.num_blocks * kv_cache.block_size)
        return super().forward(input_ids, positions, dataclasses.replace(ctx, slot_mapping=slots), kv_cache)


def build(model_config, weights, recipe):
    return WrappedSlots(model_config, weights, recipe)
''', "coverage.padded_batches"),
    "stock_with_a_comment": (_HEAD + '''
# the stock pass, one comment longer: must pass


def build(model_config, weights, recipe):
    return stock.build(model_config, weights, recipe)
''', None),
}


@dataclass
class SelfTestReport:
    passed: bool
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0  # verifying the corpus
    startup_s: float = 0.0  # starting the process candidates are forked from (once per worker)

    @property
    def failures(self) -> list[str]:
        return [r["problem"] for r in self.results if r.get("problem")]

    def message(self) -> str:
        if self.passed:
            return (f"verification self-test passed ({len(self.results)} candidates, {self.seconds:.1f} s; "
                    f"candidate processes ready in {self.startup_s:.1f} s)")
        return "verification self-test failed, nothing will be published: " + "; ".join(self.failures)


def run_self_test(corpus: dict[str, tuple[str, str | None]] | None = None) -> SelfTestReport:
    """Verify ``corpus`` (default SHORT_CORPUS) on the tiny-llama preset; each bad one must fail its gate, the good one pass."""
    import torch

    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.models.loader import random_weights
    from shapeshift.engine.models.presets import PRESETS
    from shapeshift.engine.forward_pass import patch_guard
    from shapeshift.engine.verify.anticheat import HARNESS_MODULES
    from shapeshift.engine.verify.context import GateSettings
    from shapeshift.engine.verify.gates import verify_candidate

    from shapeshift.engine.verify.isolated import prewarm

    patch_guard.capture_harness(HARNESS_MODULES)  # the verifier as it is before any candidate ran here
    t0 = time.perf_counter()
    prewarm()  # the zygote every candidate's process is forked from: started once, kept warm
    startup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    preset = PRESETS["tiny-llama"]
    cfg = ModelConfig.from_hf(preset.hf_config)
    weights = random_weights(cfg, seed=preset.weight_seed, dtype=torch.float32, device="cpu")
    settings = GateSettings(gate_timeout_s=30.0, build_timeout_s=30.0, steps=8, max_model_len=160)
    results = []
    with tempfile.TemporaryDirectory(prefix="shapeshift-selftest-") as tmp:
        for name, (source, gate) in list((corpus or SHORT_CORPUS).items()):
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "forward.py").write_text(source)
            only = (gate,) if gate else ("outputs.agreement", "anti_cheat.inputs_unchanged", "anti_cheat.no_patching")
            try:
                report = verify_candidate(folder, cfg, weights, settings=settings, only=only)
            except Exception as exc:  # noqa: BLE001 - a verifier that crashes fails its self-test
                results.append({"candidate": name, "gate": gate, "problem": f"{name}: the verifier raised "
                                f"{type(exc).__name__}: {exc}"})
                continue
            finally:
                patch_guard.put_back()  # a candidate run here (no process of its own) changes nothing after it
            entry: dict[str, Any] = {"candidate": name, "gate": gate, "passed": report.passed}
            if gate is None and not report.passed:
                entry["problem"] = f"{name} (a correct pass) was rejected by {', '.join(report.failed)}"
            elif gate is not None and report.gate(gate).passed:
                entry["problem"] = f"{name} was not rejected by {gate}"
            elif gate is not None:
                entry["reason"] = report.gate(gate).evidence.get("reason")
            results.append(entry)
    return SelfTestReport(passed=not any(r.get("problem") for r in results), results=results,
                          seconds=time.perf_counter() - t0, startup_s=startup_s)
