"""The service-level objective a replay is judged by, and goodput under it.

    SLO(ttft_p90_s, per_user_tokens_per_s_p90)
      --met(ttft_s, per_user_tokens_per_s)--> did one request get what it was promised
    replay (driver.run_once(..., slo=)) --> goodput: output tokens per second of the requests
      that met it (the rest count for nothing), and the share that met it

"p90" names the promise: 90% of requests should start within `ttft_p90_s` seconds and stream
at `per_user_tokens_per_s_p90` tokens per second or faster. Goodput is what the compile loop
maximises, rather than the highest request rate at which both p90s stay inside the SLO: it is
one replay at the traffic's own load (a sustainable-rate search would replay every candidate
at several rates), it is paired repeat by repeat like any throughput, it equals throughput when
every request meets the SLO, and it drops when a configuration buys tokens per second with
latency that users feel (a wide batch that starves some requests, a token budget that makes
new prompts wait).

Times are read on the replay's clock: wall time on a GPU; on the CPU the compile evaluator's
default clock is the measuring thread's CPU time, which leaves out time spent descheduled by
other processes on a shared machine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# Defaults (documented in docs/compile-loop.md): an interactive chat service. A first token
# within a second, and 10 tokens/s per user, about twice human reading speed.
DEFAULT_TTFT_P90_S = 1.0
DEFAULT_PER_USER_TOKENS_PER_S_P90 = 10.0


@dataclass(frozen=True)
class SLO:
    ttft_p90_s: float = DEFAULT_TTFT_P90_S
    per_user_tokens_per_s_p90: float = DEFAULT_PER_USER_TOKENS_PER_S_P90

    def __post_init__(self) -> None:
        if not self.ttft_p90_s > 0:
            raise ValueError(f"SLO ttft_p90_s must be > 0 seconds, got {self.ttft_p90_s}")
        if not self.per_user_tokens_per_s_p90 >= 0:
            raise ValueError(f"SLO per_user_tokens_per_s_p90 must be >= 0, got {self.per_user_tokens_per_s_p90}")

    def met(self, ttft_s: float, per_user_tokens_per_s: float | None) -> bool:
        """One request: first token in time and, where it streamed more than one token, fast enough."""
        if not ttft_s <= self.ttft_p90_s:
            return False
        return per_user_tokens_per_s is None or math.isnan(per_user_tokens_per_s) or \
            per_user_tokens_per_s >= self.per_user_tokens_per_s_p90

    def describe(self) -> str:
        return f"p90 TTFT <= {self.ttft_p90_s:g} s, p90 per-user >= {self.per_user_tokens_per_s_p90:g} tok/s"

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
