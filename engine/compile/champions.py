"""The champion registry: verified forward passes, found again by model, hardware and traffic.

Data flow:
    compile run --publish(champion bundle, candidate, metrics, verification)--> registry
    new compile run --nearest_champions(signature, hardware, profile, k)--> seed candidates

Keys: the *model signature* (sha256 over the architecture fields of the model config, so
a renamed copy of the same architecture matches and a different shape does not), the
*hardware* (accelerator kind or GPU name), and the *traffic regime* (coarse buckets of
median prompt length, prefix-cache hit rate and concurrency).

Two backends with one interface:
  LocalRegistry    embedded mode: a folder holding bundles/<digest>/ and index.json
                   (rewritten atomically under a file lock)
  ClusterRegistry  a cluster: ForwardPass objects (group shapeshift.dev, v1alpha1) through
                   the Kubernetes API; the bundle itself lives where the artifact URI says
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from shapeshift.engine.contracts.traffic_profile import TrafficProfile
from shapeshift.engine.contracts.traffic_regime import TrafficRegime
from shapeshift.engine.compile.candidate import Candidate, canonical_json
from shapeshift.operator.api import (API_VERSION, DTYPES, FORWARD_PASS, GROUP, VERSION, Artifact, EnvVar,
                                     ForwardPassEngine, ForwardPassHardware, ForwardPassMetrics, ForwardPassSpec,
                                     GateResult, ModelSignature, ReasoningNote, VerificationReport,
                                     accelerator_of_device)

log = logging.getLogger(__name__)

SIGNATURE_FIELDS = ("family", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias",
                    "qk_norm", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "rope_scaling")


def model_signature(model_config: Any) -> str:
    """sha256 (first 16 hex) over the architecture fields of a ModelConfig (or a dict of them)."""
    data = model_config if isinstance(model_config, Mapping) else dataclasses.asdict(model_config)
    arch = {k: data.get(k) for k in SIGNATURE_FIELDS}
    return hashlib.sha256(canonical_json(arch).encode()).hexdigest()[:16]


@dataclass
class ChampionEntry:
    """One registry entry (what a ForwardPass object holds, in embedded form)."""

    name: str
    signature: str
    model: str
    family: str
    hardware: str
    regime: dict[str, int]
    bundle_digest: str
    recipe: dict[str, Any]  # the candidate's full recipe (knobs incl. engine.* and edit.*)
    bundle_path: str = ""  # local registry: relative to the registry folder; cluster: artifact URI
    base_source: str | None = None  # candidate source before edits (None = the stock module)
    speedup: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    notes: list[dict[str, str]] = field(default_factory=list)
    parent: str | None = None
    compile_run: str | None = None
    created_unix: float = 0.0
    config_sha256: str | None = None  # the model config's digest (engine/contracts/model_config.py)

    def candidate(self) -> Candidate:
        return Candidate(dict(self.recipe), self.base_source, "registry",
                         f"champion {self.name} (x{self.speedup or 0:.2f} on {self.hardware})", parent=self.bundle_digest)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rank(entries: list[ChampionEntry], signature: str, hardware: str, profile: TrafficProfile,
         family: str | None = None, k: int = 3) -> list[ChampionEntry]:
    """Nearest first: same signature, then same family; same hardware; closest regime; fastest."""
    want = TrafficRegime.of(profile)

    def key(e: ChampionEntry):
        sig_rank = 0 if e.signature == signature else 1 if family is not None and e.family == family else 2
        return (sig_rank, 0 if e.hardware == hardware else 1, want.distance(TrafficRegime(**e.regime)),
                -(e.speedup or 0.0), e.name)

    pool = [e for e in entries if e.signature == signature or (family is not None and e.family == family)]
    return sorted(pool, key=key)[:k]


class LocalRegistry:
    """Embedded registry: `root/index.json` + `root/bundles/<digest>/`."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        (self.root / "bundles").mkdir(parents=True, exist_ok=True)
        self.index_path = self.root / "index.json"
        self.lock_path = self.root / ".lock"

    def _read(self) -> list[ChampionEntry]:
        if not self.index_path.is_file():
            return []
        try:
            data = json.loads(self.index_path.read_text())
        except ValueError as exc:
            raise ValueError(f"registry index {self.index_path} is not valid JSON ({exc}); "
                             "restore it from the bundles folder or remove it to start empty") from exc
        return [ChampionEntry(**e) for e in data.get("champions", [])]

    def entries(self) -> list[ChampionEntry]:
        return self._read()

    def publish(self, entry: ChampionEntry, bundle_dir: str | os.PathLike[str]) -> ChampionEntry:
        """Copy the bundle in and add (or replace, by name) its entry; atomic under a lock."""
        from shapeshift.engine.forward_pass.bundle import verify_bundle

        manifest = verify_bundle(bundle_dir)
        if manifest.digest != entry.bundle_digest:
            raise ValueError(f"bundle {bundle_dir} has digest {manifest.digest}, entry says {entry.bundle_digest}")
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            target = self.root / "bundles" / manifest.digest
            if not target.exists():
                shutil.copytree(bundle_dir, target)
            entry.bundle_path = str(target.relative_to(self.root))
            entry.created_unix = entry.created_unix or time.time()
            entries = [e for e in self._read() if e.name != entry.name] + [entry]
            tmp = self.index_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"champions": [e.to_dict() for e in entries]}, indent=2, sort_keys=True,
                                      default=str) + "\n")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.index_path)
        return entry

    def nearest_champions(self, signature: str, hardware: str, profile: TrafficProfile, k: int = 3,
                          family: str | None = None) -> list[ChampionEntry]:
        return rank(self._read(), signature, hardware, profile, family, k)

    def bundle_dir(self, entry: ChampionEntry) -> Path:
        return self.root / entry.bundle_path


