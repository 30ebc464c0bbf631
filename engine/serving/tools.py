"""OpenAI `tools` / `tool_choice` on /v1/chat/completions: tool calls by constrained decoding or a parser.

    request.tools + tool_choice --ToolPlan.of(req, parser)-->
        None                       no tools, or tool_choice "none": a plain text reply
        named function             {"type": "function", "function": {"name": N}}: the reply is N's
                                   arguments, constrained to its `parameters` JSON Schema
        "required"                 the reply is a JSON array of {"name", "arguments"} objects, each
                                   one of the tools with arguments of its schema; at least one call,
                                   at most one with parallel_tool_calls false
        "auto" (the default with tools): AutoToolPlan. The model writes free text (constrained only
                                   by a JSON response_format if one is given) and the server's
                                   tool-call parser (`serve --tool-call-parser`, tool_parsers.py)
                                   reads it as calls or content; without a parser, a 400 naming
                                   the flag
    ToolPlan.response_format --server.compile_response_format--> the grammar (structured.py, xgrammar)
    ToolPlan.tools --chat template (`tools=`)--> rendered where the template knows them
    reply text --plan.reply()--> message {content: null, tool_calls: [...]}, finish_reason
                                 "tool_calls" ("length" when cut off: the arguments may be partial)
    streaming: a constrained reply is held back per choice and the calls come whole once it ends (then
               the finish reason in a chunk of its own); an "auto" reply streams what is surely content
               and holds the rest
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from shapeshift.engine.serving.protocol import (APIError, ChatDelta, ChatResponseMessage, JsonSchemaFormat,
                                                ResponseFormat)
from shapeshift.engine.serving.tool_parsers import PARSER_NAMES

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Each tool is {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}
    (ValueError naming the tool otherwise)."""
    names = set()
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"tool {i} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tool {i}: function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"tool {i}: function name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tool {i} ({name}): function.parameters must be a JSON Schema object")
    return tools


def check_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        return choice
    raise ValueError("must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                     "{\"name\": ...}}")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _EMPTY_PARAMETERS


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolPlan:
    """How one request's tools shape its reply (see the module docstring)."""

    constrains = True  # response_format is the tool calls' grammar, not the client's

    def __init__(self, tools: list[dict[str, Any]], named: str | None, parallel: bool) -> None:
        self.tools = tools
        self.named = named
        by_name = {t["function"]["name"]: t for t in tools}
        if named is not None:
            schema = _parameters(by_name[named])
        else:
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                  "arguments": _parameters(t)},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for name, t in by_name.items()]}}
            if not parallel:
                schema["maxItems"] = 1
        self.response_format = ResponseFormat(type="json_schema",
                                              json_schema=JsonSchemaFormat(name="tool_calls", schema=schema))
        self._held: dict[int, str] = {}

    @classmethod
    def of(cls, req: Any, parser: Any = None) -> "ToolPlan | AutoToolPlan | None":
        """The plan of a ChatCompletionRequest, None for a plain reply; APIError for what cannot be
        honoured. ``parser``: the server's tool-call parser (tool_parsers.py), None when not configured."""
        tools = req.tools or []
        choice = req.tool_choice
        if choice == "none" or (not tools and choice in (None, "auto")):
            return None
        if not tools:
            raise APIError(400, f"Invalid value for 'tool_choice': {json.dumps(choice)} needs 'tools'; send the "
                                "tools, or tool_choice \"none\".", param="tool_choice", code="invalid_value")
        if choice in (None, "auto"):
            if parser is None:
                raise APIError(
                    400, "Invalid value for 'tool_choice': \"auto\" (the default when tools are given) leaves "
                         "the choice to call a tool to the model, which needs a parser for its tool-call format, "
                         "and this server was started without one: restart it with --tool-call-parser "
                         f"({' or '.join(PARSER_NAMES)}, the format the model's chat template teaches). Or send "
                         "tool_choice \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}} "
                         "(the reply is then constrained to the tools' parameter schemas), or \"none\" for a "
                         "text reply.", param="tool_choice", code="unsupported_value")
            return AutoToolPlan(tools, parser, req.parallel_tool_calls is not False, req.response_format)
        if req.response_format is not None and req.response_format.constrained():
            raise APIError(400, "Invalid value for 'response_format': a JSON response format and tool calls "
                                "cannot constrain one reply together; send one of them (or tool_choice "
                                "\"auto\", where the format constrains the text the parser reads).",
                           param="response_format", code="invalid_value")
        named = None
        if isinstance(choice, dict):
            named = choice["function"]["name"]
            known = [t["function"]["name"] for t in tools]
            if named not in known:
                raise APIError(400, f"Invalid value for 'tool_choice': function {named!r} is not among the tools "
                                    f"({', '.join(known)}).", param="tool_choice", code="invalid_value")
        return cls(tools, named, req.parallel_tool_calls is not False)

    # ------------------------------------------------------------------ replies
    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls in a reply's text; None where the text is not a complete call (cut off)."""
        if self.named is not None:
            pairs = [(self.named, text)]
        else:
            try:
                items = json.loads(text)
            except ValueError:
                return None
            pairs = [(item["name"], json.dumps(item["arguments"], ensure_ascii=False)) for item in items]
        return [_call(name, arguments) for name, arguments in pairs]

    def reply(self, text: str, finish: str | None) -> tuple[ChatResponseMessage, str | None]:
        """The message and finish reason of a whole reply."""
        calls = self.calls(text)
        if calls is None:  # a call array cut off by max_tokens: the text as it is
            return ChatResponseMessage(content=text), finish
        complete = all(_parses(c["function"]["arguments"]) for c in calls)  # not cut off by a stop string
        return ChatResponseMessage(content=None, tool_calls=calls), \
            "tool_calls" if finish == "stop" and complete else finish

    def stream_delta(self, index: int, text_delta: str, finish: str | None) -> tuple[ChatDelta, str | None]:
        """A streamed choice's delta: nothing until it finishes, then its calls (with their index)."""
        self._held[index] = self._held.get(index, "") + text_delta
        if finish is None:
            return ChatDelta(), None
        message, reason = self.reply(self._held.pop(index), finish)
        if message.tool_calls is None:
            return ChatDelta(content=message.content), reason
        return ChatDelta(tool_calls=[{"index": i, **call} for i, call in enumerate(message.tool_calls)]), reason


