"""Which environment variables a deployment's spec.engine.env may set, and which of them matter to
performance (no torch).

    operator/api/common.py EnvVar --reserved_reason(), RESERVED_*--> pydantic validator and CEL rule
    engine/compile/worker.py --PERFORMANCE_ENV--> the only names copied into a ForwardPass's spec.engine.env
    operator/rollout_target.py --PERFORMANCE_ENV--> the names compared with the ForwardPass's record

A spec may not set a variable that the operator sets itself, that the engine, the compile worker or
the Kubernetes client read for something other than speed (the admin API's token, the cache folder,
the ranks of a process group, the kubeconfig), or that makes the process load other code, use
other devices or send its traffic elsewhere: the dynamic loader (LD_*), the Python interpreter
(PYTHON*), the GPU and Neuron runtimes' device assignment (CUDA_*, NVIDIA_*, NEURON_RT_*, set by the
device plugins), NCCL's plugins, the libraries the engine imports (TRITON_*, TORCH*, HF_*,
TRANSFORMERS_*: compiler hooks, cache folders, hub endpoints), the C compilers Triton builds with
(CC, CXX), the HTTP clients' proxies (any name ending in _PROXY, in any case: urllib reads them so)
and their trust stores (SSL_CERT_FILE, SSL_CERT_DIR, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE). The names
the engine reads for speed are listed in PERFORMANCE_ENV with what they do; every other SHAPESHIFT_*
name is reserved. A test scans engine/ and kernels/ for the names they read and fails on one that is
neither reserved nor listed here.

HF_TOKEN, the Hugging Face hub's credential for gated models, is the one name of a reserved family a
spec may set (SECRET_ONLY_NAMES), and only from a Secret.

Names that look like credentials (SECRET_NAME_PATTERN) take their value from a Secret
(valueFrom.secretKeyRef), never a literal in the spec.
"""

from __future__ import annotations

import re

# The engine's and the kernels' performance switches: name -> what it does. Only these travel from a
# compile pod into a ForwardPass's spec.engine.env, and rollout compares only these.
PERFORMANCE_ENV: dict[str, str] = {
    "SHAPESHIFT_PDL": "kernel families launched with programmatic dependent launch (1, 0 or a comma list)",
    "SHAPESHIFT_PDL_GEMV_TRIGGER": "where a GEMV under PDL lets the next kernel start",
    "SHAPESHIFT_GEMV_SPLIT_K_FIXUP": "split-K GEMV reduction in the kernel (1) or after it (0)",
    "SHAPESHIFT_GEMV_PREFETCH": "GEMV weight prefetch",
    "SHAPESHIFT_DECODE_ATTENTION_MERGE": "decode attention merges its partial results in the last program (1) or not",
    "SHAPESHIFT_GRAPH_ARGMAX": "greedy argmax inside the CUDA graph: triton or torch",
}

# Read by the engine, the compile worker, torch.distributed or the Kubernetes client for something
# other than speed, or set by the operator (the compile pod's contract adds its own names).
RESERVED_NAMES: tuple[str, ...] = (
    "POD_NAME", "POD_NAMESPACE", "HOME", "PATH", "KUBECONFIG",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS",
    "CC", "CXX", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
)
# Whole families: the operator's and the engine's own (SHAPESHIFT_, except PERFORMANCE_ENV), the
# Kubernetes client's service discovery, the loader, the interpreter, the device runtimes, and the
# libraries the engine imports (Triton, torch and TorchInductor, the Hugging Face hub and transformers).
RESERVED_PREFIXES: tuple[str, ...] = (
    "SHAPESHIFT_", "KUBERNETES_", "LD_", "PYTHON", "CUDA_", "NVIDIA_", "NEURON_RT_",
    "TRITON_", "TORCH", "HF_", "TRANSFORMERS_",
)
# Proxies: urllib (and requests, httpx through it) takes <scheme>_proxy and no_proxy in any case.
PROXY_NAME_PATTERN = "(?i)_proxy$"  # RE2 and Python alike (CEL matches())
# In a reserved family, but a spec may set them from a Secret (the credential rule requires one).
SECRET_ONLY_NAMES: tuple[str, ...] = ("HF_TOKEN",)
# A name with one of these words is a credential: its value comes from a Secret.
SECRET_WORDS: tuple[str, ...] = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY", "CREDENTIAL",
                                 "PRIVATE_KEY", "ACCESS_KEY")
SECRET_NAME_PATTERN = "(?i)(" + "|".join(SECRET_WORDS) + ")"  # RE2 and Python alike (CEL matches())


def reserved_reason(name: str) -> str | None:
    """Why a spec may not set `name` (None: it may)."""
    if name in PERFORMANCE_ENV or name in SECRET_ONLY_NAMES:
        return None
    if name in RESERVED_NAMES:
        return f"{name} is set or read by the operator, the engine or the runtime itself"
    if re.search(PROXY_NAME_PATTERN, name):
        return f"{name}: names ending in _PROXY (any case) are reserved (the HTTP clients' proxies)"
    prefix = next((p for p in RESERVED_PREFIXES if name.startswith(p)), None)
    if prefix == "SHAPESHIFT_":
        return (f"{name} is not one of the engine's performance switches ({', '.join(PERFORMANCE_ENV)}); "
                "other SHAPESHIFT_ names are the operator's and the engine's own")
    if prefix is not None:
        return (f"{name}: names starting with {prefix} are reserved (the loader, interpreter, device runtimes "
                "and the libraries the engine imports)")
    return None


def is_secret_name(name: str) -> bool:
    return re.search(SECRET_NAME_PATTERN, name) is not None
