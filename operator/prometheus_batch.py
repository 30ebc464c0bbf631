"""Observed traffic of many deployments at once: one PromQL query per series for all of them.

    selectors of the deployments due in one tick, with one Prometheus, one window, one label layout
        --traffic_queries(matcher of all of them, by (namespace, deployment[, model]))-->
        the 14 queries of operator/prometheus.py's observe, each grouped by the labels the
        one-deployment queries filter on (sum by (namespace, deployment, model, le) (...))
        --each answer split by those labels--> each deployment's slice
        --PrometheusTraffic.assemble (the one-deployment code, unchanged)--> ObservedTraffic or
          the TrafficQueryError that deployment's own queries would have raised

A failure of the batched query itself (Prometheus unreachable, refused by the outbound policy,
an answer that is not a vector) is every deployment's in the batch. The matcher names the
deployments with regex alternatives (namespace=~"a|b", deployment=~"x|y"); the cross product it
also matches is dropped when the answer is split, so each slice holds exactly the series the
deployment's own matcher selects.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Mapping

from pydantic import ValidationError

from shapeshift.operator.api import short_error
from shapeshift.operator.prometheus import (ObservedTraffic, PrometheusAnswerMalformed, PrometheusTraffic,
                                            SeriesSelector, TrafficQueryError, traffic_queries, window_span)

__all__ = ["batch_key", "observe_many"]

_REGEX_SPECIAL = set("\\.+*?()|[]{}^$")


def batch_key(selector: SeriesSelector) -> tuple[str, str, str, bool]:
    """Selectors with the same key can share one batched query."""
    return (selector.namespace_label, selector.deployment_label, selector.model_label, bool(selector.model))


def _labels(selector: SeriesSelector) -> tuple[str, ...]:
    return (selector.namespace_label, selector.deployment_label) + ((selector.model_label,) if selector.model else ())


def _values(selector: SeriesSelector) -> tuple[str, ...]:
    return (selector.namespace or "", selector.deployment or "") + ((selector.model,) if selector.model else ())


def _regex(values: set[str]) -> str:
    """An RE2 alternation matching exactly ``values``, escaped for a PromQL string."""
    alternatives = sorted("".join("\\" + c if c in _REGEX_SPECIAL else c for c in v) for v in values)
    text = "|".join(alternatives)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def batch_matcher(selectors: list[SeriesSelector]) -> str:
    labels = _labels(selectors[0])
    parts = []
    for i, label in enumerate(labels):
        values = {_values(s)[i] for s in selectors}
        parts.append(f'{label}=~"{_regex(values)}"')
    return "{" + ",".join(parts) + "}"


def observe_many(prom: PrometheusTraffic, selectors: Mapping[str, SeriesSelector], window: str | timedelta, *,
                 at: datetime, names: Mapping[str, str] | None = None) -> dict[str, ObservedTraffic | TrafficQueryError]:
    """Each key's observation (or why there is none), from one query per series for all of them.
    The selectors must share one ``batch_key``."""
    if not selectors:
        return {}
    keys = {batch_key(s) for s in selectors.values()}
    if len(keys) != 1:
        raise ValueError(f"selectors of different label layouts cannot share a batch: {sorted(keys)}")
    span = window_span(window)
    first = next(iter(selectors.values()))
    labels = _labels(first)
    q = traffic_queries(batch_matcher(list(selectors.values())), span, by=labels)
    answers: dict[str, dict[tuple[str, ...], list[dict[str, Any]]] | TrafficQueryError] = {}

    def answer(key: str) -> dict[tuple[str, ...], list[dict[str, Any]]]:
        if key not in answers:
            try:
                sliced: dict[tuple[str, ...], list[dict[str, Any]]] = {}
                for series in prom.query(q[key], at):
                    metric = series["metric"]
                    group = tuple(str(metric.get(label, "")) for label in labels)
                    rest = {k: v for k, v in metric.items() if k not in labels}
                    sliced.setdefault(group, []).append({**series, "metric": rest})
                answers[key] = sliced
            except TrafficQueryError as err:
                answers[key] = err
        got = answers[key]
        if isinstance(got, TrafficQueryError):
            raise got
        return got

    out: dict[str, ObservedTraffic | TrafficQueryError] = {}
    for key, selector in selectors.items():
        group = _values(selector)
        own = traffic_queries(selector.matcher(), span)  # what the deployment's own queries would be
        try:
            out[key] = prom.assemble(own, lambda k, g=group: answer(k).get(g, []), selector, span, at,
                                     (names or {}).get(key))
        except ValidationError as err:  # numbers no traffic profile can hold (negative lengths ...)
            out[key] = PrometheusAnswerMalformed(f"Prometheus at {prom.host} answered with figures that make no "
                                                 f"traffic profile ({short_error(err)[:300]})")
        except TrafficQueryError as err:
            out[key] = err
    return out
