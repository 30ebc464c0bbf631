"""Traffic profiles: what the requests hitting a deployment look like.

A `TrafficProfile` is the contract between three parts of Shapeshift:

    Prometheus histograms --(operator: drift detector)--> observed TrafficProfile
    TrafficProfile --(CompileRun spec / ForwardPass spec)--> compile worker
    TrafficProfile --(sample_requests(n, seed))--> replay: RequestShape list

It holds distributions, not requests: prompt and output lengths (quantiles
p50/p90/p99, optionally a histogram of `(le, weight)` buckets), how much of
the traffic shares a common prefix and how long that prefix is, the
concurrency or open-loop arrival rate, the observed prefix-cache hit rate, and
the window the numbers were taken over, and for mixture-of-experts models the
expert-routing histogram (engine/contracts/expert_routing.py: per layer, the share of
routed tokens per expert), which a replay's own routing is checked against.

`sample_requests` turns a profile into request shapes deterministically from a
seed (an int, a `numpy.random.Generator` or a `random.Random`), so a replay
measured twice sees the same requests. `drift(other)` compares two profiles
(relative change of prompt-length quantiles, absolute change of hit rate),
which is what the operator's drift detector thresholds.

Pure pydantic v2 + numpy: importable without torch, shared by the operator and
the engine. Field names are snake_case in Python and camelCase on the wire
(YAML, the CRDs), so the same document works in both places.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from shapeshift.engine.contracts.expert_routing import ExpertRouting

__all__ = [
    "BUILTIN_PROFILES",
    "DriftReport",
    "LengthBucket",
    "LengthDistribution",
    "RequestShape",
    "TrafficProfile",
    "TrafficWindow",
    "builtin_profile",
    "load_profile",
]

SeedLike = int | np.random.Generator | random.Random | None

QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


class _WireModel(BaseModel):
    """snake_case in Python, camelCase on the wire, unknown keys rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False
    )


class LengthBucket(_WireModel):
    """One histogram bucket: `weight` is the share of requests whose length lies
    in (previous bucket's `le`, `le`] tokens. Weights need not sum to 1."""

    le: int = Field(ge=1, description="Upper bound of the bucket in tokens (inclusive).")
    weight: float = Field(ge=0, description="Relative share of requests in this bucket.")


