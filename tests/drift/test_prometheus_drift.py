"""The drift detector against a real Prometheus.

Two kinds of scrape target, both scraped every second by Debian's Prometheus,
which adds the `namespace` and `deployment` target labels a ServiceMonitor would:

- the real engine server, `shapeshift serve --model tiny-llama` on the CPU,
  driven with token-id prompts of known lengths through /v1/completions:
  traffic then a stopped Prometheus, an idle window, a handful of requests, and
  short prompts behind a shared system prompt then long ones;
- tests/drift/metrics_exporter.py, a real prometheus_client process holding the
  engine's own EngineMetrics series and recording the token counts a test sends,
  only for the first test, which needs an exact prefix-cache hit rate (half of
  every prompt, then none), which the engine's block cache cannot be made to give.

Short prompts that hit the prefix cache, then long prompts that miss it;
`PrometheusTraffic` reads both windows and the drift check
(`drift_check.run_check` -> `drift.decide`) sees the prompt lengths move
and the hit rate fall. Prometheus stopped, or a window without traffic,
gives NoData and a TrafficObserved=False condition, never a Compile.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from harness.engine_server import ServerProcess
from metrics_exporter import exporter_process, in_flight, observe
from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile
from shapeshift.operator.drift import Compile, Drifting, DriftPolicy, DriftState, NoData, Stable
from shapeshift.operator.drift_check import CheckResult, drift_status_update, run_check
from shapeshift.operator.api import InferenceDeploymentStatus
from shapeshift.operator.prometheus import (
    NoTrafficData,
    PrometheusTraffic,
    PrometheusUnreachable,
    SeriesSelector,
)

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
SELECTOR = SeriesSelector(namespace="team-a", deployment="llama", model=MODEL)


def scrape(prometheus, target: str):
    """A new Prometheus scraping `target` every second, with the deployment's target labels."""
    server = prometheus([{
        "job_name": "engine",
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "static_configs": [{"targets": [target], "labels": {"namespace": "team-a", "deployment": "llama"}}],
    }])
    # Wait for a scrape of the idle target, so the first requests count as an increase from there.
    server.wait_for('shapeshift_prompt_tokens_count{deployment="llama"}', timeout_s=30)
    return server


@pytest.fixture
def scraped(prometheus):
    """The metrics exporter, scraped by Prometheus: (exporter address, Prometheus)."""
    with exporter_process(MODEL) as exporter:
        yield exporter, scrape(prometheus, exporter)


def drive(exporter: str, server, prompts: list[int], *, cached: float, outputs: int) -> tuple[datetime, datetime]:
    """Send one request per prompt length over ~2 s; return (start, end) once Prometheus has them all."""
    before = float(server.query("sum(shapeshift_prompt_tokens_count)")[0]["value"][1])
    start = datetime.now(timezone.utc)
    for length in prompts:
        observe(exporter, length, outputs, int(length * cached))
        time.sleep(2.0 / len(prompts))
    server.wait_for("sum(shapeshift_prompt_tokens_count)", lambda v: v >= before + len(prompts), timeout_s=30)
    time.sleep(1.2)  # one more scrape, so rate() has a sample after the last change too
    return start, datetime.now(timezone.utc)


def window(start: datetime, end: datetime) -> timedelta:
    # From one scrape before the phase started to its end.
    return end - start + timedelta(seconds=1)


SHORT = [18 + (i * 7) % 13 for i in range(40)]  # 18..30 tokens: bucket (16, 32]
LONG = [150 + (i * 37) % 100 for i in range(40)]  # 150..249 tokens: bucket (128, 256]


