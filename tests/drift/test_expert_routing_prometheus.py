"""The expert-routing histogram, metric -> a real Prometheus -> the operator's profile reader.

`shapeshift serve --model tiny-moe` on the CPU (a Mixtral-style model, 4 experts top-2) serves
a few completions while Debian's Prometheus scrapes it every second with the deployment's
target labels; `PrometheusTraffic.observe` then builds the observed traffic profile over a
window around them. Its `expertRouting` must be the routing that was served: per layer, the
shares of the increase of shapeshift_expert_routed_tokens_total the server's own /metrics
showed from before the first request to after the last.
"""

from __future__ import annotations

import json
import time
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.engine_server import ServerProcess
from shapeshift.engine.contracts.expert_routing import ExpertRouting
from shapeshift.engine.contracts.metric_names import EXPERT_ROUTED_TOKENS
from shapeshift.engine.contracts.traffic_profile import TrafficProfile
from shapeshift.operator.prometheus import PrometheusTraffic, SeriesSelector

pytestmark = pytest.mark.slow

MODEL = "tiny-moe"
SELECTOR = SeriesSelector(namespace="team-m", deployment="moe", model=MODEL)


@pytest.fixture
def moe_server(tmp_path):
    """`shapeshift serve --model tiny-moe` on the CPU with serve's own context and KV sizes."""
    server = ServerProcess([], tmp_path / "serve.log", model=MODEL, max_model_len=None, num_kv_blocks=None,
                           log_level="info").start()
    yield server.address
    server.stop()


def routed(target: str) -> dict[int, list[float]]:
    """{layer: [tokens per expert]} from the server's own /metrics."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
        text = response.read().decode()
    rows: dict[int, dict[int, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == EXPERT_ROUTED_TOKENS:
                rows.setdefault(int(s.labels["layer"]), {})[int(s.labels["expert"])] = s.value
    return {layer: [row[e] for e in sorted(row)] for layer, row in rows.items()}


def complete(target: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://{target}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def test_observed_profile_holds_the_served_routing(prometheus, moe_server):
    server = prometheus([{
        "job_name": "engine", "scrape_interval": "1s", "scrape_timeout": "1s",
        "static_configs": [{"targets": [moe_server], "labels": {"namespace": "team-m", "deployment": "moe"}}],
    }])
    server.wait_for(f'count({EXPERT_ROUTED_TOKENS}{{deployment="moe"}})', lambda v: v == 2 * 4, timeout_s=30)
    before = routed(moe_server)
    assert before and all(v == 0 for row in before.values() for v in row)  # nothing counted before traffic
    time.sleep(1.5)  # a scrape of the idle counters inside the window
    start = datetime.now(timezone.utc)
    for prompt in ("def f(x):\n    return x * 2\n", "The quick brown fox jumps over the lazy dog. " * 3,
                   "SELECT name FROM users WHERE id = 7;"):
        complete(moe_server, prompt, 12)
    after = routed(moe_server)
    total = sum(after[0])
    server.wait_for(f'sum({EXPERT_ROUTED_TOKENS}{{deployment="moe",layer="0"}})', lambda v: v == total, timeout_s=30)
    time.sleep(1.5)
    end = datetime.now(timezone.utc)

    with PrometheusTraffic(server.url) as prom:
        observed = prom.observe(SELECTOR, timedelta(seconds=round((end - start).total_seconds()) + 1), at=end)
    routing = observed.profile.expert_routing
    assert routing is not None
    served = ExpertRouting.from_counts({layer: [a - b for a, b in zip(after[layer], before[layer])]
                                        for layer in after})
    assert sorted(routing.shares()) == sorted(served.shares()) == [0, 1]
    assert routing.distance(served).max < 1e-9
    for layer, shares in routing.shares().items():
        assert shares == pytest.approx(served.shares()[layer], abs=1e-9)
    assert len({tuple(round(s, 6) for s in row) for row in routing.shares().values()}) == 2  # layers differ
    # The profile survives its wire form (what a CompileRun carries).
    again = TrafficProfile.from_yaml(observed.profile.to_yaml())
    assert again.expert_routing == routing
