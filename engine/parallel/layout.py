"""Parallel layouts: how one model is spread over several devices.

Data flow: an accelerator count (``InferenceDeployment.spec.hardware.count``) and a
``ModelConfig`` -> ``choose_layout`` (or the cost model's pick, checked the same way)
-> a validated ``ParallelLayout`` -> ``layout.coords(rank)`` tells each rank which
slice of the weights it holds (sharding.py) and which groups it talks to
(process_group.py).

Degrees and their meaning:
  tp  tensor parallel: attention heads, the dense MLP's intermediate dimension and the
      vocabulary (embedding and lm_head) are split over ``tp`` ranks; an all-reduce
      follows each row-parallel projection (o_proj, down_proj) and an all-gather
      joins the vocabulary shards of the logits.
  ep  expert parallel (MoE only): the experts are split over ``ep`` ranks; the router
      is replicated, every rank runs its own experts on all tokens routed to them and
      an all-reduce sums the partial expert outputs.
  dp  data parallel: independent replicas (each with its own scheduler).
  pp  pipeline parallel: layer ranges per stage. Ranked by the cost model; this
      engine does not execute it yet (``is_executable``).

One replica holds ``model_parallel_size = max(tp, ep)`` ranks; the smaller degree must
divide the larger. When ``ep > tp`` the attention is replicated over ``ep / tp`` groups
(same batch, same result); when ``tp > ep`` each expert's intermediate dimension is
additionally split over ``tp / ep`` ranks (``expert_tp``), so every rank does work.
When ``tp`` exceeds the number of KV heads, each KV head is replicated on
``tp / num_key_value_heads`` ranks (each rank keeps exactly one).

Rank order: rank = (dp_rank * pp + pp_rank) * model_parallel_size + mp_rank; inside a
replica, tp_rank = mp_rank % tp and ep_rank = mp_rank // expert_tp, so the ranks of a
tensor-parallel group are neighbours (on one host: neighbouring GPUs, the NVLink-near ones).

No torch here: the operator validates layouts with this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from shapeshift.engine.core.config import ModelConfig


class LayoutError(ValueError):
    """A parallel layout that does not fit the model or the device count."""


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in a layout."""

    rank: int
    dp_rank: int
    pp_rank: int
    mp_rank: int  # rank inside its replica's model-parallel group
    tp_rank: int  # attention / dense tensor-parallel rank
    ep_rank: int  # which block of experts it holds
    etp_rank: int  # which slice of each of its experts' intermediate dimension


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel degree {name} must be an integer >= 1, got {value!r}")
        big, small = max(self.tp, self.ep), min(self.tp, self.ep)
        if big % small:
            raise LayoutError(
                f"tp={self.tp} and ep={self.ep}: the smaller degree must divide the larger, because "
                f"one replica has max(tp, ep) ranks; use e.g. tp=ep={big}, or tp={big} with ep a divisor of {big}")

    # ------------------------------------------------------------------ sizes
    @property
    def model_parallel_size(self) -> int:
        return max(self.tp, self.ep)

    @property
    def expert_tp(self) -> int:
        """Ranks sharing each expert (its intermediate dimension is split over them)."""
        return self.model_parallel_size // self.ep

    @property
    def attention_replicas(self) -> int:
        """Attention groups inside a replica (> 1 when ep > tp: attention is recomputed)."""
        return self.model_parallel_size // self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.model_parallel_size

    @property
    def is_executable(self) -> bool:
        """Can ``ParallelLLMEngine`` run it (pipeline stages are not implemented)."""
        return self.pp == 1

    @property
    def name(self) -> str:
        return f"tp{self.tp}-ep{self.ep}-dp{self.dp}-pp{self.pp}"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """``"tp2-ep2"``, ``"tp=2,ep=2"``, ``"tp2-ep1-dp2-pp1"`` -> layout (missing degrees are 1)."""
        degrees: dict[str, int] = {}
        for key, value in re.findall(r"(tp|ep|dp|pp)\s*=?\s*(\d+)", text.lower()):
            degrees[key] = int(value)
        leftover = re.sub(r"(tp|ep|dp|pp)\s*=?\s*\d+|[\s,;\-_]", "", text.lower())
        if not degrees or leftover:
            raise LayoutError(f"cannot read parallel layout {text!r}; write it like 'tp2-ep2-dp1' or 'tp=2,ep=2'")
        return cls(**degrees)

    @classmethod
    def coerce(cls, choice: Any) -> ParallelLayout:
        """A layout from a ParallelLayout, a mapping or an object with tp/ep/dp/pp attributes
        (what a cost model's ranking entry carries), or a string for ``parse``."""
        if isinstance(choice, ParallelLayout):
            return choice
        if isinstance(choice, str):
            return cls.parse(choice)
        if hasattr(choice, "layout") and not hasattr(choice, "tp"):  # a ranking entry (prediction) -> its layout
            return cls.coerce(choice.layout)
        source = choice if isinstance(choice, dict) else {k: getattr(choice, k) for k in ("tp", "ep", "dp", "pp")
                                                          if hasattr(choice, k)}
        known = {k: int(source[k]) for k in ("tp", "ep", "dp", "pp") if source.get(k) is not None}
        if not known:
            raise LayoutError(f"cannot read a parallel layout from {choice!r}: it names none of tp, ep, dp, pp")
        return cls(**known)

    # ------------------------------------------------------------------ model fit
    def validate(self, cfg: ModelConfig, num_devices: int | None = None) -> ParallelLayout:
        """Raise ``LayoutError`` naming the model field that the layout does not divide."""
        if num_devices is not None and self.world_size != num_devices:
            raise LayoutError(
                f"layout {self.name} needs {self.world_size} devices (dp*pp*max(tp,ep)), "
                f"the deployment has {num_devices}; pick degrees whose product is {num_devices}")
        if cfg.num_attention_heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide num_attention_heads={cfg.num_attention_heads}; "
                f"tensor-parallel degrees this model allows: {valid_tp_degrees(cfg)}")
        kv = cfg.num_key_value_heads
        if (self.tp <= kv and kv % self.tp) or (self.tp > kv and self.tp % kv):
            raise LayoutError(
                f"tp={self.tp} and num_key_value_heads={kv}: tp must divide the KV heads or be a multiple "
                f"of them (then each KV head is replicated); allowed: {valid_tp_degrees(cfg)}")
        if cfg.family == "moe":
            if cfg.num_experts % self.ep:
                raise LayoutError(
                    f"ep={self.ep} does not divide num_experts={cfg.num_experts}; expert-parallel degrees "
                    f"this model allows: {[d for d in _divisors(cfg.num_experts)]}")
            if cfg.moe_intermediate_size % self.expert_tp:
                raise LayoutError(
                    f"tp={self.tp} with ep={self.ep} splits each expert over {self.expert_tp} ranks, which does "
                    f"not divide moe_intermediate_size={cfg.moe_intermediate_size}; raise ep to {self.tp}")
        else:
            if self.ep != 1:
                raise LayoutError(f"ep={self.ep} needs a mixture-of-experts model; {cfg.model_type} is dense: use ep=1")
            if cfg.intermediate_size % self.tp:
                raise LayoutError(
                    f"tp={self.tp} does not divide intermediate_size={cfg.intermediate_size}; "
                    f"allowed: {valid_tp_degrees(cfg)}")
        if self.pp > cfg.num_hidden_layers:
            raise LayoutError(f"pp={self.pp} exceeds num_hidden_layers={cfg.num_hidden_layers}")
        return self

    # ------------------------------------------------------------------ per-rank facts
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside layout {self.name} (world size {self.world_size})")
        mp = self.model_parallel_size
        mp_rank = rank % mp
        stage = rank // mp
        return RankCoords(rank=rank, dp_rank=stage // self.pp, pp_rank=stage % self.pp, mp_rank=mp_rank,
                          tp_rank=mp_rank % self.tp, ep_rank=mp_rank // self.expert_tp,
                          etp_rank=mp_rank % self.expert_tp)

    def replica_ranks(self, dp_rank: int, pp_rank: int = 0) -> list[int]:
        first = (dp_rank * self.pp + pp_rank) * self.model_parallel_size
        return list(range(first, first + self.model_parallel_size))

    def local_heads(self, cfg: ModelConfig) -> int:
        return cfg.num_attention_heads // self.tp

    def local_kv_heads(self, cfg: ModelConfig) -> int:
        """KV heads one rank holds (and caches): 1 when KV heads are replicated."""
        return max(1, cfg.num_key_value_heads // self.tp)

    def first_kv_head(self, cfg: ModelConfig, tp_rank: int) -> int:
        kv = cfg.num_key_value_heads
        if self.tp <= kv:
            return tp_rank * (kv // self.tp)
        return tp_rank // (self.tp // kv)  # replicated: tp/kv neighbouring ranks share a head

    def padded_vocab(self, cfg: ModelConfig) -> int:
        """Vocabulary rounded up to a multiple of tp; the padding rows are zero and sliced off."""
        return math.ceil(cfg.vocab_size / self.tp) * self.tp

    def local_experts(self, cfg: ModelConfig) -> int:
        return cfg.num_experts // self.ep

    def rank_model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The per-rank view of the config: local attention and KV heads (what the KV cache
        of one rank holds); experts, vocabulary and hidden size stay global."""
        import dataclasses

        return dataclasses.replace(cfg, num_attention_heads=self.local_heads(cfg),
                                   num_key_value_heads=self.local_kv_heads(cfg))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_degrees(cfg: ModelConfig) -> list[int]:
    """Tensor-parallel degrees that split heads, KV heads and the MLP evenly."""
    out = []
    for tp in _divisors(cfg.num_attention_heads):
        kv = cfg.num_key_value_heads
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            continue
        if cfg.family != "moe" and cfg.intermediate_size % tp:
            continue
        out.append(tp)
    return out


def candidate_layouts(cfg: ModelConfig, num_devices: int, include_pipeline: bool = False) -> list[ParallelLayout]:
    """Every valid layout over exactly ``num_devices`` devices, smallest tp first."""
    layouts = []
    for mp in _divisors(num_devices):
        for pp in (_divisors(num_devices // mp) if include_pipeline else [1]):
            dp = num_devices // (mp * pp)
            for tp in _divisors(mp):
                eps = [mp] if tp != mp else _divisors(mp)
                for ep in eps:
                    if cfg.family != "moe" and ep != 1:
                        continue
                    try:
                        layout = ParallelLayout(tp=tp, ep=ep, dp=dp, pp=pp)
                        if layout.model_parallel_size != mp:
                            continue
                        layouts.append(layout.validate(cfg, num_devices))
                    except LayoutError:
                        continue
    return sorted(layouts, key=lambda x: (x.pp, x.tp, x.ep, x.dp))


def choose_layout(cfg: ModelConfig, num_devices: int, cost_model_choice: Any = None) -> ParallelLayout:
    """The layout one engine replica uses on ``num_devices`` accelerators.

    With ``cost_model_choice`` (a ParallelLayout, a mapping, a string, a ranking entry
    with tp/ep/dp/pp or with a ``layout``, or a whole ranking best first, of which the
    first executable entry wins), that layout is validated against the model and the
    device count and taken. Otherwise: one replica over all devices (the server drives one engine),
    tensor-parallel over every device, and for MoE experts split over every device when
    their count allows (else split inside each expert).
    """
    if num_devices < 1:
        raise LayoutError(f"hardware count must be >= 1, got {num_devices}")
    if isinstance(cost_model_choice, (list, tuple)):
        # A whole ranking, best first: take the best entry this engine can run.
        reasons = []
        for entry in cost_model_choice:
            try:
                return choose_layout(cfg, num_devices, entry)
            except LayoutError as exc:
                reasons.append(str(exc))
        raise LayoutError(f"no layout of the cost model's ranking fits this engine on {num_devices} devices: "
                          + "; ".join(reasons[:3]))
    if cost_model_choice is not None:
        layout = ParallelLayout.coerce(cost_model_choice).validate(cfg, num_devices)
        if not layout.is_executable:
            raise LayoutError(f"layout {layout.name} uses pipeline stages, which this engine does not run; "
                              "take the best layout with pp=1 from the ranking")
        return layout
    if num_devices not in valid_tp_degrees(cfg):
        raise LayoutError(
            f"{num_devices} devices cannot split this model tensor-parallel (num_attention_heads="
            f"{cfg.num_attention_heads}, num_key_value_heads={cfg.num_key_value_heads}); set the hardware count "
            f"to one of {valid_tp_degrees(cfg)} or pass the cost model's layout")
    ep = 1
    if cfg.family == "moe":
        ep = num_devices if cfg.num_experts % num_devices == 0 else 1
    return ParallelLayout(tp=num_devices, ep=ep).validate(cfg, num_devices)
