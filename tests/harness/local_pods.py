"""A local kubelet for kwok's CPU nodes: every pod scheduled there runs as local processes.

harness.kubelet runs one named pod; this module keeps doing it for all pods of some
namespaces, the way a node's kubelet would, so that the operator's engine Deployments and
compile Jobs do something on a laptop (hack/run-pods-local.py; docs/local-operator.md):

    every `interval_s`: API list pods of the namespaces, nodes of the pools (label shapeshift.dev/pool)
      -> a pod bound to one of those nodes, Running (kwok), not yet started
           -> harness.kubelet.LocalPod: its containers' command lines as local processes
              `shapeshift serve ...` (an engine): --host/--port replaced by 127.0.0.1 and a free
                 loopback port from `port_base` up (pods of one Deployment share a containerPort)
              anything else (the compile Job's `shapeshift compile --compile-run ns/run`): as written
              emptyDir and configMap volumes: folders under <workdir>/volumes (harness.kubelet)
              persistentVolumeClaim volumes: <workdir>/claims/<namespace>/<claim>, shared by the pods
                 of a namespace that mount the claim, as pods share a ReadWriteMany claim
              the pod's ServiceAccount: a token from the TokenRequest API (bound to the pod, as the
                 kubelet's projected token is) in a kubeconfig that KUBECONFIG names, so a process
                 that talks to the API (the compile worker) has the pod's rights, not the runner's
      -> every container of a started pod exited  -> LocalPod.wait(): phase Succeeded/Failed and
           containerStatuses reported to the API (the Job controller and the operator read them)
      -> a started pod deleted or terminating     -> LocalPod.stop(): SIGTERM, SIGKILL after the grace
    stop_all(): every running pod stopped and reported, as a node going down.
    prometheus_targets(): the engines as Prometheus file_sd target groups, labelled namespace,
      deployment (the pod's InferenceDeployment) and pod as a ServiceMonitor labels them, so a
      local Prometheus can feed the drift detector and the canary analysis.

An exit is final, as in harness.kubelet: no restarts, no probes (kwok reports the pods Ready).
"""

from __future__ import annotations

import base64
import os
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import kubernetes
import yaml
from kubernetes.client import ApiException, CoreV1Api, V1Pod

from harness.controlplane import POOL_LABEL
from harness.kubelet import LocalPod, PodSpecError
from shapeshift.operator.builders import LABEL_DEPLOYMENT

VENV_BIN = Path(sys.executable).parent
DEFAULT_POOLS = ("cpu",)


def is_engine(container) -> bool:
    """The container runs `shapeshift serve` (the operator's engine container)."""
    argv = [*(container.command or []), *(container.args or [])]
    return len(argv) >= 2 and Path(argv[0]).name == "shapeshift" and argv[1] == "serve"


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class RunningPod:
    pod: LocalPod
    uid: str
    url: str | None  # the engine's base URL on loopback; None for pods that serve nothing
    deployment: str = ""  # the InferenceDeployment the pod serves (its label), "" for other pods


