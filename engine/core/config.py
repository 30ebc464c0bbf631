"""Model and engine configuration.

Data flow: an HF ``config.json`` dict -> ``ModelConfig.from_hf`` (the architecture
facts the forward pass needs); user settings -> ``EngineConfig`` (batching, cache,
graphs). Both validate in ``__post_init__`` so "invalid" means one thing everywhere.
This module imports no torch: the operator and the server validate configs with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# HF model_type -> (family, attention_bias default, qk_norm)
_KNOWN_MODEL_TYPES: dict[str, tuple[str, bool, bool]] = {
    "llama": ("llama", False, False),
    "mistral": ("llama", False, False),
    "qwen2": ("llama", True, False),
    "qwen3": ("llama", False, True),
    "mixtral": ("moe", False, False),
    "qwen3_moe": ("moe", False, True),
}


@dataclass
class ModelConfig:
    """Architecture facts of one checkpoint (the subset the engine supports)."""

    family: str  # "llama" (dense) | "moe"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in ("llama", "moe"):
            raise ValueError(f"ModelConfig.family must be 'llama' or 'moe', got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.family == "moe":
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"MoE model needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                    f"num_experts ({self.num_experts})")
            if self.moe_intermediate_size <= 0:
                raise ValueError("MoE model needs moe_intermediate_size > 0")
        elif self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be > 0, got {self.intermediate_size}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", None):
                raise ValueError(
                    f"rope_scaling type {kind!r} is not supported (supported: llama3, default); "
                    "remove rope_scaling from config.json or use a supported model")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; raises on unsupported features."""
        model_type = hf.get("model_type")
        if model_type not in _KNOWN_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; supported: "
                f"{sorted(_KNOWN_MODEL_TYPES)}")
        family, bias_default, qk_norm = _KNOWN_MODEL_TYPES[model_type]
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")
        if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
            raise ValueError("sliding-window attention is not supported (config.json sliding_window)")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters")  # newer transformers nest rope settings here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        num_experts = 0
        topk = 0
        moe_inter = 0
        norm_topk = True
        if family == "moe":
            num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
            topk = hf.get("num_experts_per_tok", 0)
            if model_type == "mixtral":
                moe_inter = hf["intermediate_size"]
                norm_topk = True  # Mixtral: softmax over the chosen k
            else:
                moe_inter = hf["moe_intermediate_size"]
                norm_topk = bool(hf.get("norm_topk_prob", False))
                if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
                    raise ValueError(
                        "Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                        "is not supported")
        return cls(
            family=family,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0),
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", bias_default)),
            qk_norm=qk_norm,
            num_experts=num_experts,
            num_experts_per_tok=topk,
            moe_intermediate_size=moe_inter,
            norm_topk_prob=norm_topk,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
        )

    def with_num_layers(self, num_layers: int) -> ModelConfig:
        """A copy that keeps only the first ``num_layers`` layers (tiered measurement)."""
        if not 0 < num_layers <= self.num_hidden_layers:
            raise ValueError(
                f"num_layers_override must be in 1..{self.num_hidden_layers}, got {num_layers}")
        return dataclasses.replace(self, num_hidden_layers=num_layers)


# decode_steps where a config leaves it unset and runs on CUDA (see EngineConfig.decode_steps).
CUDA_DECODE_STEPS = 8
# max_num_batched_tokens where a config leaves it unset (see EngineConfig.max_num_batched_tokens).
CPU_MAX_NUM_BATCHED_TOKENS = 2048
CUDA_MAX_NUM_BATCHED_TOKENS = 4096


def default_max_num_batched_tokens(cuda: bool) -> int:
    return CUDA_MAX_NUM_BATCHED_TOKENS if cuda else CPU_MAX_NUM_BATCHED_TOKENS


