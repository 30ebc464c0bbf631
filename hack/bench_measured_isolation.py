"""What measuring each candidate in a process of its own costs and changes: the compile loop's
full-tier replays, in the compile worker's process (hot reload into the tier engine) and in the
candidate's own process (engine/verify/measured_engine.py), alternated round by round.

    hack/bench_measured_isolation.py [--model tiny-llama] [--device cpu] [--profile chat]
                                     [--rounds 6] [--requests 24] [--results bench/results]

Each round measures the shipped serving default and two candidates together (ABBA, one repeat:
EngineEvaluator.measure_together) in each mode, the modes' order swapped every round. Per mode it
keeps each candidate's paired speedup over the default (mean and 95% bounds over the rounds),
the default's goodput and its spread, the wall time of a round, and the time spent making a
candidate ready (in-process: the hot reload; isolated: the measuring process's start, fork to
candidate built and smoke-checked). Writes bench/results/measured-isolation-<model>-<hardware>-
<UTC stamp>.json with the commit, the hardware and the command, and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmeta import REPO_ROOT, claim_result_name, git_commit, result_name  # noqa: E402

from shapeshift.engine.compile.candidate import Candidate  # noqa: E402
from shapeshift.engine.compile.evaluator import FULL, EngineEvaluator, EvaluatorSettings  # noqa: E402
from shapeshift.engine.compile.measure import paired_gain  # noqa: E402
from shapeshift.engine.contracts.traffic_profile import builtin_profile  # noqa: E402

MODES = {"in-process": False, "isolated": True}


def timed_activations(ev: EngineEvaluator, spent: list[float]) -> None:
    original = ev._activate

    def activate(tier, cand):
        t0 = time.perf_counter()
        try:
            return original(tier, cand)
        finally:
            spent.append(time.perf_counter() - t0)

    ev._activate = activate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hack/bench_measured_isolation.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", default="chat")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--machine", default="", help="what else ran on the machine, recorded as given")
    args = p.parse_args(argv)
    commit, dirty = git_commit(REPO_ROOT)
    started = dt.datetime.now(dt.timezone.utc)
    cpu = args.device == "cpu"
    evs, activations = {}, {}
    for mode, isolate in MODES.items():
        evs[mode] = EngineEvaluator(builtin_profile(args.profile), EvaluatorSettings(
            model=args.model, device=args.device, max_model_len=args.max_model_len, confirm_requests=args.requests,
            cpu_threads=1 if cpu else None, isolate_measurement=isolate,
            work_dir=tempfile.mkdtemp(prefix=f"measured-isolation-{mode}-")))
        activations[mode] = []
        timed_activations(evs[mode], activations[mode])
    space = evs["isolated"].space()
    default = space.default()
    seqs = sorted(space.knob("engine.max_num_seqs").values)
    cands = {"default": Candidate(default, None, "bench", "the shipped serving default"),
             "index_select_gather": Candidate({**default, "edit.index_select_gather": True}, None, "bench", "gather"),
             f"max_num_seqs={seqs[0]}": Candidate({**default, "engine.max_num_seqs": seqs[0]}, None, "bench", "narrow")}
    names = list(cands)
    totals: dict[str, dict[str, object]] = {m: {} for m in MODES}
    rounds: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            t0 = time.perf_counter()
            ms = evs[mode].measure_together([cands[n] for n in names], repeats=1)
            rounds[mode].append(time.perf_counter() - t0)
            for n, m in zip(names, ms):
                totals[mode][n] = m if n not in totals[mode] else totals[mode][n].extended(m)
            print(f"round {r + 1} {mode}: {rounds[mode][-1]:.1f} s, " + ", ".join(
                f"{n} {m.samples[-1]:.0f}" if m.samples else f"{n} failed ({m.error})" for n, m in zip(names, ms)),
                flush=True)
    out: dict[str, dict] = {}
    for mode in MODES:
        base = totals[mode]["default"]
        row = {"default_goodput_mean": statistics.fmean(base.samples), "default_goodput_cv": base.cv,
               "round_wall_s": rounds[mode], "round_wall_s_median": statistics.median(rounds[mode]),
               "activation_s": activations[mode],
               "candidates": {}}
        for n in names[1:]:
            m = totals[mode][n]
            errors = m.error
            if m.ok and base.ok:
                gain, low, high = paired_gain(m, base)
                row["candidates"][n] = {"speedup": gain, "low": low, "high": high, "pairs": len(m.samples)}
            else:
                row["candidates"][n] = {"error": errors}
        if mode == "isolated":
            starts = evs[mode]._processes.starts
            row["process_start_s"] = starts
            row["process_start_s_median_after_first"] = statistics.median(starts[1:]) if len(starts) > 1 else None
        out[mode] = row
    hardware = "cpu" if cpu else evs["isolated"].hardware()
    name = claim_result_name(args.results, result_name("measured-isolation", args.model, hardware, started))
    data = {"benchmark": "measured-isolation", "model": args.model, "hardware": hardware, "host": platform.node(),
            "git_commit": commit, "git_dirty": dirty,
            "command": "python3 hack/bench_measured_isolation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": args.machine, "profile": args.profile, "rounds": args.rounds, "requests": args.requests,
            "timer": evs["isolated"].timer(), "measurement": {m: evs[m].describe()["measurement"] for m in MODES},
            "started": started.isoformat(), "modes": out}
    for ev in evs.values():
        ev.close()
    path = args.results / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"{'mode':<11} {'default tok/s':>13} {'cv':>6} {'round s':>8}  " + "  ".join(f"{n:>28}" for n in names[1:]))
    for mode, row in out.items():
        cells = []
        for n in names[1:]:
            c = row["candidates"][n]
            cells.append(f"{c['speedup']:.3f} [{c['low']:.3f}, {c['high']:.3f}]" if "speedup" in c else "failed")
        print(f"{mode:<11} {row['default_goodput_mean']:>13.0f} {row['default_goodput_cv']:>6.3f} "
              f"{row['round_wall_s_median']:>8.1f}  " + "  ".join(f"{c:>28}" for c in cells))
    print(f"activation (s): in-process median {statistics.median(out['in-process']['activation_s']):.3f}, "
          f"isolated median {statistics.median(out['isolated']['activation_s']):.3f}; measuring-process start "
          f"median {out['isolated']['process_start_s_median_after_first']}; saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
