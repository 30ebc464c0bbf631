"""Replay is deterministic for a seed and reports sane numbers; tiers share one weights dict."""

from __future__ import annotations

import math

import pytest

from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.core.llm_engine import LLMEngine
from shapeshift.engine.replay.driver import replay_profile
from shapeshift.engine.replay.requests import make_requests, requests_from_profile, sample_shapes
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.replay.tiers import Tiers, layer_subset
from shapeshift.engine.contracts.traffic_profile import builtin_profile


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256,
                                  num_kv_blocks=192))


def small_chat():
    return builtin_profile("chat").scaled(1 / 16, name="chat-small")


def test_requests_are_deterministic_for_a_seed(engine):
    profile = small_chat()
    a = requests_from_profile(profile, engine, 12, seed=7)
    b = requests_from_profile(profile, engine, 12, seed=7)
    c = requests_from_profile(profile, engine, 12, seed=8)
    assert a == b and a != c
    shared = [r for r in a if r.shared_prefix_len]
    assert shared, "the chat profile shares a prefix for most requests"
    prefix = shared[0].prompt_token_ids[:shared[0].shared_prefix_len]
    assert all(r.prompt_token_ids[:len(prefix)] == prefix for r in shared if r.shared_prefix_len >= len(prefix))
    assert all(len(r.prompt_token_ids) + r.max_tokens < 256 for r in a)


def test_replay_reports_sane_numbers(engine):
    report = replay_profile(engine, small_chat(), num_requests=10, seed=3, repeats=2, concurrency=4)
    s = report.summary()
    assert len(report.runs) == 2 and s["failed"] == 0
    expected_tokens = sum(r.max_tokens for r in requests_from_profile(small_chat(), engine, 10, seed=3))
    assert all(run.output_tokens == expected_tokens for run in report.runs)  # ignore_eos: exact lengths
    assert s["output_tokens_per_s"] > 0
    assert 0 < s["ttft_s_p50"] <= s["ttft_s_p90"]
    assert 0 < s["per_user_tokens_per_s_p90"] <= s["per_user_tokens_per_s_p50"]
    assert 0 < s["per_user_e2e_tokens_per_s_p90"] <= s["per_user_tokens_per_s_p50"]
    assert 0 <= s["noise_cv"] < 1 and not math.isnan(s["noise_cv"])
    assert 0 < s["prefix_cache_hit_rate"] < 1  # shared prefixes hit, the rest misses
    assert not engine.has_unfinished_requests()


def test_end_to_end_per_user_speed_counts_the_queue():
    """With more requests in flight than the batch admits, the waiting ones lose end-to-end speed
    that the decode-only per-user speed does not see; with room for all, the two tell the same story."""
    from shapeshift.engine.replay.driver import run_once
    from shapeshift.engine.replay.requests import ReplayRequest

    narrow = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=2, max_model_len=256, num_kv_blocks=192))
    requests = [ReplayRequest(prompt_token_ids=[5 + i, 9, 13, 17], max_tokens=24) for i in range(8)]
    run_once(narrow, requests[:2], concurrency=2)  # warm-up: the first steps of a new engine are slow
    queued = run_once(narrow, requests, concurrency=8)
    # decode-only: everyone decodes at the speed of a batch of <= 2
    # end to end: the last ones waited for three batches ahead of them (about a quarter of the
    # decode speed; measured 0.19-0.24 of the median decode speed, 0.25-0.45 of its slow tail,
    # which a busy machine moves most)
    assert queued.per_user_e2e_tokens_per_s_p90 < 0.5 * queued.per_user_tokens_per_s_p50
    alone = run_once(narrow, requests[:2], concurrency=2)
    assert alone.per_user_e2e_tokens_per_s_p90 > 2 * queued.per_user_e2e_tokens_per_s_p90


def test_open_loop_uses_arrival_times(engine):
    profile = builtin_profile("burst").scaled(1 / 64, name="burst-small")
    report = replay_profile(engine, profile, num_requests=6, seed=1, repeats=1)
    assert report.concurrency is None and report.arrival_rate == profile.arrival_rate
    shapes = sample_shapes(profile, 6, 1)
    assert report.runs[0].wall_s >= max(s["arrival_s"] for s in shapes)


def test_make_requests_clips_to_model_len():
    reqs = make_requests([{"prompt_len": 5000, "output_len": 900, "shared_prefix_len": 0, "arrival_s": None}],
                         seed=0, vocab_size=512, max_model_len=256)
    assert len(reqs[0].prompt_token_ids) + reqs[0].max_tokens < 256


def test_fast_tier_shares_weights_and_matches_truncated_model():
    tiers = Tiers.load(EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=128,
                                    max_num_batched_tokens=128, num_kv_blocks=32), fast_layers=1)
    assert tiers.fast.model_config.num_hidden_layers == 1
    assert tiers.full.model_config.num_hidden_layers == 2
    shared = layer_subset(tiers.full.weights, 1)
    assert set(tiers.fast.weights) == set(shared)
    assert all(tiers.fast.weights[k] is tiers.full.weights[k] for k in shared)  # no copy, no second load
    # The fast tier equals an engine loaded with num_layers_override=1 from scratch.
    direct = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
                                    num_kv_blocks=32, num_layers_override=1))
    params = SamplingParams(max_tokens=6, temperature=0)
    prompt = [[5, 6, 7, 8, 9, 10, 11]]
    assert tiers.fast.generate(prompt, params) == direct.generate(prompt, params)
    assert tiers.full.generate(prompt, params) != tiers.fast.generate(prompt, params)


def test_saved_bench_shapes_match_the_profiles():
    """bench/profiles/*.json (replayed where pydantic is missing) equal live sampling."""
    import json

    from harness.scripts import load_hack_script

    bench = load_hack_script("bench_reload")
    for small in (False, True):
        live = bench.load_plan(small)
        for name, entry in live.items():
            saved = json.loads(bench.shapes_file(name, small).read_text())
            assert saved["shapes"] == entry["shapes"], f"stale {bench.shapes_file(name, small)}; run --write-shapes"


def test_sessions_make_the_replay_hit_the_prefix_cache_as_the_profile_says():
    """On a real engine: the agentic profile (hit rate 0.7) fitted into 512 tokens replays with a
    measured prefix-cache hit rate near its own; without its sessions (the common prefix alone),
    far below it. Full KV blocks only are cached, so short prompts lose some of it."""
    from shapeshift.engine.compile.evaluator import fit_profile
    from shapeshift.engine.replay.driver import run_once

    eng = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=8, max_model_len=512))
    profile = fit_profile(builtin_profile("agentic-long-context"), 512)
    with_sessions = run_once(eng, requests_from_profile(profile, eng, 64, seed=0), profile.concurrency)
    alone = profile.model_copy(update={"prefix_cache_hit_rate": None})
    without = run_once(eng, requests_from_profile(alone, eng, 64, seed=0, token_seed=99), profile.concurrency)
    assert 0.55 <= with_sessions.prefix_cache_hit_rate <= 0.8, with_sessions.prefix_cache_hit_rate
    assert without.prefix_cache_hit_rate < 0.35, without.prefix_cache_hit_rate
