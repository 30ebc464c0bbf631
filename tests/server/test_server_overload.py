"""Overload: with one running slot and one waiting slot, a burst gets 429s at once, never a hang."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_harness import MODEL, ServerProcess, scrape, value

BURST = 8
# Long enough that the burst overlaps the first requests on any CPU.
GEN_TOKENS = 120
BURST_DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(["--max-num-seqs", "1", "--max-waiting", "1", "--max-num-batched-tokens", "64"],
                         tmp_path_factory.mktemp("overload") / "serve.log").start()
    yield proc
    proc.stop()


async def _burst(base_url: str) -> list[tuple[int, dict, float]]:
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=BURST_DEADLINE_S) as client:
        async def one() -> tuple[int, dict, float]:
            t0 = time.monotonic()
            resp = await client.post("/v1/completions", json=body)
            return resp.status_code, resp.json(), time.monotonic() - t0

        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(BURST))), BURST_DEADLINE_S)


def test_burst_gets_429_without_hanging(small_server):
    results = asyncio.run(_burst(small_server.base_url))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    # At most one running + one waiting can be admitted while the first is still generating.
    assert len(rejected) >= BURST - 2, statuses
    assert len(ok) >= 1
    for _, body, _ in ok:
        assert body["usage"]["completion_tokens"] == GEN_TOKENS
    slowest_ok = max(elapsed for _, _, elapsed in ok)
    for _, body, elapsed in rejected:
        assert body["error"]["type"] == "rate_limit_exceeded"
        assert body["error"]["code"] == "server_overloaded"
        assert elapsed < slowest_ok, "a 429 waited as long as a served request"
    assert value(scrape(small_server.base_url), "shapeshift_requests_total", status="rejected") == len(rejected)
    # Slots are released: the next request is served.
    again = httpx.post(f"{small_server.base_url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "after the burst", "max_tokens": 2})
    assert again.status_code == 200, again.text
