"""Request fields into the engine's `SamplingParams`: one per prompt, then one per choice.

Data flow: a validated `CompletionRequest` / `ChatCompletionRequest` + the prompt's length ->
`sampling_params` (context room, default max_tokens, logit_bias ids inside the vocabulary,
SamplingParams' own checks turned into a 400 naming the field) -> `choice_params` (n
independent sequences; a seeded request's choice j draws from seed + j).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shapeshift.engine.serving.protocol import APIError, ChatCompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "stop",
                    "top_logprobs", "logprobs", "ignore_eos", "min_tokens", "logit_bias", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")


def sampling_params(req: Any, prompt_len: int, max_tokens: int | None, max_tokens_param: str, logprobs: bool,
                    top_logprobs: int = 0, *, max_model_len: int, vocab_size: int) -> Any:
    """The engine's SamplingParams for one prompt of ``req``; an APIError naming the field when a value
    cannot be served (context, vocabulary, ranges)."""
    from shapeshift.engine.core.sampling import SamplingParams

    if prompt_len >= max_model_len:
        raise APIError(400, f"The prompt is {prompt_len} tokens long but this server's context "
                            f"(max_model_len) is {max_model_len} tokens, which must also hold at "
                            "least one generated token. Shorten the prompt.",
                       param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    room = max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room if isinstance(req, ChatCompletionRequest) else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif max_tokens > room:
        raise APIError(400, f"Invalid value for '{max_tokens_param}': the prompt ({prompt_len} tokens) plus "
                            f"{max_tokens_param} ({max_tokens}) exceeds max_model_len ({max_model_len}); "
                            f"ask for at most {room} tokens.",
                       param=max_tokens_param, code="context_length_exceeded")
    bias = req.logit_bias_ids()
    outside = next((t for t in bias if t >= vocab_size), None)
    if outside is not None:
        raise APIError(400, f"Invalid value for 'logit_bias': token id {outside} is outside the vocabulary "
                            f"(size {vocab_size}).", param="logit_bias", code="invalid_value")
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    kwargs = dict(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        min_tokens=req.min_tokens or 0,
        logit_bias=bias,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        msg = str(exc)
        param = (next((f for f in _SAMPLING_FIELDS if msg.startswith(f)), None)
                 or next((f for f in _SAMPLING_FIELDS if f in msg), None))
        if param == "max_tokens":
            param = max_tokens_param
        raise APIError(400, f"Invalid sampling parameters: {msg}", param=param, code="invalid_value") from None

def choice_params(params: Any, n: int) -> list[Any]:
    """One SamplingParams per choice: independent sequences; a seeded request's choice j
    draws from seed + j, so choice 0 is what n=1 returns."""
    if n == 1:
        return [params]
    return [dataclasses.replace(params, seed=None if params.seed is None else params.seed + j) for j in range(n)]
