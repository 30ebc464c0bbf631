"""`shapeshift compile`: search for a faster forward pass, verify it, publish it.

Data flow:
    flags (request_from_flags; with --compile-run ns/name completed from the CompileRun, worker.py)
      -> CompileJob (job.py: every default) -> EvaluatorSettings + Budget + agents
      -> champion registry: nearest champions seed the run
      -> CompileLoop over the real EngineEvaluator (fast tier, full tier, gates)
      -> OUT/board.jsonl (every trial, resumable), OUT/champion/ (verified bundle),
         OUT/report.json + OUT/report.md (report.py), registry entry (local folder or ForwardPass object)
      -> with --compile-run: progress and results patched into the CompileRun's status

With no flags it runs the embedded default: tiny-llama, the chat profile, 12 trials, the
three offline agents, on this machine's CPU or GPU. Running again with the same --out
resumes from the board.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from typing import Any, Sequence

from shapeshift.engine.compile.job import DEFAULT_AGENTS, CompileJob, JobRequest
from shapeshift.engine.contracts.compile_pod_env import ARTIFACT_DIR

log = logging.getLogger("shapeshift.compile")



def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '1h', '1h30m' -> seconds."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"duration {text!r} is not like 90s, 15m, 1h or 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shapeshift compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="preset name or model folder (default: tiny-llama)")
    p.add_argument("--profile", default=None,
                   help="traffic profile: chat, agentic-long-context, burst or a YAML file (default: chat)")
    p.add_argument("--budget-trials", type=int, default=None, help="candidates to screen (default: 12 unless --budget)")
    p.add_argument("--budget-seconds", type=float, default=None, help="wall-clock limit in seconds")
    p.add_argument("--budget", type=parse_duration, default=None, help="wall-clock limit as a duration (15m, 1h)")
    p.add_argument("--agents", default=None, help=f"comma list of sweep, evolve, bayes, llm (default: {','.join(DEFAULT_AGENTS)})")
    p.add_argument("--out", default=None, help="output folder; an existing board there is resumed "
                                               "(default: shapeshift-compile-out)")
    p.add_argument("--min-speedup", type=float, default=None,
                   help="least speedup over the incumbent, beyond the noise, to accept (default: 1.0)")
    p.add_argument("--slo-ttft-p90", type=float, default=None, metavar="SECONDS",
                   help="SLO: 90%% of requests get their first token within this (default: 1.0; the objective is "
                        "goodput, the output tokens/s of requests that meet the SLO: engine/replay/slo.py)")
    p.add_argument("--slo-per-user-p90", type=float, default=None, metavar="TOKENS_PER_S",
                   help="SLO: 90%% of requests stream at least this many tokens/s each (default: 10)")
    p.add_argument("--registry", default=None, help="champion registry folder (default: OUT/../shapeshift-registry)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    p.add_argument("--max-model-len", type=int, default=None, help="context of the measuring engines (default: 1024 on CPU, 8192 on GPU)")
    p.add_argument("--fast-layers", type=int, default=None, help="layers of the fast tier (default: a quarter)")
    p.add_argument("--screen-repeats", type=int, default=3)
    p.add_argument("--confirm-repeats", type=int, default=None, help="paired full-tier replays (default: 8 on CPU, 3 on GPU)")
    p.add_argument("--final-repeats", type=int, default=None,
                   help="pairs in the closing champion-vs-stock comparison (default: max(confirm repeats, 5))")
    p.add_argument("--screen-requests", type=int, default=None)
    p.add_argument("--confirm-requests", type=int, default=None)
    p.add_argument("--verify-prompts", type=int, default=None, help="fresh prompts per verification gate (default: 4)")
    p.add_argument("--verify-steps", type=int, default=None, help="greedy decode steps compared per prompt (default: 16)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads when measuring on the CPU (default: 1, timed in thread CPU time)")
    p.add_argument("--timer", default=None, choices=("wall", "process", "thread"),
                   help="clock of measurements (default: wall on GPUs, thread CPU time on the CPU)")
    p.add_argument("--deterministic", action="store_true", help="drive the agents round-robin (reproducible order)")
    p.add_argument("--llm-url", default=None, help="OpenAI-compatible base URL for the llm agent (e.g. http://host:8000/v1)")
    p.add_argument("--llm-model", default=None, help="model name for the llm agent")
    p.add_argument("--llm-key-file", default=None, help="file holding the API key (e.g. a mounted Secret)")
    p.add_argument("--compile-run", default=None, help="NAMESPACE/NAME of a CompileRun to read and report to")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig for --compile-run (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--artifact-dir", default=None,
                   help="with --compile-run: folder on a volume the engine pods also mount, where the champion "
                        f"archive is stored as <sha256>.tar.gz (default: ${ARTIFACT_DIR}; without one the "
                        "archive stays in the work folder, and the ForwardPass says it is not durable)")
    p.add_argument("--no-registry", action="store_true", help="neither seed from nor publish to the registry")
    p.add_argument("--no-recipe-seeds", action="store_true",
                   help="do not measure the engine's named recipes (engine/forward_pass/recipes.py) first")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _git_commit() -> str | None:
    """The commit of the source tree this runs from (reports name it), None where unknown."""
    from shapeshift.engine.provenance import git_commit

    commit, _ = git_commit()
    return None if commit == "unknown" else commit


def recipe_seeds(space: Any) -> list:
    """The engine's named recipes (engine/forward_pass/recipes.py: fused projections, the Triton kernels, the
    GEMV) as first candidates, each projected into ``space`` (knobs it lacks, such as Triton
    backends on the CPU, keep their defaults); duplicates and the all-default point dropped.
    They are hand-made starting points; the agents search around whichever wins."""
    from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.compile.champions import project_recipe

    default = space.default()
    out: dict[str, Candidate] = {}  # digest -> the first recipe that projects to it
    for name, knobs in NAMED_RECIPES.items():
        recipe = project_recipe(knobs, space)
        cand = Candidate(recipe, None, "recipes", f'named recipe "{name}" (engine/forward_pass/recipes.py)', None)
        if recipe != default:
            out.setdefault(cand.digest, cand)
    return list(out.values())


def plain_pass(space: Any, evaluator: Any, serving: Any) -> Any:
    """The plain-PyTorch pass (the stock recipe.yaml, no named recipe over it) at the serving
    default's engine settings: the second figure a champion is quoted against. None where the
    serving default is that pass already (the CPU)."""
    if serving.is_plain:
        return None
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.forward_pass.bundle import load_recipe

    stock = load_recipe(evaluator.stock_dir)
    recipe = space.default()
    for name in serving.recipe:
        if name in recipe:
            recipe[name] = stock.get(name, space.knob(name).values[0])
    if not space.is_valid(recipe):
        return None
    return Candidate(recipe, None, "plain", "the plain-PyTorch pass (recipe torch) at the serving engine settings")


def _resolve_profile(text: str):
    from shapeshift.engine.contracts.traffic_profile import load_profile

    try:
        return load_profile(text)
    except (KeyError, FileNotFoundError) as exc:
        raise SystemExit(f"shapeshift compile: {exc.args[0] if exc.args else exc}")


def request_from_flags(args: argparse.Namespace, argv: Sequence[str]) -> JobRequest:
    """What the command line asks for (None where a flag is not given)."""
    agents = tuple(a.strip() for a in args.agents.split(",") if a.strip()) if args.agents else None
    return JobRequest(
        model=args.model, profile=None if args.profile is None else _resolve_profile(args.profile),
        budget_trials=args.budget_trials,
        budget_seconds=args.budget_seconds if args.budget_seconds is not None else args.budget,
        agents=agents, llm_url=args.llm_url, llm_model=args.llm_model, llm_key_file=args.llm_key_file,
        out=args.out, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        fast_layers=args.fast_layers, screen_repeats=args.screen_repeats, confirm_repeats=args.confirm_repeats,
        final_repeats=args.final_repeats, screen_requests=args.screen_requests,
        confirm_requests=args.confirm_requests, verify_prompts=args.verify_prompts, verify_steps=args.verify_steps,
        cpu_threads=args.cpu_threads, timer=args.timer, min_speedup=args.min_speedup,
        slo_ttft_p90_s=args.slo_ttft_p90, slo_per_user_tokens_per_s_p90=args.slo_per_user_p90, seed=args.seed,
        deterministic=args.deterministic, registry=args.registry, use_registry=not args.no_registry,
        recipe_seeds=not args.no_recipe_seeds, compile_run=args.compile_run, artifact_dir=args.artifact_dir,
        command=("shapeshift", "compile", *argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster = None
    if args.compile_run:
        from shapeshift.engine.compile.worker import CompileRunContext

        cluster = CompileRunContext.connect(args.compile_run, args.kubeconfig)
    try:
        request = request_from_flags(args, argv)
        if cluster is not None:
            request = cluster.job_request(request)  # a run it cannot be read into is reported on the CompileRun too
        return run(CompileJob.from_request(request), cluster)
    except Exception as exc:
        if cluster is not None:
            cluster.fail(f"{type(exc).__name__}: {exc}")
        raise


def _check_rebuilt(evaluator: Any, cand: Any) -> None:
    """Warn when the pass to beat, rebuilt here from its source and recipe, is not the bundle that
    was published (another engine version's stock folder, or knobs this search space lacks):
    the run then compares with the rebuilt pass."""
    from shapeshift.engine.forward_pass.bundle import verify_bundle

    rebuilt = verify_bundle(evaluator.materialize(cand)).digest
    expected = cand.extra.get("sha256")
    if expected and rebuilt != expected:
        log.warning("the pass to beat (%s) rebuilt here has digest %s, not the published %s; comparing with "
                    "the rebuilt pass", cand.note, rebuilt[:12], expected[:12])


def build_evaluator(job: CompileJob) -> tuple[Any, Any]:
    """(EngineEvaluator, ServingDefault) for `job`: the evaluator measures on the job's device
    with its tiers, and its baseline is the pass to beat by default, what serves: `shapeshift
    serve`'s recipe and engine settings for this model and device, with the deployment's
    engine.yaml (job.engine_base) over them."""
    import torch

    from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
    from shapeshift.engine.forward_pass.recipes import serving_default

    device = job.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = not device.startswith("cuda")
    tiers = job.tiers.on(cpu)
    serving = serving_default(job.model, device)
    settings = EvaluatorSettings(
        model=job.model, device=device, dtype=job.dtype, max_model_len=job.max_model_len_on(cpu),
        fast_layers=tiers.fast_layers, screen_repeats=tiers.screen_repeats, confirm_repeats=tiers.confirm_repeats,
        final_repeats=tiers.final_repeats, screen_requests=tiers.screen_requests,
        confirm_requests=tiers.confirm_requests, length_scale=None, seed=job.seed, work_dir=str(job.out / "work"),
        cpu_threads=tiers.cpu_threads, timer=tiers.timer, verify_prompts=job.verification.prompts,
        verify_steps=job.verification.steps, engine_base={**serving.engine, **job.engine_base},
        base_recipe=dict(serving.recipe), slo=job.slo)
    return EngineEvaluator(job.profile, settings), serving


def run(job: CompileJob, cluster: Any = None) -> int:
    """Run one compile job; `cluster` (worker.py CompileRunContext): the CompileRun it reports to
    and publishes through, besides the local registry."""
    from shapeshift.engine.compile.agents import make_agents
    from shapeshift.engine.compile.board import Board
    from shapeshift.engine.compile.loop import CompileLoop, LoopConfig
    from shapeshift.engine.compile.report import print_outcome, write_report
    from shapeshift.engine.compile.champions import ChampionEntry, LocalRegistry, TrafficRegime, model_signature, project_recipe
    from shapeshift.engine.models.presets import model_config_sha256

    profile = job.profile
    out = job.out
    out.mkdir(parents=True, exist_ok=True)
    # A gate that tests itself: gates that let a known-bad candidate through (or refuse a good one)
    # must not vouch for anything, so the worker refuses to search and publish, and says why.
    from shapeshift.engine.verify.selftest import run_self_test

    self_test = run_self_test()
    log.info("%s", self_test.message())
    if not self_test.passed:
        log.error("%s", self_test.message())
        if cluster is not None:
            cluster.fail(self_test.message())
        return 3

    evaluator, serving = build_evaluator(job)
    settings, device = evaluator.settings, evaluator.settings.device
    space = evaluator.space()
    board = Board(out / "board.jsonl")
    llm = None
    if "llm" in job.agents:
        llm = {"base_url": job.llm.base_url, "model": job.llm.model, "api_key_file": job.llm.api_key_file,
               "stock_source": evaluator.stock_source,
               "context": f"Model {job.model}, traffic {profile.name}, device {device}."}
    agents = make_agents(list(job.agents), space, board, seed=job.seed, llm=llm)

    mc = evaluator.model_config()
    signature = model_signature(mc)
    hardware = evaluator.hardware()
    registry = None if job.registry is None else LocalRegistry(job.registry)
    seeds = []
    nearest = []
    if cluster is not None and registry is not None:
        nearest = cluster.nearest_champions(signature, hardware, profile, mc.family)
    elif registry is not None:
        nearest = registry.nearest_champions(signature, hardware, profile, k=3, family=mc.family)
    if nearest:
        for entry in nearest:
            cand = entry.candidate()
            if cluster is not None and entry.bundle_path:
                # A ForwardPass carries its recipe, not its source: an agent-written source is in the bundle.
                from shapeshift.engine.compile.pass_to_beat import from_artifact

                try:
                    cand = dataclasses.replace(
                        from_artifact(entry.bundle_path, entry.bundle_digest or None, entry.recipe,
                                      evaluator.stock_source, cand.note, out / "work" / "artifacts"),
                        parent=cand.parent)
                except ValueError as exc:
                    log.warning("champion %s: its bundle cannot be read (%s); seeding its recipe alone", entry.name, exc)
            seeds.append(type(cand)(project_recipe(cand.recipe, space), cand.source, "registry", cand.note, cand.parent))
        log.info("seeding with %d champion(s): %s", len(seeds), ", ".join(e.name for e in nearest))

    # Settings of the pass to beat that the traffic does not fit (a batch narrower than its
    # concurrency, a token budget shorter than its prompts): the least that fits, measured first.
    from shapeshift.engine.compile.agents.sweep import first_fitting

    seeds.extend(first_fitting(space))
    if job.recipe_seeds:
        seeds.extend(recipe_seeds(space))

    def fit_pass_to_beat(cand: Any) -> Any:
        cand = dataclasses.replace(cand, recipe=project_recipe(cand.recipe, space))
        problems = space.validate(space.complete(cand.recipe))
        if problems:
            raise ValueError(f"its recipe does not fit this run's search space: {'; '.join(problems)}")
        _check_rebuilt(evaluator, cand)
        return cand

    pass_to_beat = None
    if cluster is not None:
        pass_to_beat = cluster.pass_to_beat(evaluator.stock_source, out / "work" / "artifacts", fit_pass_to_beat)

    on_status = cluster.patch_status if cluster is not None else None
    baseline_name = serving.describe() if not job.engine_base else \
        f"{serving.describe()} with the deployment's engine settings {dict(job.engine_base)}"
    loop = CompileLoop(evaluator, space, board, agents, job.budget,
                       LoopConfig(seed=job.seed, deterministic=job.deterministic, min_speedup=job.min_speedup,
                                  baseline_name=baseline_name),
                       on_status, seeds, pass_to_beat, plain_pass(space, evaluator, serving))
    result = loop.run()

    context = {"command": list(job.command), "commit": _git_commit(), "serving_default": serving.to_dict(),
               "model": job.model, "profile": profile.name, "device": device, "signature": signature,
               "hardware": hardware, "regime": TrafficRegime.of(profile).key, "evaluator": evaluator.describe()}
    exported = None
    if result.champion is not None:
        exported = evaluator.export(result.champion, out / "champion")
        context["champion_bundle"] = exported
        if registry is not None:
            inc = result.incumbent
            entry = ChampionEntry(
                name=f"{job.model}-{profile.name}-{exported['digest'][:10]}", signature=signature,
                model=job.model, family=mc.family, hardware=hardware, regime=TrafficRegime.of(profile).to_dict(),
                bundle_digest=exported["digest"], recipe=dict(result.champion.recipe),
                base_source=result.champion.source, speedup=result.speedup,
                metrics={"tokens_per_second": inc.full.mean if inc.full else None,
                         "baseline_tokens_per_second": result.baseline_full.mean if result.baseline_full else None,
                         "per_user_p90": inc.full.per_user_p90_mean() if inc.full else None,
                         "noise": inc.full.cv if inc.full else None, "dtype": str(settings.dtype or "")},
                verification={"passed": inc.verification.passed, "gates": inc.verification.gates} if inc.verification else {},
                profile=profile.to_dict(), notes=[{"agent": result.champion.agent, "note": result.champion.note}],
                parent=result.champion.parent, compile_run=job.compile_run,
                config_sha256=model_config_sha256(job.model))
            registry.publish(entry, out / "champion")
            context["registry_entry"] = entry.name
            if cluster is not None:
                cluster.publish(entry, out / "champion")
    _, md_path = write_report(result, board, out, context)
    print_outcome(result, board, exported, md_path)
    if cluster is not None:
        cluster.finish(result, exported)
    return 0


if __name__ == "__main__":
    sys.exit(main())
