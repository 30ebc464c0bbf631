"""Tokens routed to each expert of each mixture-of-experts layer, counted on the device.

Data flow:

    forward pass, per MoE layer: router top-k ids [T, k]
      --ExpertRoutingCounts.record(row, ids, weights [T*k])--> counts [layers, experts] int64
        (one index_add_ on the device per layer: static shapes, no host sync, so it is
        captured into CUDA graphs with the rest of the step)
      --snapshot() on a scrape (one device-to-host copy)--> {layer: [tokens per expert]}
      --serving/metrics.py--> shapeshift_expert_routed_tokens_total{layer, expert}
      --replay/routing.py--> the histogram of one replay (the difference of two snapshots)

Each of a token's k choices counts once, so a layer's row sums to k times the tokens
routed. ``weights`` (``choice_weights(valid, k)``, built once per forward and shared by its
layers: 1 per choice of a token, 0 per choice of a padded row) leaves out padded rows (CUDA-graph buckets, finished rows of a decode
chunk: rows whose KV slot is the cache's null slot); rows past a sequence's end inside one
decode chunk are counted like the others. The counts belong to the forward pass that
records them; a new pass (hot reload) starts from zero, and the reader folds the previous
pass's totals in (``RoutingTotals``).
"""

from __future__ import annotations

from typing import Any

import torch


class ExpertRoutingCounts:
    """counts [num_moe_layers, num_experts] int64 on the model's device."""

    def __init__(self, layers: list[int], num_experts: int, device: torch.device | str) -> None:
        if not layers or num_experts < 1:
            raise ValueError(f"expert routing counts need MoE layers and experts, got {layers} and {num_experts}")
        self.layers = list(layers)  # model layer index of each row
        self.num_experts = int(num_experts)
        self.counts = torch.zeros((len(self.layers), self.num_experts), dtype=torch.int64, device=device)

    @classmethod
    def for_model(cls, cfg: Any, device: torch.device | str) -> "ExpertRoutingCounts | None":
        """Counts for every layer of a MoE model; None for a dense one."""
        if getattr(cfg, "family", None) != "moe" or not getattr(cfg, "num_experts", 0):
            return None
        return cls(list(range(cfg.num_hidden_layers)), cfg.num_experts, device)

    @staticmethod
    def choice_weights(valid: torch.Tensor, k: int) -> torch.Tensor:
        """valid [T] bool -> [T*k] int64: what each of the T tokens' k choices adds."""
        return valid.to(torch.int64)[:, None].expand(-1, k).reshape(-1)  # static shapes: no host sync

    def record(self, row: int, ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add one layer's choices: ids [T, k] (expert ids, int64), weights [T*k] int64 from
        ``choice_weights`` (None: every row counts)."""
        flat = ids.reshape(-1)
        self.counts[row].index_add_(0, flat, torch.ones_like(flat) if weights is None else weights)

    def snapshot(self) -> dict[int, list[int]]:
        """{model layer: tokens routed to each expert} (one copy to the host)."""
        rows = self.counts.cpu().tolist()
        return {layer: [int(v) for v in row] for layer, row in zip(self.layers, rows)}

    def reset(self) -> None:
        """Back to zero, in place (captured graphs keep writing into the same tensor)."""
        self.counts.zero_()


def counts_of(forward_pass: Any) -> ExpertRoutingCounts | None:
    """The counts a forward pass records into, or None (a dense model, or a pass that does not count)."""
    counts = getattr(forward_pass, "routing_counts", None)
    return counts if isinstance(counts, ExpertRoutingCounts) else None


class RoutingTotals:
    """Cumulative counts over the forward passes an engine ran: a pass that replaced another
    (hot reload) starts from zero; the totals of the one it replaced are kept (read once more
    when the change is first seen, so nothing it counted is lost)."""

    def __init__(self) -> None:
        self._base: dict[tuple[int, int], int] = {}
        self._current: ExpertRoutingCounts | None = None

    def read(self, counts: ExpertRoutingCounts | None) -> dict[tuple[int, int], int]:
        """{(layer, expert): tokens} so far, with ``counts`` the active pass's counts."""
        if counts is not self._current:
            if self._current is not None:
                for key, value in _flatten(self._current.snapshot()).items():
                    self._base[key] = self._base.get(key, 0) + value
            self._current = counts
        out = dict(self._base)
        if counts is not None:
            for key, value in _flatten(counts.snapshot()).items():
                out[key] = out.get(key, 0) + value
        return out


def _flatten(snapshot: dict[int, list[int]]) -> dict[tuple[int, int], int]:
    return {(layer, expert): value for layer, row in snapshot.items() for expert, value in enumerate(row)}
