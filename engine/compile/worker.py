"""The compile worker's side of a CompileRun: read the run, report progress, publish the champion.

Data flow (inside the compile pod, `shapeshift compile --compile-run NS/NAME`):
    API: CompileRun NS/NAME (spec) + its InferenceDeployment (model, when no engine config)
      + the pod's environment (contracts/compile_pod_env.py: $SHAPESHIFT_ENGINE_CONFIG, the
        deployment's engine.yaml: model, dtype, context; $SHAPESHIFT_AGENT_<i>_API_KEY, LLM keys the
        kubelet took from Secrets; the work and artifact folders; the pool's accelerator)
      --job_request, through the typed CompileRunSpec--> the command line's JobRequest completed
        (job.py: model, profile, budget, agents, tiers, verification, baseline, slo)
    spec.baseline.forwardPass, else the deployment's status.activeForwardPass
      --pass_to_beat--> that ForwardPass's bundle (fetched, sha256 checked) as a candidate the
      champion must beat besides the stock pass (compile/pass_to_beat.py)
    loop status callbacks --patch_status--> CompileRun status: trials, bestSpeedup,
      leaderboard, message (throttled; the operator owns phase, job, pod and conditions)
    champion --publish--> <sha256>.tar.gz in the artifact folder + a ForwardPass object (the
      cluster registry) whose artifact URI names that file, and whose spec.engine.env records the
      deployment's spec.engine.env as this pod got it ($SHAPESHIFT_ENGINE_ENV_NAMES names them)
    end --finish / fail--> final status: champion name, counts, message

The engine config file gives the model, dtype and context, and the engine settings the
deployment serves with (batch width, chunk budget, block size, prefix caching): the stock
candidate is measured with them, so a speedup is one over what is deployed.

Where the champion archive goes: engine pods fetch a ForwardPass's artifact from an http(s)
URL or a path on a volume they mount. The work folder ($SHAPESHIFT_WORK_DIR) is the compile
pod's own emptyDir and vanishes with the pod, so a durable artifact needs a folder on a shared
volume: --artifact-dir or $SHAPESHIFT_ARTIFACT_DIR (the operator sets it when the deployment has
spec.artifacts.pvc: a ReadWriteMany claim mounted into the compile pod at
/var/lib/shapeshift-artifacts and, read-only, into the engine pods at the same path). Without one the
archive stays in the work folder and the ForwardPass carries the annotation
shapeshift.dev/artifact-durable: "false", so nobody mistakes it for a rollout-ready pass.

The worker's ServiceAccount may get its own CompileRun, patch its status, get its
deployment and list/create ForwardPasses; nothing else is needed here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from shapeshift.engine.compile.champions import GROUP, VERSION, ClusterRegistry, forward_pass_spec
from shapeshift.engine.compile.job import DEFAULT_OUT, JobRequest
from shapeshift.engine.contracts.compile_pod_env import ARTIFACT_DURABLE_ANNOTATION, CompilePodEnv
from shapeshift.engine.contracts.engine_env import PERFORMANCE_ENV
from shapeshift.engine.contracts.traffic_profile import TrafficProfile, builtin_profile
from shapeshift.operator.api import (
    COMPILE_RUN_UID_ANNOTATION,
    AgentSpec,
    CompileRunSpec,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    TierSpec,
    VerificationSpec,
)

log = logging.getLogger(__name__)

AGENT_KINDS = {"coordinate-sweep": "sweep", "evolutionary": "evolve", "model-based": "bayes", "llm": "llm"}
# engine.yaml keys (EngineConfig fields) the measuring engines take over from the deployment
DEPLOYED_ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "block_size")


def engine_env(environ: Any = os.environ) -> list[dict[str, str]] | None:
    """The engine's performance switches (contracts/engine_env.py PERFORMANCE_ENV) among the
    deployment's spec.engine.env as this process sees it (sorted by name), from the names the
    operator lists in $SHAPESHIFT_ENGINE_ENV_NAMES; None when that variable is unset (not an
    operator's pod). Nothing else reaches the ForwardPass."""
    listed = CompilePodEnv.from_environ(environ).engine_env
    if listed is None:
        return None
    return [{"name": n, "value": v} for n, v in sorted(listed) if n in PERFORMANCE_ENV]


# CompileRun spec fields the worker does not act on yet: (section, field) -> what happens instead
_NOT_ACTED_ON = {
    ("tiers", "fast"): "every candidate is screened on the fast tier",
    ("tiers", "full"): "every candidate is confirmed on the full tier",
    ("verification", "logprob_tolerance"): "the gates use their own tolerances",
    ("verification", "kv_contamination"): "the KV-contamination gates always run",
}


def agent_names(agents: list[AgentSpec]) -> tuple[list[str], int | None]:
    """The CLI's agent list for a CompileRun's spec.agents, each kind repeated `replicas` times,
    and the index of the llm agent whose endpoint is used (the first; the CLI takes one)."""
    names: list[str] = []
    llm_index = None
    for index, agent in enumerate(agents):
        kind = AGENT_KINDS[agent.kind]
        if kind == "llm":
            if llm_index is not None:
                log.warning("spec.agents[%d]: one LLM endpoint per run; spec.agents[%d]'s is used (give it "
                            "replicas for more instances)", index, llm_index)
                continue
            llm_index = index
        names.extend([kind] * agent.replicas)
    return names, llm_index


def device_for_accelerator(accelerator: str, cuda_available: bool) -> str:
    """The torch device a compile pod on an `accelerator` pool measures on ($SHAPESHIFT_ACCELERATOR).

    Refuses (ValueError) what would be measured on the wrong chip and published as if not: a GPU
    pool without a visible CUDA device, and Trainium, which this engine has no backend for (its
    host CPU would be measured instead)."""
    if accelerator == "cpu":
        return "cpu"
    if accelerator.startswith("nvidia-"):
        if not cuda_available:
            raise ValueError(f"the compile pod runs on the {accelerator} pool but torch sees no CUDA device (does "
                             "the node's device plugin give the pod its GPU, and is the image's torch a CUDA "
                             "build?); not measuring on the CPU in its place")
        return "cuda"
    if accelerator == "trainium2":
        raise ValueError("trainium2: this engine has no Neuron backend, so a compile pod on that pool could only "
                         "measure the host CPU; set the CompileRun's spec.hardware to a GPU or CPU pool")
    raise ValueError(f"unknown accelerator {accelerator!r} in $SHAPESHIFT_ACCELERATOR")


def unhonored_fields(spec: CompileRunSpec) -> list[str]:
    """CompileRun spec fields written away from their CRD defaults that this worker does not act
    on (each named with the value given), so a user who set one hears that it had no effect.
    The defaults are the CompileRun models' own."""
    models = {"tiers": TierSpec, "verification": VerificationSpec}
    out = []
    for (section, name), instead in _NOT_ACTED_ON.items():
        field = models[section].model_fields[name]
        given = getattr(spec, section)
        value = getattr(given, name)
        if name in given.model_fields_set and value != field.default:
            out.append(f"{section}.{field.alias or name}={json.dumps(value)} ({instead})")
    return out


def _given(section: Any, name: str) -> Any:
    """A spec field's value when the run's object carries it and it is not 0 or empty, else None:
    then the command line's default holds (job.py CRD_DEFAULTS_THAT_DIFFER says where it differs)."""
    value = getattr(section, name)
    return value if name in section.model_fields_set and value else None


class Deployment(NamedTuple):
    """A run's InferenceDeployment through its models (spec None: it does not parse)."""

    spec: InferenceDeploymentSpec | None
    status: InferenceDeploymentStatus


def run_profile(spec: CompileRunSpec, deployment: Deployment | None) -> TrafficProfile:
    """The traffic a run optimises for: spec.traffic's builtin or inline profile, else what the
    deployment observed (else what its pass was compiled for), else the chat profile."""
    traffic = spec.traffic
    if traffic.inline is not None:
        return traffic.inline
    if traffic.builtin:
        return builtin_profile(traffic.builtin)
    status = deployment.status if deployment is not None else None
    for observed in (status.observed_traffic, status.compiled_for) if status is not None else ():
        if observed is not None:
            return observed
    if traffic.prometheus is not None:
        raise ValueError("spec.traffic.prometheus: the deployment has no observed traffic in its status yet; "
                         "give spec.traffic.builtin or spec.traffic.inline")
    return builtin_profile("chat")


def job_request(given: JobRequest, spec: CompileRunSpec, run: str, deployment: Deployment | None,
                pod: CompilePodEnv) -> JobRequest:
    """`given` (the command line's request) completed from CompileRun `run` ("NAMESPACE/NAME"),
    its deployment, the pod's environment and the deployment's engine.yaml; what the command
    line gives wins. Writes the llm agent's API key, if the pod has one, to a 0600 file."""
    engine_cfg: dict[str, Any] = {}
    if pod.engine_config and Path(pod.engine_config).is_file():
        import yaml

        engine_cfg = yaml.safe_load(Path(pod.engine_config).read_text()) or {}
    elif pod.engine_config:
        log.warning("$SHAPESHIFT_ENGINE_CONFIG names %s, which does not exist (in a pod it is the engine "
                    "ConfigMap's volume); measuring with the InferenceDeployment's model and engine defaults",
                    pod.engine_config)
    filled: dict[str, Any] = {"compile_run": run}
    if given.engine_base is None:
        filled["engine_base"] = {k: engine_cfg[k] for k in DEPLOYED_ENGINE_FIELDS if engine_cfg.get(k) is not None}
    if given.model is None:
        preset = deployment.spec.model.preset if deployment is not None and deployment.spec is not None else None
        filled["model"] = engine_cfg.get("model") or preset
        if filled["model"] is None:
            raise ValueError(f"CompileRun {run}: no model: neither $SHAPESHIFT_ENGINE_CONFIG nor the "
                             "InferenceDeployment names one")
    filled["dtype"] = given.dtype or engine_cfg.get("dtype")
    if given.max_model_len is None and engine_cfg.get("max_model_len"):
        filled["max_model_len"] = int(engine_cfg["max_model_len"])
    if given.profile is None:
        filled["profile"] = run_profile(spec, deployment)
    if given.budget_trials is None and _given(spec.budget, "trials"):
        filled["budget_trials"] = spec.budget.trials
    if given.budget_seconds is None and _given(spec.budget, "wall_clock_seconds"):
        filled["budget_seconds"] = float(spec.budget.wall_clock_seconds)
    if given.agents is None and "agents" in spec.model_fields_set:  # never empty (CompileRunSpec)
        names, llm_index = agent_names(spec.agents)
        if llm_index is not None:
            llm = spec.agents[llm_index].llm
            filled["llm_url"], filled["llm_model"] = llm.endpoint, llm.model
            key = pod.agent_api_keys.get(llm_index)
            if key:
                filled["llm_key_file"] = str(_key_file(pod.work_dir or given.out or DEFAULT_OUT, key))
        filled["agents"] = tuple(names)
    if spec.slo is not None:  # 0 is a value here (no per-user streaming rate promised)
        for field_name, name in (("slo_ttft_p90_s", "ttft_p90_seconds"),
                                 ("slo_per_user_tokens_per_s_p90", "per_user_tokens_per_second_p90")):
            if getattr(given, field_name) is None and getattr(spec.slo, name) is not None:
                filled[field_name] = float(getattr(spec.slo, name))
    for field_name, section, name in (("fast_layers", spec.tiers, "fast_layers"),
                                      ("confirm_requests", spec.tiers, "replay_requests"),
                                      ("confirm_repeats", spec.tiers, "repeats"),
                                      ("verify_steps", spec.verification, "greedy_steps"),
                                      ("verify_prompts", spec.verification, "fresh_prompts"),
                                      ("min_speedup", spec.baseline, "min_speedup")):
        if getattr(given, field_name) is None and _given(section, name):
            filled[field_name] = getattr(section, name)
    for field_note in unhonored_fields(spec):
        log.warning("CompileRun %s: spec.%s is not acted on by this worker", run, field_note)
    if given.out is None and pod.work_dir:
        filled["out"] = str(Path(pod.work_dir) / run.split("/")[1])
    filled["artifact_dir"] = given.artifact_dir or pod.artifact_dir or None
    if given.device is None and pod.accelerator:
        import torch

        filled["device"] = device_for_accelerator(pod.accelerator, torch.cuda.is_available())
    return dataclasses.replace(given, **filled)


def _key_file(folder: str, key: str) -> Path:
    """The key in a 0600 file under `folder` (the LLM agent reads keys from files, like a mounted Secret)."""
    folder = Path(folder) / ".keys"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llm-api-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return path


def _load_client(kubeconfig: str | None) -> Any:
    import kubernetes

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
        return kubernetes.client.ApiClient()
    return kubernetes.config.new_client_from_config(config_file=kubeconfig or os.environ.get("KUBECONFIG"))


class CompileRunContext:
    def __init__(self, api_client: Any, namespace: str, name: str, min_patch_interval_s: float = 2.0):
        import kubernetes

        self.api_client = api_client
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.namespace, self.name = namespace, name
        self.min_patch_interval_s = min_patch_interval_s
        self._last_patch = 0.0
        self.obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", name)
        self.champion_name: str | None = None
        self.champion_spec_sha256: str | None = None
        self.artifact_uri: str | None = None
        self.artifact_durable = False
        self.artifact_dir: str | None = None
        self.counts = {"total": 0, "improved": 0, "rejected": 0, "failed": 0}
        self.pass_to_beat_name: str | None = None

    @classmethod
    def connect(cls, ref: str, kubeconfig: str | None = None) -> "CompileRunContext":
        if ref.count("/") != 1 or not all(ref.split("/")):
            raise SystemExit(f"shapeshift compile: --compile-run takes NAMESPACE/NAME, got {ref!r}")
        namespace, name = ref.split("/")
        return cls(_load_client(kubeconfig), namespace, name)

    # ------------------------------------------------------------------ spec -> settings
    @functools.cached_property
    def spec(self) -> CompileRunSpec:
        """The run's spec through its model (parsed on first use, so a spec this worker cannot
        read is reported on the CompileRun like any other failure)."""
        try:
            return CompileRunSpec.model_validate(self.obj.get("spec") or {})
        except ValueError as exc:
            raise ValueError(f"CompileRun {self.namespace}/{self.name}: its spec does not parse: {exc}") from exc

    def _deployment(self) -> Deployment | None:
        """The run's InferenceDeployment (spec, status) through its models; None when it cannot be
        read, and no spec when its spec does not parse (its status still counts)."""
        ref = self.spec.deployment_ref.name
        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, "inferencedeployments", ref)
        except Exception as exc:  # noqa: BLE001 - the run may name a deployment that is gone
            log.warning("cannot read InferenceDeployment %s/%s: %s", self.namespace, ref, exc)
            return None
        try:
            spec = InferenceDeploymentSpec.model_validate(obj.get("spec") or {})
        except ValueError as exc:
            log.warning("InferenceDeployment %s/%s: its spec does not parse (%s)", self.namespace, ref, exc)
            spec = None
        return Deployment(spec, InferenceDeploymentStatus.model_validate(obj.get("status") or {}))

    def pass_to_beat(self, stock_source: str, cache_dir: Path, fit: Any = None) -> Any:
        """The forward pass the champion must beat besides the stock pass, as a Candidate: the
        run's spec.baseline.forwardPass, else the deployment's active one (None: only stock).

        `fit` (optional) takes the candidate into the run's search space and raises when it does
        not fit. A named one that cannot be read or fitted fails the run (ValueError): its
        comparison was asked for. The active one is best effort: then the run compares with the
        stock pass alone and says so in its log."""
        from shapeshift.engine.compile.pass_to_beat import from_forward_pass

        named = self.spec.baseline.forward_pass
        name = named
        if not name:
            deployment = self._deployment()
            active = deployment.status.active_forward_pass if deployment is not None else None
            name = active.name if active is not None else None
        if not name or name == "stock":
            return None
        where = "spec.baseline.forwardPass" if named else "the deployment's active forward pass"
        try:
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, "forwardpasses", name)
            cand = from_forward_pass(obj, stock_source, cache_dir)
            if fit is not None:  # into the run's search space (the caller raises when it does not fit)
                cand = fit(cand)
        except Exception as exc:  # noqa: BLE001 - not found, forbidden, unreadable artifact, bad bundle
            detail = f"ForwardPass {self.namespace}/{name} ({where}) cannot be compared with: {_reason(exc)}"
            if named:
                raise ValueError(detail) from exc
            log.warning("%s; comparing with the stock forward pass only", detail)
            return None
        self.pass_to_beat_name = name
        log.info("the champion must beat %s (%s) besides the stock forward pass", name, where)
        return cand

    def job_request(self, given: JobRequest, environ: Any = os.environ) -> JobRequest:
        """`given` (the command line's request) completed from this run (see `job_request`)."""
        request = job_request(given, self.spec, f"{self.namespace}/{self.name}", self._deployment(),
                              CompilePodEnv.from_environ(environ))
        self.artifact_dir = request.artifact_dir
        return request

    # ------------------------------------------------------------------ status
    def _patch(self, status: dict[str, Any], clear: tuple[str, ...] = ()) -> None:
        """Merge-patch the status; None values are left out, except the fields in `clear`,
        which are removed (a JSON merge patch deletes a key given as null)."""
        body = {"status": {k: v for k, v in status.items() if v is not None or k in clear}}
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.namespace, "compileruns", self.name, body)

    def status_body(self, st: dict[str, Any]) -> dict[str, Any]:
        self.counts = {"total": int(st.get("trials", 0)), "improved": int(st.get("improved", 0)),
                       "rejected": int(st.get("rejected", 0)), "failed": int(st.get("failed", 0))}
        board = [{"candidate": row["digest"], "agent": (row.get("agent") or "")[:63] or None,
                  "speedup": row.get("speedup"), "tokensPerSecond": row.get("throughput"),
                  "verified": row.get("verified")} for row in (st.get("leaderboard") or [])][:20]
        eta = st.get("eta_s")
        message = (f"{st.get('trials', 0)} trials, {st.get('confirms', 0)} confirmed on the full tier; "
                   + (f"best verified speedup {st['best_speedup']:.3f}x" if st.get("best_speedup") else "no verified gain yet")
                   + (f"; ETA {eta:.0f}s" if eta is not None else ""))
        return {"trials": self.counts, "bestSpeedup": st.get("best_speedup"), "leaderboard": board,
                "message": message[:4096]}

    def patch_status(self, st: dict[str, Any]) -> None:
        now = time.monotonic()
        final = st.get("phase") == "Succeeded"
        if not final and now - self._last_patch < self.min_patch_interval_s:
            return
        self._last_patch = now
        try:
            self._patch(self.status_body(st))
        except Exception as exc:  # noqa: BLE001 - status is best effort while the search runs
            log.warning("patching CompileRun %s/%s status failed: %s", self.namespace, self.name, exc)

    def store_artifact(self, entry: Any, bundle_dir: Path) -> Path:
        """The champion packed as <sha256>.tar.gz: in the artifact folder (shared, durable) when one
        is set, else next to the bundle in the work folder. Written under a temporary name and
        renamed, so a reader on the shared volume never sees half an archive."""
        from shapeshift.engine.forward_pass.bundle import pack_bundle

        folder = Path(self.artifact_dir) if self.artifact_dir else Path(bundle_dir).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"artifact folder {folder} cannot be created ({exc}); mount a writable volume there "
                          "or unset $SHAPESHIFT_ARTIFACT_DIR / --artifact-dir") from exc
        archive = folder / f"{entry.bundle_digest}.tar.gz"
        with tempfile.TemporaryDirectory(prefix=".partial-", dir=folder) as tmp:
            partial = Path(tmp) / archive.name
            pack_bundle(bundle_dir, partial)
            shutil.move(str(partial), str(archive))
        self.artifact_durable = self.artifact_dir is not None
        return archive

    def publish(self, entry: Any, bundle_dir: Path) -> None:
        archive = self.store_artifact(entry, bundle_dir)
        self.artifact_uri = archive.resolve().as_uri()
        annotations = {ARTIFACT_DURABLE_ANNOTATION: "true" if self.artifact_durable else "false"}
        if not self.artifact_durable:
            log.warning("champion archive %s lives in the compile pod's work folder and is lost when the pod ends; "
                        "engines cannot fetch it. Set $SHAPESHIFT_ARTIFACT_DIR (or --artifact-dir) to a folder on a "
                        "volume the engine pods mount", archive)
        # The run identity the rollout checks (operator/provenance.py): this run's uid on the pass, and
        # the pass's name and spec digest in this run's status, which only this pod's Role may patch.
        annotations[COMPILE_RUN_UID_ANNOTATION] = self.obj["metadata"]["uid"]
        entry = dataclasses.replace(entry, compile_run=f"{self.namespace}/{self.name}")
        size, env = archive.stat().st_size, engine_env()
        obj = ClusterRegistry(self.custom, self.namespace).publish(entry, self.artifact_uri, size,
                                                                   annotations=annotations, engine_env=env)
        self.champion_name = obj["metadata"]["name"]
        self.champion_spec_sha256 = forward_pass_spec(entry, self.artifact_uri, size, env).digest()
        self._patch({"champion": self.champion_name, "championSpecSha256": self.champion_spec_sha256})

    def finish(self, result: Any, exported: dict[str, Any] | None) -> None:
        if result.champion is None:
            beaten = f" and ForwardPass {self.pass_to_beat_name}" if self.pass_to_beat_name else ""
            message = f"no verified improvement over the shipped serving default{beaten} ({result.stop_reason})"
        else:
            message = (f"champion {self.champion_name or result.champion.digest[:12]}: {result.speedup:.3f}x the "
                       f"shipped serving default, verified ({result.stop_reason})")
            if self.artifact_uri and not self.artifact_durable:
                message += (f"; its bundle {self.artifact_uri} is in the compile pod's work folder and is lost with "
                            "the pod, so it is not rolled out (give the InferenceDeployment spec.artifacts.pvc, a "
                            "shared claim, or set SHAPESHIFT_ARTIFACT_DIR to a shared volume)")
        # Without a champion there is no best verified speedup, even if an incumbent reported
        # one while the search ran and then lost the final comparison with the stock pass.
        champion = self.champion_name if result.champion is not None else None
        speedup = result.speedup if result.champion is not None else None
        digest = self.champion_spec_sha256 if result.champion is not None else None
        self._patch({"trials": self.counts | {"total": result.trials}, "bestSpeedup": speedup,
                     "champion": champion, "championSpecSha256": digest, "message": message},
                    clear=("bestSpeedup", "champion", "championSpecSha256"))

    def fail(self, message: str) -> None:
        try:
            self._patch({"message": f"compile worker failed: {message}"[:4096]})
        except Exception as exc:  # noqa: BLE001
            log.warning("could not report the failure to the CompileRun: %s", exc)

    def nearest_champions(self, signature: str, hardware: str, profile: TrafficProfile, family: str, k: int = 3):
        try:
            return ClusterRegistry(self.custom, self.namespace).nearest_champions(signature, hardware, profile, k, family)
        except Exception as exc:  # noqa: BLE001 - seeding is optional
            log.warning("reading ForwardPass champions failed: %s", exc)
            return []


def _reason(exc: Exception) -> str:
    """An API error as "404 Not Found", anything else as its message."""
    status = getattr(exc, "status", None)
    return f"{status} {getattr(exc, 'reason', '')}".strip() if status else str(exc)
