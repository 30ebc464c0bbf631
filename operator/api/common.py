"""What every Shapeshift custom resource shares: the wire base classes, conditions,
the hardware and environment field types, and the helpers that parse cluster objects.

    group.py, common.py --> inference_deployment.py, compile_run.py, forward_pass.py
                        --crdgen.py--> crds/*.yaml (OpenAPI schema, CEL rules, columns)
    cluster object --parse_spec()/Status.model_validate()--> typed spec/status
    handlers --Status(...).to_wire()--> status subresource

One definition serves the API server and the operator: every bound and enum
becomes an OpenAPI constraint, every cross-field rule is written twice, once as
a CEL rule (`x-kubernetes-validations`, enforced by the API server) and once as
a pydantic validator (enforced when the operator or a test builds a spec in
Python), next to each other so they stay the same rule.

Field names are snake_case in Python, camelCase on the wire.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from shapeshift.engine.contracts import compile_pod_env as pod_env
from shapeshift.engine.contracts import engine_env
from shapeshift.engine.contracts.traffic_profile import BUILTIN_PROFILES
from shapeshift.operator.api.hardware import ACCELERATORS, AcceleratorKind

if TYPE_CHECKING:
    from shapeshift.operator.api.group import Kind

BuiltinTrafficProfile = Literal["chat", "agentic-long-context", "burst"]
assert set(BuiltinTrafficProfile.__args__) == set(BUILTIN_PROFILES)  # type: ignore[attr-defined]

# Weight and activation dtypes the engine runs in (EngineConfig's choices).
Dtype = Literal["bfloat16", "float16", "float32"]
DTYPES: tuple[str, ...] = get_args(Dtype)

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def cel(rule: str, message: str, **extra: str) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    return {"rule": rule, "message": message, **extra}


def cel_rules(*rules: dict[str, str]) -> ConfigDict:
    """A model's `x-kubernetes-validations` (each a `cel` entry), as its pydantic model_config."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(rules)})


class WireModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown keys rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(WireModel):
    """Status is read back from the cluster, where the compile worker also writes:
    tolerate keys this version does not know instead of failing to parse."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def default_of(model: type[WireModel]) -> dict[str, Any]:
    """CRD `default` of a nested object whose fields all default: the full default
    object, so the API server fills it in when the user omits it. (A bare `{}` is
    not enough: the API server checks defaults against CEL rules without applying
    the inner defaults first.)"""
    return {"default": model().to_wire()}


# ---- shared pieces ------------------------------------------------------------------------


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: str = Field(max_length=64, description="Condition type, e.g. Ready, Scheduled, Complete.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", max_length=128, description="CamelCase reason for the last transition.")
    message: str = Field(default="", max_length=4096, description="Human-readable detail.")
    last_transition_time: datetime | None = Field(default=None, description="When the status last changed.")
    observed_generation: int | None = Field(default=None, description="Generation the condition was computed for.")


def set_condition(
    conditions: list[Condition],
    type: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str = "",
    *,
    now: datetime | None = None,
    observed_generation: int | None = None,
) -> list[Condition]:
    """A new list with `type` set; the transition time only moves when the status does."""
    now = now or datetime.now(timezone.utc).replace(microsecond=0)
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type == type:
            found = True
            ltt = c.last_transition_time if c.status == status and c.last_transition_time else now
            out.append(Condition(type=type, status=status, reason=reason, message=message[:4096],
                                 last_transition_time=ltt, observed_generation=observed_generation))
        else:
            out.append(c)
    if not found:
        out.append(Condition(type=type, status=status, reason=reason, message=message[:4096],
                             last_transition_time=now, observed_generation=observed_generation))
    return out


def get_condition(conditions: list[Condition], type: str) -> Condition | None:
    return next((c for c in conditions if c.type == type), None)


class Toleration(WireModel):
    """A pod toleration (the subset of core/v1 Toleration Shapeshift passes through)."""

    key: str | None = Field(default=None, max_length=317, description="Taint key to tolerate; empty with Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty matches all."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="For NoExecute: how long to stay bound.")


NVIDIA_KINDS = tuple(k for k, a in ACCELERATORS.items() if a.resource_name == "nvidia.com/gpu")
NEURON_KINDS = tuple(k for k, a in ACCELERATORS.items() if a.resource_name == "aws.amazon.com/neuron")
# Taints of the accelerator pools: a pod that tolerates another pool's may land on that pool's nodes.
POOL_TAINT_KEYS = tuple(dict.fromkeys(t["key"] for a in ACCELERATORS.values() for t in a.tolerations))
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
# node.kubernetes.io/instance-type prefixes of the clouds' GPU machine families, which a CPU
# deployment may not select (it would hold a GPU node and use none of it): AWS P and G families,
# Google Cloud's A2/A3/A4/G2, Azure's NC/ND/NV series. Not every GPU type there is: a selector of a
# type outside these families is the user's word. Trainium's trn* has its own rule.
GPU_INSTANCE_TYPE_PREFIXES = (
    "p3.", "p3dn.", "p4d.", "p4de.", "p5.", "p5e.", "p5en.", "p6-", "p6e-",
    "g4dn.", "g4ad.", "g5.", "g5g.", "g6.", "g6e.", "g6f.", "gr6.",
    "a2-", "a3-", "a4-", "g2-",
    "Standard_NC", "Standard_ND", "Standard_NV",
)


def _cel_kinds(kinds) -> str:
    return "[" + ", ".join(f"'{k}'" for k in kinds) + "]"


def other_pool_taint_keys(kind: str) -> tuple[str, ...]:
    """The accelerator pools' taint keys that `kind`'s own pool does not carry."""
    own = {t["key"] for t in ACCELERATORS[kind].tolerations}
    return tuple(k for k in POOL_TAINT_KEYS if k not in own)


def _toleration_message(kind: str) -> str:
    if kind == "cpu":
        return ("spec.hardware.tolerations: a CPU deployment may not tolerate every taint (no key) or an "
                "accelerator pool's taint unless spec.hardware.widenTolerations is true")
    return (f"spec.hardware.tolerations: a deployment on {kind} may not tolerate every taint (no key) or another "
            f"accelerator pool's taint ({', '.join(other_pool_taint_keys(kind))}) unless "
            "spec.hardware.widenTolerations is true")


_GPU_INSTANCE_MESSAGE = ("spec.hardware.nodeSelector['node.kubernetes.io/instance-type'] names a GPU instance type "
                         "(" + ", ".join(p.rstrip(".-") for p in GPU_INSTANCE_TYPE_PREFIXES) + "); a cpu "
                         "deployment would hold a GPU node and use none of it")


def _pool_rules() -> list[dict[str, str]]:
    """Placement rules: a user's node selector may narrow the pool, never contradict it nor name
    another pool's nodes; wildcard or other-pool tolerations only when spec.hardware.widenTolerations
    says so (every accelerator)."""
    rules = []
    for kind, acc in ACCELERATORS.items():
        for key, value in acc.node_selector.items():
            rules.append(cel(f"self.accelerator != '{kind}' || !has(self.nodeSelector) || "
                             f"!('{key}' in self.nodeSelector) || self.nodeSelector['{key}'] == '{value}'",
                             f"spec.hardware.nodeSelector['{key}'] must be '{value}' for accelerator {kind}: "
                             "extra labels may narrow the pool, never contradict its own"))
    rules.append(cel(f"self.accelerator in {_cel_kinds(NVIDIA_KINDS)} || !has(self.nodeSelector) || "
                     "self.nodeSelector.all(k, !k.startsWith('nvidia.com/'))",
                     "spec.hardware.nodeSelector: nvidia.com/ labels are only on NVIDIA nodes; this accelerator's "
                     "pods could never be scheduled"))
    rules.append(cel(f"self.accelerator in {_cel_kinds(NEURON_KINDS)} || !has(self.nodeSelector) || "
                     f"(self.nodeSelector.all(k, !k.startsWith('aws.amazon.com/neuron')) && "
                     f"(!('{INSTANCE_TYPE}' in self.nodeSelector) || "
                     f"!self.nodeSelector['{INSTANCE_TYPE}'].startsWith('trn')))",
                     "spec.hardware.nodeSelector: Trainium (trn*) instance types and aws.amazon.com/neuron labels "
                     "are only for accelerator trainium2"))
    gpu_types = _cel_kinds(GPU_INSTANCE_TYPE_PREFIXES)
    rules.append(cel(f"self.accelerator != 'cpu' || !has(self.nodeSelector) || "
                     f"!('{INSTANCE_TYPE}' in self.nodeSelector) || "
                     f"!{gpu_types}.exists(p, self.nodeSelector['{INSTANCE_TYPE}'].startsWith(p))", _GPU_INSTANCE_MESSAGE))
    for kind in ACCELERATORS:
        others = other_pool_taint_keys(kind)
        keyed = "has(t.key) && t.key != ''" + (f" && !(t.key in {_cel_kinds(others)})" if others else "")
        rules.append(cel(f"self.accelerator != '{kind}' || self.widenTolerations || !has(self.tolerations) || "
                         f"self.tolerations.all(t, {keyed})", _toleration_message(kind)))
    return rules


def _pool_problem(hw: "HardwareSpec") -> str | None:
    """The pydantic twin of _pool_rules."""
    acc = ACCELERATORS[hw.accelerator]
    selector = hw.node_selector or {}
    for key, value in acc.node_selector.items():
        if key in selector and selector[key] != value:
            return (f"spec.hardware.nodeSelector['{key}'] must be '{value}' for accelerator {hw.accelerator}: "
                    "extra labels may narrow the pool, never contradict its own")
    if hw.accelerator not in NVIDIA_KINDS and any(k.startswith("nvidia.com/") for k in selector):
        return ("spec.hardware.nodeSelector: nvidia.com/ labels are only on NVIDIA nodes; this accelerator's pods "
                "could never be scheduled")
    if hw.accelerator not in NEURON_KINDS and (any(k.startswith("aws.amazon.com/neuron") for k in selector)
                                               or selector.get(INSTANCE_TYPE, "").startswith("trn")):
        return ("spec.hardware.nodeSelector: Trainium (trn*) instance types and aws.amazon.com/neuron labels are "
                "only for accelerator trainium2")
    if hw.accelerator == "cpu" and selector.get(INSTANCE_TYPE, "").startswith(GPU_INSTANCE_TYPE_PREFIXES):
        return _GPU_INSTANCE_MESSAGE
    others = other_pool_taint_keys(hw.accelerator)
    if not hw.widen_tolerations and any(not t.key or t.key in others for t in hw.tolerations or []):
        return _toleration_message(hw.accelerator)
    return None


class HardwareSpec(WireModel):
    """The accelerator pool pods run on."""

    model_config = cel_rules(*_pool_rules())

    accelerator: AcceleratorKind = Field(
        description="Accelerator kind: " + ", ".join(f"{k} ({a.description})" for k, a in ACCELERATORS.items()) + "."
    )
    count: int = Field(default=1, ge=1, le=64, description="Accelerators per pod (ignored for cpu).")
    node_selector: dict[str, str] | None = Field(
        default=None, max_length=32, description="Extra node labels that narrow the pool: they may not contradict "
                                                 "the pool's own labels, nor name another pool's (nvidia.com/ for a "
                                                 "non-NVIDIA accelerator, trn* instance types but for trainium2, "
                                                 "a GPU instance type of AWS, Google Cloud or Azure for cpu)."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Extra tolerations, added to the pool's: none that matches every "
                                                 "taint (no key) or another accelerator pool's taint (for cpu: any "
                                                 "accelerator pool's) unless widenTolerations is true."
    )
    widen_tolerations: bool = Field(
        default=False, description="Let the deployment tolerate every taint or another accelerator pool's taint "
                                   "(its pods may then land on that pool's nodes).")
    cpu: str | None = Field(default=None, max_length=32, description="CPU request per pod, e.g. '8'.")
    memory: str | None = Field(default=None, max_length=32, description="Memory request and limit per pod, e.g. '64Gi'.")

    @model_validator(mode="after")
    def _narrows_the_pool(self) -> "HardwareSpec":
        problem = _pool_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self


# ---- environment of the engine and compile containers ------------------------------------

# Environment variables the operator sets in engine and compile pods itself; a spec may not set
# them (the container's later entry would silently win over the user's, or the user's over ours).
# The compile pod's names come from its contract (engine/contracts/compile_pod_env.py).
OPERATOR_ENV_NAMES = (
    pod_env.POD_NAME, "POD_NAMESPACE", pod_env.INFERENCE_DEPLOYMENT, pod_env.ENGINE_CONFIG,
    pod_env.NAMESPACE, pod_env.COMPILE_RUN, pod_env.ACCELERATOR, pod_env.BUDGET_WALL_CLOCK_SECONDS,
    pod_env.BUDGET_TRIALS, pod_env.WORK_DIR, pod_env.ARTIFACT_DIR, pod_env.ENGINE_ENV_NAMES,
)
RESERVED_ENV_PREFIX = pod_env.AGENT_API_KEY_PREFIX  # SHAPESHIFT_AGENT_<n>_API_KEY, from the agents' Secrets
# Every name a spec may not set: the operator's, and those the engine, the compile worker, the
# Kubernetes client and the runtimes read for something other than speed (contracts/engine_env.py).
RESERVED_ENV_NAMES = tuple(dict.fromkeys(OPERATOR_ENV_NAMES + engine_env.RESERVED_NAMES))
RESERVED_ENV_PREFIXES = engine_env.RESERVED_PREFIXES
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
MAX_ENV_VARS = 32
ENV_LIST_SCHEMA = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}  # keyed by name


def _cel_list(names) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


class EnvSecretKeyRef(WireModel):
    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="Secret in the deployment's namespace.")
    key: str = Field(max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="Key in the Secret.")


class EnvValueFrom(WireModel):
    secret_key_ref: EnvSecretKeyRef = Field(description="The Secret key whose value the kubelet sets.")


class EnvVar(WireModel):
    """An environment variable of the engine container: a literal value, or for a credential a
    Secret's key. Reserved names (contracts/engine_env.py) are refused."""

    model_config = cel_rules(
        cel(f"!(self.name in {_cel_list(OPERATOR_ENV_NAMES)}) && "
            f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
            "spec.engine.env: this name is set by the operator itself"),
        cel(f"self.name in {_cel_list(tuple(engine_env.PERFORMANCE_ENV) + engine_env.SECRET_ONLY_NAMES)} || "
            f"(!(self.name in {_cel_list(RESERVED_ENV_NAMES)}) && "
            f"!self.name.matches('{engine_env.PROXY_NAME_PATTERN}') && "
            + " && ".join(f"!self.name.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES) + ")",
            "spec.engine.env[].name is reserved: the engine, the compile worker, the Kubernetes client, "
            "the loader (LD_*), Python (PYTHON*), the device runtimes (CUDA_*, NVIDIA_*, NEURON_RT_*, "
            "NCCL plugins), the libraries the engine imports (TRITON_*, TORCH*, HF_* but HF_TOKEN from a Secret, "
            "TRANSFORMERS_*), the compilers (CC, CXX), the HTTP clients' proxies (*_PROXY, any case) or trust "
            "stores (SSL_CERT_FILE, SSL_CERT_DIR, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE) read it; of the "
            "SHAPESHIFT_ names only the performance switches " + ", ".join(engine_env.PERFORMANCE_ENV) + " may be set"),
        cel(f"!self.name.matches('{engine_env.SECRET_NAME_PATTERN}') || "
            "(has(self.valueFrom) && self.value == '')",
            "spec.engine.env[].valueFrom.secretKeyRef: a credential (a name with TOKEN, SECRET, PASSWORD, "
            "API_KEY, ACCESS_KEY ...) takes its value from a Secret, never from spec.engine.env[].value"),
        cel("!has(self.valueFrom) || self.value == ''",
            "spec.engine.env[]: set value or valueFrom, not both"),
    )
    name: str = Field(max_length=128, pattern=_ENV_NAME, description="Variable name (a C identifier).")
    value: str = Field(default="", max_length=4096, description="Its literal value (not for credentials).")
    value_from: EnvValueFrom | None = Field(
        default=None, description="For a credential: the Secret key the kubelet takes the value from (engine pods "
                                  "only; compile pods measure and get literal values only).")

    @model_validator(mode="after")
    def _not_reserved(self) -> "EnvVar":
        if self.name in OPERATOR_ENV_NAMES or self.name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(f"spec.engine.env: {self.name} is set by the operator itself")
        why = engine_env.reserved_reason(self.name)
        if why is not None:
            raise ValueError(f"spec.engine.env[].name is reserved: {why}")
        if engine_env.is_secret_name(self.name) and (self.value_from is None or self.value):
            raise ValueError(f"spec.engine.env[].valueFrom.secretKeyRef: {self.name} looks like a credential; it "
                             "takes its value from a Secret, never from spec.engine.env[].value")
        if self.value_from is not None and self.value:
            raise ValueError("spec.engine.env[]: set value or valueFrom, not both")
        return self


