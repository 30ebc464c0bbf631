"""Real clients from PyPI, unmodified, against `shapeshift serve --model tiny-llama`: the `openai`
async client (plain and streaming), LangChain's ChatOpenAI and OpenAI (completions) LLMs, and
guidellm's CLI (from the clients environment hack/setup.sh builds) in its default streaming mode.
lm-eval's local-completions runs in test_server_smollm2.py (it needs a real model to score).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import pytest

from server_harness import MODEL

GREEDY = {"temperature": 0.0}


def test_openai_async_plain_and_streaming(server):
    import openai

    async def run() -> tuple[str, str, list]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "async hello"}], max_tokens=6,
                          **GREEDY, extra_body={"ignore_eos": True})
            whole, stream = await asyncio.gather(
                client.chat.completions.create(**kwargs),
                client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            chunks = [c async for c in stream]
            many = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=2)
                                          for i in range(4)))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return whole.choices[0].message.content, streamed, [chunks[-1].usage, *many]

    whole, streamed, (usage, *many) = asyncio.run(run())
    assert streamed == whole
    assert usage.completion_tokens == 6
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in many)


def test_langchain_chat_invoke_and_stream(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused",
                                       temperature=0, max_tokens=5, max_retries=0, timeout=60)
    reply = chat.invoke([("system", "You are terse."), ("human", "Name a colour.")])
    assert isinstance(reply.content, str)
    assert reply.usage_metadata["output_tokens"] >= 1
    streamed = "".join(chunk.content for chunk in chat.stream("Stream a word."))
    again = chat.invoke("Stream a word.")
    assert streamed == again.content
    batch = chat.batch(["one", "two"])
    assert len(batch) == 2


def test_langchain_completions_llm(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.OpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", temperature=0,
                                  max_tokens=4, max_retries=0, timeout=60)
    # LangChain sends the prompt as a one-element list (several with batch), and n / best_of.
    text = llm.invoke("Once upon a time")
    assert isinstance(text, str)
    assert llm.batch(["first", "second", "third"]) == [llm.invoke(p) for p in ("first", "second", "third")]
    assert "".join(llm.stream("Once upon a time")) == text


GUIDELLM_REQUESTS = 4
GUIDELLM_OUTPUT_TOKENS = 8


def test_guidellm_benchmarks_the_server_streaming(server, clients_venv, tmp_path):
    """`guidellm run` as a process, with its defaults (chat completions, streamed) but a few
    synchronous requests of synthetic text; its JSON report must show every request served,
    streamed token by token, with the output length it asked for. Its tokenizer is the served
    model's own (the random presets' byte-level one, saved in Hugging Face layout), so the token
    counts it makes agree with the server's."""
    from shapeshift.engine.models.tokenizer import Tokenizer

    Tokenizer.byte_level().save(tmp_path / "tokenizer")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.monotonic()
    run = subprocess.run(
        [str(clients_venv / "bin" / "guidellm"), "run",
         "--backend", f"kind=openai_http,target={server.base_url}",
         "--profile", "kind=synchronous",
         "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
         "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={GUIDELLM_OUTPUT_TOKENS}",
         "--tokenizer", f"kind=huggingface_auto,model={tmp_path / 'tokenizer'}",
         "--output", f"kind=json,path={report}", "--disable-console-interactive"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    print(f"guidellm ran {time.monotonic() - started:.1f} s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    assert bench["config"]["backend"]["stream"] is True  # its default mode
    assert bench["config"]["backend"]["request_format"] == "/v1/chat/completions"
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == 0 and made["incomplete"] == 0, made
    assert 1 <= made["successful"] == made["total"] <= GUIDELLM_REQUESTS, made
    metrics = bench["metrics"]
    output = metrics["output_token_count"]["successful"]
    assert output["min"] == output["max"] == GUIDELLM_OUTPUT_TOKENS  # the server honoured its max_tokens
    assert metrics["request_streaming_iterations_count"]["successful"]["min"] > 1  # streamed, not one body
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert 1 <= ttft["count"] <= made["successful"] and ttft["min"] > 0  # (its sample may leave one out)