def test_observed_profile_follows_prompt_lengths_and_hit_rate(scraped):
    exporter, server = scraped
    short_start, short_end = drive(exporter, server, SHORT, cached=0.5, outputs=8)
    time.sleep(1.5)  # keep the two windows apart
    long_start, long_end = drive(exporter, server, LONG, cached=0.0, outputs=40)

    with PrometheusTraffic(server.url) as prom:
        short = prom.observe(SELECTOR, window(short_start, short_end), at=short_end, name="short")
        long = prom.observe(SELECTOR, window(long_start, long_end), at=long_end, name="long")

    # histogram_quantile interpolates inside the engine's power-of-two buckets
    assert 16 < short.profile.prompt_length.p50 <= 32
    assert 16 < short.profile.prompt_length.p99 <= 32
    assert 128 < long.profile.prompt_length.p50 <= 256
    assert 128 < long.profile.prompt_length.p90 <= 256
    assert 4 < short.profile.output_length.p50 <= 8
    assert 32 < long.profile.output_length.p50 <= 64
    # half of each short prompt was cached, none of the long ones
    assert short.profile.prefix_cache_hit_rate == pytest.approx(0.5, abs=0.05)
    assert long.profile.prefix_cache_hit_rate == pytest.approx(0.0, abs=1e-9)
    # increase() extrapolates to the window edges, so counts are close, not exact
    assert 30 <= short.quality.requests <= 60
    assert 30 <= long.quality.requests <= 60
    assert short.quality.targets == 1
    assert long.profile.window.source == "prometheus"
    assert long.profile.arrival_rate is not None and long.profile.arrival_rate > 1
    # the histograms carry the mass in the right bucket
    short_hist = {b.le: b.weight for b in short.profile.prompt_length.histogram}
    assert max(short_hist, key=short_hist.get) == 32
    long_hist = {b.le: b.weight for b in long.profile.prompt_length.histogram}
    assert max(long_hist, key=long_hist.get) == 256
    # the profile round-trips through its wire form (what status.observedTraffic stores)
    assert TrafficProfile.model_validate(long.profile.to_dict()) == long.profile

    # The drift check sees it: two checks over the threshold, then a Compile carrying the long snapshot.
    policy = DriftPolicy(prompt_length_relative=0.3, prefix_cache_hit_rate_absolute=0.15, consecutive_checks=2,
                         cooldown=timedelta(minutes=10), min_requests=20)
    now = long_end
    with PrometheusTraffic(server.url) as prom:
        def observe_long():
            return prom.observe(SELECTOR, window(long_start, long_end), at=long_end, name="observed")

        def observe_short():
            return prom.observe(SELECTOR, window(short_start, short_end), at=short_end, name="observed")

        same = run_check(observe=observe_short, baseline=short.profile, policy=policy, state=DriftState(),
                         active_compile_run=None, now=now)
        first = run_check(observe=observe_long, baseline=short.profile, policy=policy, state=DriftState(),
                          active_compile_run=None, now=now)
        second = run_check(observe=observe_long, baseline=short.profile, policy=policy, state=first.state,
                           active_compile_run=None, now=now + timedelta(seconds=60))
    assert isinstance(same.decision, Stable)
    assert isinstance(first.decision, Drifting) and first.decision.consecutive == 1
    assert isinstance(second.decision, Compile)
    assert "promptLength" in second.decision.reason and "prefixCacheHitRate" in second.decision.reason
    assert second.decision.snapshot.prompt_length.p50 == long.profile.prompt_length.p50
    assert second.state.last_compile_at == now + timedelta(seconds=60)

    update = drift_status_update(second, InferenceDeploymentStatus(), now=now, compile_run="llama-drift-1")
    status = update.fields
    assert status["drift"]["exceeded"] is True
    assert status["drift"]["promptLengthRelativeChange"]["p50"] > 3  # ~24 -> ~190 tokens
    assert status["drift"]["prefixCacheHitRateChange"] == pytest.approx(-0.5, abs=0.05)
    assert status["lastCompileRun"] == "llama-drift-1"
    assert update.condition("TrafficObserved")[1] == "True"
    assert update.condition("Drifted")[1:3] == ("True", "CompileRunCreated")
    assert InferenceDeploymentStatus.model_validate(status).observed_traffic is not None


# ---- the real engine server -----------------------------------------------------------------


