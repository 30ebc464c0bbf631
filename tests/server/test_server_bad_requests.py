"""Bad requests get a 4xx with an OpenAI-style body naming the field; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_harness import MAX_MODEL_LEN, MODEL

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def _with(base: dict, **changes) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()

CASES = [
    # (id, path, body (dict or raw bytes), status, param)
    ("malformed-json", COMPLETIONS, b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("body-not-object", CHAT, b"[1, 2, 3]", 400, None),
    ("missing-model", COMPLETIONS, _with(OK_COMPLETION, model=_DROP), 400, "model"),
    ("missing-prompt", COMPLETIONS, _with(OK_COMPLETION, prompt=_DROP), 400, "prompt"),
    ("missing-messages", CHAT, _with(OK_CHAT, messages=_DROP), 400, "messages"),
    ("unknown-field", COMPLETIONS, _with(OK_COMPLETION, frobnicate=1), 400, "frobnicate"),
    ("wrong-type-temperature", COMPLETIONS, _with(OK_COMPLETION, temperature="hot"), 400, "temperature"),
    ("wrong-type-max-tokens", CHAT, _with(OK_CHAT, max_tokens="ten"), 400, "max_tokens"),
    ("wrong-type-stream", COMPLETIONS, _with(OK_COMPLETION, stream="yes"), 400, "stream"),
    ("wrong-type-prompt", COMPLETIONS, _with(OK_COMPLETION, prompt={"text": "hi"}), 400, "prompt"),
    ("bad-role", CHAT, _with(OK_CHAT, messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("empty-messages", CHAT, _with(OK_CHAT, messages=[]), 400, "messages"),
    ("unknown-model", COMPLETIONS, _with(OK_COMPLETION, model="gpt-17"), 404, "model"),
    ("unknown-model-chat", CHAT, _with(OK_CHAT, model="gpt-17"), 404, "model"),
    ("negative-max-tokens", COMPLETIONS, _with(OK_COMPLETION, max_tokens=-1), 400, "max_tokens"),
    ("zero-max-tokens", CHAT, _with(OK_CHAT, max_tokens=0), 400, "max_tokens"),
    ("negative-max-completion-tokens", CHAT, _with(OK_CHAT, max_completion_tokens=-5), 400,
     "max_completion_tokens"),
    ("negative-temperature", COMPLETIONS, _with(OK_COMPLETION, temperature=-0.5), 400, "temperature"),
    ("top-p-zero", COMPLETIONS, _with(OK_COMPLETION, top_p=0.0), 400, "top_p"),
    ("top-p-above-one", CHAT, _with(OK_CHAT, top_p=1.5), 400, "top_p"),
    ("n-above-max", COMPLETIONS, _with(OK_COMPLETION, n=1000), 400, "n"),
    ("n-zero", CHAT, _with(OK_CHAT, n=0), 400, "n"),
    ("negative-token-id", COMPLETIONS, _with(OK_COMPLETION, prompt=[1, -2]), 400, "prompt"),
    ("token-id-outside-vocab", COMPLETIONS, _with(OK_COMPLETION, prompt=[1, 10**9]), 400, "prompt"),
    ("empty-prompt", COMPLETIONS, _with(OK_COMPLETION, prompt=""), 400, "prompt"),
    ("prompt-longer-than-context", COMPLETIONS, _with(OK_COMPLETION, prompt=[3] * MAX_MODEL_LEN), 400, "prompt"),
    ("chat-prompt-longer-than-context", CHAT,
     _with(OK_CHAT, messages=[{"role": "user", "content": "x" * (2 * MAX_MODEL_LEN)}]), 400, "messages"),
    ("prompt-plus-max-tokens-over-context", COMPLETIONS,
     _with(OK_COMPLETION, prompt=[3] * (MAX_MODEL_LEN - 10), max_tokens=11), 400, "max_tokens"),
    ("chat-plus-max-tokens-over-context", CHAT, _with(OK_CHAT, max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("penalty-out-of-range", CHAT, _with(OK_CHAT, presence_penalty=2.5), 400, "presence_penalty"),
    ("logit-bias-key-not-token", CHAT, _with(OK_CHAT, logit_bias={"hello": 1}), 400, "logit_bias"),
    ("logit-bias-outside-vocab", COMPLETIONS, _with(OK_COMPLETION, logit_bias={str(10**9): 1}), 400, "logit_bias"),
    ("top-logprobs-above-max", CHAT, _with(OK_CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, _with(OK_CHAT, top_logprobs=2), 400, "top_logprobs"),
    ("completion-logprobs-above-max", COMPLETIONS, _with(OK_COMPLETION, logprobs=21), 400, "logprobs"),
    ("min-tokens-above-max-tokens", COMPLETIONS, _with(OK_COMPLETION, min_tokens=5), 400, "min_tokens"),
    ("min-p-above-one", COMPLETIONS, _with(OK_COMPLETION, min_p=1.5), 400, "min_p"),
    ("repetition-penalty-zero", CHAT, _with(OK_CHAT, repetition_penalty=0), 400, "repetition_penalty"),
    ("empty-prompt-in-list", COMPLETIONS, _with(OK_COMPLETION, prompt=["a", ""]), 400, "prompt"),
    # Fields the engine cannot honour: refused only at non-neutral values, saying what to do.
    ("tool-without-function", CHAT, _with(OK_CHAT, tools=[{"type": "function"}], tool_choice="required"), 400,
     "tools"),
    ("tool-choice-required-without-tools", CHAT, _with(OK_CHAT, tool_choice="required"), 400, "tool_choice"),
    ("tool-choice-names-no-tool", CHAT, _with(OK_CHAT, tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice"),
    ("tool-choice-unknown-string", CHAT, _with(OK_CHAT, tool_choice="any"), 400, "tool_choice"),
    ("deprecated-functions", CHAT, _with(OK_CHAT, functions=[{"name": "f"}]), 400, "functions"),
    ("response-format-unknown", CHAT, _with(OK_CHAT, response_format={"type": "yaml"}), 400,
     "response_format.type"),
    ("json-schema-without-schema", CHAT, _with(OK_CHAT, response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("structural-tag-without-format", CHAT, _with(OK_CHAT, response_format={"type": "structural_tag"}), 400,
     "response_format.format"),
    ("audio-modality", CHAT, _with(OK_CHAT, modalities=["text", "audio"]), 400, "modalities"),
    ("image-part", CHAT, _with(OK_CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, "messages.0.content"),
    ("suffix", COMPLETIONS, _with(OK_COMPLETION, suffix="tail"), 400, "suffix"),
    ("best-of-above-n", COMPLETIONS, _with(OK_COMPLETION, best_of=3), 400, "best_of"),
    ("empty-stop-string", COMPLETIONS, _with(OK_COMPLETION, stop=[""]), 400, "stop"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error_naming_the_field(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{server.base_url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"] and error["type"]


def test_refusals_say_what_to_do(server):
    """An unsupported field's message names it and what to send instead, in plain words."""
    image = _with(OK_CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    error = httpx.post(f"{server.base_url}{CHAT}", json=image, timeout=30).json()["error"]
    assert "text only" in error["message"] and "image_url" in error["message"]
    assert "Input should be" not in error["message"]  # not pydantic's union wording
    error = httpx.post(f"{server.base_url}{CHAT}", json=_with(OK_CHAT, tools=[{"type": "function"}]),
                       timeout=30).json()["error"]
    assert "tool 0" in error["message"] and "function" in error["message"]


def test_limits_are_exact(server):
    """prompt + max_tokens == max_model_len is allowed; one more is not."""
    prompt = [3] * (MAX_MODEL_LEN - 4)
    ok = httpx.post(f"{server.base_url}{COMPLETIONS}", timeout=30,
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 4
    over = httpx.post(f"{server.base_url}{COMPLETIONS}", timeout=30,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 5})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"


def test_openai_client_sees_errors_as_typed_exceptions(openai_client):
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["param"] == "model"


def test_unknown_route_has_openai_body(server):
    resp = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "not_found_error"


def test_server_still_serves_after_bad_requests(server, openai_client):
    for _ in range(3):
        httpx.post(f"{server.base_url}{COMPLETIONS}", content=b"{{{", timeout=10)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    resp = openai_client.completions.create(model=MODEL, prompt="still alive", max_tokens=2, temperature=0)
    assert resp.usage.completion_tokens >= 1
