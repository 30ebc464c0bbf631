"""OpenAI-style request and response models of the engine server.

Data flow: the server reads the raw body, `CompletionRequest` /
`ChatCompletionRequest` validate it (`model_validate_json`, strict types, unknown
top-level fields rejected), the handler turns it into token ids plus a
`SamplingParams` per choice, and the engine's outputs are shaped into the response
models below (or their streaming chunk forms). Every failure is an `ErrorResponse`
body `{"error": {"message", "type", "param", "code"}}` whose `param` names the
offending field, built by `APIError` and `error_from_validation`.

Field policy (docs/serving-api.md lists every field): every field of OpenAI's chat
and completions request schemas is accepted. What the engine can honour, it does
(n, penalties, logit_bias, logprobs and top logprobs up to MAX_TOP_LOGPROBS, echo
with prompt logprobs, list prompts, stream_options.continuous_usage_stats,
response_format json (and the structural_tag extension) through xgrammar when
installed, ...).
Tools are called through the same constrained decoding, with tool_choice
"required" or a named function, or with "auto" through the server's tool-call
parser (engine/serving/tools.py, tool_parsers.py). Fields that change
nothing about the output at any value (`store`, `metadata`, `user`,
`service_tier`, `reasoning_effort`, ...) are accepted and logged at debug level
(`INERT_FIELDS`). What it cannot honour is refused only when set to a
non-neutral value, with a 400 that names the field and says what to do instead
(tool_choice "auto" with tools on a server without --tool-call-parser, the deprecated functions, audio, image parts,
moderation, suffix, best_of other than n; json response formats without xgrammar). A field outside the schemas is a 400 too, so a
typo is not silently dropped. Extensions (as in vLLM): `top_k`, `min_p`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`return_token_ids` (adds `token_ids` to each choice).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


# ---------------------------------------------------------------------------
# Errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the server returns as an OpenAI-style body with `status_code`."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_error_type(status_code)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()


def _default_error_type(status_code: int) -> str:
    if status_code == 404:
        return "not_found_error"
    if status_code == 429:
        return "rate_limit_exceeded"
    if status_code == 503:
        return "service_unavailable"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


def error_from_validation(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (dotted path, e.g. `messages.0.role`)."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"Request body is not valid JSON: {err.get('msg')}. Send a JSON object.",
                        code="invalid_json")
    if not loc:
        return APIError(400, f"Request body must be a JSON object: {err.get('msg')}.",
                        code="invalid_request_body")
    param = ".".join(loc)
    if kind == "missing":
        return APIError(400, f"Missing required field '{param}'.", param=param, code="missing_field")
    if kind == "extra_forbidden":
        return APIError(400, f"Unknown field '{param}'; this server does not accept it. Remove it.",
                        param=param, code="unknown_field")
    msg = err.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")
    given = err.get("input")
    if kind != "value_error" and isinstance(given, (str, int, float, bool)) and len(repr(given)) <= 40:
        msg = f"{msg}, got {given!r}"
    return APIError(400, f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


# ---------------------------------------------------------------------------
# Requests

# The OpenAI API caps stop sequences at 4; the engine has no such limit but a
# bound keeps per-step stop matching cheap.
MAX_STOP_SEQUENCES = 16
# Choices per request (n) and prompts per completions request: each one is a
# sequence in the engine, admitted like a request of its own.
MAX_N = 16
MAX_PROMPTS = 64
# Alternatives per token (chat top_logprobs, completions logprobs): OpenAI's chat maximum.
MAX_TOP_LOGPROBS = 20

# OpenAI fields that change nothing about the output at any value: accepted, logged at debug.
# tests/server/test_server_api_fields.py sends each one at a value built from the installed `openai`
# package's create() signature.
INERT_FIELDS = ("user", "store", "metadata", "service_tier", "reasoning_effort", "prediction", "prompt_cache_key",
                "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "verbosity")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    # Usage on every chunk (guidellm asks for it), not only in the final one.
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # inert: this server adds no obfuscation padding


def _refuse_unless(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    # Inert (INERT_FIELDS).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # Extensions.
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool | None = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature_range(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 <= v < float("inf")):
            raise ValueError(f"must be a finite number >= 0 (0 means greedy), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 < v <= 1.0):
            raise ValueError(f"must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError(f"must be >= 1, or 0 / -1 to disable, got {v}")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p_range(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 <= v <= 1.0):
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _n_range(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_N:
            raise ValueError(f"must be in 1..{MAX_N}, got {v}; send several requests for more choices")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("must be a string or a list of strings")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop strings, got {len(items)}")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty_range(cls, v: float | None) -> float | None:
        if v is not None and not -2.0 <= v <= 2.0:
            raise ValueError(f"must be in [-2, 2], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty_range(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v <= 10.0:
            raise ValueError(f"must be in (0, 10] (1 is off), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_shape(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_nonnegative(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_nonnegative(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def inert_fields_set(self) -> list[str]:
        return [name for name in INERT_FIELDS if getattr(self, name, None) is not None]

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids) or a list of them: one choice (n of them) per prompt.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v == "":
                raise ValueError("must not be empty")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if _is_token_list(v):
                if any(t < 0 for t in v):
                    raise ValueError("token ids must be >= 0")
                return v
            if all(isinstance(p, str) for p in v) or all(_is_token_list(p) for p in v):
                if len(v) > MAX_PROMPTS:
                    raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
                for i, p in enumerate(v):
                    if len(p) == 0:
                        raise ValueError(f"prompt {i} is empty")
                    if isinstance(p, list) and any(t < 0 for t in p):
                        raise ValueError(f"prompt {i}: token ids must be >= 0")
                return v
        raise ValueError("must be a string, a list of token ids, or a list of either (one choice per prompt)")

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token), got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        _refuse_unless(not v, "suffix (fill-in-the-middle insertion) is not supported by this engine; "
                              "omit it and put the text in the prompt")
        return v

    def check_together(self) -> None:
        """Checks across fields (an APIError naming the field)."""
        n = self.n or 1
        if self.best_of not in (None, n):
            raise APIError(400, f"Invalid value for 'best_of': best_of={self.best_of} (ranking candidates "
                                f"server-side) is not supported; omit it or send best_of equal to n ({n}), and "
                                "pick among the n choices yourself.", param="best_of", code="unsupported_value")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group (a single prompt is a list of one)."""
        if isinstance(self.prompt, str) or _is_token_list(self.prompt):
            return [self.prompt]
        return list(self.prompt)


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


