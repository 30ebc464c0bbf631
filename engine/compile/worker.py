"""The compile worker's side of a CompileRun: read the run, report progress, publish the champion.

Data flow (inside the compile pod, `shapeshift compile --compile-run NS/NAME`):
    API: CompileRun NS/NAME (spec) + its InferenceDeployment (model, when no engine config)
      + $SHAPESHIFT_ENGINE_CONFIG (the deployment's engine.yaml: model, dtype, context)
      + $SHAPESHIFT_AGENT_<i>_API_KEY (LLM keys the kubelet took from Secrets)
      --apply_to_args--> the CLI's settings (model, profile, budget, agents, tiers, baseline)
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

import argparse
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from shapeshift.engine.contracts.traffic_profile import TrafficProfile, builtin_profile
from shapeshift.engine.compile.champions import GROUP, VERSION, ClusterRegistry

log = logging.getLogger(__name__)

AGENT_KINDS = {"coordinate-sweep": "sweep", "evolutionary": "evolve", "model-based": "bayes", "llm": "llm"}
# engine.yaml keys (EngineConfig fields) the measuring engines take over from the deployment
DEPLOYED_ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "block_size")
ARTIFACT_DURABLE_ANNOTATION = f"{GROUP}/artifact-durable"
ENGINE_ENV_NAMES = "SHAPESHIFT_ENGINE_ENV_NAMES"  # comma-separated; set by the operator in compile pods


def engine_env(environ: Any = os.environ) -> list[dict[str, str]] | None:
    """The deployment's spec.engine.env as this process sees it, from the names the operator lists
    in $SHAPESHIFT_ENGINE_ENV_NAMES; None when that variable is unset (not an operator's pod)."""
    names = environ.get(ENGINE_ENV_NAMES)
    if names is None:
        return None
    return [{"name": n, "value": environ.get(n, "")} for n in sorted({n.strip() for n in names.split(",")} - {""})]


# CompileRun spec fields the worker does not act on yet: (section, field) -> what happens instead
_NOT_ACTED_ON = {
    ("tiers", "fast"): "every candidate is screened on the fast tier",
    ("tiers", "full"): "every candidate is confirmed on the full tier",
    ("verification", "logprob_tolerance"): "the gates use their own tolerances",
    ("verification", "kv_contamination"): "the KV-contamination gates always run",
}


def agent_names(agents: list[dict[str, Any]]) -> tuple[list[str], int | None]:
    """The CLI's agent list for a CompileRun's spec.agents, each kind repeated `replicas` times,
    and the index of the llm agent whose endpoint is used (the first; the CLI takes one)."""
    names: list[str] = []
    llm_index = None
    for index, agent in enumerate(agents):
        kind = AGENT_KINDS.get(agent.get("kind"))
        if kind is None:
            continue
        if kind == "llm":
            if llm_index is not None:
                log.warning("spec.agents[%d]: one LLM endpoint per run; spec.agents[%d]'s is used (give it "
                            "replicas for more instances)", index, llm_index)
                continue
            llm_index = index
        names.extend([kind] * int(agent.get("replicas") or 1))
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


def unhonored_fields(spec: dict[str, Any]) -> list[str]:
    """CompileRun spec fields set away from their CRD defaults that this worker does not act
    on (each named with the value given), so a user who set one hears that it had no effect.
    The defaults are the CompileRun models' own."""
    from shapeshift.operator.api import TierSpec, VerificationSpec

    models = {"tiers": TierSpec, "verification": VerificationSpec}
    out = []
    for (section, name), instead in _NOT_ACTED_ON.items():
        field = models[section].model_fields[name]
        wire = field.alias or name
        given = spec.get(section) or {}
        if wire in given and given[wire] != field.default:
            value = given[wire] if isinstance(given[wire], str) else json.dumps(given[wire])  # as written
            out.append(f"{section}.{wire}={value} ({instead})")
    return out


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
        self.spec: dict[str, Any] = self.obj.get("spec", {})
        self.champion_name: str | None = None
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
    def _deployment(self) -> dict[str, Any] | None:
        ref = (self.spec.get("deploymentRef") or {}).get("name")
        if not ref:
            return None
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, "inferencedeployments", ref)
        except Exception as exc:  # noqa: BLE001 - the run may name a deployment that is gone
            log.warning("cannot read InferenceDeployment %s/%s: %s", self.namespace, ref, exc)
            return None

    def profile(self, deployment: dict[str, Any] | None) -> TrafficProfile:
        traffic = self.spec.get("traffic") or {}
        if traffic.get("inline"):
            return TrafficProfile.model_validate(traffic["inline"])
        if traffic.get("builtin"):
            return builtin_profile(traffic["builtin"])
        status = (deployment or {}).get("status") or {}
        for key in ("observedTraffic", "compiledFor"):
            if status.get(key):
                return TrafficProfile.model_validate(status[key])
        if traffic.get("prometheus"):
            raise ValueError("spec.traffic.prometheus: the deployment has no observed traffic in its status yet; "
                             "give spec.traffic.builtin or spec.traffic.inline")
        return builtin_profile("chat")

    def pass_to_beat(self, stock_source: str, cache_dir: Path, fit: Any = None) -> Any:
        """The forward pass the champion must beat besides the stock pass, as a Candidate: the
        run's spec.baseline.forwardPass, else the deployment's active one (None: only stock).

        `fit` (optional) takes the candidate into the run's search space and raises when it does
        not fit. A named one that cannot be read or fitted fails the run (ValueError): its
        comparison was asked for. The active one is best effort: then the run compares with the
        stock pass alone and says so in its log."""
        from shapeshift.engine.compile.pass_to_beat import from_forward_pass

        named = (self.spec.get("baseline") or {}).get("forwardPass")
        name = named
        if not name:
            status = (self._deployment() or {}).get("status") or {}
            name = (status.get("activeForwardPass") or {}).get("name")
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

    def apply_to_args(self, args: argparse.Namespace) -> None:
        """Fill the CLI settings from the run (explicit command-line values win)."""
        deployment = self._deployment()
        engine_file = os.environ.get("SHAPESHIFT_ENGINE_CONFIG")
        engine_cfg: dict[str, Any] = {}
        if engine_file and Path(engine_file).is_file():
            import yaml

            engine_cfg = yaml.safe_load(Path(engine_file).read_text()) or {}
        elif engine_file:
            log.warning("$SHAPESHIFT_ENGINE_CONFIG names %s, which does not exist (in a pod it is the engine "
                        "ConfigMap's volume); measuring with the InferenceDeployment's model and engine defaults",
                        engine_file)
        if getattr(args, "engine_base", None) is None:
            args.engine_base = {k: engine_cfg[k] for k in DEPLOYED_ENGINE_FIELDS if engine_cfg.get(k) is not None}
        if args.model is None:
            args.model = engine_cfg.get("model") or ((deployment or {}).get("spec", {}).get("model", {}) or {}).get("preset")
        if args.model is None:
            raise ValueError(f"CompileRun {self.namespace}/{self.name}: no model: neither $SHAPESHIFT_ENGINE_CONFIG "
                             "nor the InferenceDeployment names one")
        args.dtype = args.dtype or engine_cfg.get("dtype")
        if args.max_model_len is None and engine_cfg.get("max_model_len"):
            args.max_model_len = int(engine_cfg["max_model_len"])
        if args.profile_given is None:
            args.profile = self.profile(deployment)
        budget = self.spec.get("budget") or {}
        if args.budget_trials is None and budget.get("trials"):
            args.budget_trials = int(budget["trials"])
        if args.budget_seconds is None and args.budget is None and budget.get("wallClockSeconds"):
            args.budget_seconds = float(budget["wallClockSeconds"])
        agents = self.spec.get("agents") or []
        if agents and args.agents_given is None:
            names, llm_index = agent_names(agents)
            if llm_index is not None:
                llm = agents[llm_index].get("llm") or {}
                args.llm_url, args.llm_model = llm.get("endpoint"), llm.get("model")
                key = os.environ.get(f"SHAPESHIFT_AGENT_{llm_index}_API_KEY")
                if key:
                    args.llm_key_file = str(self._key_file(args, key))
            args.agents = ",".join(names)
        tiers = self.spec.get("tiers") or {}
        if args.fast_layers is None and tiers.get("fastLayers"):
            args.fast_layers = int(tiers["fastLayers"])
        if args.confirm_requests is None and tiers.get("replayRequests"):
            args.confirm_requests = int(tiers["replayRequests"])
        if args.confirm_repeats is None and tiers.get("repeats"):
            args.confirm_repeats = int(tiers["repeats"])
        verification = self.spec.get("verification") or {}
        if args.verify_steps is None and verification.get("greedySteps"):
            args.verify_steps = int(verification["greedySteps"])
        if args.verify_prompts is None and verification.get("freshPrompts"):
            args.verify_prompts = int(verification["freshPrompts"])
        baseline = self.spec.get("baseline") or {}
        if args.min_speedup is None and baseline.get("minSpeedup"):
            args.min_speedup = float(baseline["minSpeedup"])
        for field_note in unhonored_fields(self.spec):
            log.warning("CompileRun %s/%s: spec.%s is not acted on by this worker", self.namespace, self.name,
                        field_note)
        work = os.environ.get("SHAPESHIFT_WORK_DIR")
        if args.out_given is None and work:
            args.out = str(Path(work) / self.name)
        self.artifact_dir = args.artifact_dir = args.artifact_dir or os.environ.get("SHAPESHIFT_ARTIFACT_DIR") or None
        accelerator = os.environ.get("SHAPESHIFT_ACCELERATOR")
        if args.device is None and accelerator:
            import torch

            args.device = device_for_accelerator(accelerator, torch.cuda.is_available())
        args.compile_run = f"{self.namespace}/{self.name}"

    def _key_file(self, args: argparse.Namespace, key: str) -> Path:
        """The key in a 0600 file (the LLM agent reads keys from files, like a mounted Secret)."""
        folder = Path(os.environ.get("SHAPESHIFT_WORK_DIR") or args.out) / ".keys"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "llm-api-key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        return path

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
        obj = ClusterRegistry(self.custom, self.namespace).publish(entry, self.artifact_uri, archive.stat().st_size,
                                                                   annotations=annotations, engine_env=engine_env())
        self.champion_name = obj["metadata"]["name"]

    def finish(self, result: Any, exported: dict[str, Any] | None) -> None:
        if result.champion is None:
            beaten = f" and ForwardPass {self.pass_to_beat_name}" if self.pass_to_beat_name else ""
            message = f"no verified improvement over the stock forward pass{beaten} ({result.stop_reason})"
        else:
            message = (f"champion {self.champion_name or result.champion.digest[:12]}: {result.speedup:.3f}x the "
                       f"stock pass, verified ({result.stop_reason})")
            if self.artifact_uri and not self.artifact_durable:
                message += (f"; its bundle {self.artifact_uri} is in the compile pod's work folder and is lost with "
                            "the pod, so it is not rolled out (give the InferenceDeployment spec.artifacts.pvc, a "
                            "shared claim, or set SHAPESHIFT_ARTIFACT_DIR to a shared volume)")
        # Without a champion there is no best verified speedup, even if an incumbent reported
        # one while the search ran and then lost the final comparison with the stock pass.
        champion = self.champion_name if result.champion is not None else None
        speedup = result.speedup if result.champion is not None else None
        self._patch({"trials": self.counts | {"total": result.trials}, "bestSpeedup": speedup,
                     "champion": champion, "message": message}, clear=("bestSpeedup", "champion"))

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
