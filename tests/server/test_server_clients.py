"""Real clients from PyPI, unmodified, against `shapeshift serve --model tiny-llama`: the `openai`
async client (plain and streaming) and LangChain's ChatOpenAI and OpenAI (completions) LLMs.
lm-eval's local-completions runs in test_server_smollm2.py (it needs a Hugging Face tokenizer).
"""

from __future__ import annotations

import asyncio

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
