"""The LLM coding agent against OpenAI-compatible endpoints.

No real LLM provider is reachable here, so the success path runs against
`FakeOpenAIChatServer`, a test double: a real local HTTP server that answers
/v1/chat/completions with scripted replies. The engine's own OpenAI-compatible server
serving smollm2-135m stands in for a real model whose replies are not valid code.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from shapeshift.engine.compile.agents import LLMAgent, extract_module
from shapeshift.engine.compile.agents.llm import ReplyError
from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.search_space import build_search_space
from shapeshift.engine.compile.source_edits import apply_edits
from shapeshift.engine.forward_pass.bundle import STOCK_BUNDLE_DIR

STOCK_SOURCE = (STOCK_BUNDLE_DIR / "forward.py").read_text()


class FakeOpenAIChatServer:
    """Test double of an OpenAI-compatible provider: scripted replies, requests recorded.

    Each scripted item is (status, body): body is the assistant text (wrapped in a chat
    completion) or raw bytes sent as they are.
    """

    def __init__(self, script: list[tuple[int, str | bytes]]):
        self.script = list(script)
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                status, reply = outer.script.pop(0) if outer.script else (200, "no more scripted replies")
                if isinstance(reply, bytes):
                    payload = reply
                else:
                    payload = json.dumps({"id": "fake-1", "object": "chat.completion", "model": body.get("model"),
                                          "choices": [{"index": 0, "finish_reason": "stop",
                                                       "message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def space():
    return build_search_space(device="cpu", concurrency=32)


def make_agent(space, board, url, tmp_path, **kw):
    key = tmp_path / "api-key"
    key.write_text("sk-test-secret\n")
    return LLMAgent(space, board, 0, base_url=url, model="fake-coder", api_key_file=key,
                    stock_source=STOCK_SOURCE, context="tiny-llama on a CPU", **kw)


def test_extract_module_is_defensive() -> None:
    good = "def build(model_config, weights, recipe):\n    return None\n"
    assert extract_module(f"Here:\n```python\n{good}```\nfaster because X") == good
    # untagged fences and several blocks: the one defining build() wins
    assert extract_module(f"```\nprint('hi')\n```\n```\n{good}```") == good
    assert extract_module(good) == good  # bare module text
    for reply, why in [("", "empty"), ("I cannot do that.", "does not parse"),
                       ("```python\ndef build(:\n```", "does not parse"),
                       ("```python\nx = 1\n```", "no top-level build")]:
        with pytest.raises(ReplyError, match=why):
            extract_module(reply)


def test_success_path_with_the_scripted_endpoint(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    board.append("candidate", **Candidate(space.default(), agent="baseline").to_entry())
    board.append("result", trial_id="t0", digest=Candidate(space.default()).digest, tier="fast", status="ok",
                 metrics={"throughput": 123.0})
    new_module = apply_edits(STOCK_SOURCE, ["index_select_gather"])
    reply = f"Gather the cache with index_select.\n```python\n{new_module}```\nOne fused kernel instead of four ops."
    with FakeOpenAIChatServer([(200, reply)]) as fake:
        agent = make_agent(space, board, fake.base_url, tmp_path)
        [cand] = agent.propose(1)
    assert cand.source == new_module and cand.agent == "llm"
    assert cand.note == "One fused kernel instead of four ops."
    assert space.is_valid(cand.recipe)
    req = fake.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test-secret"
    assert req["body"]["model"] == "fake-coder"
    user = req["body"]["messages"][-1]["content"]
    assert "def build" in user and "123.0 tok/s" in user  # raw source and the board went out


def test_garbage_replies_are_logged_and_skipped(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    script = [(200, "Sure! Here is a faster version: just use a GPU."),
              (200, "```python\ndef build(model_config, weights recipe):\n    pass\n```"),
              (200, "```python\nclass Fast:\n    pass\n```"),
              (500, "internal error"),
              (200, b"this is not json"),
              (200, b'{"choices": []}')]
    with FakeOpenAIChatServer(script) as fake:
        agent = make_agent(space, board, fake.base_url, tmp_path)
        results = [agent.propose(1) for _ in script]
    assert results == [[]] * len(script)
    notes = [n["text"] for n in board.entries("note") if n.get("garbage")]
    assert len(notes) == len(script)
    assert any("does not parse" in t for t in notes) and any("no top-level build" in t for t in notes)
    assert any("HTTP 500" in t for t in notes) and any("not an OpenAI chat completion" in t for t in notes)


def test_unreachable_endpoint_and_missing_key_file(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = make_agent(space, board, f"http://127.0.0.1:{port}/v1", tmp_path, timeout_s=2)
    assert agent.propose(1) == []
    assert "LLM reply skipped" in board.entries("note")[-1]["text"]
    with pytest.raises(ValueError, match="key file"):
        LLMAgent(space, board, base_url="http://x/v1", model="m", api_key_file=tmp_path / "missing",
                 stock_source=STOCK_SOURCE)


def test_llm_module_is_measured_by_the_real_evaluator(tmp_path: Path, space) -> None:
    """A scripted module goes through the real fast tier; one that breaks at build is refused."""
    from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
    from shapeshift.engine.contracts.traffic_profile import builtin_profile

    ev = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", max_model_len=256, screen_requests=8, screen_repeats=1, cpu_threads=1,
        work_dir=str(tmp_path / "work")))
    good = Candidate(space.default(), apply_edits(STOCK_SOURCE, ["index_select_gather"]), "llm")
    broken = Candidate(space.default(), STOCK_SOURCE + "\n\ndef build(model_config, weights, recipe):\n"
                       "    raise RuntimeError('forgot the weights')\n", "llm")
    m = ev.screen(good)
    assert m.ok and m.samples[0] > 0, m.error
    # One repeat of the replay: per-user speed (p90 = the slow tail, at most the median) and TTFT.
    assert len(m.samples) == len(m.per_user_p50) == len(m.per_user_p90) == len(m.ttft_p50) == len(m.ttft_p90) == 1
    assert 0 < m.per_user_p90[0] <= m.per_user_p50[0] and 0 < m.ttft_p50[0] <= m.ttft_p90[0]
    bad = ev.screen(broken)
    assert not bad.ok and "forgot the weights" in bad.error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_engine_server_with_smollm2_replies_are_handled(tmp_path: Path, space, smollm2_folder) -> None:
    """A real model (SmolLM2-135M on the engine's own server) writes no valid module: skipped cleanly."""
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from shapeshift.engine.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", "--model", "smollm2-135m", "--port", str(port), "--max-model-len", "8192",
           "--log-level", "warning"]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("the engine server did not become healthy")
        board = Board(tmp_path / "b.jsonl")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        agent = make_agent(space, board, f"http://127.0.0.1:{port}/v1", tmp_path, timeout_s=300, max_tokens=48,
                           temperature=0.0)
        agent.model = models["data"][0]["id"]
        assert agent.propose(1) == []
        [note] = [n for n in board.entries("note") if n.get("garbage")]
        assert "LLM reply skipped" in note["text"]
        assert agent.calls == 1
    finally:
        server.terminate()
        server.wait(timeout=30)