def project_recipe(recipe: Mapping[str, Any], space: Any) -> dict[str, Any]:
    """A champion's recipe mapped into another search space: unknown knobs dropped, off-grid values defaulted."""
    out = space.default()
    for name, value in recipe.items():
        if name in space.names:
            try:
                space.knob(name).index(value)
                out[name] = value
            except ValueError:
                pass
    return out if space.is_valid(out) else space.default()


# ---------------------------------------------------------------------- cluster

PLURAL = FORWARD_PASS.plural
# Labels of a published ForwardPass: the registry's keys, so a lookup can select on them.
LABEL_MODEL_SIGNATURE = f"{GROUP}/model-signature"
LABEL_HARDWARE = f"{GROUP}/hardware"
LABEL_REGIME = f"{GROUP}/regime"
LABEL_FAMILY = f"{GROUP}/family"


def _dns_name(text: str) -> str:
    safe = re.sub("-+", "-", "".join(c if c.isalnum() else "-" for c in text.lower())).strip("-")
    return safe[:63].rstrip("-") or "fp"


def forward_pass_spec(entry: ChampionEntry, artifact_uri: str, size_bytes: int | None = None,
                      engine_env: list[dict[str, str]] | None = None) -> ForwardPassSpec:
    """The ForwardPass spec of `entry` (pydantic ValidationError when it breaks the CRD's schema);
    `engine_env` (name/value pairs, None: unknown) is the engine environment it was measured
    under, recorded as spec.engine.env."""
    metrics, verification = entry.metrics, entry.verification
    dtype = metrics.get("dtype")
    return ForwardPassSpec(
        model=ModelSignature(name=entry.model, architecture=entry.family,
                             dtype=dtype if dtype in DTYPES else "bfloat16", config_sha256=entry.config_sha256),
        hardware=ForwardPassHardware(accelerator=accelerator_of_device(entry.hardware), count=1),
        traffic=entry.profile or None,
        artifact=Artifact(uri=artifact_uri, sha256=entry.bundle_digest, size_bytes=size_bytes or None),
        recipe=entry.recipe,
        metrics=ForwardPassMetrics(
            tokens_per_second=metrics.get("tokens_per_second"),
            baseline_tokens_per_second=metrics.get("baseline_tokens_per_second"),
            per_user_tokens_per_second_p50=metrics.get("per_user_p50"),
            per_user_tokens_per_second_p90=metrics.get("per_user_p90"),
            ttft_p50_seconds=metrics.get("ttft_p50"),
            ttft_p90_seconds=metrics.get("ttft_p90"),
            speedup=entry.speedup,
            noise=metrics.get("noise")),
        verification=VerificationReport(
            passed=bool(verification.get("passed")),
            gates=[GateResult(name=n, passed=bool(ok)) for n, ok in (verification.get("gates") or {}).items()],
            artifact_sha256=entry.bundle_digest),
        engine=None if engine_env is None else ForwardPassEngine(
            env=[EnvVar(name=e["name"], value=e.get("value", "")) for e in engine_env]),
        reasoning=[ReasoningNote(agent=n.get("agent", "?")[:63], note=n.get("note", "")[:8192])
                   for n in entry.notes[:64]] or None,
        parent=_dns_name(entry.parent) if entry.parent else None,
        compile_run=entry.compile_run or None,
    )