class LengthDistribution(_WireModel):
    """A token-length distribution given by quantiles, optionally refined by a
    histogram. Without a histogram, samples follow a piecewise-linear inverse
    CDF through (0, min), (0.5, p50), (0.9, p90), (0.99, p99), (1, max)."""

    p50: int = Field(ge=1, description="Median length in tokens.")
    p90: int = Field(ge=1, description="90th percentile length in tokens.")
    p99: int = Field(ge=1, description="99th percentile length in tokens.")
    min: int = Field(default=1, ge=1, description="Shortest length generated, in tokens.")
    max: int | None = Field(
        default=None,
        ge=1,
        description="Longest length generated, in tokens (default: the last histogram bucket, else p99 + (p99 - p90) / 2).",
    )
    histogram: list[LengthBucket] | None = Field(
        default=None,
        description="Optional buckets (le, weight); when given, sampling follows them.",
    )

    # The CEL twins of _ordered (the CRDs embed this model): the API server refuses what the
    # validator refuses. Strictly increasing `le` is checked there as sorted (CEL has no pairwise
    # comparison a CRD's cost budget allows on an unbounded list); repeated `le` is refused here.
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "(has(self.min) ? self.min : 1) <= self.p50 && self.p50 <= self.p90 && self.p90 <= self.p99",
         "message": "length quantiles must be ordered min <= p50 <= p90 <= p99"},
        {"rule": "!has(self.max) || self.max >= self.p99", "message": "max must be >= p99"},
        {"rule": "!has(self.histogram) || (size(self.histogram) > 0 && self.histogram.exists(b, b.weight > 0) && "
                 "self.histogram.map(b, b.le).isSorted())",
         "message": "histogram must have at least one bucket, increasing le and a weight above zero (or be omitted)"},
    ]})

    @model_validator(mode="after")
    def _ordered(self) -> "LengthDistribution":
        if not (self.min <= self.p50 <= self.p90 <= self.p99):
            raise ValueError(
                f"length quantiles must be ordered min <= p50 <= p90 <= p99, got "
                f"min={self.min} p50={self.p50} p90={self.p90} p99={self.p99}"
            )
        if self.max is not None and self.max < self.p99:
            raise ValueError(f"max ({self.max}) must be >= p99 ({self.p99})")
        if self.histogram is not None:
            les = [b.le for b in self.histogram]
            if not les:
                raise ValueError("histogram must have at least one bucket (or be omitted)")
            if any(b <= a for a, b in zip(les, les[1:])):
                raise ValueError(f"histogram buckets must have strictly increasing le, got {les}")
            if sum(b.weight for b in self.histogram) <= 0:
                raise ValueError("histogram weights must not all be zero")
        return self

    @property
    def upper(self) -> int:
        """The longest length this distribution generates."""
        if self.max is not None:
            return self.max
        if self.histogram is not None:
            return max(self.p99, self.histogram[-1].le)
        return self.p99 + max(1, (self.p99 - self.p90) // 2)

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1) of the distribution that `sample` draws from."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.histogram is not None:
            return float(_histogram_inverse_cdf(self.histogram, self.min, np.array([q]))[0])
        return float(np.interp(q, *self._knots()))

    def sample(self, rng: SeedLike, n: int) -> np.ndarray:
        """`n` integer lengths, int64 array of shape [n], deterministic in `rng`."""
        u = _uniforms(rng, n)
        if self.histogram is not None:
            # Buckets are (low, le]: round up so a length never falls below its bucket.
            values = np.ceil(_histogram_inverse_cdf(self.histogram, self.min, u))
        else:
            values = np.rint(np.interp(u, *self._knots()))
        return np.clip(values, self.min, self.upper).astype(np.int64)

    def scaled(self, factor: float) -> "LengthDistribution":
        """The same shape with every length multiplied by `factor` (at least 1 token)."""
        if factor <= 0:
            raise ValueError(f"scale factor must be > 0, got {factor}")

        def s(x: int) -> int:
            return max(1, int(round(x * factor)))

        hist = None
        if self.histogram is not None:
            # Scaling can merge neighbouring buckets at small factors; merge their weights.
            merged: dict[int, float] = {}
            for b in self.histogram:
                merged[s(b.le)] = merged.get(s(b.le), 0.0) + b.weight
            hist = [LengthBucket(le=le, weight=w) for le, w in sorted(merged.items())]
        return LengthDistribution(
            p50=s(self.p50),
            p90=s(self.p90),
            p99=s(self.p99),
            min=min(s(self.min), s(self.p50)),
            max=None if self.max is None else s(self.max),
            histogram=hist,
        )

    @classmethod
    def from_histogram(
        cls, buckets: Sequence[tuple[float, float]], *, cumulative: bool = False
    ) -> "LengthDistribution":
        """Build a distribution from (le, weight) pairs; with `cumulative=True` the
        weights are Prometheus-style cumulative counts (a `+Inf` bucket is dropped,
        its excess folded into the last finite bucket)."""
        pairs = sorted((float(le), float(w)) for le, w in buckets)
        if cumulative:
            finite = [(le, c) for le, c in pairs if math.isfinite(le)]
            total = pairs[-1][1] if pairs else 0.0
            per_bucket, prev = [], 0.0
            for le, c in finite:
                per_bucket.append((le, max(0.0, c - prev)))
                prev = c
            if per_bucket and total > prev:
                le, w = per_bucket[-1]
                per_bucket[-1] = (le, w + (total - prev))
            pairs = per_bucket
        hist = [LengthBucket(le=max(1, int(math.ceil(le))), weight=w) for le, w in pairs]
        if not hist or sum(b.weight for b in hist) <= 0:
            raise ValueError("cannot build a length distribution from an empty histogram")
        q = _histogram_inverse_cdf(hist, 1, np.array([0.5, 0.9, 0.99, 1.0]))
        p50, p90, p99, top = (max(1, int(math.ceil(v))) for v in q)
        return cls(p50=p50, p90=max(p50, p90), p99=max(p50, p90, p99), max=max(top, p99), histogram=hist)

    def _knots(self) -> tuple[list[float], list[float]]:
        xs = [0.0, 0.5, 0.9, 0.99, 1.0]
        ys = [float(self.min), float(self.p50), float(self.p90), float(self.p99), float(self.upper)]
        return xs, ys


class TrafficWindow(_WireModel):
    """Where and when the numbers of an observed profile were taken."""

    start: datetime | None = Field(default=None, description="Start of the observation window.")
    end: datetime | None = Field(default=None, description="End of the observation window.")
    duration_seconds: int | None = Field(
        default=None, ge=1, description="Length of the window in seconds."
    )
    source: str | None = Field(
        default=None, description="Where the numbers came from, e.g. 'prometheus' or 'builtin'."
    )
    requests: int | None = Field(
        default=None, ge=0, description="Number of requests observed in the window."
    )


