"""The search space: every knob a candidate may turn, with its values and validity rules.

Data flow:
    the stock pass's knob table (engine/forward_pass/knobs.py: backend --+
      per op, fused projections and GEMV fusions, MoE gather threshold)   |
    EngineConfig knobs (batch size, chunked-prefill budget, prefix     --+--> SearchSpace
      caching, CUDA-graph buckets)                                      |     .default()
    kernels/registry.py (tile config per op, CUDA only)                --+     .sample(rng)
    source edits (engine/compile/source_edits.py: batched decode rows  --+     .enumerate()
      in mixed batches, index_select gather)                                  .validate(recipe)
                                                                              .neighbors(recipe, knob)

    candidate recipe --split_recipe--> (recipe.yaml knobs, EngineConfig overrides, edits)

Knob names carry their target: ``engine.<field>`` becomes an EngineConfig field,
``edit.<name>`` switches a source edit of forward.py on or off, ``kernel.<op>`` picks a
tile configuration for one Triton op, and any other name is a recipe knob written to the
bundle's recipe.yaml. ``split_recipe`` folds the ``kernel.<op>`` knobs that differ from
"default" into the forward pass's one ``kernel_configs: {op: config}`` recipe knob, so the
recipe the forward pass sees holds only knobs of its table (the all-default point, the
baseline, carries no kernel_configs at all). A recipe (a candidate's knob -> value mapping)
is always complete: `complete(recipe)` fills missing knobs with their defaults.

The space depends on the device: Triton kernels run on the CPU only through the
interpreter, far too slowly to measure, so kernel knobs and the triton attention backend
exist only on CUDA, and CUDA-graph buckets only where graphs are captured.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from shapeshift.engine.compile.candidate import canonical_json
from shapeshift.engine.core.config import default_max_num_batched_tokens
from shapeshift.engine.forward_pass.knobs import STOCK_KNOBS, stock_knob

log = logging.getLogger(__name__)

Recipe = dict[str, Any]
# constraint(recipe) -> None when valid, else a message naming the conflict
Constraint = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class Knob:
    """One dimension: its values (ordered, JSON-able), the default, and what it changes."""

    name: str
    values: tuple[Any, ...]
    default: Any
    doc: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"knob {self.name!r} has no values")
        if not any(_same(self.default, v) for v in self.values):
            raise ValueError(f"knob {self.name!r}: default {self.default!r} is not among its values {self.values}")

    @property
    def target(self) -> str:
        prefix = self.name.split(".", 1)[0]
        return prefix if prefix in ("engine", "edit", "kernel") else "recipe"

    def index(self, value: Any) -> int:
        for i, v in enumerate(self.values):
            if _same(v, value):
                return i
        raise ValueError(f"knob {self.name!r}: value {value!r} is not one of {self.values}")


def _same(a: Any, b: Any) -> bool:
    return canonical_json(a) == canonical_json(b)


@dataclass
class SearchSpace:
    knobs: list[Knob]
    constraints: list[tuple[str, Constraint]] = field(default_factory=list)
    device: str = "cpu"
    # the traffic the space was built for (None: not known): its requests in flight and its p90
    # prompt length (within the context); the sweep reads them against a recipe's batch width and
    # token budget (agents/sweep.py traffic_guidance)
    concurrency: int | None = None
    prompt_tokens_p90: int | None = None

    def __post_init__(self) -> None:
        names = [k.name for k in self.knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate knob names in search space: {names}")
        self._by_name = {k.name: k for k in self.knobs}
        self._uniform_misses = False  # rejection sampling found no valid point once: walk from then on

    # ------------------------------------------------------------------ basics
    def knob(self, name: str) -> Knob:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown knob {name!r}; knobs: {sorted(self._by_name)}") from None

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def default(self) -> Recipe:
        return {k.name: k.default for k in self.knobs}

    def complete(self, recipe: Mapping[str, Any]) -> Recipe:
        """`recipe` with every missing knob set to its default (unknown keys kept, validate() flags them)."""
        return {**self.default(), **dict(recipe)}

    def size(self) -> int:
        """Points before constraints (product of value counts)."""
        n = 1
        for k in self.knobs:
            n *= len(k.values)
        return n

    # ------------------------------------------------------------------ validity
    def validate(self, recipe: Mapping[str, Any]) -> list[str]:
        """Problems with `recipe` (empty = valid): unknown knobs, values off the grid, constraints."""
        problems = []
        for name, value in recipe.items():
            if name not in self._by_name:
                problems.append(f"unknown knob {name!r}")
                continue
            try:
                self._by_name[name].index(value)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            return problems
        full = self.complete(recipe)
        for label, check in self.constraints:
            message = check(full)
            if message:
                problems.append(f"{label}: {message}")
        return problems

    def is_valid(self, recipe: Mapping[str, Any]) -> bool:
        return not self.validate(recipe)

    # ------------------------------------------------------------------ walking
    def walk(self, rng: random.Random, sweeps: int = 2) -> Recipe | None:
        """A valid point reached from the default by setting each knob, in random order, to a value
        drawn among those that keep the point valid (`sweeps` passes); None when the default
        itself is invalid. Not uniform over the valid points, but every knob moves and no draw is
        wasted on a point the rules refuse."""
        recipe = self.default()
        if not self.is_valid(recipe):
            return None
        for _ in range(sweeps):
            for knob in rng.sample(self.knobs, len(self.knobs)):
                values = list(knob.values)
                rng.shuffle(values)
                for value in values:
                    if _same(value, recipe[knob.name]):
                        break
                    trial = {**recipe, knob.name: value}
                    if self.is_valid(trial):
                        recipe = trial
                        break
        return recipe

    def enumerate(self, limit: int | None = None) -> Iterator[Recipe]:
        """Valid points in lexicographic knob order (lazy; the default first)."""
        yielded = 0
        default = self.default()
        if self.is_valid(default):
            yield default
            yielded += 1
        for values in itertools.product(*(k.values for k in self.knobs)):
            if limit is not None and yielded >= limit:
                return
            recipe = dict(zip(self.names, values))
            if _same(recipe, default) or not self.is_valid(recipe):
                continue
            yield recipe
            yielded += 1

    def sample(self, rng: random.Random, max_tries: int = 200) -> Recipe:
        """A random valid point: uniformly drawn (rejection sampling) where `max_tries` draws hit
        one; else a random walk that stays valid (`walk`). On CUDA, with the kernel, fusion, row-limit
        and graph-bucket rules, 7 of 5,000 uniform draws were valid: rejection alone left the agents
        proposing the default. Once rejection misses, later draws walk at once (each validation
        costs ~2 ms on that space: 200 misses were 0.4 s a draw)."""
        if not self._uniform_misses:
            for _ in range(max_tries):
                recipe = {k.name: k.values[rng.randrange(len(k.values))] for k in self.knobs}
                if self.is_valid(recipe):
                    return recipe
            self._uniform_misses = True
        walked = self.walk(rng)
        if walked is not None:
            return walked
        log.warning("search space: no valid random point in %d tries, using the default", max_tries)
        return self.default()

    def neighbors(self, recipe: Mapping[str, Any], knob: str) -> list[Recipe]:
        """Valid recipes differing from `recipe` only in `knob` (every other value of it)."""
        base = self.complete(recipe)
        out = []
        for value in self.knob(knob).values:
            if _same(value, base[knob]):
                continue
            changed = {**base, knob: value}
            if self.is_valid(changed):
                out.append(changed)
        return out

    def mutate(self, recipe: Mapping[str, Any], rng: random.Random, num_changes: int = 1) -> Recipe:
        """Change `num_changes` random knobs to other values, keeping the result valid."""
        base = self.complete(recipe)
        for _ in range(50):
            changed = dict(base)
            for knob in rng.sample(self.knobs, min(num_changes, len(self.knobs))):
                if len(knob.values) > 1:
                    choices = [v for v in knob.values if not _same(v, changed[knob.name])]
                    changed[knob.name] = rng.choice(choices)
            if self.is_valid(changed) and not _same(changed, base):
                return changed
        return base

    def crossover(self, a: Mapping[str, Any], b: Mapping[str, Any], rng: random.Random) -> Recipe:
        """Each knob from one parent at random (uniform crossover), repaired to validity."""
        a, b = self.complete(a), self.complete(b)
        for _ in range(50):
            child = {k.name: (a if rng.random() < 0.5 else b)[k.name] for k in self.knobs}
            if self.is_valid(child):
                return child
        return a

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": k.name, "values": list(k.values), "default": k.default, "doc": k.doc} for k in self.knobs]


# ---------------------------------------------------------------------- building


def _constraint_batch_budget(recipe: Mapping[str, Any]) -> str | None:
    seqs = recipe.get("engine.max_num_seqs")
    tokens = recipe.get("engine.max_num_batched_tokens")
    if seqs is not None and tokens is not None and tokens < seqs:
        return f"engine.max_num_batched_tokens={tokens} < engine.max_num_seqs={seqs} (every sequence must decode each step)"
    return None


def _constraint_graph_buckets(recipe: Mapping[str, Any]) -> str | None:
    buckets = recipe.get("engine.cuda_graph_max_batch")
    seqs = recipe.get("engine.max_num_seqs")
    if buckets is not None and seqs is not None and buckets > seqs:
        return f"engine.cuda_graph_max_batch={buckets} > engine.max_num_seqs={seqs} (graphs above the batch limit never run)"
    return None


# kernel.<op> knob -> the stock recipe knob that switches that op to its Triton kernel
KERNEL_BACKEND_KNOB = {"kernel.rmsnorm": "norm_backend", "kernel.decode_attention": "attention_backend",
                       "kernel.rotary_kv_write": "rotary_backend", "kernel.silu_and_mul": "activation_backend",
                       "kernel.moe_grouped_gemm": "moe_backend"}
# the forward pass's recipe knob that carries the kernel.<op> tile configs: {op: KernelConfig dict}
KERNEL_CONFIGS_KNOB = "kernel_configs"
# row-limit knob -> (the recipe knob whose path it limits, the value that turns that path on)
ROW_LIMIT_NEEDS = {"gemv_max_rows": ("linear_backend", "triton"),
                   "fuse_norm_max_rows": ("fuse_norm_into_linear", True)}


def _constraint_kernels_need_backend(recipe: Mapping[str, Any]) -> str | None:
    tuned = sorted(k for k, v in recipe.items() if k.startswith("kernel.") and v != "default")
    off = [k for k in tuned if recipe.get(KERNEL_BACKEND_KNOB.get(k, ""), "torch") != "triton"]
    if off:
        return f"{', '.join(off)} tuned while its backend knob is not triton (the config would never run)"
    return None


# recipe knob -> what the stock forward pass requires for it (its build() refuses otherwise)
GEMV_FUSION_NEEDS = {"fuse_gate_up_activation": ("fuse_gate_up",),
                     "fuse_norm_into_linear": ("fuse_qkv", "fuse_gate_up"),
                     "fuse_layer_tail": ("fuse_norm_into_linear", "fuse_qkv", "fuse_gate_up"),
                     "fuse_attention_into_layer": ("fuse_layer_tail", "fuse_rotary_into_attention"),
                     "fuse_attention_into_tail": ("fuse_layer_tail", "fuse_rotary_into_attention")}


def _constraint_gemv_fusion(recipe: Mapping[str, Any]) -> str | None:
    for knob, fused in GEMV_FUSION_NEEDS.items():
        if not recipe.get(knob):
            continue
        missing = [f"{name}=true" for name in fused if not recipe.get(name)]
        if recipe.get("linear_backend") != "triton":
            missing.insert(0, "linear_backend=triton")
        if missing:
            return f"{knob}=true needs {', '.join(missing)} (the fusion lives in the Triton GEMV)"
    if recipe.get("fuse_attention_into_layer") and recipe.get("fuse_attention_into_tail"):
        return ("fuse_attention_into_layer and fuse_attention_into_tail both put the attention into the layer "
                "kernel: at most one of them")
    return None


def _constraint_row_limits(recipe: Mapping[str, Any]) -> str | None:
    for knob, (path, on) in ROW_LIMIT_NEEDS.items():
        unlimited = stock_knob(knob).grid[0]  # kernels.gemv.MAX_M: the value that changes nothing
        rows = recipe.get(knob, unlimited)
        if rows != unlimited and recipe.get(path) != on:
            return f"{knob}={rows} needs {path}={str(on).lower()} (it limits the rows of that path only)"
    return None


def _constraint_rotary_fusion(recipe: Mapping[str, Any]) -> str | None:
    if recipe.get("fuse_rotary_into_attention") and not (recipe.get("attention_backend") == "triton"
                                                         and recipe.get("rotary_backend") == "triton"):
        return ("fuse_rotary_into_attention=true needs attention_backend=triton and rotary_backend=triton "
                "(the fusion lives in the Triton decode-attention kernel)")
    if recipe.get("attention_l2_prefetch_mb") and recipe.get("attention_backend") != "triton":
        return "attention_l2_prefetch_mb > 0 needs attention_backend=triton (the prefetch runs in that kernel)"
    return None


def _constraint_activation_needs_fused(recipe: Mapping[str, Any]) -> str | None:
    if recipe.get("activation_backend") == "triton" and not recipe.get("fuse_gate_up"):
        return "activation_backend=triton needs fuse_gate_up=true (the kernel reads the fused [gate | up] rows)"
    return None


def _whole_layer_takes(head_dim: int | None) -> bool:
    """Whether kernels.decode_layer_tail.decode_layer takes this head_dim (unknown: assume so)."""
    if head_dim is None:
        return True
    try:
        from shapeshift.kernels.decode_layer_tail import head_dim_problem
    except ImportError:  # no Triton: the kernel cannot run here at all
        return False
    return head_dim_problem(head_dim) is None


def kernel_knobs(ops: Sequence[str] = tuple(op.split(".", 1)[1] for op in KERNEL_BACKEND_KNOB), max_configs: int = 12,
                 problem: Mapping[str, Any] | None = None) -> list[Knob]:
    """One ``kernel.<op>`` knob per registered op: "default" or a config dict from its space.

    Kernel modules that are missing or fail to import are skipped with a log line, so the
    space shrinks instead of breaking when a kernel is absent on this machine.
    """
    try:
        registry = importlib.import_module("shapeshift.kernels.registry")
    except Exception as exc:  # noqa: BLE001 - no Triton / no torch: no kernel knobs
        log.info("search space: kernels registry unavailable (%s); no kernel knobs", exc)
        return []
    knobs = []
    for op in ops:
        try:
            spec = registry.get_spec(op)
        except Exception:  # noqa: BLE001 - get_spec imports every kernel module; try its own module
            spec = None
            for mod in getattr(registry, "KERNEL_MODULES", ()):
                try:
                    importlib.import_module(f"shapeshift.kernels.{mod}")
                except Exception:  # noqa: BLE001
                    continue
            spec = getattr(registry, "_REGISTRY", {}).get(op)
        if spec is None:
            log.info("search space: kernel op %s is not registered; skipped", op)
            continue
        configs = [c.to_dict() for c in spec.config_space.configs(problem)]
        if len(configs) > max_configs:  # keep the space small: an even stride over the grid
            step = len(configs) / max_configs
            configs = [configs[int(i * step)] for i in range(max_configs)]
        knobs.append(Knob(f"kernel.{op}", ("default", *configs), "default",
                          f"{op}: the registry's per-GPU default or one tile config of {spec.config_space.variant_names()}"))
    return knobs


def build_search_space(
    *,
    device: str = "cpu",
    model_family: str = "llama",
    stock_recipe: Mapping[str, Any] | None = None,
    concurrency: int = 32,
    prompt_tokens_p90: int | None = None,
    max_model_len: int = 2048,
    include_kernels: bool | None = None,
    include_source_edits: bool = True,
    engine_defaults: Mapping[str, Any] | None = None,
    qk_norm: bool = False,
    head_dim: int | None = None,
) -> SearchSpace:
    """The space for one model family on one device.

    ``concurrency`` (the traffic's requests in flight) bounds the batch sizes worth trying;
    ``prompt_tokens_p90`` (the traffic's, None: unknown) is kept, within ``max_model_len``, for
    the sweep to read against the token budget;
    ``stock_recipe`` gives the defaults of the recipe knobs (the stock bundle's recipe.yaml; a knob
    it leaves out starts at the first of its values, for integers the first of its grid);
    ``engine_defaults`` (EngineConfig field -> value, e.g. the deployment's engine.yaml) become
    the defaults of the ``engine.*`` knobs, so the stock candidate runs as the deployment does.
    ``qk_norm``: the model normalises q and k per head (Qwen3), which the rotary fusion cannot take.
    ``head_dim``: the model's; the whole-layer kernel (fuse_attention_into_layer) takes only powers
    of two >= 16.
    """
    stock_recipe = dict(stock_recipe or {})
    cuda = device.startswith("cuda")
    knobs: list[Knob] = []

    # The stock pass's recipe knobs (its knob table), with device limits: Triton backends only
    # on CUDA, MoE knobs only for MoE models; tables of configs (gemv_configs, kernel_configs)
    # have no grid of their own (kernel_configs is searched through the kernel.<op> knobs).
    for recipe_knob in STOCK_KNOBS:
        if recipe_knob.name.startswith("moe_") and model_family != "moe":
            continue
        choices: tuple[Any, ...] = {"choice": tuple(c for c in recipe_knob.choices if cuda or c != "triton"),
                                    "bool": (False, True), "int": recipe_knob.grid, "table": ()}[recipe_knob.kind]
        if not choices:
            continue
        default = stock_recipe.get(recipe_knob.name, choices[0])
        if not any(_same(default, c) for c in choices):
            default = choices[0]
        knobs.append(Knob(recipe_knob.name, choices, default, recipe_knob.meaning))

    # Engine knobs: batch size and chunk size (chunked-prefill token budget), prefix caching.
    # Defaults: the deployment's settings where given (added to the grid when off it).
    given = dict(engine_defaults or {})
    seq_choices = sorted({s for s in (4, 8, 16, 32, 64, 128, 256) if s <= max(64, 2 * concurrency)})
    default_seqs = min(64, seq_choices[-1]) if 64 not in seq_choices else 64
    if given.get("max_num_seqs") is not None:
        default_seqs = int(given["max_num_seqs"])
        seq_choices = sorted(set(seq_choices) | {default_seqs})
    knobs.append(Knob("engine.max_num_seqs", tuple(seq_choices), default_seqs,
                      "max sequences per batch (continuous batching width)"))
    token_choices = tuple(t for t in (256, 512, 1024, 2048, 4096, 8192) if t <= max(2048, max_model_len * 4))
    # the deployment's token budget, else what serve runs on this device; on the grid either way
    default_tokens = int(given["max_num_batched_tokens"]) if given.get("max_num_batched_tokens") is not None \
        else default_max_num_batched_tokens(cuda)
    token_choices = tuple(sorted(set(token_choices) | {default_tokens}))
    knobs.append(Knob("engine.max_num_batched_tokens", token_choices, default_tokens,
                      "chunked-prefill token budget per scheduler step"))
    default_prefix = bool(given.get("enable_prefix_caching", True))
    knobs.append(Knob("engine.enable_prefix_caching", (default_prefix, not default_prefix), default_prefix,
                      "reuse KV blocks of shared prefixes"))
    if cuda:
        graph_default = 256 if 256 <= default_seqs else default_seqs
        knobs.append(Knob("engine.cuda_graph_max_batch", tuple(sorted({0, 8, 16, 32, 64, 128, 256, graph_default})),
                          graph_default,
                          "largest decode batch captured as a CUDA graph (0 = eager); buckets are powers of two up to it"))
        from shapeshift.engine.core.config import CUDA_DECODE_STEPS  # torch-free

        default_steps = int(given.get("decode_steps") or CUDA_DECODE_STEPS)
        knobs.append(Knob("engine.decode_steps", tuple(sorted({1, 2, 4, 8, default_steps})), default_steps,
                          "greedy decode steps per host round trip (multi-step decode on graph replays)"))
        overlap_given = given.get("overlap_decode")
        default_overlap = default_steps > 1 if overlap_given is None else bool(overlap_given)
        knobs.append(Knob("engine.overlap_decode", (default_overlap, not default_overlap), default_overlap,
                          "launch the next chunk of decode steps before the host reads the current one "
                          "(with decode_steps > 1)"))

    # Source edits of forward.py (engine/compile/source_edits.py): placed right after the recipe
    # knobs, so a coordinate sweep tries code changes before batch-size tuning.
    engine_knobs = [k for k in knobs if k.target == "engine"]
    knobs = [k for k in knobs if k.target != "engine"]
    if include_source_edits:
        from shapeshift.engine.compile.source_edits import EDITS

        for edit in EDITS.values():
            if edit.cuda_only and not cuda:
                continue
            if edit.families and model_family not in edit.families:
                continue
            knobs.append(Knob(f"edit.{edit.name}", (False, True), False, edit.doc))
    knobs.extend(engine_knobs)

    # Recipe knobs that need the Triton GEMV (linear_backend: triton) and fused projections,
    # on a dense model: dropped where they can never build (CPU, MoE), constrained elsewhere,
    # so no trial is spent on a recipe the forward pass refuses at build time.
    gemv = any(k.name == "linear_backend" and "triton" in k.values for k in knobs)
    needs_gemv = [name for name in GEMV_FUSION_NEEDS if name in {k.name for k in knobs}]
    if not gemv or model_family == "moe":
        knobs = [k for k in knobs if k.name not in needs_gemv]
        needs_gemv = []
    # A row limit is searched only where the space can turn on the path it limits (the GEMV on
    # CUDA, MoE models too; the norm fusion where that knob survived the rule above).
    row_limits = [knob for knob, (path, on) in ROW_LIMIT_NEEDS.items()
                  if any(k.name == path and any(_same(v, on) for v in k.values) for k in knobs)]
    knobs = [k for k in knobs if k.name not in ROW_LIMIT_NEEDS or k.name in row_limits]

    # The rotary fusion needs both Triton backends and a model without q/k norm (its build refuses).
    triton_attention = any(k.name == "attention_backend" and "triton" in k.values for k in knobs)
    if not triton_attention or qk_norm:
        knobs = [k for k in knobs if k.name != "fuse_rotary_into_attention"]
    # The whole-layer kernel runs the rotary-fused attention, on the head sizes it takes.
    if not any(k.name == "fuse_rotary_into_attention" for k in knobs) or not _whole_layer_takes(head_dim):
        knobs = [k for k in knobs if k.name not in ("fuse_attention_into_layer", "fuse_attention_into_tail")]
    if not triton_attention or not cuda:  # PTX prefetches: CUDA only
        knobs = [k for k in knobs if k.name != "attention_l2_prefetch_mb"]

    constraints: list[tuple[str, Constraint]] = [("batch budget", _constraint_batch_budget)]
    if any(k.name in ("fuse_rotary_into_attention", "attention_l2_prefetch_mb") for k in knobs):
        constraints.append(("rotary fusion", _constraint_rotary_fusion))
    if any(k.name == "activation_backend" and "triton" in k.values for k in knobs):
        constraints.append(("activation", _constraint_activation_needs_fused))
    if needs_gemv:
        constraints.append(("gemv fusion", _constraint_gemv_fusion))
    if any(k.name in ROW_LIMIT_NEEDS for k in knobs):
        constraints.append(("row limits", _constraint_row_limits))
    if cuda:
        constraints.append(("graph buckets", _constraint_graph_buckets))
    if include_kernels is None:
        include_kernels = cuda
    if include_kernels:
        switched = [knob.split(".", 1)[1] for knob, backend in KERNEL_BACKEND_KNOB.items()
                    if any(k.name == backend and "triton" in k.values for k in knobs)]
        if model_family == "moe":  # the experts never call the recipe's silu_and_mul launcher: no tile of it to tune
            switched = [op for op in switched if op != "silu_and_mul"]
        kknobs = kernel_knobs(tuple(op for op in switched if op != "moe_grouped_gemm"))
        if "moe_grouped_gemm" in switched:  # its tiles that fit an SM's shared memory at 2-byte elements
            kknobs += kernel_knobs(("moe_grouped_gemm",), problem={"dtype": "bfloat16"})
        if kknobs:
            knobs.extend(kknobs)
            constraints.append(("kernels", _constraint_kernels_need_backend))
    prompts = min(int(prompt_tokens_p90), max_model_len) if prompt_tokens_p90 else None
    return SearchSpace(knobs=knobs, constraints=constraints, device=device, concurrency=concurrency,
                       prompt_tokens_p90=prompts)


def split_recipe(recipe: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(recipe.yaml knobs, EngineConfig overrides, enabled source edits).

    ``kernel.<op>`` knobs other than "default" become entries of the recipe.yaml knob
    ``kernel_configs: {op: config}``; with none set, kernel_configs is left out entirely.
    """
    bundle_recipe: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    edits: list[str] = []
    kernel_configs: dict[str, Any] = {}
    for name, value in recipe.items():
        prefix, _, rest = name.partition(".")
        if prefix == "engine" and rest:
            engine[rest] = value
        elif prefix == "edit" and rest:
            if value:
                edits.append(rest)
        elif prefix == "kernel" and rest:
            if value not in (None, "default"):
                kernel_configs[rest] = dict(value)
        else:
            bundle_recipe[name] = value
    if kernel_configs:
        bundle_recipe[KERNEL_CONFIGS_KNOB] = {**dict(bundle_recipe.get(KERNEL_CONFIGS_KNOB) or {}), **kernel_configs}
    return bundle_recipe, engine, sorted(edits)


def engine_overrides(engine_knobs: Mapping[str, Any]) -> dict[str, Any]:
    """EngineConfig keyword arguments for the ``engine.*`` knobs of a recipe."""
    out: dict[str, Any] = {}
    for name, value in engine_knobs.items():
        if name == "cuda_graph_max_batch":
            if value == 0:
                out["enforce_eager"] = True
            else:
                out["cuda_graph_batch_sizes"] = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= value]
        else:
            out[name] = value
    return out