class ClusterRegistry:
    """ForwardPass objects in a namespace; `api` is a kubernetes CustomObjectsApi."""

    def __init__(self, api: Any, namespace: str):
        self.api = api
        self.namespace = namespace

    def to_object(self, entry: ChampionEntry, artifact_uri: str, size_bytes: int | None = None,
                  annotations: Mapping[str, str] | None = None,
                  engine_env: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """The ForwardPass object of `entry`, its spec built and validated by `forward_pass_spec`."""
        spec = forward_pass_spec(entry, artifact_uri, size_bytes, engine_env)
        labels = {LABEL_MODEL_SIGNATURE: entry.signature, LABEL_HARDWARE: _dns_name(entry.hardware),
                  LABEL_REGIME: TrafficRegime(**entry.regime).key, LABEL_FAMILY: entry.family}
        metadata: dict[str, Any] = {"name": _dns_name(entry.name), "namespace": self.namespace, "labels": labels}
        if annotations:
            metadata["annotations"] = dict(annotations)
        return {"apiVersion": API_VERSION, "kind": FORWARD_PASS.kind, "metadata": metadata, "spec": spec.to_wire()}

    def publish(self, entry: ChampionEntry, artifact_uri: str, size_bytes: int | None = None,
                annotations: Mapping[str, str] | None = None,
                engine_env: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """Create the ForwardPass. Its spec is immutable, so an existing object of the same name
        is kept when it pins the same bundle, and refused (ValueError) when it pins another."""
        body = self.to_object(entry, artifact_uri, size_bytes, annotations, engine_env)
        try:
            return self.api.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
        except Exception as exc:  # noqa: BLE001 - 409: look at what is there
            if getattr(exc, "status", None) != 409:
                raise
            name = body["metadata"]["name"]
            current = self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
            if current.get("spec", {}).get("artifact", {}).get("sha256") != entry.bundle_digest:
                raise ValueError(f"ForwardPass {self.namespace}/{name} exists and pins another bundle; "
                                 "publish the champion under a new name") from exc
            return current

    def entries(self) -> list[ChampionEntry]:
        objs = self.api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL).get("items", [])
        out = []
        for o in objs:
            labels = o.get("metadata", {}).get("labels", {})
            spec = o.get("spec", {})
            try:  # a label written before the output and routing buckets parses with them unknown
                reg = TrafficRegime.parse(labels.get(LABEL_REGIME, "p0-h0-c0"))
            except ValueError:
                reg = TrafficRegime(0, 0, 0)
            if spec.get("traffic"):
                try:
                    reg = TrafficRegime.of(TrafficProfile.model_validate(spec["traffic"]))
                except Exception:  # noqa: BLE001 - keep the label's regime
                    pass
            out.append(ChampionEntry(
                name=o["metadata"]["name"], signature=labels.get(LABEL_MODEL_SIGNATURE, ""),
                model=spec.get("model", {}).get("name", ""), family=labels.get(LABEL_FAMILY, ""),
                hardware=labels.get(LABEL_HARDWARE, spec.get("hardware", {}).get("accelerator", "")),
                regime=reg.to_dict(),
                bundle_digest=spec.get("artifact", {}).get("sha256", ""), recipe=spec.get("recipe", {}) or {},
                bundle_path=spec.get("artifact", {}).get("uri", ""), speedup=spec.get("metrics", {}).get("speedup"),
                verification=spec.get("verification", {}), profile=spec.get("traffic"), parent=spec.get("parent"),
                compile_run=spec.get("compileRun"), config_sha256=spec.get("model", {}).get("configSha256")))
        return out

    def nearest_champions(self, signature: str, hardware: str, profile: TrafficProfile, k: int = 3,
                          family: str | None = None) -> list[ChampionEntry]:
        return rank(self.entries(), signature, _dns_name(hardware), profile, family, k)


def regime_summary(profile: TrafficProfile) -> str:
    r = TrafficRegime.of(profile)
    names = ["<=256", "<=1k", "<=4k", "<=16k", "<=64k", ">64k"]
    return f"prompt p50 {names[r.prompt]}, hit {['low', 'mid', 'high'][r.hit]}, concurrency bucket {r.concurrency}"
