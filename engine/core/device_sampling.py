"""Sampling on the device for multi-step decode chunks (EngineConfig.multi_step_sampling).

Data flow: the runner launches a chunk of k decode steps -> ``ChunkSampler.stage`` copies the
batch's per-row temperature, top-p, top-k and k fresh seeds per row (drawn here from one
numpy generator seeded by EngineConfig.seed) to the device in one copy -> after each step's
graph replay ``ChunkSampler.sample`` draws that step's tokens from the graph's logits into
the static token buffer the next replay reads; the host reads the k x n tokens once.

On CUDA the draw is kernels.sampling.sample (no host sync; a row's draw depends only on its
seed and the logits). Elsewhere the host sampler's math (engine/core/sampling.py) with each
row's exponential noise from a generator seeded by its seed, so the CPU tests exercise the
same staging and seeds. Greedy rows get temperature 0: the first index of the maximum, as
everywhere else. Only unseeded requests come here (ModelRunner.can_decode_steps): a seeded
request's draws follow its own generator on the host.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from shapeshift.engine.core.sampling import SamplingParams, apply_top_k_top_p


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
        # Rows 0-2: temperature, top-p (float32 bit patterns), top-k; rows 3..: each step's seeds.
        self._host = torch.zeros(3 + steps, rows, dtype=torch.int64)
        if dev.type == "cuda":
            self._host = self._host.pin_memory()
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(3 + steps, rows, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=dev)
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
        h[2, :n] = [p.top_k for p in params]
        h[3:3 + k, :n] = self.rng.integers(0, 2**62, size=(k, n), dtype=np.int64)
        self._dev[:3 + k].copy_(self._host[:3 + k], non_blocking=True)
        # The float rows travelled as int64 holding float32 bits (one copy instead of three).
        self.temperature[:n].copy_(self._dev[0, :n].to(torch.int32).view(torch.float32))
        self.top_p[:n].copy_(self._dev[1, :n].to(torch.int32).view(torch.float32))
        self.top_k[:n].copy_(self._dev[2, :n])
        if self._draw is None:
            self._draw = device_sampler(self.device.type == "cuda")

    def sample(self, logits: torch.Tensor, step: int, out: torch.Tensor) -> None:
        """Step ``step``'s tokens from logits [n, V] float32 into out [n] int64; no host sync on CUDA."""
        n = logits.shape[0]
        self._draw(logits, self.temperature[:n], self.top_k[:n], self.top_p[:n], self._dev[3 + step, :n], out)


def device_sampler(on_cuda: bool) -> Callable[..., Any]:
    """(logits [n, V] float32, temperature [n] float32, top_k [n] int32, top_p [n] float32,
    seeds [n] int64, out [n] int64) -> None."""
    if on_cuda:
        try:
            from shapeshift.kernels.sampling import sample as kernel_sample
        except ImportError:
            pass
        else:
            return lambda logits, t, k, p, seeds, out: kernel_sample(logits, t, k, p, seeds, out=out)
    return sample_seeded_torch


def sample_seeded_torch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor) -> None:
    """The host sampler's math with row i's noise from a generator seeded by seeds[i] (reads
    the seeds on the host: a CPU form, and the CUDA fallback without Triton)."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    probs = torch.softmax(apply_top_k_top_p(scaled, top_k.long(), top_p), dim=-1)  # [n, V]
    noise = torch.empty_like(probs)
    for i, seed in enumerate(seeds.tolist()):
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(seed)
        noise[i].exponential_(generator=gen)
    out.copy_(torch.where(greedy, logits.argmax(dim=-1), (probs / noise).argmax(dim=-1)))
