"""Observed traffic of one deployment, read from Prometheus.

Data flow:

    engine pods --/metrics--> Prometheus (scrape adds namespace/deployment labels)
    TrafficQuery(selector, window, at) --PromQL over prometheus-api-client-->
        histogram_quantile(q, sum by (le) (rate(shapeshift_prompt_tokens_bucket{sel}[w])))   p50/p90/p99
        sum by (le) (increase(shapeshift_prompt_tokens_bucket{sel}[w]))                      histogram
        same for shapeshift_generation_tokens                                               output lengths
        sum(increase(shapeshift_prompt_tokens_count{sel}[w]))                               requests
        sum(rate(hits[w])) / sum(rate(queries[w]))                                          prefix-cache hit rate
        quantile_over_time(0.9, (((sum(running{sel}) or vector(0))                          concurrency per pod
            + (sum(waiting{sel}) or vector(0))) > 0)[w:step]) / targets seen               (busy steps; step w/120, >=1s)
        count(count by (instance) (shapeshift_prompt_tokens_count{sel}))                   targets seen
        sum by (layer, expert) (increase(shapeshift_expert_routed_tokens_total{sel}[w]))   MoE routing
    --> ObservedTraffic(profile: TrafficProfile, quality: DataQuality)

Nothing is ever invented: Prometheus unreachable or answering with an error
raises ``PrometheusUnreachable``; a window without traffic (no series, or
series that did not move) raises ``NoTrafficData``. A redirect (3xx) is not
followed (the outbound policy checked the configured address, not where a
redirect points): it raises ``PrometheusRedirected`` (reason OutboundRefused),
naming the Location's scheme, host and path. All are ``TrafficQueryError``, so
the drift timer can say why in a condition and not compile.

The expert-routing histogram (mixture-of-experts models) is each layer's routed tokens per
expert over the window (the counter's rate times the window, summed over the pods), as shares
of the layer's total; a dense model exports no such series and its profile has none.

Concurrency is what the compile worker replays in a closed loop, so it is read for the
busy moments, not on average: the deployment-wide count of requests in flight (running
plus waiting, summed over the pods at each step of a subquery), at its 0.9 quantile over
the steps of the window at which anything was in flight. Idle steps are left out: a
closed-loop replay has no idle time, and how long a deployment sat idle says nothing
about how wide its batches must be. Traffic that comes in bursts of 8 with quiet time
between them averages to 1 or 2 in flight, but it is the bursts a wider batch serves
faster. A pod that exports no waiting gauge still counts with its running one
(``or vector(0)``); a window with nothing ever in flight gives concurrency 1. The replay
drives one engine, and a Service spreads requests over the pods, so the profile's
concurrency is that deployment-wide figure over the number of pods reporting (rounded up),
and its arrival rate the deployment's request rate over the same count.

Which series belong to a deployment is a label selector. The engine itself
only labels with ``model``; ``namespace`` and ``deployment`` are target labels
that the scrape configuration adds (the chart's ServiceMonitor and the
annotation-based scrape config in docs/helm.md both copy them from the pod).
Their label names are configurable for clusters that name them otherwise.
"""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import requests
from prometheus_api_client import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

from shapeshift.engine.contracts.expert_routing import ExpertRouting
from shapeshift.engine.contracts.metric_names import (
    EXPERT_ROUTED_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_HITS as CACHE_HITS,
    PREFIX_CACHE_QUERIES as CACHE_QUERIES,
    PROMPT_TOKENS,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
)
from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile, TrafficWindow
from shapeshift.operator.outbound import host_of, outbound_problem

__all__ = [
    "DataQuality",
    "NoTrafficData",
    "ObservedTraffic",
    "PrometheusAnswerMalformed",
    "PrometheusRedirected",
    "PrometheusRefused",
    "PrometheusTraffic",
    "PrometheusUnreachable",
    "SeriesSelector",
    "TrafficQueryError",
    "parse_duration",
]

