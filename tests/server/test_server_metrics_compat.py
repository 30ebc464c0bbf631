"""/metrics beyond the drift detector's series: the token counters, KV-cache usage,
preemptions and request phases; `promtool check metrics` on the real output; and the
vLLM-named set of `--metrics-compat vllm` checked against the series the KEDA recipe in
docs/helm.md reads and those autoscaling recipes written for vLLM read."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from harness import tools
from harness.docs import yaml_documents
from server_harness import MODEL, ServerProcess, scrape, value

DOC = Path(__file__).resolve().parents[2] / "docs" / "helm.md"

# Series that autoscaling recipes written for vLLM query, with the label they select on:
# KEDA's Prometheus scaler and HPA custom-metrics examples (num_requests_waiting/running,
# kv_cache_usage_perc or the older gpu_cache_usage_perc), and the latency histograms SLO
# planners (llm-d, Dynamo) read. docs/helm.md's own recipe uses a few of them (recipe_series).
VLLM_RECIPE_SERIES = (
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:request_success_total",
)


def recipe_series() -> list[str]:
    """The vLLM series the KEDA ScaledObject in docs/helm.md queries (its triggers' PromQL)."""
    scaled = [d for d in yaml_documents(DOC) if d.get("kind") == "ScaledObject"]
    assert scaled, f"no KEDA ScaledObject in {DOC}"
    queries = [t["metadata"]["query"] for so in scaled for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
    return sorted({name for q in queries for name in re.findall(r"vllm:[a-zA-Z_:]+", q)})


def _promtool() -> str | None:
    for candidate in (tools.find("promtool"), shutil.which("promtool")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(["--metrics-compat", "vllm", "--max-num-seqs", "2"],
                         tmp_path_factory.mktemp("vllm-metrics") / "serve.log").start()
    yield proc
    proc.stop()


def _complete(base_url: str, prompt, max_tokens: int) -> None:
    resp = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text


def test_token_counters_phases_and_kv_usage_move(server):
    before = scrape(server.base_url)
    _complete(server.base_url, [9] * 30, 5)
    _complete(server.base_url, [8] * 12, 3)
    after = scrape(server.base_url)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("shapeshift_prompt_tokens_accepted_total") == 42
    assert delta("shapeshift_generated_tokens_total") == 8
    for phase in ("queue", "prefill", "decode"):
        assert delta(f"shapeshift_request_{phase}_time_seconds_count") == 2, phase
    assert 0.0 <= value(after, "shapeshift_kv_cache_usage_ratio") <= 1.0
    assert ("shapeshift_preemptions_total", (("model", MODEL),)) in after


def _promtool_check(base_url: str) -> subprocess.CompletedProcess:
    promtool = _promtool()
    if promtool is None:
        # hack/controlplane-deps.sh installs it with Prometheus: missing means the set-up did not run,
        # which fails here as the cluster tests do (SHAPESHIFT_SKIP_CLUSTER=1 makes it a skip).
        why = "promtool not installed (Debian's prometheus package, installed by hack/controlplane-deps.sh)"
        if os.environ.get("SHAPESHIFT_SKIP_CLUSTER") == "1":
            pytest.skip(why)
        pytest.fail(why)
    _complete(base_url, "promtool", 2)
    body = httpx.get(f"{base_url}/metrics", timeout=30).text
    return subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_exposition(server):
    out = _promtool_check(server.base_url)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_finds_only_vllms_colons_in_the_compat_set(vllm_server):
    """promtool's linter reserves ':' for recording rules; vLLM's own names carry it, and the
    recipes match those names, so that lint (and only that one) is expected here."""
    out = _promtool_check(vllm_server.base_url)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    others = [p for p in problems if not (p.startswith("vllm:") and p.endswith("metric names should not contain ':'"))]
    assert not others, "\n".join(others)
    assert out.returncode in (0, 3), out.returncode  # 3: lint findings only, no parse error


def test_vllm_names_carry_model_name_and_follow_traffic(vllm_server):
    before = scrape(vllm_server.base_url)
    _complete(vllm_server.base_url, [4] * 20, 4)
    after = scrape(vllm_server.base_url)
    names = {name for name, _ in after}
    wanted = recipe_series()
    # The recipe scales on the queue and the KV cache at least; an emptied example fails here.
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= set(wanted), wanted
    missing = [s for s in wanted if s not in names]
    assert not missing, f"series the docs/helm.md autoscaling recipe reads are absent: {missing}"
    missing = [s for s in VLLM_RECIPE_SERIES if s not in names]
    assert not missing, f"series autoscaling recipes read are absent: {missing}"
    for (name, labels), _ in after.items():
        if name.startswith("vllm:"):
            assert dict(labels).get("model_name") == MODEL, (name, labels)
    def vllm_value(samples: dict, name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        assert key in samples, f"{name}{labels} not exposed"
        return samples[key]

    def delta(name: str, **labels: str) -> float:
        return vllm_value(after, name, **labels) - vllm_value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 20
    assert delta("vllm:generation_tokens_total") == 4
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert vllm_value(after, "vllm:num_requests_waiting") == 0
    # The same observations as the shapeshift series.
    assert vllm_value(after, "vllm:time_to_first_token_seconds_count") == \
        value(after, "shapeshift_time_to_first_token_seconds_count")


def test_vllm_names_are_off_by_default(server):
    assert not any(name.startswith("vllm:") for name, _ in scrape(server.base_url))
