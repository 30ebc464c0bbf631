"""Traffic regimes: a traffic profile bucketed into a coarse region of traffic space, the key the
champion registry files champions under and the operator's regime library switches between.

    TrafficProfile --TrafficRegime.of--> (prompt bucket, hit-rate bucket, concurrency bucket)
      --.key--> "p<prompt>-h<hit>-c<concurrency>" (a ForwardPass label, InferenceDeployment status)
      --TrafficRegime.parse(key)--> back; .distance: buckets apart, summed over the three

Torch-free: the compile worker (engine/compile/champions.py) and the operator (operator/regimes.py)
both import it, so the two sides cannot bucket the same traffic differently.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from shapeshift.engine.contracts.traffic_profile import TrafficProfile

PROMPT_BUCKETS = (256, 1024, 4096, 16384, 65536)  # median prompt tokens: <=256, <=1k, ... , >64k
HIT_BUCKETS = (0.2, 0.6)  # low / mid / high prefix-cache hit rate
CONCURRENCY_BUCKETS = (1, 8, 32, 128)
KEY = re.compile(r"^p(\d+)-h(\d+)-c(\d+)$")


def _bucket(value: float, edges: tuple[float, ...]) -> int:
    for i, edge in enumerate(edges):
        if value <= edge:
            return i
    return len(edges)


def hit_rate(profile: TrafficProfile) -> float:
    """The observed prefix-cache hit rate, else the one the profile's shared prefixes imply."""
    if profile.prefix_cache_hit_rate is not None:
        return profile.prefix_cache_hit_rate
    return profile.shared_prefix_ratio * min(1.0, profile.shared_prefix_len / max(profile.prompt_length.p50, 1))


@dataclass(frozen=True)
class TrafficRegime:
    prompt: int  # bucket index of the median prompt length
    hit: int  # bucket index of the prefix-cache hit rate
    concurrency: int  # bucket index of the concurrency

    @classmethod
    def of(cls, profile: TrafficProfile) -> "TrafficRegime":
        return cls(_bucket(profile.prompt_length.p50, PROMPT_BUCKETS), _bucket(hit_rate(profile), HIT_BUCKETS),
                   _bucket(profile.concurrency, CONCURRENCY_BUCKETS))

    @classmethod
    def parse(cls, key: str) -> "TrafficRegime":
        match = KEY.match(key)
        if not match:
            raise ValueError(f"regime key {key!r} is not like p1-h0-c2")
        return cls(*(int(g) for g in match.groups()))

    def distance(self, other: "TrafficRegime") -> int:
        return abs(self.prompt - other.prompt) + abs(self.hit - other.hit) + abs(self.concurrency - other.concurrency)

    @property
    def key(self) -> str:
        return f"p{self.prompt}-h{self.hit}-c{self.concurrency}"

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