@pytest.fixture
def engine_server(tmp_path):
    """`shapeshift serve --model tiny-llama` on the CPU, as a serving pod would run it (serve's own
    context and KV sizes). One per test: its counters must start at zero, or increase() over a
    window at the start of a new Prometheus extrapolates from what an earlier test sent."""
    server = ServerProcess([], tmp_path / "serve.log", model=MODEL, max_model_len=None, num_kv_blocks=None,
                           log_level="info").start()
    yield server.address
    server.stop()


def complete(target: str, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://{target}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def drive_server(target: str, server, prompts: list[list[int]], max_tokens: int) -> tuple[datetime, datetime]:
    before = float(server.query("sum(shapeshift_prompt_tokens_count)")[0]["value"][1])
    start = datetime.now(timezone.utc)
    for prompt in prompts:
        usage = complete(target, prompt, max_tokens)["usage"]
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == max_tokens
    server.wait_for("sum(shapeshift_prompt_tokens_count)", lambda v: v >= before + len(prompts), timeout_s=30)
    time.sleep(1.2)
    return start, datetime.now(timezone.utc)


def test_concurrency_is_the_width_of_the_bursts_not_the_window_average(prometheus):
    """One request in flight for 8 s, a burst of 8 (2 running, 6 waiting) for 4 s, then 30 s of
    nothing: the observed concurrency, which the compile worker replays in a closed loop, is the
    burst's width, not the window's average, though the burst fills less than a tenth of the
    window (idle steps do not count). The same exporter scraped a second time without its waiting
    gauge (a metric_relabel drop) still counts its running requests; without either gauge the
    profile falls back to one request in flight. Scraped as two pods of one deployment, the
    in-flight count is per pod, as the replay drives one engine."""
    def drop(regex: str) -> list[dict]:
        return [{"source_labels": ["__name__"], "regex": regex, "action": "drop"}]

    with exporter_process(MODEL) as exporter:
        def job(name: str, deployment: str, relabel: list[dict]) -> dict:
            return {"job_name": name, "scrape_interval": "1s", "scrape_timeout": "1s",
                    "static_configs": [{"targets": [exporter], "labels": {"namespace": "team-a",
                                                                          "deployment": deployment}}],
                    "metric_relabel_configs": relabel}

        # The same exporter as two pods of one deployment (an instance label each): twice the
        # deployment-wide in-flight count, over two pods.
        two_pods = {"job_name": "two-pods", "scrape_interval": "1s", "scrape_timeout": "1s",
                    "static_configs": [{"targets": [exporter], "labels": {"namespace": "team-a",
                                                                          "deployment": "llama-two-pods",
                                                                          "instance": pod}} for pod in ("a", "b")]}
        server = prometheus([job("engine", "llama", []),
                             job("no-waiting", "llama-no-waiting", drop("shapeshift_requests_waiting")),
                             job("no-gauges", "llama-no-gauges", drop("shapeshift_requests_(running|waiting)")),
                             two_pods])
        for deployment in ("llama", "llama-no-waiting", "llama-no-gauges", "llama-two-pods"):
            server.wait_for(f'shapeshift_prompt_tokens_count{{deployment="{deployment}"}}', timeout_s=30)
        start = datetime.now(timezone.utc)
        time.sleep(2.0)  # every job scrapes the idle target inside the window before the first request
        in_flight(exporter, running=1, waiting=0)
        for i in range(8):  # a trickle, one at a time: 8 s
            observe(exporter, 40, 8, 0)
            time.sleep(1.0)
        in_flight(exporter, running=2, waiting=6)  # the burst: 8 in flight for 4 s
        for i in range(16):
            observe(exporter, 160, 8, 0)
            time.sleep(0.25)
        in_flight(exporter, running=0, waiting=0)
        time.sleep(30)  # quiet
        end = datetime.now(timezone.utc)
        span = end - start + timedelta(seconds=1)

        with PrometheusTraffic(server.url) as prom:
            observed = prom.observe(SELECTOR, span, at=end)
            no_waiting = prom.observe(SeriesSelector(namespace="team-a", deployment="llama-no-waiting", model=MODEL),
                                      span, at=end)
            no_gauges = prom.observe(SeriesSelector(namespace="team-a", deployment="llama-no-gauges", model=MODEL),
                                     span, at=end)
            pods = prom.observe(SeriesSelector(namespace="team-a", deployment="llama-two-pods", model=MODEL),
                                span, at=end)
            w = f"{int(span.total_seconds())}s"
            average = prom.scalar(f'sum(avg_over_time(shapeshift_requests_running{{deployment="llama"}}[{w}]))'
                                  f' + sum(avg_over_time(shapeshift_requests_waiting{{deployment="llama"}}[{w}]))',
                                  end)

    assert average is not None and average < 2, average  # what a window average would have said
    assert observed.profile.concurrency == 8, (observed.profile.concurrency, observed.quality.queries["concurrency"])
    assert "quantile_over_time(0.9" in observed.quality.queries["concurrency"]
    assert no_waiting.profile.concurrency == 2, no_waiting.quality.queries["concurrency"]
    assert no_gauges.profile.concurrency == 1
    # Per engine, as the replay drives one: 16 in flight over the deployment's 2 pods.
    assert pods.quality.targets == 2 and pods.profile.concurrency == 8, (pods.quality.targets, pods.profile.concurrency)
    # and the arrival rate too: twice the deployment's requests over its 2 pods is one engine's rate.
    assert pods.profile.arrival_rate == pytest.approx(observed.profile.arrival_rate, rel=0.25), \
        (pods.profile.arrival_rate, observed.profile.arrival_rate)
    # The rest of the profile does not depend on the gauges (two scrapes of one target, so the
    # quantiles agree; increase() extrapolates each job's own scrape times, so counts only nearly).
    quantiles = lambda d: (d.p50, d.p90, d.p99)  # noqa: E731
    assert quantiles(no_gauges.profile.prompt_length) == quantiles(observed.profile.prompt_length)
    assert observed.quality.requests == pytest.approx(24, abs=6)


def test_prometheus_unreachable_is_no_data_and_never_compiles(engine_server, prometheus):
    server = scrape(prometheus, engine_server)
    rng = random.Random(3)
    drive_server(engine_server, server, [[rng.randrange(3, 500) for _ in range(n)] for n in LONG[:10]], max_tokens=8)
    url = server.url
    server.stop()
    baseline = TrafficProfile(name="short", prompt_length=LengthDistribution(p50=20, p90=28, p99=30),
                              output_length=LengthDistribution(p50=8, p90=8, p99=8), prefix_cache_hit_rate=0.5)
    policy = DriftPolicy(consecutive_checks=2)
    state = DriftState(consecutive=1)  # one drifting check already seen: the next one would compile
    with PrometheusTraffic(url, timeout_seconds=2) as prom:
        with pytest.raises(PrometheusUnreachable, match="cannot be reached"):
            prom.observe(SELECTOR, "30s")
        started = time.monotonic()
        result = run_check(observe=lambda: prom.observe(SELECTOR, "30s"), baseline=baseline, policy=policy,
                           state=state, active_compile_run=None, now=datetime.now(timezone.utc))
        assert time.monotonic() - started < 5  # no retry storm delaying the condition
    assert isinstance(result.decision, NoData)
    assert result.decision.reason == "PrometheusUnreachable"
    assert result.state.consecutive == 0
    assert result.observed is None

    update = drift_status_update(result, InferenceDeploymentStatus(), now=datetime.now(timezone.utc))
    _, traffic_status, traffic_reason, traffic_message = update.condition("TrafficObserved")
    assert (traffic_status, traffic_reason) == ("False", "PrometheusUnreachable")
    assert url.split("://", 1)[1] in traffic_message  # host and port: status quotes nothing else
    assert update.condition("Drifted")[1] == "Unknown"
    assert "lastCompileRun" not in update.fields
    assert "observedTraffic" not in update.fields


def test_window_without_requests_is_no_data(engine_server, prometheus):
    server = scrape(prometheus, engine_server)
    time.sleep(2)  # a few scrapes of an idle target: series exist, nothing moved
    with PrometheusTraffic(server.url) as prom:
        with pytest.raises(NoTrafficData, match="no requests reached"):
            prom.observe(SELECTOR, "10s")
        with pytest.raises(NoTrafficData, match="no shapeshift_prompt_tokens series"):
            prom.observe(SeriesSelector(namespace="team-a", deployment="other"), "10s")
        result = run_check(observe=lambda: prom.observe(SELECTOR, "10s"), baseline=None, policy=DriftPolicy(),
                           state=DriftState(consecutive=1), active_compile_run=None,
                           now=datetime.now(timezone.utc))
    assert isinstance(result.decision, NoData) and result.decision.reason == "NoTraffic"
    assert isinstance(result, CheckResult) and result.state.consecutive == 0


def test_too_few_requests_is_no_data(engine_server, prometheus):
    server = scrape(prometheus, engine_server)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(length)] for length in LONG[:5]]
    start, end = drive_server(engine_server, server, prompts, max_tokens=8)
    with PrometheusTraffic(server.url) as prom:
        observed = prom.observe(SELECTOR, window(start, end), at=end)
        result = run_check(observe=lambda: observed, baseline=observed.profile.scaled(0.1),
                           policy=DriftPolicy(min_requests=20, consecutive_checks=1), state=DriftState(),
                           active_compile_run=None, now=end)
    assert observed.quality.requests < 20
    assert isinstance(result.decision, NoData) and result.decision.reason == "TooFewRequests"


