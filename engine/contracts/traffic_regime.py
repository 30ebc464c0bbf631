"""Traffic regimes: a traffic profile bucketed into a coarse region of traffic space, the key the
champion registry files champions under and the operator's regime library switches between.

    TrafficProfile --TrafficRegime.of--> (prompt, hit-rate, concurrency, output buckets; for a
        mixture-of-experts model the routing signature: its dominant experts)
      --.key--> "p<prompt>-h<hit>-c<concurrency>-o<output>[-e<experts>]" (a ForwardPass label,
        InferenceDeployment status)
      --TrafficRegime.parse(key)--> back; .distance: buckets apart, summed over the dimensions
    TrafficProfile (or a regime's last observed summary) --TrafficPoint--> continuous bucket
        coordinates --.distance--> how far apart two profiles are, in bucket widths

Keys written before the output and routing dimensions existed ("p1-h0-c2") still parse, with
those dimensions unknown: ``covers`` says an older key is the coarser regime of a newer one, and
``distance`` counts only the dimensions both keys know.

Torch-free: the compile worker (engine/compile/champions.py) and the operator (operator/regimes.py)
both import it, so the two sides cannot bucket the same traffic differently.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from shapeshift.engine.contracts.expert_routing import ExpertRouting
from shapeshift.engine.contracts.traffic_profile import TrafficProfile

PROMPT_BUCKETS = (256, 1024, 4096, 16384, 65536)  # median prompt tokens: <=256, <=1k, ... , >64k
HIT_BUCKETS = (0.2, 0.6)  # low / mid / high prefix-cache hit rate
CONCURRENCY_BUCKETS = (1, 8, 32, 128)
OUTPUT_BUCKETS = (64, 256, 1024, 4096)  # median output tokens: <=64, <=256, <=1k, <=4k, longer
# The routing signature: the experts whose share of routed tokens, averaged over the MoE layers,
# is at least DOMINANT_FACTOR times the uniform share (1 / experts), the MAX_DOMINANT largest, by
# index ("e3.17"); "eu" when no expert is (routing spread evenly).
DOMINANT_FACTOR = 2.0
MAX_DOMINANT = 2
UNIFORM = "u"
KEY = re.compile(r"^p(\d+)-h(\d+)-c(\d+)(?:-o(\d+))?(?:-e(u|\d+(?:\.\d+)?))?$")
# Traffic whose bucket has no regime yet belongs to a known regime whose last observed traffic is
# at most this far (TrafficPoint.distance: bucket widths, summed over the dimensions): half a
# bucket, so traffic just across a bucket edge from a regime is that regime's, and the next bucket's
# typical traffic is not.
NEAR_DISTANCE = 0.5


def _bucket(value: float, edges: tuple[float, ...]) -> int:
    for i, edge in enumerate(edges):
        if value <= edge:
            return i
    return len(edges)


def _position(value: float, edges: tuple[float, ...], log: bool) -> float:
    """Where ``value`` lies on the bucket axis: edge i at i, linear (``log``: in the logarithm)
    between edges and beyond them at the nearest pair's rate."""
    f = (lambda v: math.log(max(v, 1e-9))) if log else (lambda v: v)
    xs, x = [f(e) for e in edges], f(value)
    for i in range(len(xs) - 1):
        if x <= xs[i + 1] or i == len(xs) - 2:
            return i + (x - xs[i]) / (xs[i + 1] - xs[i])
    return 0.0  # one edge only: not used


def hit_rate(profile: TrafficProfile) -> float:
    """The observed prefix-cache hit rate, else the one the profile's shared prefixes imply."""
    if profile.prefix_cache_hit_rate is not None:
        return profile.prefix_cache_hit_rate
    return profile.shared_prefix_ratio * min(1.0, profile.shared_prefix_len / max(profile.prompt_length.p50, 1))


def routing_signature(routing: ExpertRouting | None) -> str | None:
    """The dominant experts of a routing histogram ("3.17", or "u": none), None without one."""
    if routing is None:
        return None
    n = routing.num_experts
    mean = [math.fsum(layer.shares[e] for layer in routing.layers) / len(routing.layers) for e in range(n)]
    hot = sorted((e for e in range(n) if mean[e] >= DOMINANT_FACTOR / n), key=lambda e: (-mean[e], e))
    return ".".join(str(e) for e in sorted(hot[:MAX_DOMINANT])) or UNIFORM


