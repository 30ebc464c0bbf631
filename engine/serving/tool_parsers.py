"""Tool-call parsers for tool_choice "auto": read a model's free-text reply as tool calls or as content.

With "auto" the model decides whether to call a tool, and it says so in its family's own
format, which its chat template teaches it. `shapeshift serve --tool-call-parser NAME`
names that format; the reply text is then read by the parser:

    reply text --parser.parse(text, tool names)--> None: not a call, the text stays content
                                               --> (content or None, [(name, arguments JSON)])

    hermes       Hermes, Qwen2.5 / Qwen3 and SmolLM2 templates: each call a block
                 <tool_call>{"name": N, "arguments": {...}}</tool_call>; a block may hold a
                 JSON array of such objects (SmolLM2 writes several calls so); the last block
                 may lack its closing tag (the model stopped right after the JSON). Content is
                 the text before the first block, trailing whitespace removed.
    llama3_json  Llama 3.1 / 3.2 templates (JSON tool calling): the whole reply is
                 {"name": N, "parameters": {...}} ("arguments" is read too), optionally after
                 <|python_tag|>, several separated by ';'. No content beside the calls.

A reply is a call only when every call in it parses, names one of the request's tools and
has a JSON object as arguments; otherwise all of it is content, as it was generated.

Streaming: `content_end(text)` says how much of a growing reply is content whatever comes
next (text before a block, or a reply that cannot start a call); that much is streamed as
it comes, the rest is held until the choice finishes and then parsed as a whole.
"""

from __future__ import annotations

import json
from typing import Any

Call = tuple[str, str]  # (function name, arguments as a JSON string)


def _call_of(obj: Any, names: set[str], args_keys: tuple[str, ...]) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _held_tail(text: str, marker: str) -> int:
    """Where a suffix of ``text`` that could begin ``marker`` starts (len(text) if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class HermesParser:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[Call]] | None:
        start = text.find(self.OPEN)
        if start < 0:
            return None
        calls: list[Call] = []
        rest = text[start:]
        while rest.startswith(self.OPEN):
            body = rest[len(self.OPEN):]
            end = body.find(self.CLOSE)
            if end < 0:  # unclosed: the block runs to the end of the reply
                block, rest = body, ""
            else:
                block, rest = body[:end], body[end + len(self.CLOSE):].lstrip()
            try:
                obj = json.loads(block)
            except ValueError:
                return None
            for item in obj if isinstance(obj, list) else [obj]:
                call = _call_of(item, names, ("arguments", "parameters"))
                if call is None:
                    return None
                calls.append(call)
        if not calls:
            return None
        content = text[:start].rstrip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        start = text.find(self.OPEN)
        # Whitespace before a block (or before what may begin one) is held too: it is not content then.
        return len(text[:start if start >= 0 else _held_tail(text, self.OPEN)].rstrip())


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _body(self, text: str) -> str:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        return body

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[Call]] | None:
        body = self._body(text)
        if not body.startswith("{"):
            return None
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        at = 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:
                return None
            call = _call_of(obj, names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        return None, calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[:len(self.TAG)]):
            return 0  # a call may follow (after the tag, the parse at the end decides)
        return len(text)


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser())}
PARSER_NAMES = tuple(PARSERS)


def get_parser(name: str | None) -> HermesParser | Llama3JsonParser | None:
    if name is None:
        return None
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}") from None
