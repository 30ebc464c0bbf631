"""Prometheus metrics of one engine server.

Data flow: the engine thread of `AsyncEngine` calls `EngineMetrics.observe_*`
after every scheduler step (token timings, finished requests) and
`EngineMetrics.update_from_stats` with the engine's `EngineStats` snapshot
(gauges, cumulative prefix-cache counters); the HTTP handlers count rejected
requests; `/metrics` renders `EngineMetrics.registry`, a `CollectorRegistry`
owned by this server alone (several servers in one process, as in tests, never
share or collide on series).

These names are read by the operator's drift detector; they are a stable
interface. Every series carries a `model` label (the served model name).

| name                                              | type      | extra labels   | unit / meaning                                              |
|---------------------------------------------------|-----------|----------------|-------------------------------------------------------------|
| shapeshift_prompt_tokens                          | histogram |                | prompt length in tokens, per request accepted by the engine |
| shapeshift_generation_tokens                      | histogram |                | generated tokens, per finished request                      |
| shapeshift_time_to_first_token_seconds            | histogram |                | arrival at the server -> first generated token               |
| shapeshift_inter_token_latency_seconds            | histogram |                | gap between consecutive generated tokens of one request     |
| shapeshift_e2e_request_latency_seconds            | histogram |                | arrival -> finish, per finished request                     |
| shapeshift_prefix_cache_queries_tokens_total      | counter   |                | prompt tokens looked up in the prefix cache                 |
| shapeshift_prefix_cache_hits_tokens_total         | counter   |                | prompt tokens served from the prefix cache                  |
| shapeshift_requests_total                         | counter   | status         | requests by outcome (see `REQUEST_STATUSES`)                |
| shapeshift_requests_running                       | gauge     |                | requests in the engine's running set                        |
| shapeshift_requests_waiting                       | gauge     |                | requests admitted but not yet running                       |
| shapeshift_batch_size                             | gauge     |                | sequences in the last scheduler step                        |
| shapeshift_forward_pass_info                      | info      | name, sha256   | the active forward pass (value always 1)                    |
| shapeshift_forward_pass_reloads_total             | counter   | result         | forward-pass rollout attempts by outcome (`RELOAD_RESULTS`) |
| shapeshift_forward_pass_last_reload_status        | gauge     | result         | 1 on the outcome of the last attempt, 0 on the others       |
| shapeshift_forward_pass_last_reload_timestamp_seconds | gauge |                | unix time of the last attempt (0: none yet)                 |
| shapeshift_forward_pass_in_sync                   | gauge     |                | 1 when the active pass is the one the pod annotations ask for |

`requests_total{status}` values: `stop` and `length` (finished normally, by
the OpenAI finish reason), `abort` (client went away), `error` (engine failure,
HTTP 500), `rejected` (overload, HTTP 429), `invalid` (bad request, HTTP 4xx).

`forward_pass_*reload*` results: `success`, `digest_mismatch`, `fetch_error`,
`refused` (see `rollout_protocol.py`, which the operator imports for these names).
They move only when the rollout agent runs (`--desired-forward-pass-file`);
`in_sync` is 1 when no agent runs.

Histogram buckets: token counts are roughly exponential (factor ~1.5 above
512) up to 131072 so that prompt-length drift at 10K-128K tokens moves mass
between distinct buckets; latencies span 1 ms to minutes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from shapeshift.engine.contracts.pod_annotations import RELOAD_RESULTS

REQUEST_STATUSES = ("stop", "length", "abort", "error", "rejected", "invalid")

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


class EngineMetrics:
    """All series of one server, bound to one served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        m = ("model",)
        self.prompt_tokens = Histogram(
            "shapeshift_prompt_tokens", "Prompt length in tokens of requests accepted by the engine.",
            m, buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.generation_tokens = Histogram(
            "shapeshift_generation_tokens", "Generated tokens per finished request.",
            m, buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.time_to_first_token = Histogram(
            "shapeshift_time_to_first_token_seconds", "Arrival to first generated token.",
            m, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(
            "shapeshift_inter_token_latency_seconds", "Gap between consecutive tokens of one request.",
            m, buckets=INTER_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram(
            "shapeshift_e2e_request_latency_seconds", "Arrival to finish of a request.",
            m, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        # prometheus_client appends `_total` to counter names itself.
        self.prefix_cache_queries = Counter(
            "shapeshift_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
            m, registry=r).labels(model_name)
        self.prefix_cache_hits = Counter(
            "shapeshift_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.",
            m, registry=r).labels(model_name)
        self._requests = Counter(
            "shapeshift_requests", "Requests by outcome.", ("model", "status"), registry=r)
        for status in REQUEST_STATUSES:  # pre-create so rate() sees zeros, not absent series
            self._requests.labels(model_name, status)
        self.requests_running = Gauge(
            "shapeshift_requests_running", "Requests in the engine's running set.",
            m, registry=r).labels(model_name)
        self.requests_waiting = Gauge(
            "shapeshift_requests_waiting", "Requests admitted but not yet running.",
            m, registry=r).labels(model_name)
        self.batch_size = Gauge(
            "shapeshift_batch_size", "Sequences in the last scheduler step.",
            m, registry=r).labels(model_name)
        self._forward_pass = Info(
            "shapeshift_forward_pass", "The active forward pass.", m, registry=r)
        self._forward_pass_identity: tuple[str, str] | None = None
        self._reloads = Counter(
            "shapeshift_forward_pass_reloads", "Forward-pass rollout attempts by outcome.",
            ("model", "result"), registry=r)
        self._last_reload_status = Gauge(
            "shapeshift_forward_pass_last_reload_status",
            "1 on the outcome of the last forward-pass rollout attempt, 0 on the others.",
            ("model", "result"), registry=r)
        for result in RELOAD_RESULTS:
            self._reloads.labels(model_name, result)
            self._last_reload_status.labels(model_name, result).set(0)
        self.last_reload_timestamp = Gauge(
            "shapeshift_forward_pass_last_reload_timestamp_seconds",
            "Unix time of the last forward-pass rollout attempt (0: none yet).", m, registry=r).labels(model_name)
        self.forward_pass_in_sync = Gauge(
            "shapeshift_forward_pass_in_sync",
            "1 when the active forward pass is the one the pod annotations ask for.", m, registry=r).labels(model_name)
        self.forward_pass_in_sync.set(1)
        # Last cumulative values seen in EngineStats; counters advance by the difference.
        self._last_queried_tokens = 0
        self._last_hit_tokens = 0

    def count_request(self, status: str) -> None:
        if status not in REQUEST_STATUSES:
            raise ValueError(f"unknown request status {status!r}; expected one of {REQUEST_STATUSES}")
        self._requests.labels(self.model_name, status).inc()

    def requests_counter_value(self, status: str) -> float:
        value = self.registry.get_sample_value("shapeshift_requests_total",
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

    def render(self) -> tuple[bytes, str]:
        """The text exposition of this server's registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
