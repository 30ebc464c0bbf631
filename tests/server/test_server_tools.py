"""Tool calls through the real `openai` client against the shared server (engine/serving/tools.py).

tool_choice "required" or a named function constrains the reply to the tools' parameter
schemas (xgrammar), so even the random tiny model's calls parse and fit the schema; the
client's own models (ChatCompletionMessageToolCall, streamed tool-call deltas) read them.
"""

from __future__ import annotations

import json

import pytest

from server_harness import MODEL

pytest.importorskip("xgrammar")

DECIDE = {"type": "function", "function": {
    "name": "decide", "description": "Say yes or no.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                   "required": ["answer"], "additionalProperties": False}}}
LIGHT = {"type": "function", "function": {
    "name": "set_light", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                        "required": ["on"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Should I?"}]


def _fits(call) -> None:
    args = json.loads(call.function.arguments)
    if call.function.name == "decide":
        assert set(args) == {"answer"} and args["answer"] in ("yes", "no"), args
    else:
        assert call.function.name == "set_light" and set(args) == {"on"} and isinstance(args["on"], bool), args
    assert call.id.startswith("call_") and call.type == "function"


def test_a_named_function_is_called_with_arguments_of_its_schema(openai_client):
    for seed in range(3):
        resp = openai_client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[DECIDE, LIGHT], max_tokens=48, temperature=1.0, seed=seed, n=2,
            tool_choice={"type": "function", "function": {"name": "decide"}})
        for choice in resp.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.function.name == "decide"
            _fits(call)


def test_required_calls_one_or_more_of_the_tools(openai_client):
    names = set()
    for seed in range(4):
        resp = openai_client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[DECIDE, LIGHT], tool_choice="required", max_tokens=96,
            temperature=1.0, seed=seed)
        choice = resp.choices[0]
        if choice.finish_reason == "length":  # a random model may ramble inside the array: the text stays
            assert choice.message.tool_calls is None and choice.message.content
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            _fits(call)
            names.add(call.function.name)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    assert names, "no seed produced a finished call"
    # parallel_tool_calls false: exactly one call
    resp = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[DECIDE, LIGHT], tool_choice="required", parallel_tool_calls=False,
        max_tokens=64, temperature=0)
    choice = resp.choices[0]
    if choice.finish_reason == "tool_calls":
        assert len(choice.message.tool_calls) == 1
        _fits(choice.message.tool_calls[0])


def test_streamed_tool_calls_come_whole_before_the_finish(openai_client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[DECIDE], max_tokens=48, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "decide"}})
    whole = openai_client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in openai_client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    with_calls = [c for c in chunks if c.choices[0].delta.tool_calls]
    assert len(with_calls) == 1 and with_calls[0] is chunks[-2]  # then the finish reason in a chunk of its own
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-2].choices[0].finish_reason is None
    assert not chunks[-1].choices[0].delta.tool_calls and not chunks[-1].choices[0].delta.content
    assert not any(c.choices[0].delta.content for c in chunks)
    (delta,) = chunks[-2].choices[0].delta.tool_calls
    assert delta.index == 0 and delta.function.name == "decide"
    assert json.loads(delta.function.arguments) == json.loads(whole.function.arguments)  # greedy: the same call


def test_a_tool_result_in_the_history_is_accepted(openai_client):
    """The assistant's call and the tool's result, sent back, go through the chat template."""
    call = {"id": "call_1", "type": "function", "function": {"name": "decide", "arguments": "{\"answer\": \"yes\"}"}}
    resp = openai_client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, tools=[DECIDE], tool_choice="none",
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "done"}])
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason in ("stop", "length")


def test_a_reply_cut_short_is_not_reported_as_a_finished_call():
    """max_tokens or a stop string can end the constrained JSON early: the finish reason says so."""
    from shapeshift.engine.serving.protocol import ChatCompletionRequest
    from shapeshift.engine.serving.tools import ToolPlan

    def plan(choice):
        return ToolPlan.of(ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": ASK, "tools": [DECIDE, LIGHT], "tool_choice": choice}))

    named = plan({"type": "function", "function": {"name": "decide"}})
    message, finish = named.reply('{"answer": "yes"}', "stop")
    assert finish == "tool_calls" and message.tool_calls[0]["function"]["arguments"] == '{"answer": "yes"}'
    message, finish = named.reply('{"answer": "ye', "stop")  # a stop string inside the JSON
    assert finish == "stop" and message.tool_calls[0]["function"]["arguments"] == '{"answer": "ye'
    required = plan("required")
    message, finish = required.reply('[{"name": "set_light", "arguments": {"on": tr', "length")
    assert finish == "length" and message.tool_calls is None and message.content.startswith("[")
    message, finish = required.reply('[{"name": "set_light", "arguments": {"on": true}}]', "stop")
    assert finish == "tool_calls" and message.tool_calls[0]["function"] == {"name": "set_light",
                                                                            "arguments": '{"on": true}'}
