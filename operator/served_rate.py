"""The output tokens/s a deployment serves, read from Prometheus.

    SeriesSelector of the deployment (operator/drift_check.selector_for), a window, a time
      --PromQL--> sum(rate(shapeshift_generated_tokens_total{<selector>}[<window>s]))
                  (the engine's counter of generated tokens, engine/contracts/metric_names.py,
                  summed over the deployment's pods)
      --PrometheusTraffic.query (operator/prometheus.py: the outbound policy is checked before
        anything is sent; connection failures and error answers raise TrafficQueryError)-->
    ServedRate(tokens_per_second, at, window_seconds, query)

What the compile economics (operator/compile_economics.py) turn into accelerator-hours saved.
A selector whose series Prometheus does not hold raises NoTrafficData: no rate is invented.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from shapeshift.engine.contracts.metric_names import GENERATION_TOKENS_TOTAL
from shapeshift.operator.prometheus import NoTrafficData, PrometheusTraffic, SeriesSelector

__all__ = ["ServedRate", "served_rate_query", "served_tokens_per_second"]


@dataclass(frozen=True)
class ServedRate:
    tokens_per_second: float
    at: datetime  # the query's evaluation time
    window_seconds: int
    query: str


def served_rate_query(selector: SeriesSelector, window_seconds: int) -> str:
    """The PromQL of the deployment's served output tokens/s over the last ``window_seconds``."""
    return f"sum(rate({GENERATION_TOKENS_TOTAL}{selector.matcher()}[{int(window_seconds)}s]))"


def served_tokens_per_second(url: str, selector: SeriesSelector, window_seconds: int, *, at: datetime,
                             timeout_seconds: float = 5.0, allowed_cidrs: tuple[str, ...] = ()) -> ServedRate:
    """The served output tokens/s of ``selector``'s series over ``window_seconds`` ending at ``at``."""
    promql = served_rate_query(selector, window_seconds)
    with PrometheusTraffic(url, timeout_seconds=timeout_seconds, allowed_cidrs=allowed_cidrs) as prometheus:
        value = prometheus.scalar(promql, at)
    if value is None:
        raise NoTrafficData(f"Prometheus at {prometheus.host} holds no {GENERATION_TOKENS_TOTAL} series for "
                            f"{selector.describe()}")
    return ServedRate(max(value, 0.0), at, int(window_seconds), promql)
