"""The objective is goodput under an SLO (engine/replay/slo.py), on the real evaluator:

    --slo-ttft-p90 / --slo-per-user-p90 -> JobRequest -> CompileJob.slo (documented defaults)
    replay (driver.run_once slo=) -> goodput: output tokens/s of the requests that met it
    EngineEvaluator(slo=) -> Measurement.samples = goodput, throughput and attainment kept beside;
      an SLO nobody meets -> a failed measurement that says which flag to loosen
"""

from __future__ import annotations

import math

import pytest

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.cli import build_parser, request_from_flags
from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
from shapeshift.engine.compile.job import CompileJob
from shapeshift.engine.contracts.traffic_profile import builtin_profile
from shapeshift.engine.replay.driver import run_once
from shapeshift.engine.replay.requests import requests_from_profile
from shapeshift.engine.replay.slo import DEFAULT_PER_USER_TOKENS_PER_S_P90, DEFAULT_TTFT_P90_S, SLO


def _job(argv):
    return CompileJob.from_request(request_from_flags(build_parser().parse_args(argv), argv))


def test_the_slo_comes_from_the_flags_with_documented_defaults():
    assert _job([]).slo == SLO(DEFAULT_TTFT_P90_S, DEFAULT_PER_USER_TOKENS_PER_S_P90) == SLO(1.0, 10.0)
    assert _job(["--slo-ttft-p90", "0.25"]).slo == SLO(0.25, 10.0)
    assert _job(["--slo-ttft-p90", "2", "--slo-per-user-p90", "30"]).slo == SLO(2.0, 30.0)
    with pytest.raises(ValueError, match="ttft_p90_s must be > 0"):
        _job(["--slo-ttft-p90", "0"])


def test_a_request_meets_the_slo_by_its_first_token_and_its_stream():
    slo = SLO(0.5, 20.0)
    assert slo.met(0.4, 25.0) and slo.met(0.5, None) and slo.met(0.1, math.nan)
    assert not slo.met(0.6, 100.0) and not slo.met(0.1, 19.9)


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory):
    return EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path_factory.mktemp("work")), screen_requests=8,
        screen_repeats=2, cpu_threads=1, slo=SLO(60.0, 0.0)))


def test_goodput_counts_only_the_requests_that_met_the_slo(evaluator):
    eng = evaluator._engine("full", {})
    reqs = requests_from_profile(evaluator._profile(), eng, 8, seed=0)
    loose = run_once(eng, reqs, 4, slo=SLO(60.0, 0.0))
    assert loose.slo_attainment == 1.0 and loose.goodput_tokens_per_s == pytest.approx(loose.output_tokens_per_s)
    assert loose.slo_missed_ttft == 0.0 and loose.slo_missed_per_user == 0.0
    strict = run_once(eng, reqs, 4, slo=SLO(1e-9, 0.0))  # no first token comes that fast
    assert strict.slo_attainment == 0.0 and strict.goodput_tokens_per_s == 0.0
    assert strict.slo_missed_ttft == 1.0 and strict.slo_missed_per_user == 0.0
    # A stream no engine reaches: every request that streamed more than one token is slow, and
    # the shares say which side missed (what the sweep reads to pick its first knob).
    slow = run_once(eng, reqs, 4, slo=SLO(60.0, 1e12))
    streamed = sum(1 for ids in slow.output_token_ids if len(ids) > 1) / len(reqs)
    assert slow.slo_missed_ttft == 0.0 and slow.slo_missed_per_user == pytest.approx(streamed) and streamed > 0
    assert slow.slo_attainment == pytest.approx(1.0 - streamed)
    assert math.isnan(run_once(eng, reqs, 4).goodput_tokens_per_s)  # no SLO, no goodput


def test_the_evaluator_measures_goodput_and_keeps_throughput_beside_it(evaluator):
    cand = Candidate(evaluator.space().default(), None, "baseline", "")
    m = evaluator.screen(cand)
    assert m.ok and m.slo_attainment == [1.0, 1.0] and m.samples == pytest.approx(m.throughput)
    metrics = m.metrics()
    assert metrics["objective"] == "goodput" and metrics["slo_attainment"] == 1.0
    assert metrics["slo_missed_ttft"] == 0.0 and metrics["slo_missed_per_user"] == 0.0
    assert evaluator.describe()["objective"].startswith("goodput at p90 TTFT <= 60 s")


def test_an_slo_nobody_meets_is_a_failed_measurement_naming_the_flags(tmp_path):
    ev = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path / "work"), screen_requests=4, screen_repeats=1,
        cpu_threads=1, slo=SLO(1e-9, 0.0)))
    m = ev.screen(Candidate(ev.space().default(), None, "baseline", ""))
    assert not m.ok and "no request met the SLO" in m.error and "--slo-ttft-p90" in m.error