CONCURRENCY_QUANTILE = 0.9  # of the in-flight count over the window's busy moments
CONCURRENCY_SAMPLES = 120  # subquery steps per window (a step is at least a second)


class TrafficQueryError(RuntimeError):
    """No observed profile could be built; ``reason`` is a condition reason."""

    reason = "TrafficQueryFailed"


class PrometheusUnreachable(TrafficQueryError):
    """Prometheus did not answer, or answered with an error."""

    reason = "PrometheusUnreachable"


class PrometheusRefused(TrafficQueryError):
    """The outbound policy (operator/outbound.py) refuses the address; nothing was sent."""

    reason = "OutboundRefused"


class PrometheusRedirected(TrafficQueryError):
    """Prometheus answered with a redirect (3xx). The operator does not follow it: the outbound policy
    checked the configured address only, and a redirect could lead anywhere (a metadata address,
    another host given the request's headers)."""

    reason = "OutboundRefused"


class _Redirect(Exception):
    def __init__(self, status: int, location: str) -> None:
        super().__init__(status, location)
        self.status, self.location = status, location


def _refuse_redirects(response: requests.Response, *args: Any, **kwargs: Any) -> None:
    """A requests response hook: a 3xx answer ends the request before requests follows it."""
    if 300 <= response.status_code < 400:
        location = response.headers.get("Location", "")
        response.close()
        raise _Redirect(response.status_code, location)


def _location_of(location: str) -> str:
    """A redirect's target for messages: scheme, host and path, never userinfo, query or fragment."""
    parts = urllib.parse.urlsplit(location)
    if not location:
        return "(no Location header)"
    if parts.scheme and parts.netloc:
        return f"{parts.scheme}://{host_of(location)}{parts.path}"
    return parts.path or "(no path)"


class PrometheusAnswerMalformed(TrafficQueryError):
    """Prometheus answered 200, but not with a vector of samples."""

    reason = "PrometheusAnswerMalformed"


class NoTrafficData(TrafficQueryError):
    """Prometheus answered, but the window holds no traffic for this selector."""

    reason = "NoTraffic"


@dataclass(frozen=True)
class SeriesSelector:
    """Which series are one deployment's. Empty values are left out of the matcher."""

    namespace: str | None = None
    deployment: str | None = None
    model: str | None = None
    namespace_label: str = "namespace"
    deployment_label: str = "deployment"
    model_label: str = "model"

    def matcher(self, regex: dict[str, str] | None = None) -> str:
        """``{namespace="ns",deployment="d",model="m"}`` with values escaped for PromQL, plus a
        ``label=~"value"`` matcher for each of ``regex`` (values already PromQL regexes, escaped)."""
        exact = ((self.namespace_label, self.namespace), (self.deployment_label, self.deployment),
                 (self.model_label, self.model))
        matchers = [f'{label}="{_escape(value)}"' for label, value in exact if value]
        matchers.extend(f'{label}=~"{value}"' for label, value in (regex or {}).items())
        return "{" + ",".join(matchers) + "}"

    def describe(self) -> str:
        return self.matcher() if self.matcher() != "{}" else "all series"


@dataclass(frozen=True)
class DataQuality:
    """How much the observed profile can be trusted."""

    requests: float  # requests counted over the window (increase() extrapolates, so fractional)
    targets: int  # scrape targets (pods) contributing series now
    window_seconds: int
    evaluated_at: datetime
    prefix_cache_queried_tokens: float  # prompt tokens looked up in the window; 0 means no hit rate
    queries: dict[str, str] = field(default_factory=dict)  # name -> PromQL, for status and debugging


@dataclass(frozen=True)
class ObservedTraffic:
    profile: TrafficProfile
    quality: DataQuality


