"""What the hot-swap KV check (engine/forward_pass/kv_handover.py) costs inside the serving pause.

    python hack/kv_check_cost.py [preset] [swaps]   # default: tiny-llama, 10 round trips

Serves a few 100-token prompts, then swaps between the stock pass and good_fused_mlp (same
KV layout, so the check runs every time) and prints the check's and the whole commit's median
time, in float32 and bfloat16, with prefix caching on (cached prefixes) and off (synthetic ones).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.core.llm_engine import LLMEngine
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.forward_pass.bundle import create_bundle
from shapeshift.engine.forward_pass.swap import ForwardPassManager

CANDIDATES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "candidates"


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    tmp = Path(tempfile.mkdtemp(prefix="kv-check-cost-"))
    create_bundle(CANDIDATES / "good_fused_mlp", {}, tmp / "mlp")
    for dtype in ("float32", "bfloat16"):
        for caching in (True, False):
            engine = LLMEngine(EngineConfig(model=preset, dtype=dtype, max_num_seqs=8, max_model_len=512,
                                            max_num_batched_tokens=512, num_kv_blocks=256,
                                            enable_prefix_caching=caching))
            manager = ForwardPassManager(engine)
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, engine.model_config.vocab_size, (100,), generator=gen).tolist()
                       for _ in range(6)]
            engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
            manager.reload(tmp / "mlp")
            manager.rollback()  # warm-up
            checks, swaps, evidence = [], [], {}
            for _ in range(rounds):
                for result in (manager.reload(tmp / "mlp"), manager.rollback()):
                    if result.kv["outcome"] != "kept":
                        raise SystemExit(f"unexpected: {result.kv}")
                    checks.append(result.kv["checkSeconds"])
                    swaps.append(result.timings_s["swap"])
                    evidence = result.kv["evidence"]
            print(f"{preset} {dtype} prefix_caching={caching}: check median {statistics.median(checks) * 1e3:.1f} ms "
                  f"(max {max(checks) * 1e3:.1f}), commit median {statistics.median(swaps) * 1e3:.1f} ms; "
                  f"probes cached={evidence['cached']} synthetic={evidence['synthetic']} "
                  f"prefix tokens={evidence['prefix_tokens']} max logprob diff {evidence['max_logprob_diff']:.2g}")


if __name__ == "__main__":
    main()
