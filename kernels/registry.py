"""Declared search spaces and per-GPU default configurations of every Triton kernel.

Data flow: each kernel module builds one `KernelSpec` per op (its launcher, its plain-torch
reference, a `KernelConfigSpace` of variants x tile axes, and a function that picks the default
config for a problem on a device class) and calls `register()` at import time. The compile
loop calls `all_specs()` and enumerates `spec.config_space.configs(problem)`; a launcher
called without a config asks `spec.default_config(problem, device)`.

A *problem* is a small dict of the static facts that decide which configs fit and which is
fastest (e.g. {"rows": 7, "hidden": 2048, "dtype": "bfloat16"}); each spec names its keys in
`problem_keys`. A *device key* is a coarse device class: "interpreter" (CPU through
TRITON_INTERPRET=1), "sm90" (H100/H200), "sm80" (A100-class), "cuda" (anything else).
"""

from __future__ import annotations

import functools
import importlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

# Kernel modules that register specs; `all_specs()` imports them so the registry is complete.
KERNEL_MODULES = (
    "rmsnorm",
    "activation",
    "rotary",
    "decode_attention",
    "gemv",
    "sampling",
    "argmax",
    "prefill_attention",
    "moe",
)


@dataclass(frozen=True)
class KernelConfig:
    """One point of a search space: a variant name, its tile parameters, warps and stages.

    `params` is stored as sorted (name, value) pairs so configs are hashable and can key caches.
    """

    variant: str
    params: tuple[tuple[str, Any], ...] = ()
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def make(cls, variant: str, *, num_warps: int = 4, num_stages: int = 2, **params: Any) -> "KernelConfig":
        return cls(variant, tuple(sorted(params.items())), num_warps, num_stages)

    def __getitem__(self, name: str) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(f"config {self} has no parameter {name!r}")

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    def replace(self, **changes: Any) -> "KernelConfig":
        """A copy with some parameters (or num_warps / num_stages / variant) changed."""
        variant = changes.pop("variant", self.variant)
        num_warps = changes.pop("num_warps", self.num_warps)
        num_stages = changes.pop("num_stages", self.num_stages)
        params = dict(self.params)
        params.update(changes)
        return KernelConfig.make(variant, num_warps=num_warps, num_stages=num_stages, **params)

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.params)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KernelConfig":
        data = dict(data)
        variant = data.pop("variant")
        num_warps = int(data.pop("num_warps", 4))
        num_stages = int(data.pop("num_stages", 2))
        return cls.make(variant, num_warps=num_warps, num_stages=num_stages, **data)

    def __str__(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.variant}[{inner},w{self.num_warps},s{self.num_stages}]"


@dataclass(frozen=True)
class VariantSpace:
    """The tunable axes of one kernel variant: each axis maps a name to its candidate values.

    `num_warps` and `num_stages` are axes like any other (they default to (4,) and (2,)).
    """

    name: str
    axes: Mapping[str, tuple]
    doc: str = ""

    def configs(self) -> Iterator[KernelConfig]:
        axes = dict(self.axes)
        warps = tuple(axes.pop("num_warps", (4,)))
        stages = tuple(axes.pop("num_stages", (2,)))
        names = sorted(axes)
        for values in itertools.product(*(axes[n] for n in names)):
            for w in warps:
                for s in stages:
                    yield KernelConfig.make(self.name, num_warps=w, num_stages=s, **dict(zip(names, values)))

    def size(self) -> int:
        n = 1
        for values in self.axes.values():
            n *= len(values)
        return n


