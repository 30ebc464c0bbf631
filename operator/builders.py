"""Pure builders of the objects the operator owns. No I/O, no clock.

    InferenceDeployment (Parent + InferenceDeploymentSpec)
        -> build_engine_configmap  ConfigMap  <name>-engine     engine.yaml (EngineConfig fields)
        -> build_engine_deployment Deployment <name>-engine     engine server pods on the pool; each
                                   engine follows its pod's forward-pass annotations through a
                                   downwardAPI volume (engine/contracts/pod_annotations.py); under the
                                   Restart strategy the rollout passes the template's annotations;
                                   spec.artifacts.pvc mounted read-only at ARTIFACT_MOUNT
        -> build_engine_service    Service    <name>            port http -> the pods
    CompileRun (Parent + CompileRunSpec) + its deployment's spec
        -> build_compile_rbac      ServiceAccount, Role, RoleBinding  <run>-compile
        -> build_compile_job       Job        <run>-compile     `shapeshift compile --compile-run ns/run`;
                                   the deployment's spec.artifacts.pvc mounted read-write at
                                   ARTIFACT_MOUNT, named by $SHAPESHIFT_ARTIFACT_DIR, where the
                                   worker writes the champion as <sha256>.tar.gz, and its folder
                                   compile-runs/<run uid> mounted as the run's output folder (board,
                                   report), so that a retried pod resumes the board

The artifact store sits at the same path in compile and engine pods, so the file path the
worker records in the ForwardPass is the path the engine's rollout agent opens.

Every child carries a controller owner reference to its parent (so the
garbage collector deletes it with the parent), the parent's labels, and a
`shapeshift.dev/spec-hash` annotation: the sha256 of the desired object. The
handlers compare that hash with what is in the cluster and write only when
it differs, which is what makes a resync a no-op.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

from shapeshift.engine.contracts import compile_pod_env as pod_env
from shapeshift.engine.contracts.pod_annotations import (
    DEFAULT_ANNOTATIONS_FILE,
    DOWNWARD_API_MOUNT_PATH,
    podinfo_volume,
    podinfo_volume_mount,
    serve_args,
)
from shapeshift.operator.hardware import accelerator, placement
from shapeshift.operator.api import (
    API_VERSION,
    ARTIFACT_MOUNT,
    GROUP,
    CompileRunSpec,
    HardwareSpec,
    InferenceDeploymentSpec,
)

SPEC_HASH = f"{GROUP}/spec-hash"
CONFIG_HASH = f"{GROUP}/config-sha256"
LABEL_DEPLOYMENT = f"{GROUP}/inference-deployment"
LABEL_RUN = f"{GROUP}/compile-run"
LABEL_COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "shapeshift-operator", "app.kubernetes.io/part-of": "shapeshift"}

MODEL_MOUNT = "/models"
# Siblings under /etc/shapeshift, never nested: a volume mounted inside a read-only one
# needs its mount point created in a read-only file system, which container runtimes refuse.
CONFIG_MOUNT = "/etc/shapeshift/config"
ADMIN_TOKEN_MOUNT = "/etc/shapeshift/admin"
ADMIN_TOKEN_FILE = "token"
WORK_MOUNT = "/var/lib/shapeshift"
ENGINE_CONFIG_KEY = "engine.yaml"


@dataclass(frozen=True)
class Parent:
    """The owner of the objects being built."""

    kind: str
    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "Parent":
        meta = body["metadata"]
        return cls(kind=body["kind"], name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


# ---- names and labels --------------------------------------------------------------------


def engine_deployment_name(name: str) -> str:
    return f"{name}-engine"


def engine_configmap_name(name: str) -> str:
    return f"{name}-engine"


def engine_service_name(name: str) -> str:
    return name


def compile_job_name(run: str) -> str:
    return f"{run}-compile"


def compile_account_name(run: str) -> str:
    return f"{run}-compile"


def engine_selector(name: str) -> dict[str, str]:
    """Pod selector of a deployment's engine pods (immutable once the Deployment exists)."""
    return {LABEL_DEPLOYMENT: name, LABEL_COMPONENT: "engine"}


