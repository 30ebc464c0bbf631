"""The KV cache across a hot swap, on the real engine (tiny-llama on the CPU): kept only when the
incoming pass declares the outgoing pass's KV layout and its prefix hits on blocks the outgoing
pass wrote equal a miss; flushed otherwise, with the reason in the reply, the log and
shapeshift_kv_swaps_total."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.core.sequence import Sequence
from shapeshift.engine.forward_pass.bundle import create_bundle
from shapeshift.engine.forward_pass.swap import ForwardPassManager

CANDIDATES = Path(__file__).resolve().parents[1] / "fixtures" / "candidates"
PROMPT = list(range(40, 90))  # 50 tokens: three full blocks of 16 once cached
FOLLOW_UP = PROMPT + [7, 11, 13, 17, 19]  # shares PROMPT's full blocks: a prefix hit


@pytest.fixture
def engine():
    from shapeshift.engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256,
                                  num_kv_blocks=64))


def bundle(tmp_path: Path, name: str, text_edit=None, source: str | None = None) -> Path:
    """A bundle of the fixture ``source`` (default ``name``), its forward.py edited by ``text_edit``."""
    src = tmp_path / f"{name}-src"
    shutil.copytree(CANDIDATES / (source or name), src)
    if text_edit is not None:
        (src / "forward.py").write_text(text_edit((src / "forward.py").read_text()))
    create_bundle(src, None, tmp_path / name, name=name)
    return tmp_path / name


def serve(engine, rid: str, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], list[float], int]:
    """One greedy request to completion: (tokens, their logprobs, prompt tokens served from the cache)."""
    engine.add_request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=True))
    tokens, logprobs, cached = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            tokens += out.new_token_ids
            logprobs += [float(x) for x in (out.logprobs or [])]
            cached = out.num_cached_tokens
    return tokens, logprobs, cached


def served_kv(engine) -> list:
    """A copy of every KV block a request can read (all but the null block)."""
    null = engine.kv_cache.null_block
    return [t[:null].clone() for t in (*engine.kv_cache.k, *engine.kv_cache.v)]


def cached_tokens(engine, prompt: list[int]) -> int:
    probe = Sequence(request_id="probe", prompt_token_ids=list(prompt), params=SamplingParams(max_tokens=1))
    return engine.block_manager.num_cached_tokens(probe)


def test_a_compatible_swap_keeps_the_cache_and_a_prefix_hit_after_it_equals_a_miss(engine, tmp_path, caplog):
    serve(engine, "warm", PROMPT)  # the stock pass writes PROMPT's blocks
    assert cached_tokens(engine, FOLLOW_UP) == 48
    manager = ForwardPassManager(engine)
    before = served_kv(engine)
    with caplog.at_level(logging.INFO, logger="shapeshift.engine.forward_pass.swap"):
        result = manager.reload(bundle(tmp_path, "good_fused_mlp"))
    kv = result.kv
    assert not result.flushed_kv and (kv["outcome"], kv["reason"]) == ("kept", "verified"), kv
    # the check read the cached blocks in place and wrote only the null block's slots
    assert all(torch.equal(a, b) for a, b in zip(before, served_kv(engine), strict=True))
    assert kv["evidence"]["cached"] >= 1 and kv["evidence"]["max_logprob_diff"] <= kv["evidence"]["tolerance"][0]
    assert "KV cache kept (verified)" in caplog.text
    assert result.to_dict()["kvCache"] == kv
    assert cached_tokens(engine, FOLLOW_UP) == 48  # the stock pass's blocks are still served
    # A prefix hit on those blocks under the new pass == a miss under the new pass.
    hit_tokens, hit_logprobs, hit_cached = serve(engine, "hit", FOLLOW_UP)
    assert hit_cached == 48
    engine.block_manager.flush()
    miss_tokens, miss_logprobs, miss_cached = serve(engine, "miss", FOLLOW_UP)
    assert miss_cached == 0
    assert hit_tokens == miss_tokens
    assert max(abs(a - b) for a, b in zip(hit_logprobs, miss_logprobs)) < 1e-4
    assert engine.kv_swaps == {("kept", "verified"): 1}


def test_a_pass_with_the_same_tag_whose_cache_writes_differ_is_flushed_by_the_check(engine, tmp_path, caplog):
    stock_tokens, _, _ = serve(engine, "warm", FOLLOW_UP)
    manager = ForwardPassManager(engine)
    tag = engine.block_manager.tag
    engine.add_request("inflight", FOLLOW_UP, SamplingParams(max_tokens=6, temperature=0))
    engine.step()  # its KV, written by the stock pass, is in the cache when the swap comes
    with caplog.at_level(logging.INFO, logger="shapeshift.engine.forward_pass.swap"):
        result = manager.reload(bundle(tmp_path, "kv_scaled_writes"))
    kv = result.kv
    assert engine.active_forward_pass.cache_format == tag  # the same declared layout, the same tag ...
    assert result.flushed_kv and (kv["outcome"], kv["reason"]) == ("flushed", "check_failed"), kv
    # ... but it reads the stock pass's blocks as if they were doubled: far outside the bound
    assert kv["evidence"]["max_logprob_diff"] > 100 * kv["evidence"]["tolerance"][0]
    assert "reads blocks the outgoing pass wrote differently from a miss" in kv["detail"]
    assert "KV cache flushed (check_failed)" in caplog.text
    assert result.preempted == 1 and cached_tokens(engine, FOLLOW_UP) == 0  # nothing of the stock pass is served
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
    assert outputs["inflight"] == stock_tokens  # recomputed under the new pass, which alone is exact
    # Rolling back to the stock pass: the blocks the scaled pass wrote are flushed in turn.
    back = manager.rollback()
    assert (back.kv["outcome"], back.kv["reason"]) == ("flushed", "check_failed")
    assert engine.kv_swaps == {("flushed", "check_failed"): 2}


def test_a_layout_change_is_flushed_without_a_check(engine, tmp_path):
    serve(engine, "warm", PROMPT)
    manager = ForwardPassManager(engine)
    # The same doubled writes, declared honestly: another layout, another tag.
    honest = 'KV_SCALE = 2.0\nKV_LAYOUT = {"k_scale": KV_SCALE, "v_scale": KV_SCALE}'
    declared = bundle(tmp_path, "kv_scaled_declared", lambda text: text.replace("KV_SCALE = 2.0", honest),
                      source="kv_scaled_writes")
    result = manager.reload(declared)
    kv = result.kv
    assert (kv["outcome"], kv["reason"]) == ("flushed", "layout_changed"), kv
    assert "k_scale: 1.0 -> 2.0" in kv["detail"] and "v_scale: 1.0 -> 2.0" in kv["detail"]
    assert engine.active_forward_pass.kv_layout["k_scale"] == 2.0
    assert engine.block_manager.tag == engine.active_forward_pass.cache_format != kv["evidence"]["from"]
    assert cached_tokens(engine, FOLLOW_UP) == 0
    assert "evidence" in kv and kv["checkSeconds"] < 0.01  # no probe ran
    assert engine.kv_swaps == {("flushed", "layout_changed"): 1}


def test_an_empty_cache_is_checked_on_prefixes_the_outgoing_pass_writes(tmp_path):
    """No cached blocks (prefix caching off): the check writes prefixes of its own with the
    outgoing pass, so a pass that misreads them is still caught."""
    from shapeshift.engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256,
                                    num_kv_blocks=64, enable_prefix_caching=False))
    manager = ForwardPassManager(engine)
    good = manager.reload(bundle(tmp_path, "good_refactored")).kv
    assert (good["outcome"], good["evidence"]["cached"], good["evidence"]["synthetic"]) == ("kept", 0, 3), good
    bad = manager.reload(bundle(tmp_path, "kv_scaled_writes")).kv
    assert (bad["outcome"], bad["reason"], bad["evidence"]["synthetic"]) == ("flushed", "check_failed", 3), bad


def test_a_pass_that_raises_during_the_check_is_flushed(engine, tmp_path):
    """The check runs the incoming pass on a prefix hit; an exception there flushes (check_error)."""
    serve(engine, "warm", PROMPT)
    manager = ForwardPassManager(engine)
    prepared = manager.prepare(bundle(tmp_path, "good_fused_mlp"))

    class Exploding:
        def __init__(self, inner):
            self.inner = inner

        def forward(self, input_ids, positions, ctx, kv_cache):
            if kv_cache is engine.kv_cache and ctx.context_lens_cpu[0] > len(input_ids):
                raise RuntimeError("cannot read a cached prefix")
            return self.inner.forward(input_ids, positions, ctx, kv_cache)

    prepared.record.forward_pass = Exploding(prepared.record.forward_pass)
    result = manager.commit(prepared)
    assert (result.kv["outcome"], result.kv["reason"]) == ("flushed", "check_error")
    assert "cannot read a cached prefix" in result.kv["detail"]
    assert cached_tokens(engine, FOLLOW_UP) == 0


def test_in_bfloat16_the_bound_is_the_readers_own_rounding_and_a_bad_reader_still_fails(tmp_path):
    """Half precision: the check's bounds rise to twice what the incoming pass differs from its
    own miss when it continues prefixes it wrote itself (the rounding of another schedule), so a
    correct pass is kept; a pass that reads the outgoing pass's blocks wrongly is still flushed."""
    from shapeshift.engine.core.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                                    max_num_batched_tokens=256, num_kv_blocks=64))
    serve(engine, "warm", PROMPT)
    manager = ForwardPassManager(engine)
    good = manager.reload(bundle(tmp_path, "good_fused_mlp")).kv
    ev = good["evidence"]
    assert (good["outcome"], good["reason"]) == ("kept", "verified"), good
    assert "self_max_rel_logit_diff" in ev and ev["tolerance"][1] >= 0.05
    assert ev["max_rel_logit_diff"] <= ev["tolerance"][1] and ev["max_logprob_diff"] <= ev["tolerance"][0]
    bad = manager.reload(bundle(tmp_path, "kv_scaled_writes")).kv
    assert (bad["outcome"], bad["reason"]) == ("flushed", "check_failed"), bad
    assert bad["evidence"]["max_logprob_diff"] > bad["evidence"]["tolerance"][0]