# ---- outbound URLs (spec.prometheusUrl, spec.agents[].llm.endpoint) -------------------------

# http(s), a host (and port), a path; no user:password@, query string or fragment: credentials
# belong in Secrets, and these URLs are quoted in status and events.
OUTBOUND_URL = r"^https?://[^/?#@]+(/[^?#]*)?$"


def outbound_url_rule(field: str, path: str) -> dict[str, str]:
    """The CEL rule of an optional outbound URL field `field` (wire name) at `path`."""
    return cel(f"!has(self.{field}) || self.{field}.matches('{OUTBOUND_URL}')", outbound_url_message(path))


def outbound_url_message(path: str) -> str:
    return (f"{path} must be an http(s):// URL with no user:password@, query string or fragment "
            "(credentials go in Secrets; the URL is quoted in status)")


def check_outbound_url(url: str | None, path: str) -> None:
    """The pydantic twin of outbound_url_rule (ValueError naming `path`)."""
    import re

    if url is not None and not re.match(OUTBOUND_URL, url):
        raise ValueError(outbound_url_message(path))


# ---- parsing helpers ------------------------------------------------------------------------


def parse_spec(kind: Kind, spec: Any) -> Any:
    """Typed spec from a cluster object's spec mapping (pydantic ValidationError on bad input)."""
    return kind.spec.model_validate(dict(spec or {}))


def parse_status(kind: Kind, status: Any) -> Any:
    return kind.status.model_validate(dict(status or {}))


def now_utc() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def parse_time(value: Any) -> datetime | None:
    """A time as the API server writes it (``2026-12-01T12:00:00Z``), or one already parsed; None when empty."""
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None


def short_error(exc: Exception) -> str:
    """A pydantic ValidationError as one line per error, with the wire field path."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for e in errors():
        loc = ".".join(str(p) for p in e.get("loc", ()))
        lines.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(lines)
