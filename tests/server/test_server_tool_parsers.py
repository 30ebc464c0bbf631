"""tool_choice "auto": the tool-call parsers (engine/serving/tool_parsers.py) on their own, and
through the shared server (`shapeshift serve --tool-call-parser hermes`) with the real `openai`
client and LangChain.

A tiny random model never writes a tool call by itself (nor, as tried, does SmolLM2-135M from a
prompt), so the server tests force the reply's text through constrained decoding with the
`structural_tag` response format: free text, then a <tool_call> block whose JSON the grammar
spells and whose answer the model picks. The parser must then find the call in that text, whole
and streamed; text that only looks like a call stays content.
"""

from __future__ import annotations

import json

import pytest

from server_harness import MODEL

from test_server_tools import ASK, DECIDE, LIGHT  # the same two tools and question
NAMES = {"decide", "set_light"}


# ------------------------------------------------------------------ the parsers alone

def _parsers():
    from shapeshift.engine.serving.tool_parsers import PARSERS

    return PARSERS


def test_hermes_reads_blocks_arrays_and_content():
    hermes = _parsers()["hermes"]
    # Qwen2.5 / Hermes: one block per call, content before the first
    text = ('Let me check.\n<tool_call>\n{"name": "decide", "arguments": {"answer": "yes"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "set_light", "arguments": {"on": true}}\n</tool_call>')
    assert hermes.parse(text, NAMES) == ("Let me check.", [("decide", '{"answer": "yes"}'),
                                                           ("set_light", '{"on": true}')])
    # SmolLM2: one block holding an array of calls
    assert hermes.parse('<tool_call>[{"name": "set_light", "arguments": {"on": false}}, '
                        '{"name": "decide", "arguments": {}}]</tool_call>', NAMES) == \
        (None, [("set_light", '{"on": false}'), ("decide", "{}")])
    # the model stopped right after the JSON: the last block may be unclosed
    assert hermes.parse('<tool_call>{"name": "decide", "arguments": {"answer": "no"}}', NAMES) == \
        (None, [("decide", '{"answer": "no"}')])
    for not_a_call in ['Plain text, no tags.',
                       '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not one of the tools
                       '<tool_call>{"name": "decide", "arguments": "yes"}</tool_call>',  # arguments not an object
                       '<tool_call>{"name": "decide", "arguments": {"answer": "y',  # cut off
                       '<tool_call>{"name": "decide", "arguments": {}}</tool_call><tool_call>oops</tool_call>']:
        assert hermes.parse(not_a_call, NAMES) is None, not_a_call


def test_llama3_json_reads_whole_reply_calls():
    llama = _parsers()["llama3_json"]
    assert llama.parse(' {"name": "decide", "parameters": {"answer": "no"}}', NAMES) == \
        (None, [("decide", '{"answer": "no"}')])
    assert llama.parse('<|python_tag|>{"name": "decide", "parameters": {}}; {"name": "set_light", '
                       '"arguments": {"on": true}}', NAMES) == \
        (None, [("decide", "{}"), ("set_light", '{"on": true}')])
    for not_a_call in ['The answer is {"name": "decide"}.', '{"city": "Paris"}', '{"name": "decide", "param',
                       '{"name": "decide", "parameters": {}} and then some words']:
        assert llama.parse(not_a_call, NAMES) is None, not_a_call


def _plan(parser: str, parallel: bool = True):
    from shapeshift.engine.serving.protocol import ChatCompletionRequest
    from shapeshift.engine.serving.tool_parsers import get_parser
    from shapeshift.engine.serving.tools import ToolPlan

    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, "tools": [DECIDE, LIGHT],
                                                "parallel_tool_calls": parallel})
    return ToolPlan.of(req, get_parser(parser))


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Let me check.  \n<tool_call>\n{"name": "decide", "arguments": {"answer": "yes"}}\n</tool_call>'),
    ("hermes", '<tool_call>[{"name": "set_light", "arguments": {"on": true}}]</tool_call>'),
    ("hermes", 'I would call <tool_call>{"name": "launch", "arguments": {}}</tool_call> but will not.'),
    ("hermes", 'No call here <tool but text < and <tool_call'),
    ("llama3_json", '{"name": "decide", "parameters": {"answer": "no"}}'),
    ("llama3_json", '  {"name": "nope", "parameters": {}}'),
    ("llama3_json", 'Just words, then {"name": "decide", "parameters": {}}'),
])
def test_streamed_pieces_add_up_to_the_whole_reply(parser, text):
    """Fed a token at a time (here: one character, and three at a time), the streamed content
    deltas join to the whole reply's content, and the calls at the finish are the whole reply's."""
    whole, whole_finish = _plan(parser).reply(text, "stop")
    for step in (1, 3):
        plan = _plan(parser)
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        content, calls, finish = "", None, None
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            delta, finish = plan.stream_delta(0, piece, "stop" if last else None)
            content += delta.content or ""
            if delta.tool_calls:
                assert last and calls is None
                calls = delta.tool_calls
            if not last:
                assert finish is None
        assert finish == whole_finish
        assert content == (whole.content or "")
        assert [c["function"] for c in calls or []] == [c["function"] for c in whole.tool_calls or []]
        assert [c["index"] for c in calls or []] == list(range(len(whole.tool_calls or [])))
    if whole.tool_calls:
        assert whole_finish == "tool_calls" and whole.content != text
    else:
        assert whole_finish == "stop" and whole.content == text


