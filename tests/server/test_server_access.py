"""--api-key, --cors-allow-origin and Retry-After on 429, on one small server of their own (which,
started without --tool-call-parser, also shows the 400 of tool_choice "auto");
/tokenize, /detokenize and /version on the shared one."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from server_harness import MODEL, ServerProcess

API_KEY = "sk-test-3f9a"
ORIGIN = "http://dashboard.example"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(["--api-key", API_KEY, "--cors-allow-origin", ORIGIN, "--max-num-seqs", "1",
                          "--max-waiting", "0"], tmp_path_factory.mktemp("access") / "serve.log")
    # /health stays open, so the harness's readiness poll needs no key.
    yield proc.start()
    proc.stop()


def test_auto_tool_choice_without_a_parser_is_a_400_naming_the_flag(keyed_server):
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in ({}, {"tool_choice": "auto"}):  # tools without tool_choice are "auto"
        resp = httpx.post(f"{keyed_server.base_url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                "max_tokens": 1, **choice})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "tool_choice" and error["code"] == "unsupported_value"
        assert "--tool-call-parser" in error["message"] and '"required"' in error["message"]


def test_api_key_guards_the_api_but_not_probes(keyed_server):
    base = keyed_server.base_url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    assert httpx.get(f"{base}/metrics", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="other", max_retries=0).models.list()


def test_cors_preflight_and_allowed_origin(keyed_server):
    base = keyed_server.base_url
    pre = httpx.options(f"{base}/v1/chat/completions", timeout=30, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{base}/v1/chat/completions", timeout=30, headers={
        "Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") != "http://elsewhere.example"
    got = httpx.get(f"{base}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"},
                    timeout=30)
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ORIGIN


def test_429_says_when_to_retry(keyed_server):
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 100, "temperature": 0, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=keyed_server.base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))

    rejected = [r for r in asyncio.run(burst()) if r.status_code == 429]
    assert rejected
    assert all(int(r.headers["retry-after"]) >= 1 for r in rejected)


def test_tokenize_detokenize_version(server, reference_engine):
    base = server.base_url
    tok = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "Hello there"}, timeout=30).json()
    assert tok["tokens"] == reference_engine.tokenizer.encode("Hello there", add_special_tokens=True)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == reference_engine.config.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()
    text = reference_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == reference_engine.tokenizer.encode(text, add_special_tokens=False)
    back = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}, timeout=30).json()
    assert back["prompt"] == reference_engine.tokenizer.decode(tok["tokens"])
    neither = httpx.post(f"{base}/tokenize", json={"model": MODEL}, timeout=30)
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"
    version = httpx.get(f"{base}/version", timeout=30).json()
    from shapeshift.engine.provenance import package_version

    assert version == {"version": package_version(), "model": MODEL}


def test_streaming_through_the_key_check(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key=API_KEY, max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt="stream", max_tokens=3, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text is not None) == 3