class LocalPodRunner:
    """Runs the pods of `namespaces` (None: every namespace) bound to nodes of `pools`."""

    def __init__(self, api_client: kubernetes.client.ApiClient, namespaces: list[str] | None, workdir: Path, *,
                 pools: tuple[str, ...] = DEFAULT_POOLS, host: str = "127.0.0.1", port_base: int = 18000,
                 extra_env: dict[str, str] | None = None, serve_flags: dict[str, str] | None = None,
                 log: Callable[[str], None] = print):
        self.api_client, self.core = api_client, CoreV1Api(api_client)
        self.namespaces, self.workdir, self.pools = namespaces, Path(workdir), tuple(pools)
        self.host, self.port_base = host, port_base
        self.serve_flags = dict(serve_flags or {})
        # `shapeshift` and the interpreter of this checkout's venv come first on the PATH
        self.extra_env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONSAFEPATH": "1",
                          **(extra_env or {})}
        self.log = log
        self.running: dict[tuple[str, str], RunningPod] = {}
        self.refused: set[str] = set()  # uids of pods that cannot run locally (said once)
        self.waiting: set[str] = set()  # uids of pods waiting for their ServiceAccount (said once)
        self._lock = threading.Lock()

    # ---- one pass

    def sync(self) -> None:
        with self._lock:
            nodes = self._pool_nodes()
            pods = self._pods()
            seen = {(pod.metadata.namespace, pod.metadata.name) for pod in pods}
            for key in [k for k in self.running if k not in seen]:  # first: frees CPU and ports
                self._stop(key, "gone")
            for pod in pods:
                key = (pod.metadata.namespace, pod.metadata.name)
                entry = self.running.get(key)
                if entry is not None and entry.uid != pod.metadata.uid:  # same name, a new pod
                    self._stop(key, "replaced")
                    entry = None
                if entry is not None:
                    if pod.metadata.deletion_timestamp is not None:
                        self._stop(key, "deleted")
                    elif self._exited(entry):
                        self._reap(key)
                    continue
                if (pod.spec.node_name in nodes and pod.status.phase == "Running"
                        and pod.metadata.deletion_timestamp is None and pod.metadata.uid not in self.refused
                        and not self._reported(pod)):
                    self._start(pod)

    def stop_all(self) -> None:
        with self._lock:
            for key in list(self.running):
                self._stop(key, "runner stopping")

    def urls(self) -> dict[str, str]:
        """{namespace/pod: engine base URL} of the engines running now."""
        return {f"{ns}/{name}": e.url for (ns, name), e in self.running.items() if e.url}

    def prometheus_targets(self) -> list[dict]:
        """Prometheus file_sd target groups, one per running engine."""
        return [{"targets": [e.url.removeprefix("http://")],
                 "labels": {"namespace": ns, "deployment": e.deployment, "pod": name}}
                for (ns, name), e in sorted(self.running.items()) if e.url]

    # ---- pieces

    def _pool_nodes(self) -> set[str]:
        selector = f"{POOL_LABEL} in ({','.join(self.pools)})"
        return {n.metadata.name for n in self.core.list_node(label_selector=selector).items}

    def _pods(self) -> list[V1Pod]:
        if self.namespaces is None:
            return self.core.list_pod_for_all_namespaces().items
        return [p for ns in self.namespaces for p in self.core.list_namespaced_pod(ns).items]

    @staticmethod
    def _reported(pod: V1Pod) -> bool:
        """Some container already reported terminated: an earlier run of it finished (an exit is final)."""
        return any(s.state is not None and s.state.terminated is not None for s in pod.status.container_statuses or [])

    def _next_port(self) -> int:
        taken = {int(e.url.rsplit(":", 1)[1]) for e in self.running.values() if e.url}
        port = self.port_base
        while port in taken or not port_free(self.host, port):
            port += 1
        return port

    def _start(self, pod: V1Pod) -> None:
        namespace, name = pod.metadata.namespace, pod.metadata.name
        engine = any(is_engine(c) for c in pod.spec.containers)
        if engine and len(pod.spec.containers) > 1:
            self.refused.add(pod.metadata.uid)
            self.log(f"pod {namespace}/{name}: an engine pod with several containers is not run locally")
            return
        flags, url = {}, None
        if engine:
            port = self._next_port()
            flags = {**self.serve_flags, "--host": self.host, "--port": str(port)}
            url = f"http://{self.host}:{port}"
        claims = {v.persistent_volume_claim.claim_name for v in pod.spec.volumes or [] if v.persistent_volume_claim}
        pvc_dirs = {claim: self.workdir / "claims" / namespace / claim for claim in claims}
        env = dict(self.extra_env)
        try:
            kubeconfig = self._service_account_kubeconfig(pod)
        except ApiException as error:  # e.g. the ServiceAccount is not there yet: try again next pass
            if pod.metadata.uid not in self.waiting:
                self.waiting.add(pod.metadata.uid)
                self.log(f"pod {namespace}/{name}: no token for ServiceAccount {pod.spec.service_account_name!r} "
                         f"yet ({error.status} {error.reason}); retrying")
            return
        except OSError as error:
            self.refused.add(pod.metadata.uid)
            self.log(f"pod {namespace}/{name}: not run locally: cannot write its kubeconfig: {error}")
            return
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        local = LocalPod(self.api_client, namespace, name, self.workdir / "pods", extra_env=env,
                         flag_overrides=flags, pvc_dirs=pvc_dirs, volumes_root=self.workdir / "volumes")
        try:
            local.start(timeout_s=5)
        except (PodSpecError, TimeoutError, FileNotFoundError, PermissionError) as error:
            self.refused.add(pod.metadata.uid)
            local.stop(grace_s=1)
            self.log(f"pod {namespace}/{name}: not run locally: {error}")
            return
        deployment = (pod.metadata.labels or {}).get(LABEL_DEPLOYMENT, "")
        self.running[(namespace, name)] = RunningPod(local, pod.metadata.uid, url, deployment)
        logs = ", ".join(str(run.log_path) for run in local.containers)
        self.log(f"pod {namespace}/{name}: started {' '.join(local.containers[0].argv[:4])} ..."
                 + (f" serving on {url}" if url else "") + f" (log: {logs})")

    def _service_account_kubeconfig(self, pod: V1Pod, expiration_s: int = 86400) -> Path | None:
        """A kubeconfig holding a token of the pod's ServiceAccount bound to the pod (None when the
        pod mounts no token); written next to the pod's logs, readable by this user only."""
        if pod.spec.automount_service_account_token is False or not pod.spec.service_account_name:
            return None
        request = kubernetes.client.AuthenticationV1TokenRequest(spec=kubernetes.client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=expiration_s,
            bound_object_ref=kubernetes.client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid)))
        token = self.core.create_namespaced_service_account_token(
            pod.spec.service_account_name, pod.metadata.namespace, request).status.token
        conf = self.api_client.configuration
        cluster: dict = {"server": conf.host}
        if not conf.verify_ssl:
            cluster["insecure-skip-tls-verify"] = True
        elif conf.ssl_ca_cert:
            cluster["certificate-authority-data"] = base64.b64encode(Path(conf.ssl_ca_cert).read_bytes()).decode()
        user = f"system:serviceaccount:{pod.metadata.namespace}:{pod.spec.service_account_name}"
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "pod",
                  "clusters": [{"name": "local", "cluster": cluster}],
                  "users": [{"name": user, "user": {"token": token}}],
                  "contexts": [{"name": "pod", "context": {"cluster": "local", "user": user,
                                                           "namespace": pod.metadata.namespace}}]}
        path = self.workdir / "pods" / f"{pod.metadata.namespace}_{pod.metadata.name}_kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(yaml.safe_dump(config))
        return path

    @staticmethod
    def _exited(entry: RunningPod) -> bool:
        return all(run.process.poll() is not None for run in entry.pod.containers)

    def _reap(self, key: tuple[str, str]) -> None:
        entry = self.running.pop(key)
        try:
            codes = entry.pod.wait(timeout_s=5)
        except ApiException as error:
            if error.status != 404:
                raise
            self.log(f"pod {key[0]}/{key[1]}: exited {entry.pod.exit_codes}; the pod is gone, nothing to report")
            return
        self.log(f"pod {key[0]}/{key[1]}: exited {codes}; reported {'Succeeded' if not any(codes.values()) else 'Failed'}")

    def _stop(self, key: tuple[str, str], why: str) -> None:
        entry = self.running.pop(key)
        try:
            codes = entry.pod.stop()
        except ApiException as error:  # the processes are stopped; the pod was deleted meanwhile
            if error.status != 404:
                raise
            codes = entry.pod.exit_codes
        self.log(f"pod {key[0]}/{key[1]}: stopped ({why}), exit codes {codes}")