def engine_labels(name: str) -> dict[str, str]:
    return {**MANAGED_BY, "app.kubernetes.io/name": "shapeshift-engine", "app.kubernetes.io/instance": name,
            **engine_selector(name)}


def compile_labels(run: str, deployment: str) -> dict[str, str]:
    return {**MANAGED_BY, "app.kubernetes.io/name": "shapeshift-compile", "app.kubernetes.io/instance": run,
            LABEL_COMPONENT: "compile", LABEL_RUN: run, LABEL_DEPLOYMENT: deployment}


def spec_hash(obj: Mapping[str, Any]) -> str:
    """sha256 of an object's canonical JSON, without its own hash annotation."""
    clean = json.loads(json.dumps(obj))
    clean.get("metadata", {}).get("annotations", {}).pop(SPEC_HASH, None)
    return hashlib.sha256(json.dumps(clean, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _finish(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})[SPEC_HASH] = spec_hash(obj)
    return obj


def _meta(name: str, parent: Parent, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": parent.namespace,
        "labels": dict(labels),
        "annotations": {},
        "ownerReferences": [parent.owner_reference()],
    }


def _placement(hw: HardwareSpec):
    return placement(
        hw.accelerator,
        hw.count,
        extra_node_selector=hw.node_selector,
        extra_tolerations=[t.model_dump(by_alias=True, exclude_none=True) for t in hw.tolerations or []],
        cpu=hw.cpu,
        memory=hw.memory,
    )


# ---- engine ------------------------------------------------------------------------------


def engine_config(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The engine's EngineConfig fields (snake_case, as `shapeshift.engine.core.config.EngineConfig` takes them)."""
    e = spec.engine
    acc = accelerator(spec.hardware.accelerator)
    cfg: dict[str, Any] = {
        "model": _model_arg(spec),
        "dtype": e.dtype,
        # "neuron" on Trainium: the engine refuses it by name rather than fall back to the host CPU
        "device": acc.device,
        "max_num_seqs": e.max_batch_size,
        "max_model_len": e.max_model_len,
        "block_size": e.kv_block_size,
        "enable_prefix_caching": e.prefix_caching,
        "enforce_eager": not e.cuda_graphs or acc.device != "cuda",
        "gpu_memory_utilization": e.gpu_memory_utilization,
    }
    if e.max_num_batched_tokens is not None:
        cfg["max_num_batched_tokens"] = e.max_num_batched_tokens
    return {k: v for k, v in cfg.items() if v is not None}


def _model_arg(spec: InferenceDeploymentSpec) -> str:
    if spec.model.preset:
        return spec.model.preset
    assert spec.model.pvc is not None
    path = spec.model.pvc.path.strip("/")
    return f"{MODEL_MOUNT}/{path}" if path else MODEL_MOUNT


def engine_args(spec: InferenceDeploymentSpec) -> list[str]:
    """Arguments of `shapeshift serve` for the engine container."""
    cfg = engine_config(spec)
    args = [
        "serve",
        "--model", cfg["model"],
        "--host", "0.0.0.0",
        "--port", str(spec.engine.port),
        "--served-model-name", spec.model.display_name,
        "--dtype", cfg["dtype"],
        "--max-num-seqs", str(cfg["max_num_seqs"]),
        "--max-model-len", str(cfg["max_model_len"]),
        "--block-size", str(cfg["block_size"]),
    ]
    if "max_num_batched_tokens" in cfg:
        args += ["--max-num-batched-tokens", str(cfg["max_num_batched_tokens"])]
    if "device" in cfg:
        args += ["--device", cfg["device"]]
    if not cfg["enable_prefix_caching"]:
        args.append("--no-prefix-caching")
    if cfg["enforce_eager"]:
        args.append("--enforce-eager")
    if spec.engine.metrics_compat is not None:
        args += ["--metrics-compat", spec.engine.metrics_compat]
    # The engine follows the pod's forward-pass annotations (the rollout writes them).
    args += serve_args(DEFAULT_ANNOTATIONS_FILE)
    if spec.engine.admin_token_secret is not None:
        args += ["--admin-token-file", f"{ADMIN_TOKEN_MOUNT}/{ADMIN_TOKEN_FILE}"]
    return args


def build_engine_configmap(parent: Parent, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    data = {
        ENGINE_CONFIG_KEY: yaml.safe_dump(engine_config(spec), sort_keys=True),
        "served-model-name": spec.model.display_name,
        "accelerator": spec.hardware.accelerator,
    }
    obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(engine_configmap_name(parent.name), parent, engine_labels(parent.name)),
        "data": data,
    }
    return _finish(obj)


def _model_volumes(spec: InferenceDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if spec.model.pvc is None:
        return [], []
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": spec.model.pvc.claim_name, "readOnly": True}}
    mount = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    return [volume], [mount]


def _artifact_volumes(spec: InferenceDeploymentSpec, *, writable: bool
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The deployment's artifact store: read-write for the compile worker, read-only for engines."""
    store = spec.artifacts.pvc if spec.artifacts is not None else None
    if store is None:
        return [], []
    claim: dict[str, Any] = {"claimName": store.claim_name}
    mount: dict[str, Any] = {"name": "artifacts", "mountPath": ARTIFACT_MOUNT}
    if not writable:
        claim["readOnly"] = True
        mount["readOnly"] = True
    if store.sub_path:
        mount["subPath"] = store.sub_path
    return [{"name": "artifacts", "persistentVolumeClaim": claim}], [mount]


RUN_FOLDERS = "compile-runs"  # on the artifact store: one folder per CompileRun (uid), its board and report


def _run_folder_mount(parent: Parent, spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    """The run's output folder on the artifact store, where the worker writes it.

    The worker writes its board, report and champion bundle to $SHAPESHIFT_WORK_DIR/<run name>
    (engine/compile/worker.py job_request). The work folder is the pod's emptyDir, which a retried
    pod (the Job's backoffLimit) does not get back; mounted there from the store instead, the folder
    outlives the pod, and the retry resumes the board (trials already on it are not measured
    again). Keyed by the run's uid, so a new run of the same name starts afresh; the rest of the
    work folder (an agent's API key file) stays in the emptyDir. No store: nothing is mounted and a
    retry starts over."""
    store = spec.artifacts.pvc if spec.artifacts is not None else None
    if store is None:
        return []
    folder = f"{RUN_FOLDERS}/{parent.uid}"
    return [{"name": "artifacts", "mountPath": f"{WORK_MOUNT}/{parent.name}",
             "subPath": f"{store.sub_path}/{folder}" if store.sub_path else folder}]


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": timeout,
            "failureThreshold": failures}


def _engine_volumes(spec: InferenceDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod-info (downward API) volume every engine reads, plus the admin token if configured."""
    assert podinfo_volume_mount()["mountPath"] == DOWNWARD_API_MOUNT_PATH
    volumes, mounts = [podinfo_volume()], [podinfo_volume_mount()]
    secret = spec.engine.admin_token_secret
    if secret is not None:
        volumes.append({"name": "admin-token", "secret": {
            "secretName": secret.name, "items": [{"key": secret.key, "path": ADMIN_TOKEN_FILE}],
            "defaultMode": 0o400}})
        mounts.append({"name": "admin-token", "mountPath": ADMIN_TOKEN_MOUNT, "readOnly": True})
    return volumes, mounts


def build_engine_deployment(parent: Parent, spec: InferenceDeploymentSpec,
                            template_annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The engine Deployment. ``template_annotations``: extra pod-template annotations (the
    forward pass the Restart strategy rolls out); a change to them rolls the pods."""
    place = _placement(spec.hardware)
    configmap = build_engine_configmap(parent, spec)
    model_volumes, model_mounts = _model_volumes(spec)
    engine_volumes, engine_mounts = _engine_volumes(spec)
    artifact_volumes, artifact_mounts = _artifact_volumes(spec, writable=False)
    port = spec.engine.port
    pod_labels = engine_labels(parent.name)
    pod_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
        # A changed engine config restarts the pods; the ConfigMap itself is not watched by the engine.
        CONFIG_HASH: configmap["metadata"]["annotations"][SPEC_HASH],
        **dict(template_annotations or {}),
    }
    container = {
        "name": "engine",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["shapeshift"],
        "args": engine_args(spec),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": [
            {"name": pod_env.INFERENCE_DEPLOYMENT, "value": parent.name},
            {"name": pod_env.ENGINE_CONFIG, "value": f"{CONFIG_MOUNT}/{ENGINE_CONFIG_KEY}"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *user_env(spec),
        ],
        "resources": place.resources,
        # Loading weights and capturing CUDA graphs can take minutes: the startup
        # probe allows 30 minutes before liveness takes over.
        "startupProbe": _probe("/health", 10, 180),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": [{"name": "engine-config", "mountPath": CONFIG_MOUNT, "readOnly": True}, *model_mounts,
                         *engine_mounts, *artifact_mounts],
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "engine-config", "configMap": {"name": engine_configmap_name(parent.name)}},
            *model_volumes,
            *engine_volumes,
            *artifact_volumes,
        ],
        "terminationGracePeriodSeconds": 60,
    }
    if place.node_selector:
        pod_spec["nodeSelector"] = place.node_selector
    if place.tolerations:
        pod_spec["tolerations"] = place.tolerations
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(engine_deployment_name(parent.name), parent, engine_labels(parent.name)),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": engine_selector(parent.name)},
            # Accelerator pools are usually full: replace pods one at a time
            # instead of surging an extra pod that would wait for a free device.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": {"labels": pod_labels, "annotations": pod_annotations}, "spec": pod_spec},
        },
    }
    return _finish(obj)