@dataclass
class EngineConfig:
    """What to serve and how: batching, KV cache, CUDA graphs."""

    model: str = "tiny-llama"  # preset name or path to an HF-style folder
    dtype: str | None = None  # None -> float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None -> "cuda" when available, else "cpu"
    max_num_seqs: int = 64
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None -> sized from free memory
    # Token budget of one scheduler step (chunked prefill). None: 4096 on CUDA, 2048 on the CPU.
    # On an H200 (llama-3.2-1b-shape, the SLO goodput of the regime matrix against 2048, 5 pairs,
    # 95% bounds) 4096 gave chat 1.011x [1.005, 1.017], agentic-long-context 1.040x [1.022, 1.058],
    # burst 1.002x [1.000, 1.004]; through the HTTP server 1.004x and 1.036x the output tokens/s
    # and a lower p90 TTFT on both (docs/serving-performance.md, run K). Smaller budgets lost on
    # every regime (1024: 0.81x to 0.84x on the fast tier). On the CPU nothing measured beat 2048.
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    cuda_graph_batch_sizes: list[int] | None = None  # None -> defaults clipped to max_num_seqs
    # Decode graphs read a fixed number of KV blocks per sequence; one graph set per
    # width keeps short contexts from paying for max_model_len. Token counts; None ->
    # [512, 2048, max_model_len] clipped to max_model_len.
    cuda_graph_context_lens: list[int] | None = None
    enforce_eager: bool = False
    # Greedy decode steps run back to back on the device before the host reads the tokens
    # (decode-only batches that replay a CUDA graph, all greedy without logprobs, nothing
    # waiting for admission). 1: every step returns to the host. k > 1 hides the host's
    # per-step work behind the GPU; tokens then stream k at a time, and a request that
    # stops early (EOS, stop string) discards the extra steps it computed.
    # None: CUDA_DECODE_STEPS on CUDA, 1 on the CPU (no graphs there). Eight overlapped steps were
    # the fastest serving configuration measured on every replayed profile on an H200, so they are
    # the shipped serving default (`shapeshift serve` and the compile loop's baseline): through the
    # HTTP server 1.50x (chat), 1.33x (agentic), 1.35x (burst) the output tokens/s of the previous
    # default, single steps (docs/serving-performance.md, run D).
    decode_steps: int | None = None
    # With decode_steps > 1: launch the next chunk of decode steps before the host reads and
    # post-processes the one in flight, so detokenising and stop checks (~5-10 us per sequence
    # and token) overlap the GPU instead of following it. Costs: a request that stops inside a
    # chunk also computed the chunk after it (discarded), and a new request waits up to two
    # chunks for admission. None: on wherever decode_steps > 1 on CUDA (the measured default).
    overlap_decode: bool | None = None
    # With decode_steps > 1: a row near its max_tokens (or max_model_len) stops writing KV (the
    # null slot) past its last token instead of shortening the chunk for every row, and with
    # overlap_decode a chain of overlapped chunks runs on across finishes: a row that ends
    # (max_tokens, max_model_len, a stop token or string, an abort) leaves the next chunk's
    # batch, whose step 0 gathers the others' tokens from where the chunk in flight leaves them
    # on the device. Tokens a row computed after its finish are dropped on the host, never
    # streamed. False: chunks stop at the first row's max_tokens and every finish ends the chain
    # (the host reads the chunk in flight, then schedules anew), as before this option.
    chain_across_finishes: bool = True
    # With chain_across_finishes: a request that arrives while a chain runs joins it instead of
    # ending it when it is greedy without logprobs and its whole prompt (past a prefix-cache hit)
    # fits one step: its prompt runs between two chunks (a mixed-step graph where a bucket holds
    # it), its first token is the argmax on the device, which the next chunk's step 0 reads, and
    # the host reads that token with the chunk in flight. Other arrivals end the chain, as before.
    # Measured on an H200 through the server, both options against neither (docs/serving-
    # performance.md, run G): chat at 32 in flight 1.18x output tok/s, 1.38x per-user p90;
    # agentic 1.05x, burst 1.04x.
    chain_across_admissions: bool = True
    # With decode_steps > 1: decode batches of up to this many sequences also get one CUDA graph
    # for a whole chunk (decode_steps steps captured back to back; step j reads its positions,
    # slots and context lengths from staging the host fills once a chunk, and its token ids from
    # step j-1's argmax), so a chunk is one graph launch with no copies between its steps (the
    # per-step copies and graph launches idled the GPU ~12 us a token at batch 1 on an H200).
    # Costs decode_steps times the capture time and graph memory of those buckets. Chunks of
    # another length (a request's last) replay the one-step graph; changing decode_steps at run
    # time captures them again. 0: none. Measured on an H200 at 8 overlapped steps: +1.2% at
    # batch 1, +0.7-1.0% at batches 2-16 (docs/decode-performance.md, tenth and eleventh sets).
    chunk_graph_max_batch: int = 16
    # Mixed steps (a prefill chunk beside decodes, or prompts alone) replay CUDA graphs too,
    # one per (tokens, sequences) bucket of mixed_graph_buckets: static inputs padded to the
    # bucket, attention through the varlen path whose launch shape depends only on the bucket
    # (engine/core/mixed_graphs.py, docs/serving-performance.md). Dense models only (the MoE
    # prefill path sorts tokens by expert on the host); steps no bucket holds run eagerly.
    # Measured on an H200 through the server (docs/serving-performance.md): chat replay 3.1x the
    # output tokens/s at 32 in flight (0.98x at 24 requests), agentic 5.9x, burst 1.09x.
    mixed_cuda_graphs: bool = True
    # [[tokens, seqs], ...]; None -> mixed_graphs.default_buckets (the token ladder up to
    # max_num_batched_tokens x sequence buckets up to max_num_seqs).
    mixed_graph_buckets: list[list[int]] | None = None
    # With decode_steps > 1: unseeded sampled requests (no logprobs) decode k steps at a time
    # too; their tokens are drawn on the device (engine/core/device_sampling.py: the host
    # sampler's math, noise hashed from seeds the runner draws per row and step) instead of by
    # the host sampler, so the GPU does not wait for the host between steps. Seeded requests
    # keep the host sampler (their draws follow their own generator) and single steps.
    multi_step_sampling: bool = True
    num_layers_override: int | None = None
    seed: int = 0
    gpu_memory_utilization: float = 0.90
    forward_pass: str | None = None  # bundle folder; None -> the stock forward pass
    forward_pass_recipe: dict[str, Any] | None = None  # knob values overriding the bundle's recipe.yaml

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device == "neuron":  # what the operator passes on Trainium pools
            raise ValueError("EngineConfig.device 'neuron' (AWS Trainium): this engine has no Neuron backend; "
                             "serve on a GPU or CPU pool (spec.hardware.accelerator)")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.decode_steps is None or self.overlap_decode is None or self.max_num_batched_tokens is None:
            cuda = (self.device or self.resolved_device()).startswith("cuda")
            if self.max_num_batched_tokens is None:
                self.max_num_batched_tokens = default_max_num_batched_tokens(cuda)
            if self.decode_steps is None:
                self.decode_steps = CUDA_DECODE_STEPS if cuda else 1
            if self.overlap_decode is None:
                self.overlap_decode = cuda and self.decode_steps > 1
        for name in ("max_num_seqs", "max_model_len", "block_size", "max_num_batched_tokens", "decode_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.chunk_graph_max_batch < 0:
            raise ValueError(f"EngineConfig.chunk_graph_max_batch must be >= 0, got {self.chunk_graph_max_batch}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"EngineConfig.num_kv_blocks={self.num_kv_blocks} holds "
                f"{self.num_kv_blocks * self.block_size} tokens, less than max_model_len="
                f"{self.max_model_len}; raise num_kv_blocks or lower max_model_len")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")
        if self.cuda_graph_batch_sizes is None:
            sizes = [s for s in DEFAULT_CUDA_GRAPH_BATCH_SIZES if s <= self.max_num_seqs]
            if self.max_num_seqs not in sizes and self.max_num_seqs < DEFAULT_CUDA_GRAPH_BATCH_SIZES[-1]:
                sizes.append(self.max_num_seqs)
            self.cuda_graph_batch_sizes = sizes
        else:
            if any(s <= 0 for s in self.cuda_graph_batch_sizes):
                raise ValueError(f"cuda_graph_batch_sizes must be positive, got {self.cuda_graph_batch_sizes}")
            self.cuda_graph_batch_sizes = sorted(set(self.cuda_graph_batch_sizes))
        if self.cuda_graph_context_lens is None:
            lens = [n for n in (512, 2048) if n < self.max_model_len] + [self.max_model_len]
            self.cuda_graph_context_lens = lens
        else:
            if any(n <= 0 for n in self.cuda_graph_context_lens):
                raise ValueError(f"cuda_graph_context_lens must be positive, got {self.cuda_graph_context_lens}")
            lens = sorted({min(n, self.max_model_len) for n in self.cuda_graph_context_lens})
            if lens[-1] != self.max_model_len:
                lens.append(self.max_model_len)
            self.cuda_graph_context_lens = lens
        if self.mixed_graph_buckets is not None:
            pairs = []
            for pair in self.mixed_graph_buckets:
                if len(pair) != 2 or not all(isinstance(x, int) and x > 0 for x in pair) or pair[1] > pair[0]:
                    raise ValueError(f"EngineConfig.mixed_graph_buckets entries are [tokens, seqs] with "
                                     f"0 < seqs <= tokens, got {pair!r}")
                pairs.append([int(pair[0]), int(pair[1])])
            self.mixed_graph_buckets = sorted(map(list, {tuple(p) for p in pairs}))
        if self.num_layers_override is not None and self.num_layers_override <= 0:
            raise ValueError(f"num_layers_override must be > 0, got {self.num_layers_override}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @staticmethod
    def fit_token_budget(settings: dict[str, Any]) -> dict[str, Any]:
        """``settings`` (EngineConfig field values) with max_num_batched_tokens raised to
        max_num_seqs where it is below (every running sequence must decode each step), missing
        ones read as the defaults (the token budget as the smaller of its device defaults): a
        batch width chosen on its own brings its token budget."""
        seqs = settings.get("max_num_seqs", EngineConfig.max_num_seqs)
        tokens = settings.get("max_num_batched_tokens")
        tokens = CPU_MAX_NUM_BATCHED_TOKENS if tokens is None else tokens
        return {**settings, "max_num_batched_tokens": seqs} if tokens < seqs else settings

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch  # local: keeps this module importable without torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"
