"""The engine's Prometheus series: the names the serving pods export and the operator reads.

Seam: engine server ``/metrics`` (engine/serving/metrics.py) --scraped--> Prometheus
--PromQL--> operator (drift: operator/prometheus.py; canary analysis and what each pod
runs: operator/rollout_metrics.py). Torch-free; both sides import these names, so a
rename is one edit here and a test failure everywhere else.

Names are the series as Prometheus stores them (counters end in ``_total``, an Info
series in ``_info``; a histogram's name is the stem of its ``_bucket``/``_sum``/
``_count`` series). Every series carries a ``model`` label (the served model name).

| name                                                  | type      | extra labels | meaning                                           |
|-------------------------------------------------------|-----------|--------------|---------------------------------------------------|
| shapeshift_prompt_tokens                              | histogram |              | prompt length in tokens, per accepted request     |
| shapeshift_generation_tokens                          | histogram |              | generated tokens, per finished request            |
| shapeshift_time_to_first_token_seconds                | histogram |              | arrival at the server -> first generated token    |
| shapeshift_inter_token_latency_seconds                | histogram |              | gap between consecutive tokens of one request     |
| shapeshift_e2e_request_latency_seconds                | histogram |              | arrival -> finish, per finished request           |
| shapeshift_prefix_cache_queries_tokens_total          | counter   |              | prompt tokens looked up in the prefix cache       |
| shapeshift_prefix_cache_hits_tokens_total             | counter   |              | prompt tokens served from the prefix cache        |
| shapeshift_requests_total                             | counter   | status       | requests by outcome (``REQUEST_STATUSES``)        |
| shapeshift_requests_running                           | gauge     |              | requests in the engine's running set              |
| shapeshift_requests_waiting                           | gauge     |              | requests admitted but not yet running             |
| shapeshift_batch_size                                 | gauge     |              | sequences in the last scheduler step              |
| shapeshift_forward_pass_info                          | info      | name, sha256 | the active forward pass (value always 1)          |
| shapeshift_forward_pass_reloads_total                 | counter   | result       | rollout attempts by outcome (``RELOAD_RESULTS``)  |
| shapeshift_forward_pass_last_reload_status            | gauge     | result       | 1 on the last attempt's outcome, 0 on the others  |
| shapeshift_forward_pass_last_reload_timestamp_seconds | gauge     |              | unix time of the last attempt (0: none yet)       |
| shapeshift_forward_pass_in_sync                       | gauge     |              | 1 when the active pass is the one asked for       |
| shapeshift_prompt_tokens_accepted_total               | counter   |              | prompt tokens of requests accepted by the engine  |
| shapeshift_generated_tokens_total                     | counter   |              | tokens generated, counted as they are made        |
| shapeshift_kv_cache_usage_ratio                       | gauge     |              | KV-cache blocks in use / all blocks (0..1)        |
| shapeshift_preemptions_total                          | counter   |              | sequences preempted (KV blocks freed, recomputed) |
| shapeshift_request_queue_time_seconds                 | histogram |              | arrival -> start of the step first scheduling it  |
| shapeshift_request_prefill_time_seconds               | histogram |              | first scheduled -> first generated token          |
| shapeshift_request_decode_time_seconds                | histogram |              | first generated token -> finish                   |
| shapeshift_expert_routed_tokens_total                 | counter   | layer, expert | MoE: top-k choices of served tokens per expert    |
| shapeshift_kv_swaps_total                             | counter   | outcome, reason | forward-pass swaps by what became of the KV cache |

``shapeshift_expert_routed_tokens_total`` exists for mixture-of-experts models only: per
decoder layer and expert, how many of the served tokens' top-k router choices went to
that expert (a token counts once for each of its k experts; padded rows are left out).
It is counted on the device and read when /metrics is scraped; the operator turns its
rate into the traffic profile's ``expertRouting`` (engine/contracts/expert_routing.py).

``shapeshift_kv_swaps_total{outcome, reason}`` counts hot swaps and rollbacks of the
forward pass by what became of the KV cache (engine/forward_pass/kv_handover.py):
``outcome`` is ``kept`` or ``flushed``; ``reason`` is ``verified`` (kept: the incoming
pass's prefix hits on blocks the outgoing pass wrote equal a miss), ``layout_changed`` or
``layout_undeclared`` (the passes' KV layouts differ, or one declares none),
``check_failed`` (same layout, but hits differ from a miss) or ``check_error`` (the
incoming pass raised during the check). Every pair of ``KV_SWAP_SERIES`` exists from zero.

With ``shapeshift serve --metrics-compat vllm`` the server also exports the same
observations under vLLM's names with a ``model_name`` label (``VLLM_SERIES``), so
autoscaling recipes written for vLLM (HPA/KEDA on ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``; llm-d's and Dynamo's planners) work unchanged.
"""

from __future__ import annotations

PREFIX = "shapeshift_"