class TrafficProfile(_WireModel):
    """The shape of a deployment's traffic, as observed or as assumed."""

    name: str = Field(default="custom", description="Name of the profile.")
    description: str | None = Field(default=None, description="What this traffic is.")
    prompt_length: LengthDistribution = Field(description="Prompt length distribution in tokens.")
    output_length: LengthDistribution = Field(description="Generated length distribution in tokens.")
    shared_prefix_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Share of requests that start with a common prefix (system prompt, tools).",
    )
    shared_prefix_len: int = Field(
        default=0, ge=0, description="Length of that common prefix in tokens."
    )
    concurrency: int = Field(
        default=1, ge=1, description="Requests in flight at once (closed-loop replay)."
    )
    arrival_rate: float | None = Field(
        default=None, gt=0,
        description="Requests per second for open-loop replay (Poisson arrivals); unset means closed loop.",
    )
    prefix_cache_hit_rate: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Observed share of prompt tokens served from the prefix cache.",
    )
    window: TrafficWindow | None = Field(default=None, description="Observation window metadata.")
    expert_routing: ExpertRouting | None = Field(
        default=None,
        description="Mixture-of-experts models: per layer, the share of routed tokens per expert (unset: dense "
                    "model, or not observed).",
    )

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "!has(self.sharedPrefixRatio) || self.sharedPrefixRatio == 0.0 || "
                 "(has(self.sharedPrefixLen) && self.sharedPrefixLen > 0)",
         "message": "sharedPrefixRatio is above 0 but sharedPrefixLen is 0: set the prefix length in tokens, "
                    "or the ratio to 0"},
    ]})

    @model_validator(mode="after")
    def _prefix_consistent(self) -> "TrafficProfile":
        if self.shared_prefix_ratio > 0 and self.shared_prefix_len == 0:
            raise ValueError(
                f"sharedPrefixRatio is {self.shared_prefix_ratio} but sharedPrefixLen is 0: "
                "set the prefix length in tokens, or the ratio to 0"
            )
        return self

    # ---- requests -------------------------------------------------------------------

    def sample_requests(self, n: int, seed: SeedLike = 0) -> list["RequestShape"]:
        """`n` request shapes drawn deterministically from `seed`.

        Requests that share the prefix get a prompt at least one token longer than
        it (the prefix plus something of their own). With an `arrival_rate`, each
        request carries an arrival time from a Poisson process starting at 0.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = _generator(seed)
        prompts = self.prompt_length.sample(rng, n)  # [n]
        outputs = self.output_length.sample(rng, n)  # [n]
        shares = _uniforms(rng, n) < self.shared_prefix_ratio  # [n] bool
        if self.arrival_rate is not None:
            gaps = rng.exponential(1.0 / self.arrival_rate, size=n)
            arrivals: list[float | None] = list(np.cumsum(gaps) - gaps[0]) if n else []
        else:
            arrivals = [None] * n
        out = []
        for i in range(n):
            p = int(prompts[i])
            if shares[i]:
                p = max(p, self.shared_prefix_len + 1)
            out.append(
                RequestShape(
                    index=i,
                    prompt_len=p,
                    output_len=int(outputs[i]),
                    shared_prefix_len=self.shared_prefix_len if shares[i] else 0,
                    arrival_s=None if arrivals[i] is None else float(arrivals[i]),
                )
            )
        if self.prefix_cache_hit_rate:
            out = _sessions(out, self.prefix_cache_hit_rate, self.concurrency)
        return out

    def scaled(self, factor: float, *, name: str | None = None) -> "TrafficProfile":
        """Every length multiplied by `factor`: the same traffic shape for a smaller model."""
        return self.model_copy(
            update={
                "name": name or self.name,
                "prompt_length": self.prompt_length.scaled(factor),
                "output_length": self.output_length.scaled(factor),
                "shared_prefix_len": int(round(self.shared_prefix_len * factor))
                if self.shared_prefix_ratio == 0 else max(1, int(round(self.shared_prefix_len * factor))),
            }
        )

    # ---- comparison -----------------------------------------------------------------

    def drift(self, other: "TrafficProfile") -> "DriftReport":
        """How far `other` (typically observed now) has moved from `self` (what the
        active forward pass was compiled for)."""
        prompt = {k: _relative_change(getattr(self.prompt_length, k), getattr(other.prompt_length, k))
                  for k, _ in QUANTILES}
        output = {k: _relative_change(getattr(self.output_length, k), getattr(other.output_length, k))
                  for k, _ in QUANTILES}
        hit = None
        if self.prefix_cache_hit_rate is not None and other.prefix_cache_hit_rate is not None:
            hit = other.prefix_cache_hit_rate - self.prefix_cache_hit_rate
        return DriftReport(
            baseline=self.name,
            observed=other.name,
            prompt_length_relative_change=prompt,
            output_length_relative_change=output,
            prefix_cache_hit_rate_change=hit,
        )

    # ---- YAML -----------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The wire form (camelCase keys, unset optionals left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "TrafficProfile":
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError("a traffic profile YAML document must be a mapping")
        return cls.model_validate(data)


def _sessions(shapes: list["RequestShape"], hit_rate: float, gap: int) -> list["RequestShape"]:
    """The shapes with later turns of sessions among them, so that the share of prompt tokens a
    prefix cache can serve comes near ``hit_rate`` (the profile's observed one). Lengths and
    arrivals stay as drawn. Walking the requests in order, while the cacheable tokens so far (the
    common prefix after its first use, and the reused turns) are behind the target, a request
    continues the session whose latest turn has the longest prompt shorter than its own, among
    turns at least ``gap`` requests earlier (the traffic's concurrency: a user sends the next
    turn after the answer to the last one, by which time that many others have started)."""
    import bisect
    from collections import deque
    from dataclasses import replace

    out: list[RequestShape] = []
    # Sessions' latest turns, in two places: those at least `gap` requests back, sorted by
    # (prompt length, -index) so the longest shorter prompt (the earliest among equals) is one
    # bisection away (indices are unique, so the shape itself is never compared); and the newer
    # ones, in arrival order, until they are that far back.
    ready: list[tuple[int, int, RequestShape]] = []
    waiting: deque[RequestShape] = deque()
    total = cached = 0
    prefix_seen = False
    for s in shapes:
        while waiting and waiting[0].index <= s.index - gap:
            head = waiting.popleft()
            bisect.insort(ready, (head.prompt_len, -head.index, head))
        total += s.prompt_len
        system = s.shared_prefix_len if (s.shared_prefix_len and prefix_seen) else 0
        prefix_seen = prefix_seen or s.shared_prefix_len > 0
        best = None
        if cached + system < hit_rate * total:
            at = bisect.bisect_left(ready, (s.prompt_len,)) - 1  # (n,) sorts before every (n, ...)
            if at >= 0 and ready[at][0] > system:
                best = ready.pop(at)[2]
        if best is None:
            cached += system
            waiting.append(s)
            out.append(s)
            continue
        turn = replace(s, continues=best.index, reused_len=best.prompt_len,
                       shared_prefix_len=best.shared_prefix_len)
        cached += best.prompt_len
        waiting.append(turn)
        out.append(turn)
    return out


@dataclass(frozen=True)
class RequestShape:
    """One generated request: lengths in tokens, optional arrival time in seconds."""

    index: int
    prompt_len: int
    output_len: int
    shared_prefix_len: int  # 0 when this request does not share the common prefix
    arrival_s: float | None
    # A later turn of a session: its prompt repeats the whole prompt of request `continues` (an
    # earlier one, `reused_len` tokens) and then has a part of its own; None: a request of its own.
    continues: int | None = None
    reused_len: int = 0


class DriftReport(_WireModel):
    """Relative change of length quantiles ((observed - baseline) / baseline) and
    absolute change of the prefix-cache hit rate (None when either side lacks it)."""

    baseline: str
    observed: str
    prompt_length_relative_change: dict[str, float]
    output_length_relative_change: dict[str, float]
    prefix_cache_hit_rate_change: float | None = None

    @property
    def prompt_score(self) -> float:
        """Largest absolute relative change over the prompt-length quantiles."""
        return max(abs(v) for v in self.prompt_length_relative_change.values())

    @property
    def score(self) -> float:
        """One number for status: the larger of the prompt score and |hit-rate change|."""
        hit = abs(self.prefix_cache_hit_rate_change or 0.0)
        return max(self.prompt_score, hit)

    def exceeds(self, prompt_length_relative: float, prefix_hit_rate_absolute: float | None = None) -> bool:
        """True when either change passes its threshold (a threshold of None is off)."""
        if self.prompt_score > prompt_length_relative:
            return True
        if prefix_hit_rate_absolute is not None and self.prefix_cache_hit_rate_change is not None:
            return abs(self.prefix_cache_hit_rate_change) > prefix_hit_rate_absolute
        return False


# ---- built-in profiles -------------------------------------------------------------------

BUILTIN_PROFILES: dict[str, TrafficProfile] = {
    p.name: p
    for p in (
        TrafficProfile(
            name="chat",
            description="Interactive chat: short prompts behind a shared system prompt, medium answers.",
            prompt_length=LengthDistribution(p50=512, p90=2048, p99=6144, min=16, max=8192),
            output_length=LengthDistribution(p50=256, p90=768, p99=1536, min=1, max=2048),
            shared_prefix_ratio=0.6,
            shared_prefix_len=256,
            concurrency=32,
            prefix_cache_hit_rate=0.45,
            window=TrafficWindow(source="builtin"),
        ),
        TrafficProfile(
            name="agentic-long-context",
            description="Coding agents: very long prompts that mostly repeat the previous turn, long tool outputs.",
            prompt_length=LengthDistribution(p50=32768, p90=98304, p99=122880, min=2048, max=131072),
            output_length=LengthDistribution(p50=384, p90=1536, p99=4096, min=1, max=8192),
            shared_prefix_ratio=0.85,
            shared_prefix_len=16384,
            concurrency=8,
            prefix_cache_hit_rate=0.7,
            window=TrafficWindow(source="builtin"),
        ),
        TrafficProfile(
            name="burst",
            description="A customer burst: many short, unrelated requests arriving open-loop.",
            prompt_length=LengthDistribution(p50=1024, p90=4096, p99=16384, min=8, max=24576),
            output_length=LengthDistribution(p50=128, p90=512, p99=1024, min=1, max=2048),
            shared_prefix_ratio=0.2,
            shared_prefix_len=128,
            concurrency=128,
            arrival_rate=50.0,
            prefix_cache_hit_rate=0.1,
            window=TrafficWindow(source="builtin"),
        ),
    )
}


def builtin_profile(name: str) -> TrafficProfile:
    """A copy of a built-in profile; unknown names raise with the known ones listed."""
    try:
        return BUILTIN_PROFILES[name].model_copy(deep=True)
    except KeyError:
        raise KeyError(
            f"unknown traffic profile {name!r}; built-in profiles are {sorted(BUILTIN_PROFILES)}"
        ) from None


def load_profile(source: str | Path) -> TrafficProfile:
    """A built-in name, a path to a YAML file, or YAML text."""
    if isinstance(source, str) and source in BUILTIN_PROFILES:
        return builtin_profile(source)
    path = Path(source)
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and path.suffix in (".yaml", ".yml")):
        if not path.exists():
            raise FileNotFoundError(
                f"traffic profile file {str(path)!r} not found (built-in profiles: {sorted(BUILTIN_PROFILES)})"
            )
        return TrafficProfile.from_yaml(path.read_text())
    return TrafficProfile.from_yaml(str(source))


# ---- helpers -----------------------------------------------------------------------------


def _generator(seed: SeedLike) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, random.Random):
        # Derive a numpy generator from the Random's stream, so both seed kinds
        # give a reproducible sequence and advance the caller's Random.
        return np.random.default_rng(seed.getrandbits(64))
    return np.random.default_rng(seed)


def _uniforms(rng: SeedLike, n: int) -> np.ndarray:
    if isinstance(rng, random.Random):
        return np.array([rng.random() for _ in range(n)], dtype=np.float64)
    return _generator(rng).random(n)


def _histogram_inverse_cdf(buckets: Iterable[LengthBucket], lower: int, u: np.ndarray) -> np.ndarray:
    """Inverse CDF of a histogram, uniform inside each bucket (lengths in tokens).

    u: [n] in [0, 1] -> [n] lengths. Empty buckets get no mass.
    """
    buckets = list(buckets)
    weights = np.array([b.weight for b in buckets], dtype=np.float64)  # [B]
    cdf = np.cumsum(weights) / weights.sum()  # [B], cdf[-1] == 1
    lows = np.array([float(min(lower, buckets[0].le))] + [float(b.le) for b in buckets[:-1]])  # [B]
    highs = np.array([float(b.le) for b in buckets])  # [B]
    idx = np.minimum(np.searchsorted(cdf, u, side="left"), len(buckets) - 1)  # [n]
    # cdf is flat across an empty bucket, so "left" search lands on one only at
    # u == 0 before the first non-empty bucket.
    idx = np.maximum(idx, int(np.argmax(weights > 0)))
    cdf_low = np.where(idx > 0, cdf[np.maximum(idx - 1, 0)], 0.0)  # [n]
    width = np.maximum(cdf[idx] - cdf_low, 1e-300)
    frac = np.clip((u - cdf_low) / width, 0.0, 1.0)
    return lows[idx] + frac * (highs[idx] - lows[idx])


def _relative_change(baseline: float, observed: float) -> float:
    return (observed - baseline) / baseline if baseline else math.inf