@dataclass(frozen=True)
class KernelConfigSpace:
    """Variants x axes, with an optional constraint rejecting configs that do not fit a problem."""

    variants: tuple[VariantSpace, ...]
    # constraint(config, problem) -> True when the config is valid for that problem.
    constraint: Callable[[KernelConfig, Mapping[str, Any]], bool] | None = None

    def configs(self, problem: Mapping[str, Any] | None = None) -> Iterator[KernelConfig]:
        for variant in self.variants:
            for config in variant.configs():
                if problem is None or self.constraint is None or self.constraint(config, problem):
                    yield config

    def size(self) -> int:
        return sum(v.size() for v in self.variants)

    def variant_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    def contains(self, config: KernelConfig) -> bool:
        """True when `config` is a point of this space (ignoring any problem constraint)."""
        for variant in self.variants:
            if variant.name != config.variant:
                continue
            axes = dict(variant.axes)
            if config.num_warps not in axes.pop("num_warps", (4,)):
                return False
            if config.num_stages not in axes.pop("num_stages", (2,)):
                return False
            params = dict(config.params)
            return set(params) == set(axes) and all(params[k] in axes[k] for k in axes)
        return False


@dataclass(frozen=True)
class KernelSpec:
    """Everything the compile loop needs to know about one op."""

    op: str
    module: str
    launcher: Callable[..., Any]
    reference: Callable[..., Any]
    config_space: KernelConfigSpace
    # choose_default(problem, device_key) -> KernelConfig
    choose_default: Callable[[Mapping[str, Any], str], KernelConfig]
    problem_keys: tuple[str, ...]
    doc: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def default_config(self, problem: Mapping[str, Any], device: torch.device | str | None = None) -> KernelConfig:
        # Launchers call this on every launch without a config: a dict lookup on the problem's
        # items in the caller's order (no sorting, no device queries) serves repeats.
        fast_key = (self.op, tuple(problem.items()), device)
        try:
            return _FAST_DEFAULTS[fast_key]
        except (KeyError, TypeError):  # TypeError: an unhashable problem value
            pass
        config = _cached_default(self.op, _freeze(problem), device_key(device))
        try:
            if len(_FAST_DEFAULTS) >= 8192:
                _FAST_DEFAULTS.clear()
            _FAST_DEFAULTS[fast_key] = config
        except TypeError:
            pass
        return config

    def is_valid(self, config: KernelConfig, problem: Mapping[str, Any]) -> bool:
        if not self.config_space.contains(config):
            return False
        return self.config_space.constraint is None or self.config_space.constraint(config, problem)


_REGISTRY: dict[str, KernelSpec] = {}
# (op, problem items in the caller's order, device as given) -> default config.
_FAST_DEFAULTS: dict[tuple, KernelConfig] = {}


def register(spec: KernelSpec) -> KernelSpec:
    _REGISTRY[spec.op] = spec
    _FAST_DEFAULTS.clear()
    _cached_default.cache_clear()
    return spec


def get_spec(op: str) -> KernelSpec:
    if op not in _REGISTRY:
        all_specs()
    if op not in _REGISTRY:
        raise ValueError(f"unknown kernel op {op!r}; known ops: {sorted(_REGISTRY)}")
    return _REGISTRY[op]


def all_specs() -> dict[str, KernelSpec]:
    """Import every kernel module (each registers its specs) and return op -> spec."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    return dict(_REGISTRY)


def _freeze(problem: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, str(v) if isinstance(v, torch.dtype) else v) for k, v in problem.items()))


@functools.lru_cache(maxsize=4096)
def _cached_default(op: str, frozen_problem: tuple, key: str) -> KernelConfig:
    spec = _REGISTRY[op]
    return spec.choose_default(dict(frozen_problem), key)


@functools.lru_cache(maxsize=64)
def _cuda_device_key(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    if major == 9:
        return "sm90"
    if major == 8:
        return "sm80"
    return "cuda"


def device_key(device: torch.device | str | None) -> str:
    """Coarse device class used to pick default configs ("interpreter", "sm90", "sm80", "cuda")."""
    if device is None:
        return "interpreter"
    device = torch.device(device)
    if device.type != "cuda":
        return "interpreter"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_device_key(index)


@functools.lru_cache(maxsize=64)
def multiprocessor_count(device: torch.device | str | None) -> int:
    """SM count of a CUDA device (132 for an H200); a nominal 8 for the CPU interpreter."""
    if device is None or torch.device(device).type != "cuda":
        return 8
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
