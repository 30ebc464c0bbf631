"""The regime matrix (engine/compile/regime_matrix.py): its arithmetic on known samples, and its
measurement on the real evaluator (tiny-llama on the CPU: one pair of engines, retargeted from
one regime's traffic to the next, every configuration replayed in alternation)."""

from __future__ import annotations

import json
import math

import pytest

from shapeshift.engine.compile import regime_matrix as rm
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
from shapeshift.engine.compile.measure import Measurement
from shapeshift.engine.contracts.traffic_profile import builtin_profile

DEFAULT = Candidate({"variant": "default"}, None, "baseline", "")
CHAT = Candidate({"variant": "chat"}, None, "sweep", "")
BURST = Candidate({"variant": "burst"}, None, "sweep", "")


def m(*samples: float) -> Measurement:
    return Measurement(samples=list(samples), per_user_p90=[1.0] * len(samples))


def test_the_matrix_names_the_best_static_configuration_and_each_regime_against_it():
    """chat's champion 1.3x on chat and 0.9x on burst; burst's 0.95x on chat and 1.2x on burst;
    agentic has no champion (it serves the default). Geometric means over the three regimes:
    chat's (1.3 * 1.0 * 0.9)^(1/3) = 1.054, burst's (0.95 * 1.1 * 1.2)^(1/3) = 1.078: burst's
    champion is the best static configuration, and chat beats it on chat traffic."""
    champions = [rm.RegimeChampion("chat", CHAT, "c" * 64, True), rm.RegimeChampion("agentic", None),
                 rm.RegimeChampion("burst", BURST, "b" * 64, True)]
    configs = rm.configurations(DEFAULT, champions)
    assert list(configs) == ["default", "chat", "burst"]
    measured = {
        "chat": {"default": m(100, 102, 98, 100, 101), "chat": m(130, 132.6, 127.4, 130, 131.3),
                 "burst": m(95, 96.9, 93.1, 95, 95.95)},
        "agentic": {"default": m(50, 51, 49, 50, 50), "chat": m(50, 51, 49, 50, 50), "burst": m(55, 56.1, 53.9, 55, 55)},
        "burst": {"default": m(200, 204, 196, 200, 202), "chat": m(180, 183.6, 176.4, 180, 181.8),
                  "burst": m(240, 244.8, 235.2, 240, 242.4)},
    }
    out = rm.summarize(measured, champions, configs)
    assert out["matrix"]["chat"]["chat"]["speedup"] == pytest.approx(1.3, rel=1e-3)
    assert out["matrix"]["burst"]["burst"]["speedup"] == pytest.approx(1.2, rel=1e-3)
    assert out["matrix"]["default"]["agentic"] == {"speedup": 1.0, "low": 1.0, "high": 1.0, "pairs": 5}
    assert out["matrix"]["chat"]["chat"]["low"] > 1.29 and out["matrix"]["chat"]["chat"]["pairs"] == 5
    assert out["geomean_vs_default"]["chat"] == pytest.approx((1.3 * 1.0 * 0.9) ** (1 / 3), rel=1e-3)
    assert out["geomean_vs_default"]["burst"] == pytest.approx((0.95 * 1.1 * 1.2) ** (1 / 3), rel=1e-3)
    assert out["best_static"] == "burst"
    assert out["vs_best_static"]["chat"]["serves"] == "chat"
    assert out["vs_best_static"]["chat"]["speedup"] == pytest.approx(1.3 / 0.95, rel=1e-3)
    assert out["vs_best_static"]["agentic"]["serves"] == "default"
    assert out["vs_best_static"]["agentic"]["speedup"] == pytest.approx(50 / 55, rel=1e-3)
    assert out["vs_best_static"]["burst"] == {"serves": "burst", "speedup": 1.0, "low": 1.0, "high": 1.0, "pairs": 5}
    (moves,) = [h for h in out["head_to_head"] if h["regimes"] == ["chat", "burst"]]
    assert moves["optimum_moves"] and moves["beyond_noise"]
    assert all(h["regimes"] != ["chat", "agentic"] or not h["optimum_moves"] for h in out["head_to_head"])
    json.dumps(out)  # the JSON the benchmark writes: no infinities, nothing unserialisable


def test_a_champion_equal_to_another_adds_no_configuration_and_a_failed_cell_ranks_last():
    same_as_chat = Candidate(dict(CHAT.recipe), None, "evolve", "found again")
    champions = [rm.RegimeChampion("chat", CHAT, "c" * 64, True), rm.RegimeChampion("burst", same_as_chat, "c" * 64, True),
                 rm.RegimeChampion("agentic", Candidate(dict(DEFAULT.recipe), None, "x", ""), "d" * 64, True)]
    configs = rm.configurations(DEFAULT, champions)
    assert list(configs) == ["default", "chat"]
    assert rm.label_of(champions[1], configs) == "chat" and rm.label_of(champions[2], configs) == "default"
    failed = Measurement(error="crashed in forward()")
    measured = {t: {"default": m(100, 101, 99), "chat": failed if t == "burst" else m(150, 151, 149)}
                for t in ("chat", "burst", "agentic")}
    out = rm.summarize(measured, champions, configs)
    assert out["matrix"]["chat"]["burst"]["speedup"] is None and "crashed" in out["matrix"]["chat"]["burst"]["error"]
    assert out["geomean_vs_default"]["chat"] == 0.0 and out["best_static"] == "default"


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory):
    return EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path_factory.mktemp("work")), confirm_requests=8,
        confirm_repeats=2, cpu_threads=1))


