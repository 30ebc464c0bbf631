"""Prometheus metrics of one engine server.

Data flow: the engine thread of `AsyncEngine` calls `EngineMetrics.observe_*`
after every scheduler step (token timings, finished requests) and
`EngineMetrics.update_from_stats` with the engine's `EngineStats` snapshot
(gauges, cumulative prefix-cache counters); the HTTP handlers count rejected
requests; `/metrics` renders `EngineMetrics.registry`, a `CollectorRegistry`
owned by this server alone (several servers in one process, as in tests, never
share or collide on series).

The series names and their meaning are the contract in
`engine/contracts/metric_names.py` (the operator's drift detector and canary analysis
read them). `forward_pass_*reload*` results are `RELOAD_RESULTS` of
`engine/contracts/pod_annotations.py`; they move only when the rollout agent runs
(`--desired-forward-pass-file`); `in_sync` is 1 when no agent runs.

`metrics_compat="vllm"` (`shapeshift serve --metrics-compat vllm`) adds vLLM's
names (`metric_names.VLLM_SERIES`, label `model_name`) fed by the same
observations: each attribute below is then a `_Fanout` that forwards to both.

Mixture-of-experts models add `shapeshift_expert_routed_tokens_total{layer, expert}`
(`watch_expert_routing`): a collector that reads the forward pass's device-side routing
counts (engine/core/expert_routing.py) when /metrics is scraped, never on the engine's steps.

Histogram buckets: token counts are roughly exponential (factor ~1.5 above
512) up to 131072 so that prompt-length drift at 10K-128K tokens moves mass
between distinct buckets; latencies span 1 ms to minutes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from shapeshift.engine.contracts import metric_names as names
from shapeshift.engine.contracts.metric_names import REQUEST_STATUSES
from shapeshift.engine.contracts.pod_annotations import RELOAD_RESULTS

# 1..512 by powers of two, then ~1.5x steps (768, 1024, 1536, ...) to 128K.
TOKEN_BUCKETS: tuple[float, ...] = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512,
    768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384,
    24576, 32768, 49152, 65536, 98304, 131072,
)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)
INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)
E2E_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0,
)


log = logging.getLogger(__name__)


class _RoutingCollector:
    """shapeshift_expert_routed_tokens_total{model, layer, expert}, read from ``source()`` (the
    active forward pass's ExpertRoutingCounts, or None) at each scrape."""

    def __init__(self, model_name: str, source: Callable[[], Any]) -> None:
        from shapeshift.engine.core.expert_routing import RoutingTotals

        self.model_name, self.source = model_name, source
        self.totals = RoutingTotals()
        self._lock = threading.Lock()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(names.client_name(names.EXPERT_ROUTED_TOKENS),
                                   "Router top-k choices of served tokens per MoE layer and expert.",
                                   labels=("model", "layer", "expert"))

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        try:
            with self._lock:
                counts = self.totals.read(self.source())
        except Exception:  # noqa: BLE001 - a scrape must not fail because one collector did
            log.exception("reading the expert routing counts failed")
            counts = {}
        for (layer, expert), value in sorted(counts.items()):
            family.add_metric((self.model_name, str(layer), str(expert)), float(value))
        yield family


class _Fanout:
    """One observation into several series (the shapeshift one and its vLLM-named twin)."""

    def __init__(self, *children: Any) -> None:
        self.children = children

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)

    def inc(self, amount: float = 1) -> None:
        for child in self.children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)


