"""Replay that looks like traffic, through the one generator (engine/replay/requests.py):

    prompts: spans of real text (engine/replay/corpus.py) through the model's tokenizer, EOS
      dropped, fresh per token seed, the shared prefix one span for every request that shares
    open loop: a profile with an arrival rate is replayed at its arrival times (the clock jumps
      over idle gaps, so a CPU-time clock works), waits counted from arrival
"""

from __future__ import annotations

import time

import pytest

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
from shapeshift.engine.contracts.traffic_profile import builtin_profile
from shapeshift.engine.replay.corpus import CORPUS_NAME, corpus_text, corpus_tokens
from shapeshift.engine.replay.driver import run_once
from shapeshift.engine.replay.requests import ReplayRequest, requests_from_profile


@pytest.fixture(scope="module")
def burst(tmp_path_factory):
    """The real evaluator on the burst profile (open loop, 50 requests/s)."""
    return EngineEvaluator(builtin_profile("burst"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path_factory.mktemp("work")), screen_requests=12,
        screen_repeats=2, cpu_threads=1))


def test_prompts_are_real_text_through_the_models_tokenizer(burst):
    eng = burst._engine("full", {})
    eos = set(eng.model_config.eos_token_ids)
    reqs = requests_from_profile(builtin_profile("chat").scaled(0.05), eng, 16, seed=0)
    text = corpus_text()
    assert CORPUS_NAME.startswith("python-stdlib:") and len(text) > 50_000
    for r in reqs:
        assert not eos & set(r.prompt_token_ids)
        decoded = eng.tokenizer.decode(r.prompt_token_ids[r.shared_prefix_len:])
        # every prompt is cut from the corpus (a span, or spans where it wrapped)
        assert decoded[:12] in text, decoded[:40]
    shared = [r for r in reqs if r.shared_prefix_len]
    assert shared and len({tuple(r.prompt_token_ids[:r.shared_prefix_len]) for r in shared}) == 1
    again = requests_from_profile(builtin_profile("chat").scaled(0.05), eng, 16, seed=0, token_seed=7)
    assert [r.prompt_token_ids for r in again] != [r.prompt_token_ids for r in reqs]
    assert corpus_tokens(eng.tokenizer, frozenset(eos), eng.model_config.vocab_size) is \
        corpus_tokens(burst._engine("fast", {}).tokenizer, frozenset(eos), eng.model_config.vocab_size)


def test_open_loop_replays_arrival_times_on_a_cpu_time_clock(burst):
    eng = burst._engine("full", {})
    prompt = list(range(3, 19))
    # two requests 30 s apart: the clock jumps the gap (no sleeping), and it counts in the span
    reqs = [ReplayRequest(prompt, 4, arrival_s=0.0), ReplayRequest(prompt, 4, arrival_s=30.0)]
    t0 = time.perf_counter()
    run = run_once(eng, reqs, None, time.thread_time)
    assert time.perf_counter() - t0 < 10
    assert run.output_tokens == 8 and run.wall_s >= 30.0 and run.ttft_s_p90 < 5


def test_the_evaluator_replays_an_open_loop_profile_open_loop(burst):
    assert burst._profile().arrival_rate == 50.0
    m = burst.screen(Candidate(burst.space().default(), None, "baseline", ""))
    assert m.ok and len(m.samples) == 2 and m.slo_attainment == []


def test_open_loop_arrivals_are_compressed_to_load_the_engine(burst, tmp_path):
    """Goodput of open-loop traffic that the engine serves well within the SLO is bound by the
    arrivals (every pass reads 1.000x): the evaluator compresses the arrival pattern to a share
    of the tier's measured capacity, once per tier, and says by how much; with open_loop_load
    None the profile's own rate is replayed."""
    base = Candidate(burst.space().default(), None, "baseline", "")
    loaded = burst.screen(base)
    scale = burst.describe()["open_loop"]["arrival_scale"]["fast"]
    assert scale > 2.0, scale  # tiny-llama on a CPU serves 50 short requests/s with room to spare
    assert burst.screen(base).ok and burst.describe()["open_loop"]["arrival_scale"] == {"fast": scale}
    as_given = EngineEvaluator(builtin_profile("burst"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path / "work"), screen_requests=12, screen_repeats=2,
        cpu_threads=1, open_loop_load=None))
    plain = as_given.screen(Candidate(as_given.space().default(), None, "baseline", ""))
    assert as_given.describe()["open_loop"]["arrival_scale"] == {}
    # Compressed arrivals deliver the same tokens in less (CPU) time.
    assert loaded.ok and plain.ok and loaded.mean > 1.5 * plain.mean, (loaded.samples, plain.samples)


def test_a_replay_faster_than_the_device_allows_is_a_measurement_fault(tmp_path):
    """Every measured replay is held to the speed of light (engine/verify/measured.py): a clock
    that runs a million times slow makes tokens/s that no device can produce, and the measurement
    fails saying so rather than counting as a speedup; the honest clock passes. (tiny-llama's
    weights fit in the cache, so its bound here is the host's generous FLOPs figure alone.)"""
    chat = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", work_dir=str(tmp_path / "work"), screen_requests=8, screen_repeats=1,
        cpu_threads=1))
    base = Candidate(chat.space().default(), None, "baseline", "")
    honest = chat.screen(base)
    assert honest.ok, honest.error
    chat._clock = lambda eng=None: (lambda: time.thread_time() / 1_000_000)
    slowed = chat.screen(base)
    assert not slowed.ok and slowed.error.startswith("speed of light: measured "), slowed.error
    assert "a measurement fault" in slowed.error
