"""Promotion check: the verification a confirmed winner must pass before it becomes the incumbent.

Data flow: the full-tier engine (weights, model config, dtype, device, block size) + the
candidate bundle --shapeshift.engine.verify.verify_candidate--> the engine's gate suite
(smoke, outputs.finite, outputs.agreement, KV contamination, coverage, anti-cheat), each on
fresh random prompts against the stock pass built over the same weights
--> Verification(passed, gates={name: passed}, report={the suite's report}).

The compile loop owns no checks of its own: one suite decides, for the loop, the admin API
and the tests alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shapeshift.engine.compile.measure import Verification


def verify_for_promotion(engine: Any, candidate_path: Path, prompts: int = 4, steps: int = 16) -> Verification:
    from shapeshift.engine.verify import GateSettings, verify_candidate

    settings = GateSettings(num_prompts=prompts, steps=steps, block_size=engine.kv_cache.block_size)
    report = verify_candidate(candidate_path, engine.model_config, engine.weights, dtype=engine.dtype,
                              device=engine.device, settings=settings)
    gates = {g.name: bool(g.passed) for g in report.gates}
    return Verification(passed=bool(report.passed) and bool(gates), gates=gates, report=report.to_dict())
