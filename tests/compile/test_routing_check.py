"""The replay's expert routing checked against the profile's, on the real evaluator (tiny-moe).

One evaluator over tiny-moe (Mixtral-style, 4 experts top-2) on the CPU. Routing histograms
of real-text replays (two draws of the corpus) and of random-token replays of the same shapes
are measured on its engine; then the evaluator measures the stock pass with the profile's
expertRouting set to a real-text histogram (representative: the distance is small) and to a
random-token one (not representative), and the loop's board record and the report say so.
"""

from __future__ import annotations

import pytest

from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.evaluator import FULL, EngineEvaluator, EvaluatorSettings, replay
from shapeshift.engine.compile.job import Budget
from shapeshift.engine.compile.loop import CompileLoop
from shapeshift.engine.compile.report import _routing_lines, routing_summary
from shapeshift.engine.contracts.expert_routing import REPRESENTATIVE_TV
from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile
from shapeshift.engine.replay import routing as rr
from shapeshift.engine.replay.requests import make_requests, requests_from_profile, sample_shapes

# Prompt-heavy traffic without a shared prefix: most routed tokens are the prompts' own.
PROFILE = TrafficProfile(name="moe-short", prompt_length=LengthDistribution(p50=48, p90=96, p99=128, min=16),
                         output_length=LengthDistribution(p50=4, p90=6, p99=8, min=2), concurrency=8)
N = 16


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    ev = EngineEvaluator(PROFILE, EvaluatorSettings(model="tiny-moe", device="cpu", max_model_len=256,
                                                    work_dir=str(tmp_path_factory.mktemp("work")),
                                                    confirm_requests=N, confirm_repeats=1, cpu_threads=1))
    eng = ev._engine(FULL, {})

    def routed(reqs):
        before = rr.routing_snapshot(eng)
        ev._fresh_cache(eng)
        replay(eng, reqs, PROFILE.concurrency)
        return rr.routing_between(before, rr.routing_snapshot(eng))

    eos = set(eng.model_config.eos_token_ids)
    real = [routed(requests_from_profile(PROFILE, eng, N, seed=s, token_seed=100 + s)) for s in (1, 2)]
    random_ids = routed(make_requests(sample_shapes(PROFILE, N, 1), 301, eng.model_config.vocab_size,
                                      eng.config.max_model_len, eos, None))
    return ev, real, random_ids


def test_random_tokens_route_further_from_real_text_than_another_draw_of_real_text(measured):
    _, (a, b), random_ids = measured
    same, other = a.distance(b).max, a.distance(random_ids).max
    assert same < REPRESENTATIVE_TV < other, (same, other)


def test_the_evaluator_tells_a_matching_profile_from_a_mismatched_one(measured, tmp_path):
    ev, (a, _), random_ids = measured
    base = Candidate(ev.space().default(), None, "baseline", "")
    ev.retarget(PROFILE.model_copy(update={"expert_routing": a}))
    matching = ev.confirm(base)
    ev.retarget(PROFILE.model_copy(update={"expert_routing": random_ids}))
    mismatched = ev.confirm(base)
    assert matching.ok and mismatched.ok
    good, bad = matching.details["routing"], mismatched.details["routing"]
    assert good["representative"] and good["distance"] < REPRESENTATIVE_TV
    assert not bad["representative"] and bad["distance"] > REPRESENTATIVE_TV
    assert set(good["per_layer"]) == {"0", "1"} and len(bad["repeats"]) == 1

    board = Board(tmp_path / "board.jsonl")
    loop = CompileLoop(ev, ev.space(), board, [], Budget(max_trials=0))
    loop._record(base, "t1", FULL, matching, None)
    loop._record(base, "t2", FULL, mismatched, None)
    assert [r["routing"]["representative"] for r in board.entries("result")] == [True, False]
    summary = routing_summary(board)
    assert summary["checked"] == 2 and not summary["representative"]
    assert summary["not_representative"][0]["distance"] == bad["distance"]
    assert "not representative" in _routing_lines(summary)[0]


def test_profiles_without_routing_are_not_checked(measured):
    ev, _, _ = measured
    ev.retarget(PROFILE)
    m = ev.confirm(Candidate(ev.space().default(), None, "baseline", ""))
    assert m.ok and "routing" not in m.details
