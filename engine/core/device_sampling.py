"""Sampling on the device for multi-step decode chunks (EngineConfig.multi_step_sampling).

Data flow: the runner launches a chunk of k decode steps -> ``ChunkSampler.stage`` copies the
batch's per-row temperature, top-p, top-k, min-p and k fresh seeds per row (drawn here from one
numpy generator seeded by EngineConfig.seed) to the device in one copy -> after each step's
graph replay ``ChunkSampler.sample`` draws that step's tokens from the graph's logits into
the static token buffer the next replay reads; the host reads the k x n tokens once.

The draw is the host sampler's math (engine/core/sampling.py: temperature, top-k, top-p on
the sorted row, min-p, the exponential race) in device ops with no host sync, its noise a
counter-based hash of (the row's seed, token index) instead of a generator, so a row's draw
depends only on its seed and logits, on the CPU and on CUDA alike. kernels.sampling.sample
(SHAPESHIFT_CHUNK_SAMPLER=triton) avoids the sort, but on near-flat rows (random weights, top-p
0.9) it made sampled multi-step decode slower than single steps (docs/serving-performance.md).
Greedy rows get temperature 0: the first index of the maximum, as everywhere else. Only
unseeded requests come here (ModelRunner.can_decode_steps): a seeded request's draws follow its
own generator on the host.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import torch

from shapeshift.engine.core.sampling import SamplingParams, apply_min_p, apply_top_k_top_p


class ChunkSampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.rng = np.random.default_rng(seed)
        self._rows = 0  # rows the buffers hold
        self._steps = 0  # steps of seeds they hold
        self._draw: Callable[..., Any] | None = None

    def _ensure(self, n: int, k: int) -> None:
        if self._rows >= n and self._steps >= k:
            return
        rows, steps, dev = max(n, self._rows), max(k, self._steps), self.device
        # Rows 0-3: temperature, top-p, min-p (float32 bit patterns), top-k; rows 4..: each step's seeds.
        self._host = torch.zeros(4 + steps, rows, dtype=torch.int64)
        if dev.type == "cuda":
            self._host = self._host.pin_memory()
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(4 + steps, rows, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(rows, dtype=torch.int32, device=dev)
        self._rows, self._steps = rows, steps

    def stage(self, params: list[SamplingParams], k: int) -> None:
        """The chunk's parameters and seeds [k, n] to the device (one non-blocking copy). The
        caller has waited until the previous chunk's copies were done (the pinned pack is
        rewritten here), as for the runner's step staging."""
        n = len(params)
        self._ensure(n, k)
        h = self._host_np
        h[0, :n] = np.array([0.0 if p.greedy else p.temperature for p in params], np.float32).view(np.int32)
        h[1, :n] = np.array([p.top_p for p in params], np.float32).view(np.int32)
        h[2, :n] = np.array([p.min_p for p in params], np.float32).view(np.int32)
        h[3, :n] = [p.top_k for p in params]
        h[4:4 + k, :n] = self.rng.integers(0, 2**62, size=(k, n), dtype=np.int64)
        self._dev[:4 + k].copy_(self._host[:4 + k], non_blocking=True)
        # The float rows travelled as int64 holding float32 bits (one copy instead of four).
        self.temperature[:n].copy_(self._dev[0, :n].to(torch.int32).view(torch.float32))
        self.top_p[:n].copy_(self._dev[1, :n].to(torch.int32).view(torch.float32))
        self.min_p[:n].copy_(self._dev[2, :n].to(torch.int32).view(torch.float32))
        self.top_k[:n].copy_(self._dev[3, :n])
        sampled = [p for p in params if not p.greedy]
        self.filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in sampled)
        self.min_p_used = any(p.min_p > 0.0 for p in sampled)
        if self._draw is None:
            self._draw = device_sampler(self.device.type == "cuda")

    def sample(self, logits: torch.Tensor, step: int, out: torch.Tensor) -> None:
        """Step ``step``'s tokens from logits [n, V] float32 into out [n] int64; no host sync on CUDA."""
        n = logits.shape[0]
        self._draw(logits, self.temperature[:n], self.top_k[:n], self.top_p[:n], self._dev[4 + step, :n], out,
                   self.filtered, self.min_p[:n] if self.min_p_used else None)


def device_sampler(on_cuda: bool) -> Callable[..., Any]:
    """(logits [n, V] float32, temperature [n] float32, top_k [n] int32, top_p [n] float32,
    seeds [n] int64, out [n] int64, filtered: bool, min_p [n] float32 | None) -> None.
    ``filtered`` False: no sampled row has top-k or top-p, so the sort is skipped; ``min_p``
    None: no sampled row has min-p (the Triton kernel has none: such chunks take sample_hashed)."""
    if on_cuda and os.environ.get("SHAPESHIFT_CHUNK_SAMPLER", "torch") == "triton":
        try:
            from shapeshift.kernels.sampling import sample as kernel_sample
        except ImportError:
            pass
        else:
            def draw(logits, t, k, p, seeds, out, filtered=True, min_p=None):  # noqa: ANN001
                if min_p is not None:
                    return sample_hashed(logits, t, k, p, seeds, out, filtered, min_p)
                return kernel_sample(logits, t, k, p, seeds, out=out)

            return draw
    return sample_hashed


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; products wrap).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def hashed_uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), float32 [n, V]: splitmix64 of seed * golden + token index, top 24 bits
    (the race needs no more: the largest noise is then -ln(2^-25), about 17)."""
    idx = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    z = seeds.to(torch.int64)[:, None] * _GOLDEN + idx[None, :]  # [n, V]
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_hashed(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, out: torch.Tensor, filtered: bool = True,
                  min_p: torch.Tensor | None = None) -> None:
    """The host sampler's math in device ops (the same filters in the same order), noise from
    hashed_uniforms(seeds)."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if filtered:
        scaled = apply_top_k_top_p(scaled, top_k.long(), top_p)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    probs = torch.softmax(scaled, dim=-1)  # [n, V]
    noise = -torch.log(hashed_uniforms(seeds, logits.shape[-1]))  # Exp(1)
    out.copy_(torch.where(greedy, logits.argmax(dim=-1), (probs / noise).argmax(dim=-1)))
