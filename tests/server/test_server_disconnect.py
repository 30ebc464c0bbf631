"""A client that goes away mid-generation gets its request aborted in the engine."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from server_harness import MODEL, ServerProcess, scrape, value

LONG_LEN = 4096
LONG_GEN = 4000  # seconds of CPU decoding: far longer than the test waits


@pytest.fixture(scope="module")
def long_server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(["--max-num-seqs", "2", "--max-model-len", str(LONG_LEN), "--num-kv-blocks", "300"],
                         tmp_path_factory.mktemp("disconnect") / "serve.log").start()
    yield proc
    proc.stop()


def _wait_for_abort(base_url: str, aborts_before: float, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = scrape(base_url)
        if value(samples, "shapeshift_requests_total", status="abort") > aborts_before and \
                value(samples, "shapeshift_requests_running") == 0:
            return samples
        time.sleep(0.1)
    raise AssertionError(f"request not aborted within {timeout_s}s: {samples}")


def test_streaming_client_disconnect_aborts(long_server):
    before = value(scrape(long_server.base_url), "shapeshift_requests_total", status="abort")
    body = {"model": MODEL, "prompt": "abort me", "max_tokens": LONG_GEN, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{long_server.base_url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        first = next(line for line in resp.iter_lines() if line)
        assert first.startswith("data: ")
    # Leaving the block closed the connection with thousands of tokens still to go.
    after = _wait_for_abort(long_server.base_url, before)
    assert value(after, "shapeshift_requests_total", status="length") == 0


def test_non_streaming_client_disconnect_aborts(long_server):
    before = value(scrape(long_server.base_url), "shapeshift_requests_total", status="abort")
    payload = json.dumps({"model": MODEL, "prompt": "abort me too", "max_tokens": LONG_GEN,
                          "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", long_server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 10
        while value(scrape(long_server.base_url), "shapeshift_requests_running") < 1:
            assert time.monotonic() < deadline, "request never started running"
            time.sleep(0.05)
    _wait_for_abort(long_server.base_url, before)
    # The slot is free again: a short request is served.
    resp = httpx.post(f"{long_server.base_url}/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "next", "max_tokens": 2})
    assert resp.status_code == 200
