"""The real `openai` client against `shapeshift serve --model tiny-llama`.

Greedy outputs through the API are compared token for token with
`LLMEngine.generate` on the same prompt (the `return_token_ids` extension
exposes the ids; `ignore_eos` fixes the length).
"""

from __future__ import annotations

import httpx
import pytest

from server_harness import MAX_MODEL_LEN, MODEL

GREEDY = {"temperature": 0.0}
N_TOKENS = 8


def _reference(engine, prompt_ids: list[int], max_tokens: int = N_TOKENS) -> list[int]:
    from shapeshift.engine.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt_ids], params)[0]


def _chat_prompt_ids(engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_health_and_models(server, openai_client):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_greedy_token_ids_equal_engine_generate(openai_client, reference_engine):
    prompt_ids = [5, 17, 99, 3, 250, 42, 7, 7, 130]
    resp = openai_client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=N_TOKENS, **GREEDY,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == _reference(reference_engine, prompt_ids)
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == N_TOKENS
    assert resp.usage.total_tokens == len(prompt_ids) + N_TOKENS
    assert resp.model == MODEL and resp.object == "text_completion"


def test_completion_string_prompt_uses_tokenizer_with_special_tokens(openai_client, reference_engine):
    prompt = "The quick brown fox"
    resp = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=N_TOKENS, **GREEDY,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = reference_engine.tokenizer.encode(prompt, add_special_tokens=True)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    expected = _reference(reference_engine, prompt_ids)
    assert resp.choices[0].model_extra["token_ids"] == expected
    assert resp.choices[0].text == reference_engine.tokenizer.decode(expected).rstrip("\ufffd")


def test_completion_stream_equals_non_stream(openai_client):
    kwargs = dict(model=MODEL, prompt="Streaming test prompt", max_tokens=N_TOKENS, **GREEDY)
    whole = openai_client.completions.create(**kwargs, extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(openai_client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2, "streaming delivered everything in one chunk"
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    streamed_ids = [t for c in text_chunks for t in c.choices[0].model_extra["token_ids"]]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == N_TOKENS


def test_chat_greedy_matches_engine_and_template(openai_client, reference_engine):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    resp = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=N_TOKENS, **GREEDY,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = _chat_prompt_ids(reference_engine, messages)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    choice = resp.choices[0]
    expected = _reference(reference_engine, prompt_ids)
    assert choice.model_extra["token_ids"] == expected
    assert choice.message.role == "assistant"
    # The detokenizer holds back a trailing incomplete UTF-8 character (random
    # weights emit arbitrary bytes); everything before it must match.
    assert choice.message.content == reference_engine.tokenizer.decode(expected).rstrip("\ufffd")
    assert choice.finish_reason == "length"
    assert resp.object == "chat.completion"


def test_chat_stream_equals_non_stream(openai_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Stream me"}], max_tokens=N_TOKENS,
                  **GREEDY, extra_body={"ignore_eos": True})
    whole = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == N_TOKENS
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_raw_sse_framing_ends_with_done(server):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) == 3 + 1  # one chunk per token, then [DONE]


def test_seeded_sampling_is_reproducible(openai_client):
    kwargs = dict(model=MODEL, prompt=[9, 8, 7, 6], max_tokens=N_TOKENS, temperature=1.0, seed=1234,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    first = openai_client.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    second = openai_client.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    assert first == second
    others = {tuple(openai_client.completions.create(**{**kwargs, "seed": s}).choices[0].model_extra["token_ids"])
              for s in (1, 2, 3)}
    assert len(others | {tuple(first)}) > 1, "different seeds all gave the same sample"


def test_stop_string_cuts_the_text(openai_client):
    # Random weights emit mostly non-text bytes; seeded sampling finds a
    # continuation with enough ASCII characters to pick a stop string from.
    prompt, text, seed = "Once", "", None
    for seed in range(16):
        text = openai_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True}).choices[0].text
        alnum = [i for i, ch in enumerate(text) if ch.isascii() and ch.isalnum()]
        if len(alnum) >= 3:
            break
    else:
        pytest.fail(f"no seed gave a continuation with 3 ASCII letters or digits; last: {text!r}")
    stop = text[alnum[1]]
    stopped = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=seed, stop=[stop],
        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stop not in stopped.choices[0].text


def test_logprobs(openai_client):
    comp = openai_client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=5, logprobs=1, **GREEDY,
                                            extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == 5
    assert all(x <= 0.0 for x in lp.token_logprobs)
    chat = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, logprobs=True, **GREEDY,
                                                 extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(c.logprob <= 0.0 for c in content)