def test_real_engine_server_drift_in_prompt_lengths_and_cache_hits(engine_server, prometheus):
    """Short prompts behind a shared 32-token prefix (two KV blocks hit the prefix cache),
    then long unrelated prompts: the real server's histograms and cache counters show both."""
    server = scrape(prometheus, engine_server)
    rng = random.Random(7)
    system_prompt = [rng.randrange(3, 500) for _ in range(32)]
    short_prompts = [system_prompt + [rng.randrange(3, 500) for _ in range(4 + i % 9)] for i in range(30)]
    long_prompts = [[rng.randrange(3, 500) for _ in range(150 + (i * 37) % 100)] for i in range(30)]

    short_start, short_end = drive_server(engine_server, server, short_prompts, max_tokens=4)
    time.sleep(1.5)
    long_start, long_end = drive_server(engine_server, server, long_prompts, max_tokens=24)

    policy = DriftPolicy(prompt_length_relative=0.3, prefix_cache_hit_rate_absolute=0.15, consecutive_checks=2,
                         min_requests=20)
    with PrometheusTraffic(server.url) as prom:
        short = prom.observe(SELECTOR, window(short_start, short_end), at=short_end, name="short")
        long = prom.observe(SELECTOR, window(long_start, long_end), at=long_end, name="long")

        def observe_long():
            return prom.observe(SELECTOR, window(long_start, long_end), at=long_end)

        first = run_check(observe=observe_long, baseline=short.profile, policy=policy, state=DriftState(),
                          active_compile_run=None, now=long_end)
        second = run_check(observe=observe_long, baseline=short.profile, policy=policy, state=first.state,
                           active_compile_run=None, now=long_end + timedelta(minutes=1))

    assert 32 < short.profile.prompt_length.p50 <= 64  # 36..44 tokens
    assert 128 < long.profile.prompt_length.p50 <= 256  # 150..249 tokens
    assert 2 < short.profile.output_length.p50 <= 4 and 16 < long.profile.output_length.p50 <= 32
    # after the first request, 32 of ~40 prompt tokens of each short prompt come from the cache
    assert 0.6 < short.profile.prefix_cache_hit_rate < 0.85
    assert long.profile.prefix_cache_hit_rate < 0.1
    assert isinstance(first.decision, Drifting)
    assert isinstance(second.decision, Compile)
    assert "prefixCacheHitRate" in second.decision.reason
