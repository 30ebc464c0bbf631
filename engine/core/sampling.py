"""Sampling parameters and the sampler.

Data flow: float32 logits [B, V] of the sequences that sample this step + each one's
``SamplingParams`` and optional per-request ``torch.Generator`` -> temperature ->
top-k -> top-p (on the renormalized top-k distribution, as HF does) -> one token per
row. Greedy rows (temperature 0) take the argmax of the raw logits. Random rows sample
by the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p
and lets each seeded row take its noise from its own generator, so a seeded request
gets the same tokens whatever its batch mates are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A row is greedy below this temperature (dividing by ~0 would overflow).
GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k, then outside its top-p nucleus, with -inf.

    logits: [B, V] float32; top_k: [B] int64 (0 = off); top_p: [B] float32 (1 = off).
    The nucleus is the smallest set of most likely tokens whose mass reaches top_p
    (at least one token always survives).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           want_logprobs: bool = False) -> tuple[list[int], list[float] | None]:
    """logits: [B, V] float32 -> (B token ids, their logprobs under the raw logits or None).

    The only host sync is the final ``tolist``: the per-row parameters travel in one
    non-blocking copy from pinned memory (``torch.tensor(..., device="cuda")`` would
    synchronize the stream once per tensor).
    """
    if all(p.greedy for p in params):
        tokens = logits.argmax(dim=-1)  # [B]
    else:
        device = logits.device
        # [4, B] float32: greedy flag, temperature (1 for greedy rows), top_k (exact in float32
        # far beyond any vocabulary), top_p.
        host = torch.tensor([[float(p.greedy) for p in params],
                             [1.0 if p.greedy else p.temperature for p in params],
                             [float(p.top_k) for p in params],
                             [p.top_p for p in params]], dtype=torch.float32)
        if device.type == "cuda":
            host = host.pin_memory()
        rows = host.to(device, non_blocking=True)
        greedy_rows = rows[0] != 0
        scaled = logits / rows[1][:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = apply_top_k_top_p(scaled, rows[2].long(), rows[3])
        probs = torch.softmax(scaled, dim=-1)  # [B, V]
        noise = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) < len(params):
            noise.exponential_()
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy_rows, logits.argmax(dim=-1), sampled)
    token_list = tokens.tolist()
    if not want_logprobs:
        return token_list, None
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return token_list, logprobs.tolist()
