"""`/metrics` of a real server moves as the drift detector expects."""

from __future__ import annotations

import time

import httpx
from server_harness import MODEL, scrape, value

EXPECTED_SERIES = {
    # exposed sample name -> metric type
    "shapeshift_prompt_tokens_count": "histogram",
    "shapeshift_generation_tokens_count": "histogram",
    "shapeshift_time_to_first_token_seconds_count": "histogram",
    "shapeshift_inter_token_latency_seconds_count": "histogram",
    "shapeshift_e2e_request_latency_seconds_count": "histogram",
    "shapeshift_prefix_cache_queries_tokens_total": "counter",
    "shapeshift_prefix_cache_hits_tokens_total": "counter",
    "shapeshift_requests_total": "counter",
    "shapeshift_requests_running": "gauge",
    "shapeshift_requests_waiting": "gauge",
    "shapeshift_batch_size": "gauge",
    "shapeshift_forward_pass_info": "info",
}


def complete(base_url: str, prompt, max_tokens: int) -> dict:
    resp = httpx.post(f"{base_url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_all_series_exposed_with_model_label(server):
    samples = scrape(server.base_url)
    names = {k[0] for k in samples}
    assert set(EXPECTED_SERIES) <= names, set(EXPECTED_SERIES) - names
    for (name, labels), _ in samples.items():
        if name.startswith("shapeshift_"):
            assert dict(labels).get("model") == MODEL, (name, labels)
    info = [dict(labels) for (name, labels) in samples if name == "shapeshift_forward_pass_info"]
    assert len(info) == 1 and info[0]["name"] and info[0]["sha256"]


def test_repeated_long_prompt_raises_prefix_cache_hits(server):
    prompt = [(7 * i + 3) % 250 + 1 for i in range(160)]  # ten full 16-token blocks
    before = scrape(server.base_url)
    complete(server.base_url, prompt, 1)
    middle = scrape(server.base_url)
    complete(server.base_url, prompt, 1)
    after = scrape(server.base_url)

    hits = "shapeshift_prefix_cache_hits_tokens_total"
    queries = "shapeshift_prefix_cache_queries_tokens_total"
    assert value(middle, queries) > value(before, queries)
    first_hits = value(middle, hits) - value(before, hits)
    second_hits = value(after, hits) - value(middle, hits)
    assert first_hits == 0, "a never-seen prompt hit the prefix cache"
    # All full blocks but the one holding the last prompt token can be reused.
    assert second_hits >= 128, second_hits


def test_histograms_and_counters_grow(server):
    before = scrape(server.base_url)
    complete(server.base_url, [5] * 40, 6)
    complete(server.base_url, "metrics please", 3)
    after = scrape(server.base_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("shapeshift_prompt_tokens_count") == 2
    assert delta("shapeshift_prompt_tokens_sum") >= 40 + 2
    assert delta("shapeshift_prompt_tokens_bucket", le="32.0") == 1  # "metrics please" is short
    assert delta("shapeshift_prompt_tokens_bucket", le="64.0") == 2
    assert delta("shapeshift_generation_tokens_count") == 2
    assert delta("shapeshift_generation_tokens_sum") == 9
    assert delta("shapeshift_time_to_first_token_seconds_count") == 2
    assert delta("shapeshift_inter_token_latency_seconds_count") == (6 - 1) + (3 - 1)
    assert delta("shapeshift_e2e_request_latency_seconds_count") == 2
    assert delta("shapeshift_requests_total", status="length") == 2


def test_gauges_return_to_idle(server):
    complete(server.base_url, "gauge check", 2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        samples = scrape(server.base_url)
        if value(samples, "shapeshift_requests_running") == 0 and value(samples, "shapeshift_requests_waiting") == 0:
            break
        time.sleep(0.1)
    assert value(samples, "shapeshift_requests_running") == 0
    assert value(samples, "shapeshift_requests_waiting") == 0
    assert value(samples, "shapeshift_batch_size") >= 1  # the last step ran a batch


def test_invalid_requests_counted(server):
    before = scrape(server.base_url)
    httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    after = scrape(server.base_url)
    assert value(after, "shapeshift_requests_total", status="invalid") == \
        value(before, "shapeshift_requests_total", status="invalid") + 1