# histograms (series: <name>_bucket, <name>_sum, <name>_count)
PROMPT_TOKENS = "shapeshift_prompt_tokens"
GENERATION_TOKENS = "shapeshift_generation_tokens"
TIME_TO_FIRST_TOKEN = "shapeshift_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "shapeshift_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "shapeshift_e2e_request_latency_seconds"
# counters
PREFIX_CACHE_QUERIES = "shapeshift_prefix_cache_queries_tokens_total"
PREFIX_CACHE_HITS = "shapeshift_prefix_cache_hits_tokens_total"
REQUESTS = "shapeshift_requests_total"  # label: status
FORWARD_PASS_RELOADS = "shapeshift_forward_pass_reloads_total"  # label: result
# gauges
REQUESTS_RUNNING = "shapeshift_requests_running"
REQUESTS_WAITING = "shapeshift_requests_waiting"
BATCH_SIZE = "shapeshift_batch_size"
FORWARD_PASS_LAST_RELOAD_STATUS = "shapeshift_forward_pass_last_reload_status"  # label: result; one-hot
FORWARD_PASS_LAST_RELOAD_TIMESTAMP = "shapeshift_forward_pass_last_reload_timestamp_seconds"
FORWARD_PASS_IN_SYNC = "shapeshift_forward_pass_in_sync"  # 1: the active pass is the desired one
# info (labels: name, sha256; value 1)
FORWARD_PASS_INFO = "shapeshift_forward_pass_info"
# token counters, KV cache and the request phases
# (not *_prompt_tokens_total: Prometheus would take it for a sample of the histogram above)
PROMPT_TOKENS_TOTAL = "shapeshift_prompt_tokens_accepted_total"
GENERATION_TOKENS_TOTAL = "shapeshift_generated_tokens_total"
KV_CACHE_USAGE = "shapeshift_kv_cache_usage_ratio"
PREEMPTIONS = "shapeshift_preemptions_total"
REQUEST_QUEUE_TIME = "shapeshift_request_queue_time_seconds"
REQUEST_PREFILL_TIME = "shapeshift_request_prefill_time_seconds"
REQUEST_DECODE_TIME = "shapeshift_request_decode_time_seconds"
# mixture-of-experts models: router top-k choices per layer and expert (labels: layer, expert)
EXPERT_ROUTED_TOKENS = "shapeshift_expert_routed_tokens_total"
# forward-pass swaps by what became of the KV cache (labels: outcome, reason)
KV_SWAPS = "shapeshift_kv_swaps_total"
KV_SWAP_KEPT, KV_SWAP_FLUSHED = "kept", "flushed"
KV_SWAP_VERIFIED = "verified"
KV_SWAP_LAYOUT_CHANGED, KV_SWAP_LAYOUT_UNDECLARED = "layout_changed", "layout_undeclared"
KV_SWAP_CHECK_FAILED, KV_SWAP_CHECK_ERROR = "check_failed", "check_error"
# (outcome, reason) pairs that can occur
KV_SWAP_SERIES = ((KV_SWAP_KEPT, KV_SWAP_VERIFIED), (KV_SWAP_FLUSHED, KV_SWAP_LAYOUT_CHANGED),
                  (KV_SWAP_FLUSHED, KV_SWAP_LAYOUT_UNDECLARED), (KV_SWAP_FLUSHED, KV_SWAP_CHECK_FAILED),
                  (KV_SWAP_FLUSHED, KV_SWAP_CHECK_ERROR))

# `--metrics-compat vllm`: vLLM's names (label `model_name`) -> the shapeshift series whose
# observations they repeat. gpu_cache_usage_perc is vLLM's older name of kv_cache_usage_perc,
# still read by recipes written before vLLM 0.10.
VLLM_MODEL_LABEL = "model_name"
VLLM_SERIES = {
    "vllm:num_requests_running": REQUESTS_RUNNING,
    "vllm:num_requests_waiting": REQUESTS_WAITING,
    "vllm:kv_cache_usage_perc": KV_CACHE_USAGE,
    "vllm:gpu_cache_usage_perc": KV_CACHE_USAGE,
    "vllm:num_preemptions_total": PREEMPTIONS,
    "vllm:prompt_tokens_total": PROMPT_TOKENS_TOTAL,
    "vllm:generation_tokens_total": GENERATION_TOKENS_TOTAL,
    "vllm:prefix_cache_queries_total": PREFIX_CACHE_QUERIES,
    "vllm:prefix_cache_hits_total": PREFIX_CACHE_HITS,
    "vllm:request_success_total": REQUESTS,  # label finished_reason: stop, length, abort
    "vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN,
    "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY,
    "vllm:time_per_output_token_seconds": INTER_TOKEN_LATENCY,
    "vllm:e2e_request_latency_seconds": E2E_REQUEST_LATENCY,
    "vllm:request_queue_time_seconds": REQUEST_QUEUE_TIME,
    "vllm:request_prefill_time_seconds": REQUEST_PREFILL_TIME,
    "vllm:request_decode_time_seconds": REQUEST_DECODE_TIME,
    "vllm:request_prompt_tokens": PROMPT_TOKENS,
    "vllm:request_generation_tokens": GENERATION_TOKENS,
}
METRICS_COMPAT_CHOICES = ("vllm",)

# `shapeshift_requests_total{status}`: finished normally by the OpenAI finish reason
# (`stop`, `length`), the client went away (`abort`), engine failure / HTTP 500 (`error`),
# overload / HTTP 429 (`rejected`), bad request / HTTP 4xx (`invalid`).
REQUEST_STATUSES = ("stop", "length", "abort", "error", "rejected", "invalid")
FAILED_REQUEST_STATUSES = ("error", "rejected")  # the engine's failures; `invalid`/`abort` are the client's


def client_name(series: str) -> str:
    """The name to give prometheus_client, which appends ``_total`` to counters and
    ``_info`` to Info metrics itself."""
    for suffix in ("_total", "_info"):
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series