# Content parts a text-only model cannot read, and what the message says instead.
_NON_TEXT_PARTS = {"image_url": "an image", "input_audio": "audio", "file": "a file", "input_image": "an image"}


class ChatMessage(BaseModel):
    # Clients often send back a whole message object (with tool_calls=None,
    # refusal=None, ...); extra keys of a message are ignored, not rejected.
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, sent back: given to the template
    tool_call_id: str | None = None  # a tool result's call

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        parts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _NON_TEXT_PARTS:
                raise ValueError(f"part {i} is {_NON_TEXT_PARTS[kind]} ({kind}); this model reads text only: "
                                 "send text parts ({\"type\": \"text\", \"text\": ...}) or a string")
            if kind == "refusal" and isinstance(part.get("refusal"), str):
                part = {"type": "text", "text": part["refusal"]}  # an assistant's refusal, sent back
            elif kind != "text":
                raise ValueError(f"part {i} has type {kind!r}; send text parts "
                                 "({\"type\": \"text\", \"text\": ...}) or a string")
            parts.append(part)
        return parts

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text`; `json_object` and `json_schema` are honoured through constrained decoding
    (engine/serving/structured.py) when xgrammar is installed; so is the extension
    `structural_tag` (as in vLLM): `format` is an xgrammar structural-tag format, e.g. a
    {"type": "tag", "begin", "content": {"type": "json_schema", ...}, "end"} block."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_given(cls, v: JsonSchemaFormat | None) -> JsonSchemaFormat | None:
        if v is not None and v.schema_ is None:
            raise ValueError("json_schema needs a 'schema' (a JSON Schema object)")
        return v

    def constrained(self) -> bool:
        return self.type != "text"


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    parallel_tool_calls: bool | None = None  # false: at most one call (tool_choice "required")
    # Inert (INERT_FIELDS).
    reasoning_effort: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # prefix caching is automatic: blocks live while memory allows
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None  # refused when set: no moderation model runs here

    @field_validator("messages")
    @classmethod
    def _messages_nonempty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must contain at least one message")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens_positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be at least 1, got {v}")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be in 0..{MAX_TOP_LOGPROBS}, got {v}")
        return v

    @field_validator("tools")
    @classmethod
    def _tools_shape(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        from shapeshift.engine.serving.tools import check_tools  # tools.py builds on this module's models

        return check_tools(v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        from shapeshift.engine.serving.tools import check_tool_choice

        return check_tool_choice(v)

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        _refuse_unless(not v or v in ("none", "auto"), "the deprecated functions API is not supported; send "
                                                       "'tools' with tool_choice \"required\" or a named function")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        _refuse_unless(v is None or set(v) <= {"text"}, "this model produces text only; send [\"text\"] or omit it")
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _refuse_unless(v is None, "audio output is not supported (text-only model); omit it")
        return v

    @field_validator("moderation")
    @classmethod
    def _no_moderation(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _refuse_unless(v is None, "moderation is not available on this server (no moderation model runs here); "
                                  "omit it, or moderate input and output with a model of your own")
        return v

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        _refuse_unless(v is None, "web search is not available on this server; omit it")
        return v

    def check_together(self) -> None:
        """Checks across fields (an APIError naming the field)."""
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise APIError(400, "Invalid value for 'response_format': type json_schema needs "
                                "'json_schema': {\"name\": ..., \"schema\": {...}}.",
                           param="response_format.json_schema", code="invalid_value")
        if rf is not None and rf.type == "structural_tag" and rf.format is None:
            raise APIError(400, "Invalid value for 'response_format': type structural_tag needs 'format': an "
                                "xgrammar structural-tag format such as {\"type\": \"tag\", \"begin\": ..., "
                                "\"content\": {...}, \"end\": ...}.", param="response_format.format",
                           code="invalid_value")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "Invalid value for 'top_logprobs': it needs logprobs: true; send both.",
                           param="top_logprobs", code="invalid_value")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(_Strict):
    """`/tokenize` (as vLLM): a prompt, or chat messages through the chat template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True

    def check_together(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "Send either 'prompt' (a string) or 'messages' (a chat), not both or neither.",
                           param="prompt", code="invalid_value")


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _nonnegative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v


# ---------------------------------------------------------------------------
# Responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_unix() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shapeshift"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
