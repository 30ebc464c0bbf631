"""What the engine pods of one deployment report during a rollout, read from Prometheus.

Data flow:

    engine pods --/metrics--> Prometheus (the scrape adds namespace, deployment and pod labels)
    RolloutQueries(selector, pod_label)
        .reports()  --PromQL, instant-->   {pod: PodReport(running, in_sync, last reload result + time)}
            shapeshift_forward_pass_info{sel}                              name, sha256 per pod
            shapeshift_forward_pass_in_sync{sel}                           1: runs what it is asked
            shapeshift_forward_pass_last_reload_status{sel} == 1           result of the last attempt
            shapeshift_forward_pass_last_reload_timestamp_seconds{sel}     when it happened
        .group_metrics(pods, window)  --PromQL over the analysis window--> ServingMetrics of a pod group
            sum(increase(shapeshift_requests_total{sel,pod=~G}[w]))                       requests
            same with status=~"error|rejected"                                              failures
            histogram_quantile(0.9, sum by (le) (rate(inter_token_latency_bucket[w])))      p90 latency
            sum(rate(shapeshift_generation_tokens_sum[w])) / pods                           tokens/s per pod
        .analysis(canary, baseline, window) --> rollout.CanaryAnalysis

The engine's latency series carry no forward-pass label: canary and baseline are
told apart by the pod target label, because the operator knows which pods it asked
to run what. p90 is taken over inter-token latency rather than end-to-end latency:
it is what a forward pass changes, and it does not depend on how long the outputs
of the requests that happened to reach each group were.

Errors from Prometheus surface as ``prometheus.PrometheusUnreachable``; the rollout
timer then holds the rollout where it is (it never promotes on missing data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Iterable

from shapeshift.engine.contracts.metric_names import (
    FAILED_REQUEST_STATUSES as FAILED_STATUSES,
    FORWARD_PASS_INFO as METRIC_FORWARD_PASS_INFO,
    FORWARD_PASS_IN_SYNC as METRIC_IN_SYNC,
    FORWARD_PASS_LAST_RELOAD_STATUS as METRIC_LAST_RELOAD_STATUS,
    FORWARD_PASS_LAST_RELOAD_TIMESTAMP as METRIC_LAST_RELOAD_TIMESTAMP,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    REQUESTS,
)
from shapeshift.operator.prometheus import PrometheusTraffic, SeriesSelector, _promql_duration
from shapeshift.operator.rollout import CanaryAnalysis, ForwardPassIdentity, ServingMetrics

__all__ = ["PodReport", "RolloutQueries", "pod_regex"]



@dataclass(frozen=True)
class PodReport:
    """What one pod's engine last reported."""

    running: ForwardPassIdentity | None = None
    in_sync: bool | None = None
    last_reload_result: str | None = None
    last_reload_at: float | None = None  # unix seconds; None: no attempt yet


def pod_regex(pods: Iterable[str]) -> str:
    """An anchored PromQL regex matching exactly these pod names (RE2 metacharacters escaped)."""
    escaped = []
    for pod in sorted(pods):
        escaped.append("".join("\\\\" + ch if ch in r".^$*+?()[]{}|\\" else ch for ch in pod))
    return "|".join(escaped)


class RolloutQueries:
    """Rollout reads for one deployment's series (``selector``) through one Prometheus client."""

    def __init__(self, prometheus: PrometheusTraffic, selector: SeriesSelector, pod_label: str = "pod") -> None:
        self.prometheus, self.selector, self.pod_label = prometheus, selector, pod_label

    def reports(self, at: datetime | None = None) -> dict[str, PodReport]:
        """Every pod with a forward-pass series now, by pod label value."""
        sel = self.selector.matcher()
        found: dict[str, dict[str, Any]] = {}

        def each(promql: str):
            for series in self.prometheus.query(promql, at):
                pod = series.get("metric", {}).get(self.pod_label)
                if pod:
                    yield pod, series["metric"], float(series["value"][1])

        for pod, labels, _ in each(f"{METRIC_FORWARD_PASS_INFO}{sel}"):
            found.setdefault(pod, {})["running"] = ForwardPassIdentity(labels.get("name", ""), labels.get("sha256") or None)
        for pod, _, value in each(f"{METRIC_IN_SYNC}{sel}"):
            found.setdefault(pod, {})["in_sync"] = value == 1
        for pod, labels, _ in each(f"{METRIC_LAST_RELOAD_STATUS}{sel} == 1"):
            found.setdefault(pod, {})["last_reload_result"] = labels.get("result")
        for pod, _, value in each(f"{METRIC_LAST_RELOAD_TIMESTAMP}{sel}"):
            found.setdefault(pod, {})["last_reload_at"] = value if value > 0 else None
        return {pod: PodReport(**fields) for pod, fields in found.items()}

    def group_metrics(self, pods: Iterable[str], window: timedelta, at: datetime | None = None) -> ServingMetrics:
        """Serving metrics of a group of pods over ``window`` ending at ``at``."""
        names = sorted(pods)
        if not names:
            return ServingMetrics(requests=0, p90_latency_seconds=None, error_rate=0.0, tokens_per_second=0.0)
        w = _promql_duration(window)
        group = {self.pod_label: pod_regex(names)}
        sel = self.selector.matcher(regex=group)
        failed = self.selector.matcher(regex={**group, "status": "|".join(FAILED_STATUSES)})
        requests = self.prometheus.scalar(f"sum(increase({REQUESTS}{sel}[{w}]))", at) or 0.0
        failures = self.prometheus.scalar(f"sum(increase({REQUESTS}{failed}[{w}]))", at) or 0.0
        p90 = self.prometheus.scalar(
            f"histogram_quantile(0.9, sum by (le) (rate({INTER_TOKEN_LATENCY}_bucket{sel}[{w}])))", at)
        tokens = self.prometheus.scalar(f"sum(rate({GENERATION_TOKENS}_sum{sel}[{w}]))", at) or 0.0
        reporting = self.prometheus.scalar(f"count(count by ({self.pod_label}) ({GENERATION_TOKENS}_count{sel}))", at) or 0.0
        return ServingMetrics(
            requests=requests,
            p90_latency_seconds=p90 if p90 is not None and math.isfinite(p90) else None,
            error_rate=failures / requests if requests > 0 else 0.0,
            tokens_per_second=tokens / reporting if reporting else 0.0,
        )

    def analysis(self, canary: Iterable[str], baseline: Iterable[str], window: timedelta, *,
                 min_requests: float, latency_resolution_seconds: float = 0.0,
                 at: datetime | None = None) -> CanaryAnalysis:
        return CanaryAnalysis(canary=self.group_metrics(canary, window, at),
                              baseline=self.group_metrics(baseline, window, at), min_requests=min_requests,
                              latency_resolution_seconds=latency_resolution_seconds)
