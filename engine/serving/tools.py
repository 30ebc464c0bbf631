"""OpenAI `tools` / `tool_choice` on /v1/chat/completions: tool calls through constrained decoding.

    request.tools + tool_choice --ToolPlan.of()-->
        None                       no tools, or tool_choice "none": a plain text reply
        named function             {"type": "function", "function": {"name": N}}: the reply is N's
                                   arguments, constrained to its `parameters` JSON Schema
        "required"                 the reply is a JSON array of {"name", "arguments"} objects, each
                                   one of the tools with arguments of its schema; at least one call,
                                   at most one with parallel_tool_calls false
        "auto" (the default with tools): refused with a 400. Whether to call a tool is the model's
                                   choice in free text, which needs a parser for the model family's
                                   tool-call format; the served families (SmolLM2, Llama, Qwen and
                                   the random presets) have none here
    ToolPlan.response_format --server.compile_response_format--> the grammar (structured.py, xgrammar)
    ToolPlan.tools --chat template (`tools=`)--> rendered where the template knows them
    reply text --ToolPlan.reply()--> message {content: null, tool_calls: [...]}, finish_reason
                                     "tool_calls" ("length" when cut off: the arguments may be partial)
    streaming: the text is held back per choice and the calls come whole in the choice's last chunk
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from shapeshift.engine.serving.protocol import (APIError, ChatDelta, ChatResponseMessage, JsonSchemaFormat,
                                                ResponseFormat)

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


class ToolPlan:
    """How one request's tools shape its reply (see the module docstring)."""

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
    def of(cls, req: Any) -> "ToolPlan | None":
        """The plan of a ChatCompletionRequest, None for a plain reply; APIError for what cannot be honoured."""
        tools = req.tools or []
        choice = req.tool_choice
        if choice == "none" or (not tools and choice in (None, "auto")):
            return None
        if not tools:
            raise APIError(400, f"Invalid value for 'tool_choice': {json.dumps(choice)} needs 'tools'; send the "
                                "tools, or tool_choice \"none\".", param="tool_choice", code="invalid_value")
        if req.response_format is not None and req.response_format.constrained():
            raise APIError(400, "Invalid value for 'response_format': a JSON response format and tool calls "
                                "cannot constrain one reply together; send one of them.",
                           param="response_format", code="invalid_value")
        if choice in (None, "auto"):
            raise APIError(
                400, "Invalid value for 'tool_choice': \"auto\" (the default when tools are given) leaves the "
                     "choice to call a tool to the model, which needs a parser for its tool-call format, and this "
                     "engine has none for the model it serves. Send tool_choice \"required\" or {\"type\": "
                     "\"function\", \"function\": {\"name\": ...}} (the reply is then constrained to the tools' "
                     "parameter schemas), or \"none\" for a text reply.",
                param="tool_choice", code="unsupported_value")
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
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": arguments}} for name, arguments in pairs]

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
