"""The embedded default, run again and again: `hack/compile.sh` with no flags, N times in a row.

    hack/bench_compile_repeat.py [--runs 10] [--results bench/results] [-- extra compile flags]

Each run gets a fresh working folder (its own shapeshift-compile-out and champion registry, so no
run seeds or resumes another) and is timed from outside. Per run it keeps what the run's
report.json says: the champion (or none), its speedup over the shipped serving default with the
closing comparison's 95% bounds, the agent that found it, trials, confirmations, verifications,
why it stopped. Writes bench/results/compile-repeat-<model>-<hardware>-<UTC stamp>.json with the
commit, the hardware and the command, and prints a table and the count of runs that ended with a
verified champion whose lower bound is above 1.0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmeta import REPO_ROOT, claim_result_name, git_commit, result_name  # noqa: E402


def one_run(index: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"compile-repeat-{index}-") as folder:
        started = time.monotonic()
        proc = subprocess.run(["bash", str(REPO_ROOT / "hack" / "compile.sh"), *extra], cwd=folder,
                              capture_output=True, text=True)
        wall = time.monotonic() - started
        report_path = Path(folder) / "shapeshift-compile-out" / "report.json"
        if proc.returncode != 0 or not report_path.exists():
            return {"run": index, "wall_s": round(wall), "rc": proc.returncode, "champion": None,
                    "error": (proc.stderr or proc.stdout)[-2000:]}
        report = json.loads(report_path.read_text())
        return {"run": index, "wall_s": round(wall), "rc": 0, "champion": report.get("champion"),
                "speedup": report.get("speedup"), "speedup_bounds": report.get("speedup_bounds"),
                "agent": report.get("champion_agent"), "champion_note": report.get("champion_note"),
                "champion_recipe": report.get("champion_recipe"), "trials": report.get("trials"),
                "confirms": report.get("confirms"), "verifications": report.get("verifications"),
                "stop_reason": report.get("stop_reason"), "baseline": report.get("baseline_name"),
                "vs_plain": report.get("vs_plain"), "serving_default": report.get("serving_default"),
                "model": report.get("model"), "profile": report.get("profile"), "device": report.get("device")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hack/bench_compile_repeat.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--machine", default="", help="what else ran on the machine, recorded as given")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    commit, dirty = git_commit(REPO_ROOT)
    started = dt.datetime.now(dt.timezone.utc)
    runs = []
    for i in range(1, args.runs + 1):
        run = one_run(i, extra)
        runs.append(run)
        bounds = run.get("speedup_bounds") or [None, None]
        print(f"run {i}: {run['wall_s']} s, champion {str(run['champion'])[:12]}, speedup {run.get('speedup')}, "
              f"bounds {bounds}, by {run.get('agent')}, stop: {run.get('stop_reason')}", flush=True)
    won = [r for r in runs if r["champion"] and r.get("speedup_bounds") and r["speedup_bounds"][0] > 1.0]
    speedups = [r["speedup"] for r in won]
    first = next((r for r in runs if r.get("model")), {})
    hardware = first.get("device") or "cpu"
    summary = {"runs": len(runs), "with_verified_champion": len([r for r in runs if r["champion"]]),
               "lower_bound_above_1": len(won),
               "speedup_min": min(speedups) if speedups else None,
               "speedup_median": statistics.median(speedups) if speedups else None,
               "speedup_max": max(speedups) if speedups else None,
               "wall_s_min": min(r["wall_s"] for r in runs), "wall_s_max": max(r["wall_s"] for r in runs)}
    name = claim_result_name(args.results, result_name("compile-repeat", first.get("model") or "tiny-llama",
                                                       hardware, started))
    data = {"benchmark": "compile-repeat", "model": first.get("model"), "hardware": hardware,
            "host": platform.node(), "git_commit": commit, "git_dirty": dirty,
            "command": " ".join(["hack/compile.sh", *extra]) + f" ({args.runs} runs in a row, each in a fresh "
                       "working folder with its own shapeshift-compile-out and registry; hack/bench_compile_repeat.py)",
            "machine": args.machine, "profile": first.get("profile"), "device": first.get("device"),
            "serving_default": first.get("serving_default"), "started": started.isoformat(),
            "summary": summary, "runs": runs}
    path = args.results / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"{summary['lower_bound_above_1']} of {len(runs)} runs ended with a verified champion whose 95% lower "
          f"bound is above 1.0 (against {first.get('baseline')}); saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
