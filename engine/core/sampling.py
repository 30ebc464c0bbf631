"""Sampling parameters and the sampler.

Data flow: float32 logits [B, V] of the sequences that sample this step + each one's
``SamplingParams`` and optional per-request ``torch.Generator`` -> logits processors
(only rows that ask for them: min_tokens, logit_bias, repetition / presence / frequency
penalties) -> temperature -> top-k -> top-p (on the renormalized top-k distribution, as
HF does) -> min-p -> one token per row. Rows at temperature 0 take the argmax of their
(processed) logits. Random rows sample by the exponential race (argmax of p / E with
E ~ Exp(1)), which draws exactly from p and lets each seeded row take its noise from its
own generator, so a seeded request gets the same tokens whatever its batch mates are.

Rows with neutral controls never touch the processors, so they run exactly the code they
ran before the controls existed (``SamplingParams.greedy`` stays true for them and the
runner's graph argmax and device sampler keep serving them). A row with processors is
not ``greedy`` even at temperature 0, always has a generator (``LLMEngine.add_request``),
and so always samples here, on the torch path. The processors read the sequence's tokens
through ``SamplingParams.history`` (a ``SequenceHistory`` bound by the engine: token
counts kept per sequence, updated with the tokens added since the last step).

Logprobs are under the raw logits. With ``top_logprobs`` > 0 a row's logprob is a
``TokenLogprob``: a float (so everything that stores or compares logprobs is unchanged)
that also carries the row's most likely tokens as ``top`` [(token id, logprob)].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# A row is greedy below this temperature (dividing by ~0 would overflow).
GREEDY_EPSILON = 1e-5
# The most alternatives per token a request may ask for (top_logprobs / completions logprobs),
# as OpenAI's chat API; docs/serving-api.md states it.
MAX_TOP_LOGPROBS = 20


class TokenLogprob(float):
    """A sampled token's logprob that also carries the row's ``top`` alternatives."""

    __slots__ = ("top",)

    def __new__(cls, value: float, top: list[tuple[int, float]]) -> "TokenLogprob":
        self = super().__new__(cls, value)
        self.top = top
        return self


class SequenceHistory:
    """What the logits processors of one sequence read: its tokens (the sequence's own list,
    which only grows), where the output starts, the ids that end it (min_tokens masks them),
    and per-token output counts on the logits' device, updated incrementally."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int, eos_token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.eos_token_ids = list(eos_token_ids)
        self._counts: torch.Tensor | None = None  # [V] float32: occurrences in the output
        self._prompt_mask: torch.Tensor | None = None  # [V] bool: in the prompt
        self._counted = num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def output_counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if self._counted < len(self.token_ids):
            new = torch.tensor(self.token_ids[self._counted:], dtype=torch.int64, device=device)
            self._counts.index_add_(0, new, torch.ones(len(new), dtype=torch.float32, device=device))
            self._counted = len(self.token_ids)
        return self._counts

    def prompt_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._prompt_mask is None:
            ids = torch.tensor(self.token_ids[:self.num_prompt_tokens], dtype=torch.int64, device=device)
            self._prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._prompt_mask[ids] = True
        return self._prompt_mask


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
    top_logprobs: int = 0  # alternatives per token with its logprob (needs logprobs)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0 = off)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the raw logits
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/CTRL: logits of prompt or output tokens / (or *) this
    # Constrained decoding (response_format): an object whose mask_logits(row [V], history) sets
    # the logits of tokens the constraint forbids next to -inf, in place. One per sequence.
    constraint: Any = field(default=None, repr=False, compare=False)
    # Bound per sequence by the engine when processors need it (see SequenceHistory).
    history: SequenceHistory | None = field(default=None, repr=False, compare=False)

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
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            raise ValueError("logit_bias keys must be non-negative token ids")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")

    @property
    def argmax(self) -> bool:
        """Temperature 0: the row takes the most likely token of its (processed) logits."""
        return self.temperature < GREEDY_EPSILON

    @property
    def greedy(self) -> bool:
        """The token is the argmax of the raw logits (temperature 0 and no logits processors)."""
        return self.temperature < GREEDY_EPSILON and not self.has_processors

    @property
    def has_processors(self) -> bool:
        """Whether the logits change before sampling (min_tokens, bias, penalties)."""
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.constraint is not None)

    @property
    def needs_history(self) -> bool:
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.constraint is not None)


def apply_processors(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, V] float32 -> a processed copy: for each row with processors, in order,
    min_tokens (EOS / stop ids to -inf while the output is shorter), logit_bias (added),
    repetition penalty (positive logits of seen tokens divided by it, negative multiplied),
    presence and frequency penalties (OpenAI: minus presence x [count > 0] + frequency x count,
    counts over the output), then the constraint's mask. Applied before temperature, as
    OpenAI and vLLM do."""
    out = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    for i, p in enumerate(params):
        if not p.has_processors:
            continue
        row = out[i]
        h = p.history
        if p.min_tokens and h is not None and h.num_output_tokens < p.min_tokens:
            banned = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(h.eos_token_ids)) if t < vocab]
            if banned:
                row[torch.tensor(banned, dtype=torch.int64, device=device)] = float("-inf")
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            if ids:
                row[torch.tensor(ids, dtype=torch.int64, device=device)] += torch.tensor(
                    [p.logit_bias[t] for t in ids], dtype=torch.float32, device=device)
        if h is None:
            continue
        if p.repetition_penalty != 1.0:
            seen = h.prompt_mask(vocab, device) | (h.output_counts(vocab, device) > 0)
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if p.presence_penalty or p.frequency_penalty:
            counts = h.output_counts(vocab, device)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.constraint is not None:
            p.constraint.mask_logits(row, h)  # last: bias and penalties never re-allow a token
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p [B] times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


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
    raw = logits
    if any(p.has_processors for p in params):
        logits = apply_processors(logits, params)
    if all(p.argmax for p in params):
        tokens = logits.argmax(dim=-1)  # [B]
    else:
        device = logits.device
        # [5, B] float32: argmax flag, temperature (1 for argmax rows), top_k (exact in float32
        # far beyond any vocabulary), top_p, min_p.
        host = torch.tensor([[float(p.argmax) for p in params],
                             [1.0 if p.argmax else p.temperature for p in params],
                             [float(p.top_k) for p in params],
                             [p.top_p for p in params],
                             [p.min_p for p in params]], dtype=torch.float32)
        if device.type == "cuda":
            host = host.pin_memory()
        rows = host.to(device, non_blocking=True)
        greedy_rows = rows[0] != 0
        scaled = logits / rows[1][:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = apply_top_k_top_p(scaled, rows[2].long(), rows[3])
        if any(p.min_p > 0.0 for p in params):
            scaled = apply_min_p(scaled, rows[4])
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
    all_logprobs = torch.log_softmax(raw, dim=-1)  # [B, V]
    logprobs = all_logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    top_n = max(p.top_logprobs for p in params)
    if top_n == 0:
        return token_list, logprobs
    top_values, top_ids = all_logprobs.topk(top_n, dim=-1)  # [B, top_n]
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[float] = []
    for i, p in enumerate(params):
        k = p.top_logprobs
        out.append(TokenLogprob(logprobs[i], list(zip(top_ids[i][:k], top_values[i][:k]))) if k else logprobs[i])
    return token_list, out