@dataclass(frozen=True)
class TrafficRegime:
    prompt: int  # bucket index of the median prompt length
    hit: int  # bucket index of the prefix-cache hit rate
    concurrency: int  # bucket index of the concurrency
    output: int | None = None  # bucket index of the median output length (None: a key from before it)
    experts: str | None = None  # routing signature (MoE traffic with a routing histogram; else None)

    @classmethod
    def of(cls, profile: TrafficProfile) -> "TrafficRegime":
        return cls(_bucket(profile.prompt_length.p50, PROMPT_BUCKETS), _bucket(hit_rate(profile), HIT_BUCKETS),
                   _bucket(profile.concurrency, CONCURRENCY_BUCKETS), _bucket(profile.output_length.p50, OUTPUT_BUCKETS),
                   routing_signature(profile.expert_routing))

    @classmethod
    def parse(cls, key: str) -> "TrafficRegime":
        match = KEY.match(key)
        if not match:
            raise ValueError(f"regime key {key!r} is not like p1-h0-c2-o0 (or p1-h0-c2-o0-e3.17 for MoE traffic)")
        p, h, c, o, e = match.groups()
        return cls(int(p), int(h), int(c), None if o is None else int(o), e)

    def distance(self, other: "TrafficRegime") -> int:
        """Buckets apart over the dimensions both know; another routing signature counts one."""
        d = abs(self.prompt - other.prompt) + abs(self.hit - other.hit) + abs(self.concurrency - other.concurrency)
        if self.output is not None and other.output is not None:
            d += abs(self.output - other.output)
        if self.experts is not None and other.experts is not None and self.experts != other.experts:
            d += 1
        return d

    def covers(self, other: "TrafficRegime") -> bool:
        """Whether ``other`` lies in this regime: the same buckets where this key knows a dimension
        (an older key, without output or routing, covers every output and routing of its cell)."""
        return ((self.prompt, self.hit, self.concurrency) == (other.prompt, other.hit, other.concurrency)
                and self.output in (None, other.output) and self.experts in (None, other.experts))

    @property
    def key(self) -> str:
        key = f"p{self.prompt}-h{self.hit}-c{self.concurrency}"
        if self.output is not None:
            key += f"-o{self.output}"
        return key + (f"-e{self.experts}" if self.experts is not None else "")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class TrafficPoint:
    """A profile's place on the regime axes, continuous (bucket edge i at i): how far two profiles
    are, in bucket widths, when their buckets differ or lie next to each other."""

    prompt: float
    hit: float | None
    concurrency: float | None
    output: float | None = None
    experts: str | None = None

    @classmethod
    def of(cls, profile: TrafficProfile) -> "TrafficPoint":
        return cls.at(profile.prompt_length.p50, hit_rate(profile), profile.concurrency, profile.output_length.p50,
                      routing_signature(profile.expert_routing))

    @classmethod
    def at(cls, prompt_p50: float, hit: float | None, concurrency: float | None, output_p50: float | None = None,
           experts: str | None = None) -> "TrafficPoint":
        return cls(_position(prompt_p50, PROMPT_BUCKETS, log=True),
                   None if hit is None else _position(hit, HIT_BUCKETS, log=False),
                   None if concurrency is None else _position(max(concurrency, 1), CONCURRENCY_BUCKETS, log=True),
                   None if output_p50 is None else _position(output_p50, OUTPUT_BUCKETS, log=True), experts)

    def distance(self, other: "TrafficPoint") -> float:
        """Bucket widths apart, summed over the dimensions both know; another routing signature
        counts one whole bucket."""
        d = abs(self.prompt - other.prompt)
        for a, b in ((self.hit, other.hit), (self.concurrency, other.concurrency), (self.output, other.output)):
            if a is not None and b is not None:
                d += abs(a - b)
        if self.experts is not None and other.experts is not None and self.experts != other.experts:
            d += 1.0
        return d