class AutoToolPlan:
    """tool_choice "auto": the model's text, read by the server's tool-call parser.

    ``response_format``: the client's own (a JSON format constrains the text the parser then
    reads), or None. With parallel_tool_calls false a reply of several calls is content."""

    constrains = False

    def __init__(self, tools: list[dict[str, Any]], parser: Any, parallel: bool,
                 response_format: ResponseFormat | None) -> None:
        self.tools = tools
        self.parser = parser
        self.parallel = parallel
        self.response_format = response_format
        self._names = {t["function"]["name"] for t in tools}
        self._held: dict[int, str] = {}
        self._sent: dict[int, int] = {}  # characters of each streamed choice already sent as content

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        parsed = self.parser.parse(text, self._names)
        if parsed is None or (not self.parallel and len(parsed[1]) > 1):
            return None
        content, pairs = parsed
        return content, [_call(name, arguments) for name, arguments in pairs]

    def reply(self, text: str, finish: str | None) -> tuple[ChatResponseMessage, str | None]:
        parsed = self.parse(text)
        if parsed is None:
            return ChatResponseMessage(content=text), finish
        content, calls = parsed
        return ChatResponseMessage(content=content, tool_calls=calls), "tool_calls" if finish == "stop" else finish

    def stream_delta(self, index: int, text_delta: str, finish: str | None) -> tuple[ChatDelta, str | None]:
        """What is surely content goes out as it comes; the rest waits for the finish, then
        the remaining content and the calls (with their index) come when the choice finishes."""
        text = self._held.get(index, "") + text_delta
        sent = self._sent.get(index, 0)
        if finish is None:
            self._held[index] = text
            end = max(sent, self.parser.content_end(text))
            self._sent[index] = end
            return ChatDelta(content=text[sent:end] or None), None
        self._held.pop(index, None)
        self._sent.pop(index, None)
        parsed = self.parse(text)
        if parsed is None:
            return ChatDelta(content=text[sent:] or None), finish
        content, calls = parsed
        rest = content[sent:] if content is not None and len(content) > sent else None
        return ChatDelta(content=rest, tool_calls=[{"index": i, **call} for i, call in enumerate(calls)]), \
            "tool_calls" if finish == "stop" else finish
