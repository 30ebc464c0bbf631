#!/usr/bin/env python3
"""The compile loop's outputs.agreement gate on one recipe, over several seeds: does a candidate
that rounds like the stock pass get through, and with what bounds?

Data flow: a preset's seeded weights in the model's dtype -> the recipe written once as a bundle over
the stock forward pass (engine/bundle.create_bundle) -> verify_candidate(..., only=
("outputs.agreement",)) per seed (fresh prompts each; the float32 calibration is measured once
and reused) -> per seed: passed, the bounds in force (logprob atol, logit rtol, near-tie margin)
and the evidence (flips, forgiven near-ties, largest differences) -> stdout and
bench/results/agreement-gate-<model>-<gpu>-<utc>.json (commit, GPU, command).

    python3 hack/probe_agreement_gate.py --recipe fast+fuse_rotary_into_attention=true --seeds 1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from shapeshift.engine.forward_pass.bundle import create_bundle, stock_bundle_dir
from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.models.loader import load_model
from shapeshift.engine.verify import GateSettings, verify_candidate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import recipe_with_overrides  # noqa: E402  (sibling: name[+knob=value] specs)
from benchmeta import REPO_ROOT, claim_result_name, git_commit, hardware_slug, result_name  # noqa: E402

EVIDENCE = ("flips", "forgiven_near_ties", "tokens", "max_abs_logit_diff", "max_rel_logit_diff", "max_logprob_diff",
            "tie_margin")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--recipe", default="fast+fuse_rotary_into_attention=true")
    p.add_argument("--seeds", default="1,2,3,4")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_model(EngineConfig(model=args.model, device=device, dtype=args.dtype, max_model_len=512))
    dtype = next(iter(loaded.weights.values())).dtype
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "candidate"
        create_bundle(stock_bundle_dir(), recipe_with_overrides(args.recipe), bundle)
        for seed in (int(s) for s in args.seeds.split(",")):
            t0 = time.perf_counter()
            report = verify_candidate(bundle, loaded.model_config, loaded.weights, dtype=dtype, device=device,
                                      settings=GateSettings(seed=seed), only=("outputs.agreement",))
            evidence = report.gate("outputs.agreement").evidence
            row = {"seed": seed, "passed": report.passed, "seconds": round(time.perf_counter() - t0, 1),
                   "tolerance": report.tolerance, "agreement": {k: evidence.get(k) for k in EVIDENCE}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    out = Path(args.out_dir)
    name = claim_result_name(out, result_name("agreement-gate", args.model, hardware_slug(gpu)))
    doc = {"benchmark": "agreement-gate", "git_commit": git_commit(), "gpu": gpu, "torch": torch.__version__,
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "model": args.model, "recipe": args.recipe, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"saved {out / f'{name}.json'}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