class EngineMetrics:
    """All series of one server, bound to one served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 metrics_compat: str | None = None) -> None:
        if metrics_compat not in (None, *names.METRICS_COMPAT_CHOICES):
            raise ValueError(f"metrics_compat must be one of {names.METRICS_COMPAT_CHOICES} or None, "
                             f"got {metrics_compat!r}")
        self.model_name = model_name
        self.metrics_compat = metrics_compat
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        m = ("model",)
        self.prompt_tokens_total = self._series(
            Counter, names.PROMPT_TOKENS_TOTAL, "Prompt tokens of requests accepted by the engine.")
        self.generation_tokens_total = self._series(
            Counter, names.GENERATION_TOKENS_TOTAL, "Tokens generated, counted as they are made.")
        self.kv_cache_usage = self._series(
            Gauge, names.KV_CACHE_USAGE, "KV-cache blocks in use over all blocks (0..1).")
        self.preemptions = self._series(
            Counter, names.PREEMPTIONS, "Sequences preempted (KV blocks freed, recomputed later).")
        self.request_queue_time = self._series(
            Histogram, names.REQUEST_QUEUE_TIME, "Arrival to the start of the step that first schedules the request.", E2E_BUCKETS)
        self.request_prefill_time = self._series(
            Histogram, names.REQUEST_PREFILL_TIME, "First scheduled to first generated token.", E2E_BUCKETS)
        self.request_decode_time = self._series(
            Histogram, names.REQUEST_DECODE_TIME, "First generated token to finish.", E2E_BUCKETS)
        self.prompt_tokens = self._series(
            Histogram, names.PROMPT_TOKENS, "Prompt length in tokens of requests accepted by the engine.", TOKEN_BUCKETS)
        self.generation_tokens = self._series(
            Histogram, names.GENERATION_TOKENS, "Generated tokens per finished request.", TOKEN_BUCKETS)
        self.time_to_first_token = self._series(
            Histogram, names.TIME_TO_FIRST_TOKEN, "Arrival to first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = self._series(
            Histogram, names.INTER_TOKEN_LATENCY, "Gap between consecutive tokens of one request.", INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = self._series(
            Histogram, names.E2E_REQUEST_LATENCY, "Arrival to finish of a request.", E2E_BUCKETS)
        self.prefix_cache_queries = self._series(
            Counter, names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = self._series(
            Counter, names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.")
        self._requests = Counter(
            names.client_name(names.REQUESTS), "Requests by outcome.", ("model", "status"), registry=r)
        for status in REQUEST_STATUSES:  # pre-create so rate() sees zeros, not absent series
            self._requests.labels(model_name, status)
        self.requests_running = self._series(
            Gauge, names.REQUESTS_RUNNING, "Requests in the engine's running set.")
        self.requests_waiting = self._series(
            Gauge, names.REQUESTS_WAITING, "Requests admitted but not yet running.")
        self.batch_size = self._series(Gauge, names.BATCH_SIZE, "Sequences in the last scheduler step.")
        self._forward_pass = Info(
            names.client_name(names.FORWARD_PASS_INFO), "The active forward pass.", m, registry=r)
        self._forward_pass_identity: tuple[str, str] | None = None
        self._reloads = Counter(
            names.client_name(names.FORWARD_PASS_RELOADS), "Forward-pass rollout attempts by outcome.",
            ("model", "result"), registry=r)
        self._last_reload_status = Gauge(
            names.FORWARD_PASS_LAST_RELOAD_STATUS,
            "1 on the outcome of the last forward-pass rollout attempt, 0 on the others.",
            ("model", "result"), registry=r)
        for result in RELOAD_RESULTS:
            self._reloads.labels(model_name, result)
            self._last_reload_status.labels(model_name, result).set(0)
        self.last_reload_timestamp = Gauge(
            names.FORWARD_PASS_LAST_RELOAD_TIMESTAMP,
            "Unix time of the last forward-pass rollout attempt (0: none yet).", m, registry=r).labels(model_name)
        self.forward_pass_in_sync = Gauge(
            names.FORWARD_PASS_IN_SYNC,
            "1 when the active forward pass is the one the pod annotations ask for.", m, registry=r).labels(model_name)
        self.forward_pass_in_sync.set(1)
        self._kv_swaps = Counter(names.client_name(names.KV_SWAPS),
                                 "Forward-pass swaps by what became of the KV cache (kept or flushed, and why).",
                                 ("model", "outcome", "reason"), registry=r)
        for outcome, reason in names.KV_SWAP_SERIES:
            self._kv_swaps.labels(model_name, outcome, reason)
        self._last_kv_swaps: dict[tuple[str, str], int] = {}
        # Last cumulative values seen in EngineStats; counters advance by the difference.
        self._last_queried_tokens = 0
        self._last_hit_tokens = 0
        self._last_preemptions = 0
        self._vllm_success = None
        if metrics_compat == "vllm":
            self._add_vllm_series()

    def _series(self, kind: type, series: str, doc: str, buckets: tuple[float, ...] | None = None) -> Any:
        """One series of the contract (metric_names), labelled with this server's model."""
        extra = {"buckets": buckets} if buckets is not None else {}
        return kind(names.client_name(series), doc, ("model",), registry=self.registry, **extra).labels(self.model_name)

    def _add_vllm_series(self) -> None:
        """vLLM's names next to ours, fed by the same observations (metric_names.VLLM_SERIES)."""
        r, label, model = self.registry, (names.VLLM_MODEL_LABEL,), self.model_name
        ours = {value: key for key, value in vars(names).items() if isinstance(value, str)}
        buckets = {names.PROMPT_TOKENS: TOKEN_BUCKETS, names.GENERATION_TOKENS: TOKEN_BUCKETS,
                   names.TIME_TO_FIRST_TOKEN: TTFT_BUCKETS, names.INTER_TOKEN_LATENCY: INTER_TOKEN_BUCKETS}
        attribute = {
            names.REQUESTS_RUNNING: "requests_running", names.REQUESTS_WAITING: "requests_waiting",
            names.KV_CACHE_USAGE: "kv_cache_usage", names.PREEMPTIONS: "preemptions",
            names.PROMPT_TOKENS_TOTAL: "prompt_tokens_total", names.GENERATION_TOKENS_TOTAL: "generation_tokens_total",
            names.PREFIX_CACHE_QUERIES: "prefix_cache_queries", names.PREFIX_CACHE_HITS: "prefix_cache_hits",
            names.TIME_TO_FIRST_TOKEN: "time_to_first_token", names.INTER_TOKEN_LATENCY: "inter_token_latency",
            names.E2E_REQUEST_LATENCY: "e2e_request_latency", names.REQUEST_QUEUE_TIME: "request_queue_time",
            names.REQUEST_PREFILL_TIME: "request_prefill_time", names.REQUEST_DECODE_TIME: "request_decode_time",
            names.PROMPT_TOKENS: "prompt_tokens", names.GENERATION_TOKENS: "generation_tokens",
        }
        for vllm_name, series in names.VLLM_SERIES.items():
            doc = f"vLLM-compatible name of {series} ({ours[series]} in engine/contracts/metric_names.py)."
            if series == names.REQUESTS:
                self._vllm_success = Counter(names.client_name(vllm_name), doc, ("finished_reason", *label),
                                             registry=r)
                for reason in ("stop", "length", "abort"):
                    self._vllm_success.labels(reason, model)
                continue
            mine = getattr(self, attribute[series])
            if series.endswith("_total"):
                twin = Counter(names.client_name(vllm_name), doc, label, registry=r).labels(model)
            elif series in (names.REQUESTS_RUNNING, names.REQUESTS_WAITING, names.KV_CACHE_USAGE):
                twin = Gauge(vllm_name, doc, label, registry=r).labels(model)
            else:
                twin = Histogram(vllm_name, doc, label, buckets=buckets.get(series, E2E_BUCKETS),
                                 registry=r).labels(model)
            children = mine.children if isinstance(mine, _Fanout) else (mine,)
            setattr(self, attribute[series], _Fanout(*children, twin))

    def observe_phases(self, arrival: float, scheduled: float | None, first_token: float | None,
                       finished: float) -> None:
        """A finished request's queue, prefill and decode times (time.monotonic() stamps)."""
        if scheduled is not None:
            self.request_queue_time.observe(max(scheduled - arrival, 0.0))
            if first_token is not None:
                self.request_prefill_time.observe(max(first_token - scheduled, 0.0))
        if first_token is not None:
            self.request_decode_time.observe(max(finished - first_token, 0.0))

    def count_request(self, status: str) -> None:
        if status not in REQUEST_STATUSES:
            raise ValueError(f"unknown request status {status!r}; expected one of {REQUEST_STATUSES}")
        self._requests.labels(self.model_name, status).inc()
        if self._vllm_success is not None and status in ("stop", "length", "abort"):
            self._vllm_success.labels(status, self.model_name).inc()

    def requests_counter_value(self, status: str) -> float:
        value = self.registry.get_sample_value(names.REQUESTS,
                                               {"model": self.model_name, "status": status})
        return 0.0 if value is None else value

    def set_forward_pass(self, name: str, sha256: str) -> None:
        if self._forward_pass_identity != (name, sha256):
            self._forward_pass.labels(self.model_name).info({"name": name, "sha256": sha256})
            self._forward_pass_identity = (name, sha256)

    def record_reload(self, result: str, timestamp: float) -> None:
        """Count one rollout attempt and make it the last one."""
        if result not in RELOAD_RESULTS:
            raise ValueError(f"unknown reload result {result!r}; expected one of {RELOAD_RESULTS}")
        self._reloads.labels(self.model_name, result).inc()
        self.set_last_reload_status(result, timestamp)

    def set_last_reload_status(self, result: str, timestamp: float) -> None:
        """The last attempt's outcome without counting an attempt (a no-op reconcile)."""
        for other in RELOAD_RESULTS:
            self._last_reload_status.labels(self.model_name, other).set(1 if other == result else 0)
        self.last_reload_timestamp.set(timestamp)

    def update_from_stats(self, stats: Any, pending_admissions: int = 0) -> None:
        """Copy an `EngineStats` snapshot into gauges and advance the cache counters.

        `pending_admissions` are requests accepted by the server but not yet
        handed to the engine; they are waiting too.
        """
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting + pending_admissions)
        self.batch_size.set(stats.batch_size_last_step)
        queried, hits = int(stats.prefix_cache_queried_tokens), int(stats.prefix_cache_hit_tokens)
        # A counter never goes down; if the engine's cumulative values restart
        # (a new block manager after a reload) the new values count from zero.
        self.prefix_cache_queries.inc(queried - self._last_queried_tokens
                                      if queried >= self._last_queried_tokens else queried)
        self.prefix_cache_hits.inc(hits - self._last_hit_tokens
                                   if hits >= self._last_hit_tokens else hits)
        self._last_queried_tokens, self._last_hit_tokens = queried, hits
        blocks = int(getattr(stats, "num_kv_blocks", 0) or 0)
        if blocks > 0:
            self.kv_cache_usage.set(1.0 - int(stats.num_free_blocks) / blocks)
        preempted = int(getattr(stats, "num_preemptions", 0) or 0)
        self.preemptions.inc(preempted - self._last_preemptions if preempted >= self._last_preemptions else preempted)
        self._last_preemptions = preempted
        for (outcome, reason), total in (getattr(stats, "kv_swaps", None) or {}).items():
            seen = self._last_kv_swaps.get((outcome, reason), 0)
            self._kv_swaps.labels(self.model_name, outcome, reason).inc(total - seen if total >= seen else total)
            self._last_kv_swaps[(outcome, reason)] = total

    def watch_expert_routing(self, source: Callable[[], Any]) -> None:
        """Export the routing counts ``source()`` returns (the active pass's ExpertRoutingCounts,
        None while it has none) as shapeshift_expert_routed_tokens_total, read at each scrape."""
        self.registry.register(_RoutingCollector(self.model_name, source))

    def render(self) -> tuple[bytes, str]:
        """The text exposition of this server's registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