def parse_duration(text: str | int | float | timedelta) -> timedelta:
    """``"5m"``, ``"90s"``, ``"1h30m"``, a number of seconds, or a timedelta."""
    if isinstance(text, timedelta):
        return text
    if isinstance(text, (int, float)):
        return timedelta(seconds=float(text))
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    total, number, i, raw = 0.0, "", 0, text.strip()
    while i < len(raw):
        ch = raw[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = "ms" if raw.startswith("ms", i) else ch
        if unit not in units or not number:
            raise ValueError(f"cannot read duration {text!r}: use Prometheus style like '30s', '5m' or '1h30m'")
        total += float(number) * units[unit]
        number, i = "", i + len(unit)
    if number:
        raise ValueError(f"duration {text!r} has a number without a unit (s, m, h, d)")
    if total <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return timedelta(seconds=total)


class PrometheusTraffic:
    """Reads observed traffic from one Prometheus through prometheus-api-client."""

    def __init__(self, url: str, *, timeout_seconds: float = 5.0, headers: dict[str, str] | None = None,
                 disable_ssl: bool = False, allowed_cidrs: tuple[str, ...] = ()) -> None:
        self.url = url.rstrip("/")
        self.host = host_of(self.url)  # what messages quote: never the URL's userinfo or path
        # Checked before the first query, so nothing is sent to a refused address.
        self._refused = outbound_problem(self.url, allowed_cidrs, what="the Prometheus address")
        # One quick attempt: the drift timer retries on its own schedule, and a
        # check stuck in urllib3's backoff would delay the NoData condition.
        # Redirects are not followed (_refuse_redirects): a 3xx is an error naming where it pointed.
        session = requests.Session()
        session.verify = not disable_ssl
        session.max_redirects = 0
        session.hooks["response"].append(_refuse_redirects)
        self._client = PrometheusConnect(
            url=self.url, headers=headers, disable_ssl=disable_ssl, session=session,
            retry=Retry(total=0, connect=0, read=0, status=0, redirect=0), timeout=timeout_seconds,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "PrometheusTraffic":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- queries ------------------------------------------------------------------------

    def query(self, promql: str, at: datetime | None = None) -> list[dict[str, Any]]:
        """An instant query; connection failures and error answers become PrometheusUnreachable."""
        if self._refused is not None:
            raise PrometheusRefused(self._refused)
        params = {"time": f"{at.timestamp():.3f}"} if at is not None else None
        try:
            result = self._client.custom_query(promql, params=params)
        except _Redirect as err:
            raise PrometheusRedirected(
                f"Prometheus at {self.host} answered HTTP {err.status} redirecting to {_location_of(err.location)}; "
                "the operator does not follow redirects: set the Prometheus address (chart value prometheus.url or "
                "spec.prometheusUrl) to the address that answers"
            ) from None
        except requests.RequestException as err:
            raise PrometheusUnreachable(
                f"Prometheus at {self.host} cannot be reached ({_short_cause(err)}); check the "
                "operator's Prometheus address (chart value prometheus.url) and that Prometheus is running"
            ) from err
        except PrometheusApiClientException as err:
            # The exception carries the answer's body: quote only its HTTP status.
            status = str(err).split()[3] if str(err).startswith("HTTP Status Code") else "an error"
            raise PrometheusUnreachable(
                f"Prometheus at {self.host} rejected the query {promql!r} (HTTP {status})"
            ) from err
        except ValueError as err:  # a body that is not JSON: something else listens on that address
            raise PrometheusUnreachable(
                f"{self.host} did not answer like a Prometheus HTTP API (not JSON); check the address"
            ) from err
        except (KeyError, TypeError, AttributeError) as err:  # JSON without data.result
            raise PrometheusAnswerMalformed(
                f"Prometheus at {self.host} answered the query {promql!r} without data.result; check the address"
            ) from err
        return _samples(result, self.host, promql)

    def scalar(self, promql: str, at: datetime | None = None) -> float | None:
        """The value of a one-element vector, or None when the vector is empty or NaN."""
        return _scalar(self.query(promql, at), promql)

    def observe(self, selector: SeriesSelector, window: str | timedelta = "5m", *, at: datetime | None = None,
                name: str | None = None) -> ObservedTraffic:
        """The traffic profile of ``selector``'s series over ``window`` ending at ``at`` (default: now)."""
        span = window_span(window)
        evaluated_at = at or datetime.now(timezone.utc)
        q = traffic_queries(selector.matcher(), span)
        return self.assemble(q, lambda key: self.query(q[key], evaluated_at), selector, span, evaluated_at, name)

    def assemble(self, q: dict[str, str], fetch: Callable[[str], list[dict[str, Any]]], selector: SeriesSelector,
                 span: timedelta, evaluated_at: datetime, name: str | None) -> ObservedTraffic:
        """The profile from the answers ``fetch(key)`` gives for the queries ``q`` (one deployment's series:
        its own queries, or its slice of a batched answer, operator/prometheus_batch.py); the queries are
        asked in this order, and only as far as the traffic needs them."""
        w = _promql_duration(span)

        def scalar(key: str) -> float | None:
            return _scalar(fetch(key), q[key])

        requests_seen = scalar("requests")
        if requests_seen is None:
            raise NoTrafficData(
                f"Prometheus at {self.host} has no {PROMPT_TOKENS} series for {selector.describe()} in the last "
                f"{w}: no engine pod of this deployment is being scraped (check the ServiceMonitor or scrape "
                "annotations and the namespace/deployment target labels)"
            )
        if requests_seen <= 0:
            raise NoTrafficData(f"no requests reached {selector.describe()} in the last {w}")

        prompt = self._distribution(q, fetch, "prompt", selector, w)
        output = self._distribution(q, fetch, "output", selector, w)
        queried = scalar("cacheQueried") or 0.0
        # No prompt tokens looked up (cache off, or series missing): the hit rate is unknown, not zero.
        hit_rate = scalar("prefixCacheHitRate") if queried > 0 else None
        rate = scalar("requestRate")
        concurrency = scalar("concurrency")
        targets = int(scalar("targets") or 0)
        routing = self._routing(q["expertRouting"], fetch("expertRouting"))

        profile = TrafficProfile(
            name=name or f"observed-{evaluated_at.strftime('%Y%m%dT%H%M%SZ')}",
            description=f"observed in Prometheus for {selector.describe()} over {w}",
            prompt_length=prompt,
            output_length=output,
            # per engine: the replay drives one, the Service spreads the deployment's requests
            concurrency=max(1, int(math.ceil(concurrency / max(1, targets)))) if concurrency else 1,
            arrival_rate=rate / max(1, targets) if rate and rate > 0 else None,  # per engine, as concurrency
            prefix_cache_hit_rate=None if hit_rate is None else min(1.0, max(0.0, hit_rate)),
            expert_routing=routing,
            window=TrafficWindow(
                start=evaluated_at - span,
                end=evaluated_at,
                duration_seconds=max(1, int(span.total_seconds())),
                source="prometheus",
                requests=int(round(requests_seen)),
            ),
        )
        quality = DataQuality(
            requests=requests_seen,
            targets=targets,
            window_seconds=int(span.total_seconds()),
            evaluated_at=evaluated_at,
            prefix_cache_queried_tokens=queried,
            queries=q,
        )
        return ObservedTraffic(profile=profile, quality=quality)

    def _distribution(self, q: dict[str, str], fetch: Callable[[str], list[dict[str, Any]]], key: str,
                      selector: SeriesSelector, w: str) -> LengthDistribution:
        quantiles: dict[str, float] = {}
        for label in ("p50", "p90", "p99"):
            value = _scalar(fetch(f"{key}.{label}"), q[f"{key}.{label}"])
            if value is None or not math.isfinite(value):
                metric = PROMPT_TOKENS if key == "prompt" else GENERATION_TOKENS
                raise NoTrafficData(
                    f"{metric} for {selector.describe()} has no observations in the last {w} "
                    f"({label} is {'empty' if value is None else value})"
                )
            quantiles[label] = value
        # histogram_quantile interpolates inside a bucket, so values are fractional tokens;
        # round up and keep them ordered (they are, up to float noise).
        p50 = max(1, math.ceil(quantiles["p50"] - 1e-9))
        p90 = max(p50, math.ceil(quantiles["p90"] - 1e-9))
        p99 = max(p90, math.ceil(quantiles["p99"] - 1e-9))
        histogram = self._histogram(q[f"{key}.histogram"], fetch(f"{key}.histogram"))
        top = max((b["le"] for b in histogram if b["weight"] > 0), default=p99)
        return LengthDistribution.model_validate({
            "p50": p50, "p90": p90, "p99": p99, "max": max(p99, top),
            "histogram": histogram or None,
        })

    def _routing(self, promql: str, samples: list[dict[str, Any]]) -> ExpertRouting | None:
        """Routed tokens per (layer, expert) over the window as per-layer shares; None without
        the series (a dense model) or where no layer routed a token in the window."""
        counts: dict[int, dict[int, float]] = {}
        for series in samples:
            labels = series["metric"]
            try:
                layer, expert = int(labels["layer"]), int(labels["expert"])
            except (KeyError, TypeError, ValueError):
                raise PrometheusAnswerMalformed(f"Prometheus at {self.host} answered {promql!r} with a series "
                                                "without integer layer and expert labels") from None
            value = float(series["value"][1])
            if math.isfinite(value):
                counts.setdefault(layer, {})[expert] = max(0.0, value)
        if not counts:
            return None
        experts = 1 + max(e for row in counts.values() for e in row)
        return ExpertRouting.from_counts({layer: [row.get(e, 0.0) for e in range(experts)]
                                          for layer, row in counts.items()})

    def _histogram(self, promql: str, samples: list[dict[str, Any]]) -> list[dict[str, float]]:
        """Per-bucket (not cumulative) request counts over the window, finite buckets only."""
        cumulative: list[tuple[float, float]] = []
        for series in samples:
            try:
                le = float(series["metric"].get("le", "nan"))
            except (TypeError, ValueError):
                raise PrometheusAnswerMalformed(f"Prometheus at {self.host} answered {promql!r} with a bucket "
                                                "whose le label is not a number") from None
            value = float(series["value"][1])
            if math.isfinite(le) and not math.isnan(value):
                cumulative.append((le, value))
        cumulative.sort()
        buckets, previous = [], 0.0
        for le, count in cumulative:
            buckets.append({"le": max(1, int(math.ceil(le))), "weight": max(0.0, count - previous)})
            previous = max(previous, count)
        # Buckets below 1 token (none in the engine's layout) would collapse onto le=1; merge them.
        merged: dict[int, float] = {}
        for b in buckets:
            merged[b["le"]] = merged.get(b["le"], 0.0) + b["weight"]
        result = [{"le": le, "weight": w} for le, w in sorted(merged.items())]
        # Empty buckets above the longest request carry nothing; leading ones stay,
        # because each bucket's lower edge is the previous bucket's `le`.
        while result and result[-1]["weight"] <= 0:
            result.pop()
        return result


def _scalar(result: list[dict[str, Any]], promql: str) -> float | None:
    """The value of a one-element vector, or None when the vector is empty or NaN."""
    if not result:
        return None
    if len(result) > 1:
        raise TrafficQueryError(
            f"expected one series from {promql!r}, got {len(result)}: {[r.get('metric') for r in result]}"
        )
    value = float(result[0]["value"][1])
    return None if math.isnan(value) else value


def window_span(window: str | int | float | timedelta) -> timedelta:
    span = parse_duration(window)
    if span < timedelta(seconds=1):
        raise ValueError(f"window {window!r} is shorter than a second")
    return span


def traffic_queries(sel: str, span: timedelta, by: tuple[str, ...] = ()) -> dict[str, str]:
    """The PromQL of one observation over the series ``sel`` matches. ``by``: labels to keep apart
    (a batch of deployments, operator/prometheus_batch.py); empty: one deployment's, summed."""
    w = _promql_duration(span)
    g = ", ".join(by)
    sp = f"sum by ({g}) " if by else "sum"

    def grouped(*extra: str) -> str:
        return f"sum by ({', '.join((*by, *extra))}) "

    if by:
        running, waiting = f"{sp}({REQUESTS_RUNNING}{sel})", f"{sp}({REQUESTS_WAITING}{sel})"
        # (running or 0) + (waiting or 0) of each group, as the one-deployment query adds them
        in_flight = f"(({running} + {waiting}) or {running} or {waiting})"
        targets = f"count by ({g}) (count by ({g}, instance) ({PROMPT_TOKENS}_count{sel}))"
    else:
        in_flight = (f"((sum({REQUESTS_RUNNING}{sel}) or vector(0))"
                     f" + (sum({REQUESTS_WAITING}{sel}) or vector(0)))")
        targets = f"count(count by (instance) ({PROMPT_TOKENS}_count{sel}))"
    q: dict[str, str] = {
        "requests": f"{sp}(increase({PROMPT_TOKENS}_count{sel}[{w}]))",
        "targets": targets,
        "cacheQueried": f"{sp}(increase({CACHE_QUERIES}{sel}[{w}]))",
        "prefixCacheHitRate": f"{sp}(rate({CACHE_HITS}{sel}[{w}])) / {sp}(rate({CACHE_QUERIES}{sel}[{w}]))",
        "requestRate": f"{sp}(rate({PROMPT_TOKENS}_count{sel}[{w}]))",
        "expertRouting": f"{grouped('layer', 'expert')}(increase({EXPERT_ROUTED_TOKENS}{sel}[{w}]))",
        "concurrency": (f"quantile_over_time({CONCURRENCY_QUANTILE}, ({in_flight} > 0)[{w}:{_subquery_step(span)}])"),
    }
    for metric, key in ((PROMPT_TOKENS, "prompt"), (GENERATION_TOKENS, "output")):
        buckets = f"{grouped('le')}(rate({metric}_bucket{sel}[{w}]))"
        for label, quant in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            q[f"{key}.{label}"] = f"histogram_quantile({quant}, {buckets})"
        q[f"{key}.histogram"] = f"{grouped('le')}(increase({metric}_bucket{sel}[{w}]))"
    return q


def _samples(result: Any, host: str, promql: str) -> list[dict[str, Any]]:
    """``result`` checked to be a vector: [{"metric": {label: value}, "value": [time, "number"]}]."""
    def well_formed(series: Any) -> bool:
        if not isinstance(series, dict) or not isinstance(series.get("metric", {}), dict):
            return False
        value = series.get("value")
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            return False
        try:
            float(value[1])
        except (TypeError, ValueError):
            return False
        return True

    if not isinstance(result, list) or not all(well_formed(series) for series in result):
        raise PrometheusAnswerMalformed(
            f"Prometheus at {host} answered the query {promql!r} with something other than a vector of samples "
            "(data.result[].metric, data.result[].value); check the address")
    for series in result:
        series.setdefault("metric", {})
    return result


def _short_cause(err: BaseException) -> str:
    """``ConnectionError: ... Connection refused`` without the URL-encoded query urllib3 repeats."""
    text = str(err)
    if "Caused by" in text:
        text = text.rsplit("Caused by", 1)[1].strip(" ()")
        if ": " in text:
            text = text.rsplit(": ", 1)[1].strip(" ()\"'")
    return f"{type(err).__name__}: {text}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _subquery_step(span: timedelta) -> str:
    """Resolution of the concurrency subquery: CONCURRENCY_SAMPLES steps over the window, whole
    seconds, at least one (a finer step than the scrape interval only repeats samples)."""
    return f"{max(1, int(span.total_seconds() // CONCURRENCY_SAMPLES))}s"


def _promql_duration(span: timedelta) -> str:
    seconds = span.total_seconds()
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{int(round(seconds * 1000))}ms"