def test_the_matrix_measures_every_configuration_on_every_regimes_traffic(evaluator, tmp_path):
    """On the real evaluator: a champion exported as the compile run leaves it is read back as a
    candidate of the same digest; each regime's traffic is replayed (the evaluator retargeted, the
    profile it fits named in describe()) with the default and the champion in alternation, two
    pairs a cell, their tokens compared."""
    space = evaluator.space()
    default = Candidate(space.default(), None, "baseline", "")
    recipe = {**space.default(), "edit.index_select_gather": True}
    champ = Candidate(recipe, None, "sweep", "index_select gather")
    run = tmp_path / "chat"
    exported = evaluator.export(champ, run / "champion")
    (run / "report.json").write_text(json.dumps({"champion": champ.digest, "champion_recipe": recipe, "speedup": 1.2,
                                                 "elapsed_s": 60.0, "trials": 12, "confirms": 3,
                                                 "verification": {"passed": True}}))
    read = rm.champion_of("chat", run, evaluator.stock_source)
    assert read.digest == exported["digest"] and read.verified and read.compile["confirms_per_hour"] == 180.0
    assert evaluator.materialize(read.candidate).name == evaluator.materialize(champ).name
    none = tmp_path / "burst"
    none.mkdir()
    (none / "report.json").write_text(json.dumps({"champion": None, "trials": 12, "elapsed_s": 30.0}))
    assert rm.champion_of("burst", none, evaluator.stock_source).candidate is None

    configs = rm.configurations(default, [read])
    profiles = {"chat": builtin_profile("chat"), "agentic": builtin_profile("agentic-long-context")}
    seen = []
    measured = rm.measure_matrix(evaluator, profiles, configs, pairs=2,
                                 progress=lambda t, row: seen.append((t, evaluator.describe()["fitted_profile"])))
    assert [t for t, _ in seen] == ["chat", "agentic"]
    assert seen[0][1].startswith("chat") and seen[1][1].startswith("agentic-long-context")
    for traffic in profiles:
        for label in configs:
            cell = measured[traffic][label]
            assert cell.ok, (traffic, label, cell.error)
            assert len(cell.samples) == 2 and all(math.isfinite(s) and s > 0 for s in cell.samples)
    out = rm.summarize(measured, [read], configs)
    assert set(out["matrix"]["chat"]) == {"chat", "agentic"} and out["best_static"] in configs


def test_the_benchmark_writes_the_matrix_json_and_its_heatmap(tmp_path):
    """hack/bench_regimes.py over finished compile runs (--reuse; here two regimes whose runs kept
    no champion): the JSON has the fields the benchmark promises, named by the result scheme, with
    each regime's compile run kept beside it, and a heatmap PNG."""
    import importlib.util
    from pathlib import Path

    from shapeshift.engine.provenance import RESULT_NAME

    script = Path(__file__).resolve().parents[2] / "hack" / "bench_regimes.py"
    spec = importlib.util.spec_from_file_location("bench_regimes", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    work, results = tmp_path / "work", tmp_path / "results"
    for regime in ("chat", "burst"):
        (work / regime).mkdir(parents=True)
        (work / regime / "report.json").write_text(json.dumps({"champion": None, "trials": 4, "elapsed_s": 20.0,
                                                                "confirms": 1, "stop_reason": "trial budget spent"}))
        (work / regime / "board.jsonl").write_text("")
    assert bench.main(["--regimes", "chat,burst", "--reuse", "--work", str(work), "--results", str(results),
                       "--device", "cpu", "--pairs", "5", "--matrix-requests", "6", "--confirm-requests", "6",
                       "--log-level", "warning"]) == 0
    (json_path,) = results.glob("regimes-*.json")
    assert RESULT_NAME.fullmatch(json_path.name) and json_path.with_suffix(".png").is_file()
    out = json.loads(json_path.read_text())
    assert out["benchmark"] == "regime-matrix" and out["model"] == "tiny-llama" and out["hardware"] == "cpu"
    assert out["regimes"] == ["chat", "burst"] and out["git_commit"] and out["command"].startswith("python hack/")
    assert out["default"]["recipe_name"] == "torch" and set(out["default"]["engine"]) >= {"max_num_seqs", "decode_steps"}
    assert out["champions"]["chat"]["digest"] is None and out["best_static"] == "default"
    assert out["matrix"]["default"]["burst"]["pairs"] == 5 and set(out["vs_best_static"]) == {"chat", "burst"}
    assert out["goodput"]["burst"]["default"]["mean"] > 0 and out["pairs"] == 5
    assert len(set(out["compile_runs"].values())) == 2  # runs stamped in the same second get -2
    for regime, folder in out["compile_runs"].items():
        assert RESULT_NAME.fullmatch(folder) and (results / folder / "report.json").is_file(), regime
