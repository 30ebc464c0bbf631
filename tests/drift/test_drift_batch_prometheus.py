"""The drift scheduler's batched reads (operator/prometheus_batch.py, operator/drift_scheduler.py)
against a real Prometheus.

Two metrics exporters (tests/drift/metrics_exporter.py), scraped every second: one as two
deployments in two namespaces (team-a/llama, team-b/mistral), fed short prompts half of which
hit the prefix cache; the other as team-a/mistral, fed long prompts. A batch of team-a/llama,
team-b/mistral and team-x/ghost (no series) reads each deployment's traffic with one query per
series for all three; each deployment's result equals what its own 15 queries give, team-a/mistral
(in the batch matcher's cross product, not in the batch) is left out, and the ghost has no traffic.
A batch against an address that answers without a vector, or one the outbound policy refuses,
gives every deployment of the batch the reason.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from metrics_exporter import exporter_process, observe
from shapeshift.operator.drift_scheduler import DriftScheduler, Registration
from shapeshift.operator.prometheus import (NoTrafficData, PrometheusAnswerMalformed, PrometheusRefused,
                                            PrometheusTraffic, SeriesSelector)
from shapeshift.operator.prometheus_batch import observe_many

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
BATCH = {"a": SeriesSelector("team-a", "llama", MODEL), "b": SeriesSelector("team-b", "mistral", MODEL),
         "ghost": SeriesSelector("team-x", "ghost", MODEL)}


class Counting(PrometheusTraffic):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[str] = []

    def query(self, promql, at=None):
        self.asked.append(promql)
        return super().query(promql, at)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    from harness.prometheus import Prometheus

    with exporter_process(MODEL) as short, exporter_process(MODEL) as long:
        def job(name, target, labels):
            return {"job_name": name, "scrape_interval": "1s", "scrape_timeout": "1s",
                    "static_configs": [{"targets": [target], "labels": labels}]}

        server = Prometheus(tmp_path_factory.mktemp("prometheus"), [
            job("a", short, {"namespace": "team-a", "deployment": "llama"}),
            job("b", short, {"namespace": "team-b", "deployment": "mistral"}),
            job("c", long, {"namespace": "team-a", "deployment": "mistral"}),
        ]).start()
        try:
            for ns, dep in (("team-a", "llama"), ("team-b", "mistral"), ("team-a", "mistral")):
                server.wait_for(f'shapeshift_prompt_tokens_count{{namespace="{ns}",deployment="{dep}"}}',
                                timeout_s=30)
            start = datetime.now(timezone.utc)
            time.sleep(1.5)
            for i in range(30):
                observe(short, 18 + (i * 7) % 13, 8, 12)
                observe(long, 150 + (i * 37) % 100, 40, 0)
                time.sleep(0.07)
            server.wait_for('sum(shapeshift_prompt_tokens_count{deployment="llama"})', lambda v: v >= 30,
                            timeout_s=30)
            time.sleep(2.5)
            end = datetime.now(timezone.utc).replace(microsecond=0)
            yield server, end - start + timedelta(seconds=2), end
        finally:
            server.stop()


def test_batch_equals_each_deployments_own_queries_with_one_query_per_series(scraped):
    server, span, end = scraped
    with Counting(server.url) as prom:
        batched = observe_many(prom, BATCH, span, at=end, names={k: f"{k}-observed" for k in BATCH})
        asked = list(prom.asked)
        own = {}
        for key, selector in BATCH.items():
            try:
                own[key] = prom.observe(selector, span, at=end, name=f"{key}-observed")
            except NoTrafficData as err:
                own[key] = err
    assert len(asked) == 15 and len(set(asked)) == 15, "\n".join(asked)  # one query per series, for all
    assert all('deployment=~"' in q for q in asked)
    for key in ("a", "b"):
        assert batched[key] == own[key], key
    assert batched["a"].profile.prompt_length.p50 <= 32 and batched["a"].quality.requests >= 20
    assert batched["a"].profile.prefix_cache_hit_rate == pytest.approx(0.5, abs=0.1)
    assert batched["a"].quality.targets == 1  # team-a/mistral (the long prompts) is not llama's
    assert isinstance(batched["ghost"], NoTrafficData) and isinstance(own["ghost"], NoTrafficData)
    assert str(batched["ghost"]) == str(own["ghost"])
    # team-a/mistral on its own: the long prompts, which no slice of the batch holds
    with PrometheusTraffic(server.url) as prom:
        other = prom.observe(SeriesSelector("team-a", "mistral", MODEL), span, at=end)
    assert other.profile.prompt_length.p50 > 128


@pytest.fixture
def not_a_vector():
    """An HTTP server answering every query 200 with data.result that is not a vector."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self):
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": "nope"}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_scheduler_batches_per_url_and_gives_each_deployment_the_batch_failure(scraped, not_a_vector):
    server, span, end = scraped
    results: dict[str, object] = {}

    def due(uid, url, selector):
        def apply(observed, now, shared):
            results[uid] = observed
        return Registration(uid=uid, name=uid, interval_seconds=60.0, url=url,
                            window_seconds=int(span.total_seconds()) + 1, selector=selector, timeout_seconds=5.0,
                            allowed_cidrs=(), apply=apply)

    scheduler = DriftScheduler()
    for key, selector in BATCH.items():
        scheduler.register(due(key, server.url, selector), start=False)
        scheduler.register(due(f"bad-{key}", not_a_vector, selector), start=False)
        scheduler.register(due(f"refused-{key}", "http://169.254.169.254:9090", selector), start=False)
    scheduler.register(due("no-url", None, BATCH["a"]), start=False)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = scheduler.run_once(pool)
        assert len(futures) == 10
        concurrent.futures.wait(futures)
    assert scheduler.batches == 4  # one per Prometheus address (and one without any)
    assert scheduler.running() == 0 and scheduler.run_once(pool) == []  # each due again an interval later
    assert results["a"].quality.requests >= 20 and results["b"].quality.requests >= 20
    assert isinstance(results["ghost"], NoTrafficData)
    for key in BATCH:
        assert isinstance(results[f"bad-{key}"], PrometheusAnswerMalformed), results[f"bad-{key}"]
        assert results[f"bad-{key}"].reason == "PrometheusAnswerMalformed"
        assert isinstance(results[f"refused-{key}"], PrometheusRefused)
    assert results["no-url"] is None  # the check's apply says: no Prometheus address