def test_parallel_tool_calls_false_leaves_several_calls_as_content():
    text = '{"name": "decide", "parameters": {}}; {"name": "set_light", "parameters": {"on": true}}'
    assert len(_plan("llama3_json").reply(text, "stop")[0].tool_calls) == 2
    message, finish = _plan("llama3_json", parallel=False).reply(text, "stop")
    assert message.tool_calls is None and message.content == text and finish == "stop"


def test_auto_without_a_parser_names_the_flag():
    from shapeshift.engine.serving.protocol import APIError, ChatCompletionRequest
    from shapeshift.engine.serving.tools import ToolPlan

    for body in ({"tools": [DECIDE]}, {"tools": [DECIDE], "tool_choice": "auto"}):
        req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, **body})
        with pytest.raises(APIError) as err:
            ToolPlan.of(req, None)
        assert err.value.status_code == 400 and err.value.param == "tool_choice"
        assert "--tool-call-parser" in err.value.message and "hermes" in err.value.message


# ------------------------------------------------------------------ through the server

@pytest.fixture()
def client(openai_client):
    pytest.importorskip("xgrammar")  # the forced replies need constrained decoding
    return openai_client


def _block(name: str, args_pattern: str) -> dict:
    """A Hermes <tool_call> block whose compact JSON is spelled by the grammar; the model picks
    what ``args_pattern`` (a regex) leaves open."""
    return {"type": "tag", "begin": "<tool_call>\n", "end": "\n</tool_call>",
            "content": {"type": "regex", "pattern": r'\{"name": "' + name + r'", "arguments": ' + args_pattern + r"\}"}}


ANSWER = r'\{"answer": "(yes|no)"\}'
ON = r'\{"on": (true|false)\}'


def _forced(*elements) -> dict:
    return {"response_format": {"type": "structural_tag", "format": {"type": "sequence", "elements": list(elements)}}}


PREAMBLE = {"type": "const_string", "value": "Let me decide.\n"}


def test_a_reply_with_a_call_comes_back_as_tool_calls(client):
    answers = set()
    for seed in range(3):
        resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[DECIDE, LIGHT], tool_choice="auto",
                                              max_tokens=120, temperature=1.0, seed=seed, n=2,
                                              extra_body=_forced(PREAMBLE, _block("decide", ANSWER)))
        for choice in resp.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content == "Let me decide."
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_") and call.function.name == "decide"
            args = json.loads(call.function.arguments)
            assert set(args) == {"answer"}
            answers.add(args["answer"])
    assert answers <= {"yes", "no"} and answers


def test_tools_without_tool_choice_are_auto_and_several_calls_are_read(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[DECIDE, LIGHT], max_tokens=200, temperature=0,
        extra_body=_forced(_block("decide", ANSWER), {"type": "const_string", "value": "\n"}, _block("set_light", ON)))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["decide", "set_light"]
    assert isinstance(json.loads(choice.message.tool_calls[1].function.arguments)["on"], bool)
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_streamed_auto_reply_assembles_to_the_same_call(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[DECIDE], max_tokens=120, temperature=0,
                  extra_body=_forced(PREAMBLE, _block("decide", ANSWER)))
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.message.content == "Let me decide."
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and not chunks[-1].choices[0].delta.tool_calls
    assert [c for c in chunks if c.choices[0].delta.tool_calls] == [chunks[-2]]  # the call whole, then the finish
    # the client's own stream assembler builds the same message
    with client.chat.completions.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion().choices[0]
    assert "tool_calls.function.arguments.done" in events
    assert final.finish_reason == "tool_calls" and final.message.content == whole.message.content
    (call,) = final.message.tool_calls
    assert (call.function.name, call.function.arguments) == (whole.message.tool_calls[0].function.name,
                                                             whole.message.tool_calls[0].function.arguments)


def test_text_that_is_not_a_call_stays_content(client):
    """A block naming a function that is not among the tools is text, whole and streamed; so is the
    model's own free text (there: the same reply as with tool_choice "none")."""
    fake = 'I could write <tool_call>{"name": "launch", "arguments": {}}</tool_call> but will not.'
    kwargs = dict(model=MODEL, messages=ASK, tools=[DECIDE], max_tokens=120, temperature=0,
                  extra_body=_forced({"type": "const_string", "value": fake}))
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls is None and whole.message.content == fake and whole.finish_reason == "stop"
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == fake
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    free = dict(model=MODEL, messages=ASK, tools=[DECIDE], max_tokens=12, temperature=0)
    auto = client.chat.completions.create(**free).choices[0]
    none = client.chat.completions.create(tool_choice="none", **free).choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length")
    assert auto.message.content == none.message.content


def test_langchain_bind_tools_reads_the_call(server):
    pytest.importorskip("xgrammar")
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessageChunk

    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused",
                                       temperature=0, max_tokens=120, max_retries=0, timeout=60,
                                       extra_body=_forced(PREAMBLE, _block("decide", ANSWER)))
    bound = chat.bind_tools([DECIDE])  # LangChain sends no tool_choice: "auto"
    reply = bound.invoke("Should I?")
    (call,) = reply.tool_calls
    assert call["name"] == "decide" and call["args"]["answer"] in ("yes", "no") and call["id"].startswith("call_")
    assert reply.content == "Let me decide."
    streamed = None
    for chunk in bound.stream("Should I?"):
        assert isinstance(chunk, AIMessageChunk)
        streamed = chunk if streamed is None else streamed + chunk
    (streamed_call,) = streamed.tool_calls
    assert (streamed_call["name"], streamed_call["args"]) == (call["name"], call["args"])
    assert streamed.content == reply.content
