"""The field policy and the honoured sampling controls, through the real `openai` client and raw
HTTP against `shapeshift serve --model tiny-llama` (docs/serving-api.md).

Greedy outputs are compared with `LLMEngine.generate` on the same prompt; prompt logprobs
with the log-softmax of `LLMEngine.prompt_logits`.
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import math
import types

import httpx
import openai
import pytest

from server_harness import MODEL

GREEDY = {"temperature": 0.0}
N_TOKENS = 6
PROMPT = [5, 17, 99, 3, 250, 42, 7]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _reference(engine, prompt_ids: list[int], max_tokens: int = N_TOKENS, **params) -> list[int]:
    from shapeshift.engine.core.sampling import SamplingParams

    return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                        **params))[0]


def _complete(client, **kwargs):
    extra = {"return_token_ids": True, "ignore_eos": True, **kwargs.pop("extra_body", {})}
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": N_TOKENS, **GREEDY, **kwargs}
    return client.completions.create(**args, extra_body=extra)


# Parameters of the openai client's create() that configure the client, not the request body.
CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


def _create_parameters(kind: str) -> dict[str, object]:
    """The request parameters of the installed openai package's chat or completions create(), each
    with the type that package declares for it."""
    import typing_extensions

    if kind == "chat":
        from openai.resources.chat.completions import Completions
    else:
        from openai.resources.completions import Completions
    params = inspect.signature(Completions.create).parameters
    hints = typing_extensions.get_type_hints(Completions.create)
    return {name: hints[name] for name, p in params.items() if name not in CLIENT_ONLY and p.kind is p.KEYWORD_ONLY}


def _sample(tp):
    """A value of the type the openai package declares for a parameter: a Literal's first choice,
    a TypedDict with its required keys, a string, ... (Omit and None left out)."""
    import typing

    import typing_extensions

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Literal, typing_extensions.Literal):
        return args[0]
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None) and getattr(a, "__name__", "") not in ("Omit", "NotGiven")]
        return _sample(kept[0])
    if origin is typing_extensions.Required or origin is typing.Required:
        return _sample(args[0])
    if hasattr(tp, "__required_keys__"):  # a TypedDict (total=False, its Required[...] keys given)
        hints = typing_extensions.get_type_hints(tp, include_extras=True)
        return {key: _sample(hint) for key, hint in sorted(hints.items())
                if key in tp.__required_keys__ or typing.get_origin(hint) in (typing.Required,
                                                                                typing_extensions.Required)}
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        return {"k": "v"}
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence):
        return []
    return {str: "x", bool: True, int: 1, float: 1.0}[tp]


def test_every_openai_request_parameter_is_a_field():
    """No parameter the current openai client can send is an 'Unknown field' here (a new one fails
    this test until protocol.py decides: honour, refuse with a reason, or INERT_FIELDS)."""
    from shapeshift.engine.serving.protocol import INERT_FIELDS, ChatCompletionRequest, CompletionRequest

    for kind, model in (("chat", ChatCompletionRequest), ("completions", CompletionRequest)):
        fields = {f.alias or name for name, f in model.model_fields.items()}
        missing = sorted(set(_create_parameters(kind)) - fields)
        assert not missing, f"openai {kind}.create() parameters the server does not know: {missing}"
    # every inert field is one the client sends (not a made-up name)
    assert set(INERT_FIELDS) <= set(_create_parameters("chat")), set(INERT_FIELDS) - set(_create_parameters("chat"))


def test_inert_openai_fields_are_accepted_and_change_nothing(server, openai_client):
    from shapeshift.engine.serving.protocol import INERT_FIELDS

    plain = _ids(_complete(openai_client).choices[0])
    inert = {"store": False, "metadata": {"team": "search"}, "service_tier": "auto", "user": "u-1"}
    assert _ids(_complete(openai_client, extra_body=inert).choices[0]) == plain
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    base = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=30).json()
    # Each inert field at a value of the type the installed openai package gives it.
    hints = _create_parameters("chat")
    sampled = {name: _sample(hints[name]) for name in INERT_FIELDS}
    assert sampled["prompt_cache_retention"] in ("in_memory", "24h") and sampled["prompt_cache_key"] == "x"
    chat_inert = {**chat, **sampled, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                  "response_format": {"type": "text"}, "modalities": ["text"], "seed": 3,
                  "messages": [{"role": "user", "content": [
                      {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}]}]}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat_inert, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == base["choices"][0]["token_ids"]
    # the same request as the openai client itself sends it, each inert field as a create() argument
    extensions = {"ignore_eos": True, "return_token_ids": True}
    sent = openai_client.chat.completions.create(
        **{k: v for k, v in chat_inert.items() if k not in extensions}, extra_body=extensions)
    assert _ids(sent.choices[0]) == base["choices"][0]["token_ids"]


def test_moderation_is_refused_naming_the_field(server, openai_client):
    moderation = _sample(_create_parameters("chat")["moderation"])
    assert moderation == {"model": "x"}  # the openai package's required keys
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "moderation": moderation}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "moderation" and "omit it" in error["message"]
    # what the openai client raises when its own moderation argument is refused
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(**body)
    assert refused.value.param == "moderation" and "omit it" in refused.value.message


def test_content_parts_of_text_and_a_refusal_sent_back(openai_client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                {"role": "user", "content": "Please."}]
    resp = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_continuous_usage_stats_on_every_chunk(openai_client):
    chunks = list(openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N_TOKENS, **GREEDY, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    with_text = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in with_text] == list(range(1, N_TOKENS + 1))
    assert all(c.usage.prompt_tokens == len(PROMPT) for c in with_text)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N_TOKENS


@pytest.mark.parametrize("prompts", [[PROMPT], ["The first prompt", "A second one", "Third"]],
                         ids=["one-element", "three-prompts"])
def test_list_prompt_gives_one_choice_per_prompt(openai_client, reference_engine, prompts):
    resp = _complete(openai_client, prompt=prompts)
    assert [c.index for c in resp.choices] == list(range(len(prompts)))
    tok = reference_engine.tokenizer
    prompt_ids = [p if isinstance(p, list) else tok.encode(p, add_special_tokens=True) for p in prompts]
    for choice, ids in zip(resp.choices, prompt_ids):
        assert _ids(choice) == _reference(reference_engine, ids)
    assert resp.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    assert resp.usage.completion_tokens == N_TOKENS * len(prompts)


def test_n_choices_are_independent_and_seeded_per_choice(openai_client):
    sampled = {"temperature": 1.0, "seed": 77}
    three = _complete(openai_client, n=3, **sampled)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 3 * N_TOKENS
    one = _complete(openai_client, **sampled)
    assert _ids(three.choices[0]) == _ids(one.choices[0])  # choice j draws from seed + j
    second = _complete(openai_client, **{**sampled, "seed": 78})
    assert _ids(three.choices[1]) == _ids(second.choices[0])
    assert len({tuple(_ids(c)) for c in three.choices}) > 1
    greedy = _complete(openai_client, n=2)
    assert _ids(greedy.choices[0]) == _ids(greedy.choices[1])


def test_n_choices_stream_with_their_indices(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two please"}], max_tokens=4, n=2, temperature=1.0,
        seed=5, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert chunks[-1].usage.completion_tokens == 8


def test_logit_bias_forces_and_bans_tokens(openai_client, reference_engine):
    forced = _complete(openai_client, logit_bias={"321": 100})
    assert _ids(forced.choices[0]) == [321] * N_TOKENS
    plain = _reference(reference_engine, PROMPT)
    banned = _ids(_complete(openai_client, logit_bias={str(plain[0]): -100}).choices[0])
    assert banned[0] != plain[0]
    assert banned == _reference(reference_engine, PROMPT, logit_bias={plain[0]: -100.0})


def test_min_tokens_holds_back_stop_tokens(openai_client, reference_engine):
    plain = _reference(reference_engine, PROMPT)
    stopped = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N_TOKENS, **GREEDY,
                                               extra_body={"stop_token_ids": [plain[0]], "return_token_ids": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N_TOKENS, **GREEDY,
        extra_body={"stop_token_ids": [plain[0]], "min_tokens": 3, "return_token_ids": True})
    assert held.usage.completion_tokens >= 3
    assert plain[0] not in _ids(held.choices[0])[:3]


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.0), ("presence_penalty", 2.0),
                                         ("repetition_penalty", 3.0)])
def test_penalties_match_the_engine(openai_client, reference_engine, field, value):
    got = _ids(_complete(openai_client, max_tokens=12, **({field: value} if field != "repetition_penalty" else {}),
                         extra_body={field: value} if field == "repetition_penalty" else {}).choices[0])
    assert got == _reference(reference_engine, PROMPT, max_tokens=12, **{field: value})
    if field == "presence_penalty":
        # 2 nats off every token already said: the random model's loops break.
        assert got != _reference(reference_engine, PROMPT, max_tokens=12)


def test_min_p_one_is_greedy(openai_client, reference_engine):
    got = _complete(openai_client, temperature=1.0, seed=1, extra_body={"min_p": 1.0})
    assert _ids(got.choices[0]) == _reference(reference_engine, PROMPT)


def test_chat_top_logprobs(openai_client):
    resp = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=5,
        **GREEDY, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert 1 <= len(entry.top_logprobs) <= 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_echo_with_prompt_logprobs(openai_client, reference_engine):
    import torch

    resp = _complete(openai_client, max_tokens=1, echo=True, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = torch.log_softmax(reference_engine.prompt_logits(PROMPT).float(), dim=-1)
    for pos in range(1, len(PROMPT)):
        assert lp.token_logprobs[pos] == pytest.approx(expected[pos - 1, PROMPT[pos]].item(), abs=1e-4)
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(expected[pos - 1].max().item(), abs=1e-4)
        assert len(lp.top_logprobs[pos]) <= 2
    prompt_text = reference_engine.tokenizer.decode(PROMPT)
    assert choice.text.startswith(prompt_text)
    assert lp.text_offset[len(PROMPT)] == len(prompt_text)
    assert math.isfinite(lp.token_logprobs[-1])


def test_echo_streams_the_prompt_first(server):
    body = {"model": MODEL, "prompt": "Echo this", "max_tokens": 2, "temperature": 0, "stream": True,
            "echo": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line and line != "data: [DONE]"]
    first = json.loads(events[0].removeprefix("data: "))
    assert first["choices"][0]["text"].startswith("Echo this")


def test_the_api_and_the_sampler_agree_on_the_top_logprobs_maximum():
    from shapeshift.engine.core import sampling
    from shapeshift.engine.serving import protocol

    assert protocol.MAX_TOP_LOGPROBS == sampling.MAX_TOP_LOGPROBS


def test_prompt_logprobs_in_chunks_equal_one_pass(reference_engine):
    """Long prompts are scored in prefill chunks of max_num_batched_tokens; the result is the same."""
    import torch

    prompt = [(7 * i + 3) % 250 + 1 for i in range(100)]
    whole = torch.log_softmax(reference_engine.prompt_logits(prompt).float(), dim=-1)
    saved = reference_engine.config.max_num_batched_tokens
    reference_engine.config.max_num_batched_tokens = 32
    try:
        chunked = reference_engine.prompt_logprobs(prompt, top_n=2)
    finally:
        reference_engine.config.max_num_batched_tokens = saved
    assert len(chunked) == len(prompt) and chunked[0] is None
    for pos in range(1, len(prompt)):
        assert chunked[pos][0] == pytest.approx(whole[pos - 1, prompt[pos]].item(), abs=1e-5)
        assert chunked[pos][1][0][0] == whole[pos - 1].argmax().item()


def test_json_schema_response_format_constrains_the_output(openai_client):
    pytest.importorskip("xgrammar")
    schema = {"type": "string", "enum": ["yes", "no"]}
    for seed in range(3):
        resp = openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "yes or no?"}], max_tokens=12, temperature=1.0,
            seed=seed, n=2, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        for choice in resp.choices:
            assert json.loads(choice.message.content) in ("yes", "no"), choice.message.content
            assert choice.finish_reason == "stop"  # only the stop token is allowed once the JSON is complete


def test_json_object_response_format_starts_an_object(openai_client):
    pytest.importorskip("xgrammar")
    resp = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=8, temperature=0,
        response_format={"type": "json_object"})
    assert resp.choices[0].message.content.lstrip().startswith("{")
