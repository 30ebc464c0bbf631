"""Cost model: rank parallel layouts for a model on some GPUs before any agent spends time.

Data flow:
    ModelConfig + HardwareSpec (+ calibration from measured steps)
      -> enumerate layouts (tensor, expert, data, pipeline degrees) whose product fits the GPUs
      -> per layout: bytes read per GPU (weights, touched experts, KV cache), FLOPs,
         collective volumes (TP all-reduce, EP all-to-all, PP point-to-point)
      -> predicted decode step time (roofline: max(memory, compute) + communication + fixed
         overhead) and prefill throughput; memory footprint per GPU -> infeasible layouts pruned
      -> ranked list (best decode throughput first, prefill as tie-break)
    calibrate(measurements) fits the efficiency factors (bandwidth, FLOP/s and interconnect
    efficiency, fixed per-step overhead, per-sequence host time) to measured steps by least
    squares.

Units: bytes, seconds, FLOP. Defaults are an H200: 4.8 TB/s nominal HBM (about 4.2-4.3 TB/s
reached by a copy), about 790 TFLOP/s bf16 dense, NVLink 900 GB/s per GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}


@dataclass(frozen=True)
class HardwareSpec:
    name: str = "nvidia-h200"
    hbm_bandwidth: float = 4.8e12  # bytes/s, nominal
    measured_copy_bandwidth: float | None = 4.25e12  # what a device-to-device copy reaches
    peak_flops: float = 790e12  # dense bf16 FLOP/s
    hbm_bytes: float = 141e9
    interconnect_bandwidth: float = 900e9  # bytes/s per GPU (NVLink)
    interconnect_latency: float = 6e-6  # seconds per collective (launch + small-message round)
    interconnect_latency_per_rank: float = 1e-6  # added per extra rank in a ring
    memory_utilization: float = 0.9  # share of HBM the engine may use

    @classmethod
    def h200(cls) -> "HardwareSpec":
        return cls()


@dataclass
class Efficiency:
    """Factors that turn spec-sheet rates into reachable ones (fitted by `calibrate`)."""

    bandwidth: float = 0.88  # of nominal HBM bandwidth (copy ~4.25 / 4.8)
    flops: float = 0.6  # of peak FLOP/s in GEMMs
    interconnect: float = 0.7  # of link bandwidth in collectives
    step_overhead_s: float = 30e-6  # launches, sampling, host work per step (CUDA graphs keep it small)
    per_sequence_s: float = 0.5e-6  # host work per sequence per step (scheduling, sampling bookkeeping)


@dataclass(frozen=True)
class Layout:
    tp: int = 1  # tensor parallel (attention heads, dense MLP columns)
    ep: int = 1  # expert parallel (experts spread over ranks; MoE only)
    dp: int = 1  # data parallel replicas
    pp: int = 1  # pipeline stages (layers split)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp

    def __str__(self) -> str:
        return f"tp{self.tp}-ep{self.ep}-dp{self.dp}-pp{self.pp}"


@dataclass(frozen=True)
class Workload:
    """What one step does: `batch` sequences (decode) or `tokens` new tokens (prefill), at `context`."""

    kind: str = "decode"  # "decode" | "prefill"
    batch: int = 1
    context: int = 1024  # tokens already in the cache per sequence (decode) / prompt length (prefill)
    tokens: int = 0  # prefill: tokens per step (default batch * context)

    @property
    def new_tokens(self) -> int:
        return self.batch if self.kind == "decode" else (self.tokens or self.batch * self.context)


@dataclass
class Prediction:
    layout: Layout
    feasible: bool
    reason: str
    memory_per_gpu: float  # bytes
    decode_step_s: float
    decode_tokens_per_s: float  # all replicas
    prefill_tokens_per_s: float
    breakdown: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layout"] = str(self.layout)
        return d


@dataclass(frozen=True)
class Measurement:
    """A measured step for calibration."""

    layout: Layout
    workload: Workload
    seconds: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class CostModel:
    def __init__(self, model_config: Any, hardware: HardwareSpec | None = None, dtype: str = "bfloat16",
                 efficiency: Efficiency | None = None):
        self.cfg = model_config
        self.hw = hardware or HardwareSpec()
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.eff = efficiency or Efficiency(
            bandwidth=(self.hw.measured_copy_bandwidth or self.hw.hbm_bandwidth * 0.88) / self.hw.hbm_bandwidth)

    # ------------------------------------------------------------------ model sizes (parameters)
    @property
    def is_moe(self) -> bool:
        return self.cfg.family == "moe" and self.cfg.num_experts > 0

    def attention_params_per_layer(self) -> int:
        c = self.cfg
        return c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)

    def expert_params(self) -> int:
        """One expert's (or the dense MLP's) gate, up and down projections."""
        c = self.cfg
        inner = c.moe_intermediate_size if self.is_moe else c.intermediate_size
        return 3 * c.hidden_size * inner

    def embedding_params(self) -> int:
        c = self.cfg
        return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)

    def total_params(self) -> int:
        c = self.cfg
        mlp = self.expert_params() * (c.num_experts if self.is_moe else 1)
        return c.num_hidden_layers * (self.attention_params_per_layer() + mlp) + self.embedding_params()

    def weight_bytes(self) -> float:
        return self.total_params() * self.dtype_bytes

    def kv_bytes_per_token(self) -> float:
        c = self.cfg
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype_bytes

    # ------------------------------------------------------------------ layouts
    def layouts(self, gpus: int) -> list[Layout]:
        """Every (tp, ep, dp, pp) with tp*dp*pp == gpus; ep > 1 only for MoE, dividing the experts
        and the ranks of one replica stage (tp); tp at most the attention heads; pp at most the layers."""
        c = self.cfg
        out = []
        for tp, dp in itertools.product(_divisors(gpus), repeat=2):
            if gpus % (tp * dp):
                continue
            pp = gpus // (tp * dp)
            if tp > c.num_attention_heads or c.num_attention_heads % tp or pp > c.num_hidden_layers:
                continue
            eps = [1]
            if self.is_moe:
                eps = [e for e in _divisors(tp) if c.num_experts % e == 0]
            for ep in eps:
                out.append(Layout(tp, ep, dp, pp))
        return out

    # ------------------------------------------------------------------ one step
    def _touched_experts(self, tokens: int) -> float:
        """Expected distinct experts hit by `tokens` tokens with top-k routing (uniform routing)."""
        c = self.cfg
        e, k = c.num_experts, c.num_experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    def _allreduce(self, nbytes: float, ranks: int) -> tuple[float, float]:
        """(bytes each rank sends, latency seconds) of a ring all-reduce."""
        if ranks <= 1:
            return 0.0, 0.0
        volume = 2 * (ranks - 1) / ranks * nbytes  # reduce-scatter + all-gather
        return volume, self.hw.interconnect_latency + (ranks - 1) * self.hw.interconnect_latency_per_rank

    def _alltoall(self, nbytes: float, ranks: int) -> tuple[float, float]:
        if ranks <= 1:
            return 0.0, 0.0
        return (ranks - 1) / ranks * nbytes, self.hw.interconnect_latency

    def step_terms(self, layout: Layout, work: Workload) -> dict[str, float]:
        """Raw (unscaled) quantities of one step on one GPU of one replica: bytes, flops, comm bytes."""
        c = self.cfg
        b = self.dtype_bytes
        tokens = max(1, math.ceil(work.new_tokens / layout.dp))  # per replica
        layers_per_stage = c.num_hidden_layers / layout.pp
        kv_split = min(layout.tp, c.num_key_value_heads)  # kv heads replicate beyond their count
        attn_bytes = self.attention_params_per_layer() * b / layout.tp * layers_per_stage
        if self.is_moe:
            touched = self._touched_experts(tokens)
            mlp_bytes = touched / layout.ep * self.expert_params() * b * layers_per_stage
            if layout.ep == 1:
                mlp_bytes /= layout.tp  # experts split by tensor parallelism instead
            active_mlp_params = c.num_experts_per_tok * self.expert_params()
        else:
            mlp_bytes = self.expert_params() * b / layout.tp * layers_per_stage
            active_mlp_params = self.expert_params()
        embed_bytes = c.vocab_size * c.hidden_size * b / layout.tp / layout.pp  # lm_head read once per step
        seqs = max(1, math.ceil(work.batch / layout.dp))
        context = work.context
        if work.kind == "decode":
            kv_read = seqs * context * self.kv_bytes_per_token() / kv_split / layout.pp
        else:
            kv_read = tokens * self.kv_bytes_per_token() / kv_split / layout.pp  # written once
        active_params = c.num_hidden_layers * (self.attention_params_per_layer() + active_mlp_params)
        flops = 2 * tokens * active_params / (layout.tp * layout.pp) + 2 * tokens * c.vocab_size * c.hidden_size / layout.tp
        attn_ctx = context if work.kind == "decode" else context / 2
        flops += 4 * tokens * attn_ctx * c.num_attention_heads * c.head_dim * c.num_hidden_layers / (layout.tp * layout.pp)
        act = tokens * c.hidden_size * b
        comm_bytes, comm_lat = 0.0, 0.0
        vol, lat = self._allreduce(act, layout.tp)  # after attention and after the MLP, every layer
        comm_bytes += 2 * layers_per_stage * vol
        comm_lat += 2 * layers_per_stage * lat
        if self.is_moe and layout.ep > 1:
            vol, lat = self._alltoall(act * c.num_experts_per_tok, layout.ep)  # dispatch and combine
            comm_bytes += 2 * layers_per_stage * vol
            comm_lat += 2 * layers_per_stage * lat
        if layout.pp > 1:
            comm_bytes += (layout.pp - 1) / layout.pp * act
            comm_lat += (layout.pp - 1) / layout.pp * self.hw.interconnect_latency
        comm_s = comm_bytes / (self.hw.interconnect_bandwidth * self.eff.interconnect) + comm_lat
        return {"bytes": attn_bytes + mlp_bytes + embed_bytes + kv_read, "weight_bytes": attn_bytes + mlp_bytes + embed_bytes,
                "kv_bytes": kv_read, "flops": flops, "comm_bytes": comm_bytes, "comm_latency_s": comm_lat,
                "comm_s": comm_s, "tokens_per_replica": tokens, "seqs_per_replica": seqs}

    def step_time(self, layout: Layout, work: Workload) -> tuple[float, dict[str, float]]:
        t = self.step_terms(layout, work)
        mem_s = t["bytes"] / (self.hw.hbm_bandwidth * self.eff.bandwidth)
        compute_s = t["flops"] / (self.hw.peak_flops * self.eff.flops)
        # A decode step runs the stages one after another (one batch in flight); prefill streams
        # micro-batches through the pipeline, so its throughput follows one stage.
        stages = layout.pp if work.kind == "decode" else 1
        host_s = self.eff.step_overhead_s + self.eff.per_sequence_s * t["seqs_per_replica"]
        total = stages * max(mem_s, compute_s) + t["comm_s"] + host_s
        return total, {**t, "memory_s": mem_s * stages, "compute_s": compute_s * stages, "host_s": host_s,
                       "comm_bw_s": t["comm_bytes"] / (self.hw.interconnect_bandwidth * self.eff.interconnect)}

    def memory_per_gpu(self, layout: Layout, batch: int, context: int) -> float:
        c = self.cfg
        b = self.dtype_bytes
        attn = c.num_hidden_layers * self.attention_params_per_layer() * b / (layout.tp * layout.pp)
        if self.is_moe:
            mlp = c.num_hidden_layers * c.num_experts * self.expert_params() * b / (layout.pp * (layout.ep if layout.ep > 1 else layout.tp))
        else:
            mlp = c.num_hidden_layers * self.expert_params() * b / (layout.tp * layout.pp)
        embed = self.embedding_params() * b / layout.tp
        kv_split = min(layout.tp, c.num_key_value_heads)
        kv = math.ceil(batch / layout.dp) * context * self.kv_bytes_per_token() / (kv_split * layout.pp)
        return attn + mlp + embed + kv

    # ------------------------------------------------------------------ ranking
    def predict(self, layout: Layout, batch: int = 32, context: int = 2048, prefill_tokens: int = 8192) -> Prediction:
        mem = self.memory_per_gpu(layout, batch, context)
        cap = self.hw.hbm_bytes * self.hw.memory_utilization
        feasible = mem <= cap
        reason = "" if feasible else f"needs {mem / 1e9:.1f} GB per GPU, {cap / 1e9:.1f} GB usable"
        dec_s, breakdown = self.step_time(layout, Workload("decode", batch, context))
        pre_s, _ = self.step_time(layout, Workload("prefill", max(1, prefill_tokens // max(context, 1)), context,
                                                   tokens=prefill_tokens))
        return Prediction(layout, feasible, reason, mem, dec_s, batch / dec_s, prefill_tokens / pre_s, breakdown)

    def rank(self, gpus: int, batch: int = 32, context: int = 2048, prefill_tokens: int = 8192,
             include_infeasible: bool = False) -> list[Prediction]:
        preds = [self.predict(layout, batch, context, prefill_tokens) for layout in self.layouts(gpus)]
        if not include_infeasible:
            preds = [p for p in preds if p.feasible]
        return sorted(preds, key=lambda p: (-p.decode_tokens_per_s, -p.prefill_tokens_per_s, str(p.layout)))

    # ------------------------------------------------------------------ calibration
    def calibrate(self, measurements: Iterable[Measurement], iterations: int = 60) -> Efficiency:
        """Fit the efficiency factors to measured steps; returns (and keeps) the fitted factors.

        Minimises the sum of squared relative errors of the full model (roofline max included).
        The two host terms (fixed step overhead, per-sequence time) enter a step time linearly,
        so for any rate factors their best non-negative values are solved exactly
        (`_fit_host_terms`); a pattern search over the logarithms of the three rate factors
        (bandwidth, FLOP/s and link efficiency, each at most 1) does the rest. Searching all
        five factors by one pattern search stalled: once an additive term shrinks to a few
        nanoseconds its log no longer moves the loss, and measured CPU steps were fitted with
        no overhead at all (errors near 20%). Factors that no measurement depends on do not
        move: the link factor without communication, the per-sequence time when every
        measurement has the same sequence count.
        """
        data = [(m.layout, m.workload, m.seconds) for m in measurements]
        if not data:
            raise ValueError("calibrate() needs at least one measurement")
        if any(s <= 0 for _, _, s in data):
            raise ValueError("calibrate() needs positive measured step times")
        names = ("bandwidth", "flops", "interconnect")
        x = np.log(np.array([max(getattr(self.eff, n), 1e-12) for n in names]))
        seconds = np.array([s for _, _, s in data])
        seqs = np.array([float(self.step_terms(layout, work)["seqs_per_replica"]) for layout, work, _ in data])
        fixed_per_sequence = None if len(set(seqs.tolist())) > 1 else self.eff.per_sequence_s

        def fitted(logs: np.ndarray) -> tuple[float, Efficiency]:
            rates = {n: float(np.exp(v)) for n, v in zip(names, logs)}
            self.eff = dataclasses.replace(self.eff, **rates, step_overhead_s=0.0, per_sequence_s=0.0)
            rest = np.array([self.step_time(layout, work)[0] for layout, work, _ in data])
            overhead, per_seq = _fit_host_terms(rest, seqs, seconds, fixed_per_sequence)
            eff = dataclasses.replace(self.eff, step_overhead_s=overhead, per_sequence_s=per_seq)
            pred = rest + overhead + per_seq * seqs
            return float(np.sum((pred / seconds - 1.0) ** 2)), eff

        best, best_eff = fitted(x)
        step = 2.0
        for _ in range(iterations):
            improved = False
            for i in range(len(x)):
                for direction in (1.0, -1.0):
                    trial = x.copy()
                    trial[i] = min(trial[i] + direction * step, 0.0)  # efficiencies cannot exceed 1
                    value, eff = fitted(trial)
                    if value < best - 1e-15:
                        x, best, best_eff, improved = trial, value, eff, True
            if not improved:
                step /= 2
                if step < 1e-3:
                    break
        self.eff = best_eff
        return self.eff


def _fit_host_terms(rest: np.ndarray, seqs: np.ndarray, seconds: np.ndarray,
                    fixed_per_sequence: float | None) -> tuple[float, float]:
    """Non-negative (step overhead, per-sequence time) minimising sum(((rest + o + p*seqs) / seconds - 1)^2).

    A least-squares problem in two bounded variables: its optimum lies on one of the four faces
    (both free, either at zero, both at zero), so each face is solved and the best feasible
    one kept. With `fixed_per_sequence` set, only the overhead is fitted.
    """
    w = 1.0 / seconds
    target = 1.0 - rest * w  # what the host terms must add, in units of each measured step

    def loss(o: float, p: float) -> float:
        return float(np.sum((o * w + p * seqs * w - target) ** 2))

    def overhead_only(p: float) -> float:
        return max(0.0, float(np.dot(w, target - p * seqs * w) / np.dot(w, w)))

    if fixed_per_sequence is not None:
        return overhead_only(fixed_per_sequence), fixed_per_sequence
    candidates = [(0.0, 0.0), (overhead_only(0.0), 0.0)]
    ws = seqs * w
    candidates.append((0.0, max(0.0, float(np.dot(ws, target) / np.dot(ws, ws)))))
    (o, p), *_ = np.linalg.lstsq(np.stack([w, ws], axis=1), target, rcond=None)
    if o >= 0 and p >= 0:
        candidates.append((float(o), float(p)))
    return min(candidates, key=lambda c: loss(*c))


def calibrate_from_forward(model_config: Any, hardware: HardwareSpec, dtype: str,
                           timed_steps: list[tuple[Workload, float]]) -> CostModel:
    """A cost model calibrated on measured forward passes of one GPU (layout tp1-ep1-dp1-pp1)."""
    model = CostModel(model_config, hardware, dtype)
    model.calibrate([Measurement(Layout(), w, s) for w, s in timed_steps])
    return model
