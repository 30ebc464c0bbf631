"""The regime matrix: compile a champion per traffic regime, then measure every champion and the
shipped serving default on every regime's replay, paired, with 95% bounds.

    hack/bench_regimes.py [--model tiny-llama] [--regimes chat,agentic-long-context,burst]
                          [--budget 4m] [--pairs 6] [--device cpu|cuda]

Per regime it runs the compile loop (engine/compile/cli.py `run`, registry off so no regime seeds
another), each against the shipped serving default (what `shapeshift serve` runs for that model and
device). Then one evaluator, its engines loaded once, replays each regime's traffic with the default
and every distinct champion in alternation (engine/compile/regime_matrix.py), and names the best
static configuration: the one with the highest geometric-mean goodput over all regimes.

Writes bench/results/regimes-<model>-<hardware>-<UTC stamp>.json (benchmark "regime-matrix"; fields:
default, regimes, champions, matrix, best_static, vs_best_static, head_to_head, goodput, the
compile runs' economics) and a heatmap PNG beside it, and each regime's compile run as
bench/results/compile-<model>-<hardware>-<its start stamp>/ (report.md, report.json, board.jsonl).
Prints the tables last. `--work DIR` keeps the compile runs' work folders; an existing run's
report there is reused with `--reuse` (a matrix re-measured without compiling again).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmeta import REPO_ROOT, claim_result_name, git_commit, hardware_slug, result_name  # noqa: E402

from shapeshift.engine.compile.cli import parse_duration  # noqa: E402
from shapeshift.engine.compile.job import CompileJob, JobRequest  # noqa: E402
from shapeshift.engine.contracts.traffic_profile import load_profile  # noqa: E402

log = logging.getLogger("shapeshift.bench_regimes")
DEFAULT_REGIMES = ("chat", "agentic-long-context", "burst")
KEPT_FILES = ("report.md", "report.json", "board.jsonl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hack/bench_regimes.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--regimes", default=",".join(DEFAULT_REGIMES),
                   help="comma list of built-in profiles or YAML files (default: %(default)s)")
    p.add_argument("--budget", type=parse_duration, default=None,
                   help="each regime's compile wall-clock limit (15m, 1h); default: --budget-trials alone")
    p.add_argument("--total-budget", type=parse_duration, default=None,
                   help="wall-clock limit of all the compile runs together: each regime gets an equal share of "
                        "what is left (less --overhead-s for its engine start and closing comparisons), "
                        "capped by --budget")
    p.add_argument("--overhead-s", type=float, default=60.0,
                   help="seconds kept per regime for what its budget does not count (default: %(default)s)")
    p.add_argument("--compile-only", action="store_true",
                   help="stop after the compile runs (a later --reuse run measures the matrix)")
    p.add_argument("--budget-trials", type=int, default=None, help="each regime's screened candidates (default: 12)")
    p.add_argument("--pairs", type=int, default=6, help="paired repeats of every matrix cell (at least 5)")
    p.add_argument("--matrix-requests", type=int, default=None,
                   help="requests per matrix replay (default: the compile's full-tier count)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--confirm-repeats", type=int, default=None)
    p.add_argument("--confirm-requests", type=int, default=None)
    p.add_argument("--screen-requests", type=int, default=None)
    p.add_argument("--final-repeats", type=int, default=None)
    p.add_argument("--fast-layers", type=int, default=None,
                   help="layers of the fast tier's model (default: a quarter of the model's). With an SLO that "
                        "binds, give the model's own count: a shallower proxy streams each user faster than the "
                        "full model does, so it would rank batch widths against the wrong promise")
    p.add_argument("--slo-ttft-p90", type=float, default=None)
    p.add_argument("--slo-per-user-p90", type=float, default=None)
    p.add_argument("--agents", default=None, help="comma list (default: the compile loop's)")
    p.add_argument("--no-recipe-seeds", action="store_true",
                   help="do not measure the engine's named recipes first (where the shipped default is already "
                        "the fastest of them, they spend the budget on screens that cannot win)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="work folder of the compile runs (default: a fresh temporary one)")
    p.add_argument("--reuse", action="store_true", help="reuse a regime's finished compile run found in --work")
    p.add_argument("--results", default=str(REPO_ROOT / "bench" / "results"), help="where results are written")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def job_for(args: argparse.Namespace, regime: str, work: Path, argv: list[str],
            budget_s: float | None = None) -> CompileJob:
    agents = tuple(a.strip() for a in args.agents.split(",") if a.strip()) if args.agents else None
    return CompileJob.from_request(JobRequest(
        model=args.model, profile=load_profile(regime), budget_trials=args.budget_trials,
        budget_seconds=budget_s if budget_s is not None else args.budget, agents=agents, out=str(work / Path(regime).stem), device=args.device,
        dtype=args.dtype, max_model_len=args.max_model_len, confirm_repeats=args.confirm_repeats,
        confirm_requests=args.confirm_requests, screen_requests=args.screen_requests,
        final_repeats=args.final_repeats, fast_layers=args.fast_layers, slo_ttft_p90_s=args.slo_ttft_p90,
        slo_per_user_tokens_per_s_p90=args.slo_per_user_p90, seed=args.seed, use_registry=False,
        recipe_seeds=not args.no_recipe_seeds, command=("python", "hack/bench_regimes.py", *argv, f"# regime {regime}")))


def heatmap(summary: dict[str, Any], regimes: list[str], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = list(summary["matrix"])
    grid = [[summary["matrix"][k][t]["speedup"] or 0.0 for t in regimes] for k in labels]
    fig, ax = plt.subplots(figsize=(1.9 * len(regimes) + 2.5, 0.8 * len(labels) + 1.8))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=min(0.8, min(map(min, grid))), vmax=max(1.2, max(map(max, grid))))
    for i, k in enumerate(labels):
        for j, t in enumerate(regimes):
            cell = summary["matrix"][k][t]
            text = "failed" if cell["speedup"] is None else \
                f"{cell['speedup']:.2f}x\n[{cell['low'] or 0:.2f}, {cell['high'] or float('inf'):.2f}]"
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(regimes)), [f"{t} traffic" for t in regimes], rotation=15)
    ax.set_yticks(range(len(labels)),
                  [("shipped default" if k == "default" else f"{k} champion") +
                   (" (best static)" if k == summary["best_static"] else "") for k in labels])
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="goodput / shipped default")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _rates(per_hour: Any) -> str:
    if isinstance(per_hour, dict):
        return ", ".join(f"{tier} tier {v:.0f}/h" for tier, v in per_hour.items() if v)
    return f"{per_hour}/h"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.pairs < 5:
        raise SystemExit("hack/bench_regimes.py: --pairs must be at least 5 (bounds from fewer pairs mean little)")
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    names = [Path(r).stem for r in regimes]
    if len(set(names)) != len(names) or len(names) < (1 if args.compile_only else 2):
        raise SystemExit("hack/bench_regimes.py: name at least two distinct regimes (one with --compile-only)")
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="shapeshift-regimes-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()

    from shapeshift.engine.compile import cli as compile_cli

    starts: dict[str, dt.datetime] = {}
    for regime, name in zip(regimes, names):
        run_dir = work / name
        if args.reuse and (run_dir / "report.json").is_file():
            log.info("regime %s: reusing the compile run in %s", name, run_dir)
            starts[name] = dt.datetime.fromtimestamp((run_dir / "report.json").stat().st_mtime, dt.timezone.utc)
            continue
        starts[name] = dt.datetime.now(dt.timezone.utc)
        budget_s = args.budget
        if args.total_budget is not None:
            left = names[names.index(name):]
            todo = [n for n in left if not (args.reuse and (work / n / "report.json").is_file())]
            share = (args.total_budget - (time.perf_counter() - t0)) / max(1, len(todo)) - args.overhead_s
            budget_s = max(30.0, min(share, budget_s or share))
        log.info("regime %s: compiling (%s, budget %s)", name, run_dir,
                 f"{budget_s:.0f} s" if budget_s else f"{args.budget_trials or 12} trials")
        rc = compile_cli.run(job_for(args, regime, work, argv, budget_s))
        if rc != 0:
            raise SystemExit(f"hack/bench_regimes.py: the compile run of regime {name} exited {rc}")
    compile_s = time.perf_counter() - t0
    if args.compile_only:
        print(f"compiled {len(names)} regime(s) in {compile_s:.0f} s into {work}; measure the matrix with "
              f"--reuse --work {work}")
        return 0

    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.compile import regime_matrix as rm

    # The matrix's evaluator: the first regime's job (same model, device, tiers and SLO as every run).
    matrix_job = job_for(args, regimes[0], work / "matrix", argv)
    evaluator, serving = compile_cli.build_evaluator(matrix_job)
    space = evaluator.space()
    default = Candidate(space.default(), None, "baseline", serving.describe())
    champions = [rm.champion_of(name, work / name, evaluator.stock_source) for name in names]
    configs = rm.configurations(default, champions)
    profiles = {name: load_profile(regime) for regime, name in zip(regimes, names)}
    log.info("matrix: %d configuration(s) (%s) on %d regime(s), %d pairs each", len(configs),
             ", ".join(configs), len(profiles), args.pairs)

    def progress(traffic: str, row: dict) -> None:
        log.info("matrix: %s traffic measured: %s", traffic,
                 ", ".join(f"{k} {m.mean:.1f}" + ("" if m.ok else f" (failed: {m.error})") for k, m in row.items()))

    t1 = time.perf_counter()
    measured = rm.measure_matrix(evaluator, profiles, configs, args.pairs, args.matrix_requests, progress)
    matrix_s = time.perf_counter() - t1
    summary = rm.summarize(measured, champions, configs)

    hardware_name = evaluator.hardware()
    hardware = hardware_slug("cpu" if hardware_name == "cpu" else hardware_name)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    base = claim_result_name(results, result_name("regimes", args.model, hardware, started))
    compile_runs = {}
    for name in names:
        base_folder = result_name("compile", args.model, hardware, starts[name])
        folder = results / base_folder
        copy = 2
        while folder.name in compile_runs.values() or folder.exists():  # runs started in the same second
            folder, copy = results / f"{base_folder}-{copy}", copy + 1
        folder.mkdir(parents=True)
        for f in KEPT_FILES:
            if (work / name / f).is_file():
                shutil.copy2(work / name / f, folder / f)
        compile_runs[name] = folder.name
    commit, dirty = git_commit()
    payload = {
        "benchmark": "regime-matrix", "hardware": hardware, "device_name": hardware_name,
        "host": platform.node(), "model": args.model, "git_commit": commit, "git_dirty": dirty,
        "command": "python hack/bench_regimes.py " + " ".join(argv), "started": started.isoformat(),
        "objective": evaluator.describe()["objective"], "slo": evaluator.describe()["slo"],
        "timer": evaluator.timer(), "pairs": args.pairs,
        "matrix_requests": args.matrix_requests or evaluator.settings.confirm_requests,
        "default": serving.to_dict(), "default_described": serving.describe(), "regimes": names,
        "profiles": {n: p.to_dict() for n, p in profiles.items()},
        "champions": {c.regime: c.to_dict() for c in champions},
        "configurations": {k: {"digest": c.digest, "recipe": dict(c.recipe)} for k, c in configs.items()},
        **summary, "compile_runs": compile_runs,
        "seconds": {"compile": round(compile_s, 1), "matrix": round(matrix_s, 1),
                    "total": round(time.perf_counter() - t0, 1)},
    }
    json_path = results / f"{base}.json"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    png = results / f"{base}.png"
    heatmap(summary, names, png, f"{args.model} on {hardware}: goodput vs the shipped serving default "
                                 f"({args.pairs} pairs per cell)")
    evaluator.close()

    print(f"\nregime matrix ({args.model}, {hardware}; speedup vs the shipped serving default, paired, 95% bounds)")
    print(f"{'configuration':<28}" + "".join(f"{n + ' traffic':>32}" for n in names))
    for label, row in summary["matrix"].items():
        name = "shipped default" if label == "default" else f"{label} champion"
        cells = "".join(f"{'failed':>32}" if row[n]["speedup"] is None else
                        f"{row[n]['speedup']:>12.3f} [{row[n]['low'] or 0:.3f}, {row[n]['high'] or 0:.3f}]{'':>3}"
                        for n in names)
        print(f"{name:<28}{cells}")
    print(f"best static configuration: {summary['best_static']} (geometric-mean goodput ratio "
          f"{summary['geomean_vs_default'][summary['best_static']]:.3f} over the regimes)")
    for regime, cell in summary["vs_best_static"].items():
        low, high = cell["low"], cell["high"]
        print(f"  {regime}: serves {cell['serves']}; vs best static {cell['speedup']} "
              f"[{low}, {high}] over {cell['pairs']} pairs")
    for c in champions:
        comp = c.compile
        print(f"  {c.regime} compile: champion {c.digest[:12] if c.digest else 'none'}; "
              f"{comp.get('trials')} trials in {comp.get('elapsed_s')} s ({_rates(comp.get('trials_per_hour'))}), "
              f"{comp.get('confirms')} confirmations ({comp.get('confirms_per_hour')}/h)")
    print(f"saved {json_path}" + (f" and {png.name}" if png.exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