def build_engine_service(parent: Parent, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    meta = _meta(engine_service_name(parent.name), parent, engine_labels(parent.name))
    meta["annotations"].update({"prometheus.io/port": str(spec.engine.port), "prometheus.io/path": "/metrics"})
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": engine_selector(parent.name),
            "ports": [{"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    return _finish(obj)


# ---- compile -----------------------------------------------------------------------------


def compile_hardware(run: CompileRunSpec, deployment: InferenceDeploymentSpec) -> HardwareSpec:
    """The pool a run compiles on: its own hardware, else its deployment's."""
    return run.hardware or deployment.hardware


def build_compile_rbac(parent: Parent, run: CompileRunSpec) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding of one compile worker.

    Least privilege: the worker reads its own CompileRun and its deployment,
    patches only its own CompileRun's status, reads the ForwardPass registry
    to seed the search, and creates the ForwardPass it publishes. Nothing else
    (no Secrets: API keys arrive as environment variables through the kubelet).

    Kubernetes cannot narrow `create` by resourceNames (the name is not known when the request
    is authorized), so this Role lets a worker create ForwardPasses of any name. The API server
    narrows it by content: the chart's ValidatingAdmissionPolicy
    (charts/shapeshift/templates/admission-policy.yaml, value admissionPolicy.enabled) refuses a
    ForwardPass created or updated by a ServiceAccount `<run>-compile` unless it is in that
    account's namespace and its spec.compileRun is `<namespace>/<run>` or `<run>`. Behind it, the
    rollout's trust check (operator/provenance.py) rolls out a pass only when its spec.compileRun's
    status, which only that run's worker may patch, names it with its spec's digest: that also
    holds where the policy is not installed.
    """
    name = compile_account_name(parent.name)
    labels = compile_labels(parent.name, run.deployment_ref.name)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, parent, labels)}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(name, parent, labels),
        "rules": [
            {"apiGroups": [GROUP], "resources": ["compileruns"], "resourceNames": [parent.name], "verbs": ["get"]},
            {"apiGroups": [GROUP], "resources": ["compileruns/status"], "resourceNames": [parent.name],
             "verbs": ["get", "patch"]},
            {"apiGroups": [GROUP], "resources": ["inferencedeployments"],
             "resourceNames": [run.deployment_ref.name], "verbs": ["get"]},
            {"apiGroups": [GROUP], "resources": ["forwardpasses"], "verbs": ["get", "list", "create"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(name, parent, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": parent.namespace}],
    }
    return [_finish(sa), _finish(role), _finish(binding)]


def user_env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    """spec.engine.env as the engine container's env entries (reserved names are refused at
    admission); a credential as a secretKeyRef, never a literal."""
    out: list[dict[str, Any]] = []
    for e in spec.engine.env or []:
        if e.value_from is not None:
            ref = e.value_from.secret_key_ref
            out.append({"name": e.name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
        else:
            out.append({"name": e.name, "value": e.value})
    return out


def compile_command(parent: Parent) -> list[str]:
    return ["shapeshift", "compile", "--compile-run", f"{parent.namespace}/{parent.name}"]


def build_compile_job(parent: Parent, run: CompileRunSpec, deployment: InferenceDeploymentSpec) -> dict[str, Any]:
    """The Job that runs one compile worker on the run's pool."""
    hw = compile_hardware(run, deployment)
    place = _placement(hw)
    labels = compile_labels(parent.name, run.deployment_ref.name)
    model_volumes, model_mounts = _model_volumes(deployment)
    artifact_volumes, artifact_mounts = _artifact_volumes(deployment, writable=True)
    env = pod_env.CompilePodEnv(
        namespace=parent.namespace, compile_run=parent.name, inference_deployment=run.deployment_ref.name,
        accelerator=hw.accelerator, budget_wall_clock_seconds=run.budget.wall_clock_seconds,
        budget_trials=run.budget.trials, engine_config=f"{CONFIG_MOUNT}/{ENGINE_CONFIG_KEY}", work_dir=WORK_MOUNT,
        # The worker writes <sha256>.tar.gz here and records its path in the ForwardPass; without
        # it the archive stays in the pod's emptyDir and the ForwardPass is marked not durable.
        artifact_dir=ARTIFACT_MOUNT if artifact_mounts else None,
        # Literal values only: credentials (valueFrom) serve requests, the compile pod only measures.
        engine_env=tuple((e.name, e.value) for e in deployment.engine.env or [] if e.value_from is None),
        agent_api_key_secrets={
            index: pod_env.SecretKeySelector(agent.llm.api_key_secret_ref.name, agent.llm.api_key_secret_ref.key)
            for index, agent in enumerate(run.agents) if agent.llm is not None and agent.llm.api_key_secret_ref},
    ).to_env()
    container = {
        "name": "compile",
        "image": run.image or deployment.engine.image,
        "imagePullPolicy": deployment.engine.image_pull_policy,
        "command": compile_command(parent)[:1],
        "args": compile_command(parent)[1:],
        "env": env,
        "resources": place.resources,
        "volumeMounts": [
            {"name": "engine-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "work", "mountPath": WORK_MOUNT},
            *model_mounts,
            *artifact_mounts,
            *_run_folder_mount(parent, deployment),
        ],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": compile_account_name(parent.name),
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "engine-config", "configMap": {"name": engine_configmap_name(run.deployment_ref.name)}},
            {"name": "work", "emptyDir": {}},
            *model_volumes,
            *artifact_volumes,
        ],
    }
    if place.node_selector:
        pod_spec["nodeSelector"] = place.node_selector
    if place.tolerations:
        pod_spec["tolerations"] = place.tolerations
    job_spec: dict[str, Any] = {
        "backoffLimit": run.backoff_limit,
        "completions": 1,
        "parallelism": 1,
        "template": {"metadata": {"labels": labels}, "spec": pod_spec},
    }
    deadline = run.budget.active_deadline_seconds
    if deadline is not None:
        job_spec["activeDeadlineSeconds"] = deadline
    obj = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(compile_job_name(parent.name), parent, labels),
        "spec": job_spec,
    }
    return _finish(obj)
