"""In-process tests of `AsyncEngine` and the app over a real tiny-llama `LLMEngine`.

The only injected fault is `FlakyStep`, a wrapper that makes the real engine's
`step()` raise once (named as such): engine failures cannot be provoked otherwise.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from server_harness import MAX_MODEL_LEN, MODEL, NUM_KV_BLOCKS

MAX_NUM_SEQS = 2


@pytest.fixture()
def engine():
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=MODEL, device="cpu", max_model_len=MAX_MODEL_LEN,
                                  num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS))


def params(max_tokens: int = 4, **kw):
    from shapeshift.engine.core.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_async(engine, max_waiting: int = 1, metrics=None):
    from shapeshift.engine.serving.async_engine import AsyncEngine

    return AsyncEngine(engine, max_waiting=max_waiting, metrics=metrics).start()


async def drain(stream) -> list:
    return [out async for out in stream]


def test_stream_yields_tokens_equal_to_generate(engine):
    prompt = [3, 14, 15, 92, 65]
    expected = engine.generate([prompt], params(6))[0]  # before the loop thread owns the engine
    ae = make_async(engine)
    try:
        async def run():
            return await asyncio.wait_for(drain(ae.submit("r1", prompt, params(6))), 30)
        outs = asyncio.run(run())
    finally:
        ae.stop()
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    assert ae.num_in_flight == 0


def test_concurrent_requests_from_two_event_loops(engine):
    """Each request's outputs go back to the loop that submitted it."""
    ae = make_async(engine, max_waiting=4)
    results: dict[str, list[int]] = {}

    def client(name: str, prompt: list[int]) -> None:
        async def run():
            outs = await asyncio.wait_for(drain(ae.submit(name, prompt, params(5))), 30)
            results[name] = [t for o in outs for t in o.new_token_ids]
        asyncio.run(run())

    threads = [threading.Thread(target=client, args=(f"t{i}", [i + 1] * 8)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        ae.stop()
    assert sorted(results) == ["t0", "t1", "t2"]
    assert all(len(v) == 5 for v in results.values())


def test_admission_is_bounded_and_released(engine):
    from shapeshift.engine.serving.async_engine import EngineOverloadedError

    ae = make_async(engine, max_waiting=1)  # capacity = 2 running + 1 waiting
    try:
        async def run():
            streams = [ae.submit(f"r{i}", [7, 8, 9], params(30)) for i in range(3)]
            with pytest.raises(EngineOverloadedError, match="max_waiting=1"):
                ae.submit("r-over", [7, 8, 9], params(2))
            for s in streams:
                await asyncio.wait_for(drain(s), 60)
            assert ae.num_in_flight == 0
            return await asyncio.wait_for(drain(ae.submit("r-after", [1, 2], params(2))), 30)
        outs = asyncio.run(run())
    finally:
        ae.stop()
    assert outs[-1].finished


def test_abort_removes_request_from_engine(engine):
    ae = make_async(engine)
    try:
        async def run():
            stream = ae.submit("long", [5, 6, 7], params(MAX_MODEL_LEN - 10))
            first = await asyncio.wait_for(stream.__anext__(), 30)
            assert not first.finished
            stream.abort()
            for _ in range(100):
                if ae.num_in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            return await ae.call(lambda e: e.has_unfinished_requests())
        still_there = asyncio.run(run())
    finally:
        ae.stop()
    assert ae.num_in_flight == 0
    assert still_there is False


class FlakyStep:
    """Fault injection: the wrapped engine's next `step()` raises once."""

    def __init__(self, engine) -> None:
        self.real_step = engine.step
        self.armed = False
        engine.step = self

    def __call__(self):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected step failure")
        return self.real_step()


def test_step_failure_fails_requests_and_loop_keeps_serving(engine):
    from shapeshift.engine.serving.async_engine import EngineStepError
    from shapeshift.engine.serving.metrics import EngineMetrics

    flaky = FlakyStep(engine)
    metrics = EngineMetrics(MODEL)
    ae = make_async(engine, metrics=metrics)
    try:
        async def run():
            flaky.armed = True
            with pytest.raises(EngineStepError, match="injected step failure"):
                await asyncio.wait_for(drain(ae.submit("doomed", [1, 2, 3], params(4))), 30)
            assert ae.is_healthy()[0]
            return await asyncio.wait_for(drain(ae.submit("fine", [1, 2, 3], params(4))), 30)
        outs = asyncio.run(run())
    finally:
        ae.stop()
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    assert metrics.requests_counter_value("error") == 1
    assert metrics.requests_counter_value("length") == 1


def test_engine_rejection_is_a_request_error_not_a_crash(engine):
    from shapeshift.engine.serving.async_engine import RequestRejectedError

    ae = make_async(engine)
    try:
        async def run():
            # Past max_model_len: the engine's own check rejects it (the server checks earlier).
            with pytest.raises(RequestRejectedError):
                await asyncio.wait_for(drain(ae.submit("too-long", [1] * (MAX_MODEL_LEN + 5), params(4))), 30)
            return await asyncio.wait_for(drain(ae.submit("ok", [1, 2], params(2))), 30)
        outs = asyncio.run(run())
    finally:
        ae.stop()
    assert outs[-1].finished and ae.num_in_flight == 0


def _app(engine, max_waiting=2):
    from shapeshift.engine.serving.async_engine import AsyncEngine
    from shapeshift.engine.serving.metrics import EngineMetrics
    from shapeshift.engine.serving.server import build_app

    metrics = EngineMetrics(MODEL)
    ae = AsyncEngine(engine, max_waiting=max_waiting, metrics=metrics).start()
    return build_app(ae, metrics, MODEL), ae


async def _post(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post(path, json=body, timeout=30)


async def _get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.get(path, timeout=30)


def test_http_500_on_step_failure_then_200(engine):
    flaky = FlakyStep(engine)
    app, ae = _app(engine)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    try:
        async def run():
            flaky.armed = True
            failed = await _post(app, "/v1/completions", body)
            ok = await _post(app, "/v1/completions", body)
            health = await _get(app, "/health")
            return failed, ok, health
        failed, ok, health = asyncio.run(run())
    finally:
        ae.stop()
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "engine_error"
    assert "injected step failure" in failed.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert health.status_code == 200


def test_health_503_when_loop_stopped(engine):
    app, ae = _app(engine)

    async def run():
        healthy = await _get(app, "/health")
        await asyncio.to_thread(ae.stop)
        dead = await _get(app, "/health")
        refused = await _post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        return healthy, dead, refused

    healthy, dead, refused = asyncio.run(run())
    assert healthy.status_code == 200
    assert dead.status_code == 503 and dead.json()["error"]["code"] == "engine_unavailable"
    assert refused.status_code == 503
