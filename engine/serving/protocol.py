"""OpenAI-style request and response models of the engine server.

Data flow: the server reads the raw body, `CompletionRequest` /
`ChatCompletionRequest` validate it (`model_validate_json`, strict types, unknown
top-level fields rejected), the handler turns it into token ids plus a
`SamplingParams`, and the engine's outputs are shaped into the response models
below (or their streaming chunk forms). Every failure is an `ErrorResponse`
body `{"error": {"message", "type", "param", "code"}}` whose `param` names the
offending field, built by `APIError` and `error_from_validation`.

Supported: n=1, temperature/top_p/top_k/seed/stop/max_tokens, streaming with
`stream_options.include_usage`, logprobs of the sampled token. Fields that the
OpenAI API defines but this engine does not implement (penalties, logit_bias,
best_of, echo, suffix, tools, top_logprobs > 0) are accepted only at their
neutral value so that a client relying on them gets a clear 400 instead of
silently different behaviour. Extensions (as in vLLM): `top_k`, `ignore_eos`,
`stop_token_ids`, `return_token_ids` (adds `token_ids` to each choice).
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
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

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported, got {v}; send separate requests instead")
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
    def _no_penalties(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported by this engine; omit the field or send 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by this engine; omit the field")
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
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
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
            if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                if any(t < 0 for t in v):
                    raise ValueError("token ids must be >= 0")
                return v
            if all(isinstance(t, str) for t in v) or all(isinstance(t, list) for t in v):
                raise ValueError("batched prompts are not supported; send one prompt per request")
        raise ValueError("must be a string or a list of token ids (integers)")

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and v not in (0, 1):
            raise ValueError(f"only the sampled token's logprob is available: send 0 or 1, got {v}")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported by this engine")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported by this engine")
        return v


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Clients often send back a whole message object (with tool_calls=None,
    # refusal=None, ...); extra keys of a message are ignored, not rejected.
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool | None = True

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
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v not in (None, 0):
            raise ValueError("only the sampled token's logprob is available; send 0 or omit")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("tool calling is not supported by this engine")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


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
    top_logprobs: list[dict[str, float]] | None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: Literal["stop", "length"] | None = None
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


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
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
