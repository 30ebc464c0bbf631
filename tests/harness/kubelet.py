"""Run a pod's workload as local processes, the way a kubelet would, and report back.

kwok nodes run no containers: kwok only moves a scheduled pod to Running. For
end-to-end tests, this module plays the rest of the kubelet's part for one pod:

    API: pod spec (+ ConfigMaps, Secrets, Node)  -> resolve_env(): env for each container
      -> subprocess.Popen(command + args)  one process per container, output in <workdir>/*.log
      -> process exits (or stop() terminates it)
      -> API: pod status (phase Succeeded/Failed, containerStatuses[].state.terminated)

so controllers that watch pod status (the Job controller, an operator) see the real
outcome of the real process. Supported, as a kubelet does them: command and args with
$(VAR) expansion, env values, envFrom and valueFrom for ConfigMap/Secret keys, fieldRef
(metadata.name/namespace/uid/labels/annotations, spec.nodeName/serviceAccountName,
status.podIP/hostIP) and resourceFieldRef (cpu/memory requests and limits). Not
modelled: images (the process runs from the local PATH, so a container must set
`command`), volumes, probes and restarts: an exit is final, whatever restartPolicy says.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import kubernetes
from kubernetes.client import ApiException, CoreV1Api, V1Pod

# The process environment a workload starts from, before the pod's own env. A real
# container gets only the image's env; locally the tools must still be found.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SHAPESHIFT_CACHE", "VIRTUAL_ENV", "PYTHONSAFEPATH")
EXIT_CODE_SIGTERM, EXIT_CODE_SIGKILL = 143, 137  # what container runtimes report: 128 + signal

_VAR_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class PodSpecError(ValueError):
    """The pod cannot be run locally as written; the message names the pod and field."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, $$ escapes, unknown stay."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REFERENCE.sub(replace, text)


def _field_value(pod: V1Pod, field_path: str) -> str:
    meta, spec, status = pod.metadata, pod.spec, pod.status
    simple = {
        "metadata.name": meta.name,
        "metadata.namespace": meta.namespace,
        "metadata.uid": meta.uid,
        "spec.nodeName": spec.node_name,
        "spec.serviceAccountName": spec.service_account_name,
        "status.podIP": status.pod_ip if status else None,
        "status.hostIP": status.host_ip if status else None,
    }
    if field_path in simple:
        return simple[field_path] or ""
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if match:
        mapping = (meta.labels if match.group(1) == "labels" else meta.annotations) or {}
        return mapping.get(match.group(2), "")
    raise PodSpecError(f"pod {meta.namespace}/{meta.name}: fieldRef {field_path!r} is not supported locally")


def _resource_value(core: CoreV1Api, pod: V1Pod, container, ref) -> str:
    from kubernetes.utils import parse_quantity

    target = container
    if ref.container_name:
        target = next((c for c in pod.spec.containers if c.name == ref.container_name), None)
        if target is None:
            raise PodSpecError(f"pod {pod.metadata.name}: resourceFieldRef names unknown container {ref.container_name!r}")
    kind, _, resource = ref.resource.partition(".")
    resources = target.resources
    values = (resources.limits if kind == "limits" else resources.requests) if resources else None
    quantity = (values or {}).get(resource)
    if quantity is None:
        # An unset limit reads as the node's allocatable amount, as on a real node.
        node = core.read_node(pod.spec.node_name)
        quantity = (node.status.allocatable or {}).get(resource, "0")
    # An unset divisor can come back from the API as "0"; the kubelet treats it as 1.
    divisor = parse_quantity(ref.divisor or "1") or 1
    return str(math.ceil(parse_quantity(quantity) / divisor))


def resolve_env(core: CoreV1Api, pod: V1Pod, container) -> dict[str, str]:
    """The environment the kubelet would give `container` of `pod` (pod-level sources only)."""
    namespace = pod.metadata.namespace
    env: dict[str, str] = {}

    def config_map(name: str, optional: bool | None) -> dict[str, str]:
        try:
            return core.read_namespaced_config_map(name, namespace).data or {}
        except ApiException as error:
            if error.status == 404 and optional:
                return {}
            raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: ConfigMap {name!r}: {error.reason}") from error

    def secret(name: str, optional: bool | None) -> dict[str, str]:
        import base64

        try:
            data = core.read_namespaced_secret(name, namespace).data or {}
        except ApiException as error:
            if error.status == 404 and optional:
                return {}
            raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: Secret {name!r}: {error.reason}") from error
        return {key: base64.b64decode(value).decode() for key, value in data.items()}

    for source in container.env_from or []:
        prefix = source.prefix or ""
        if source.config_map_ref:
            values = config_map(source.config_map_ref.name, source.config_map_ref.optional)
        else:
            values = secret(source.secret_ref.name, source.secret_ref.optional)
        env.update({prefix + key: value for key, value in values.items()})

    for variable in container.env or []:
        source = variable.value_from
        if source is None:
            env[variable.name] = expand(variable.value or "", env)
        elif source.field_ref:
            env[variable.name] = _field_value(pod, source.field_ref.field_path)
        elif source.config_map_key_ref:
            ref = source.config_map_key_ref
            values = config_map(ref.name, ref.optional)
            if ref.key in values:
                env[variable.name] = values[ref.key]
            elif not ref.optional:
                raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: key {ref.key!r} missing from ConfigMap {ref.name!r}")
        elif source.secret_key_ref:
            ref = source.secret_key_ref
            values = secret(ref.name, ref.optional)
            if ref.key in values:
                env[variable.name] = values[ref.key]
            elif not ref.optional:
                raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: key {ref.key!r} missing from Secret {ref.name!r}")
        elif source.resource_field_ref:
            env[variable.name] = _resource_value(core, pod, container, source.resource_field_ref)
        else:
            raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: env {variable.name!r} uses an unsupported valueFrom")
    return env


@dataclass
class ContainerRun:
    name: str
    image: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen
    started_at: datetime.datetime
    finished_at: datetime.datetime | None = None
    exit_code: int | None = None

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


class LocalPod:
    """One pod's containers running as local processes.

    `start()` waits until the pod is bound to a node and kwok reports it Running, then
    starts every container; `wait()` blocks until all exit and reports the outcome to
    the API; `stop()` terminates them (SIGTERM, then SIGKILL) and reports that.
    """

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        namespace: str,
        name: str,
        workdir: Path,
        *,
        extra_env: dict[str, str] | None = None,
    ):
        self.core = CoreV1Api(api_client)
        self.namespace, self.name = namespace, name
        self.workdir = Path(workdir)
        self.extra_env = dict(extra_env or {})
        self.containers: list[ContainerRun] = []
        self.reported = False

    # ---- lifecycle

    def start(self, timeout_s: float = 60.0) -> LocalPod:
        pod = self._wait_running(timeout_s)
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        base["HOSTNAME"] = pod.metadata.name
        for container in pod.spec.containers:
            if not container.command:
                raise PodSpecError(
                    f"pod {self.namespace}/{self.name} container {container.name!r} has no `command`; "
                    "without an image there is no entrypoint to run locally, so set command (and args)"
                )
            env = {**base, **resolve_env(self.core, pod, container), **self.extra_env}
            argv = [expand(part, env) for part in [*container.command, *(container.args or [])]]
            cwd = container.working_dir if container.working_dir and Path(container.working_dir).is_dir() else self.workdir
            log_path = self.workdir / f"{self.namespace}_{self.name}_{container.name}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, so stop() reaches its children
                )
            self.containers.append(ContainerRun(container.name, container.image, argv, log_path, process, _now()))
        return self

    def wait(self, timeout_s: float = 120.0) -> dict[str, int]:
        """Wait for every container to exit; report the pod's final status; return exit codes."""
        deadline = time.monotonic() + timeout_s
        for run in self.containers:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                run.exit_code = run.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(
                    f"pod {self.namespace}/{self.name} container {run.name!r} still running after {timeout_s}s; "
                    f"stopped it. Output so far:\n{run.output[-2000:]}"
                ) from None
            run.finished_at = _now()
        self.report()
        return self.exit_codes

    def stop(self, grace_s: float = 10.0) -> dict[str, int]:
        """Terminate the containers like a pod deletion would, then report."""
        for run in self.containers:
            if run.process.poll() is None:
                os.killpg(run.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for run in self.containers:
            try:
                run.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(run.process.pid, signal.SIGKILL)
                run.process.wait()
            if run.exit_code is None:
                code = run.process.returncode
                # A signal shows as a negative return code; runtimes report 128 + signal.
                run.exit_code = 128 - code if code < 0 else code
                run.finished_at = _now()
        if not self.reported:
            self.report()
        return self.exit_codes

    @property
    def exit_codes(self) -> dict[str, int]:
        return {run.name: run.exit_code for run in self.containers}

    def output(self, container: str | None = None) -> str:
        run = self.containers[0] if container is None else next(r for r in self.containers if r.name == container)
        return run.output

    # ---- API side

    def _wait_running(self, timeout_s: float) -> V1Pod:
        deadline = time.monotonic() + timeout_s
        while True:
            pod = self.core.read_namespaced_pod(self.name, self.namespace)
            if pod.spec.node_name and pod.status.phase == "Running":
                return pod
            if time.monotonic() > deadline:
                conditions = "; ".join(
                    f"{c.type}={c.status} {c.reason or ''} {c.message or ''}".strip() for c in pod.status.conditions or []
                )
                raise TimeoutError(
                    f"pod {self.namespace}/{self.name} not Running on a node after {timeout_s}s "
                    f"(phase {pod.status.phase}, node {pod.spec.node_name!r}; {conditions or 'no conditions'})"
                )
            time.sleep(0.1)

    def report(self) -> None:
        """Write phase and containerStatuses to the pod, retrying on update conflicts."""
        failed = any(run.exit_code != 0 for run in self.containers)
        for _attempt in range(10):
            pod = self.core.read_namespaced_pod_status(self.name, self.namespace)
            status = pod.status
            status.phase = "Failed" if failed else "Succeeded"
            status.container_statuses = [
                kubernetes.client.V1ContainerStatus(
                    name=run.name,
                    image=run.image,
                    image_id="",
                    ready=False,
                    started=False,
                    restart_count=0,
                    state=kubernetes.client.V1ContainerState(
                        terminated=kubernetes.client.V1ContainerStateTerminated(
                            exit_code=run.exit_code,
                            reason="Completed" if run.exit_code == 0 else "Error",
                            started_at=run.started_at,
                            finished_at=run.finished_at,
                        )
                    ),
                )
                for run in self.containers
            ]
            now = _now()
            kept = [c for c in status.conditions or [] if c.type not in ("Ready", "ContainersReady")]
            status.conditions = kept + [
                kubernetes.client.V1PodCondition(type=kind, status="False", reason="PodCompleted", last_transition_time=now)
                for kind in ("Ready", "ContainersReady")
            ]
            try:
                self.core.replace_namespaced_pod_status(self.name, self.namespace, pod)
                self.reported = True
                return
            except ApiException as error:
                if error.status == 409:
                    continue  # someone (kwok, a controller) wrote in between: reread
                if error.status == 404:
                    self.reported = True  # the pod is gone; nothing left to report to
                    return
                raise
        raise RuntimeError(f"could not update the status of pod {self.namespace}/{self.name}: conflicts kept coming")


def run_pod_locally(
    api_client: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    workdir: Path,
    *,
    timeout_s: float = 120.0,
    extra_env: dict[str, str] | None = None,
) -> LocalPod:
    """Run the pod's containers to completion and report; returns the finished LocalPod."""
    pod = LocalPod(api_client, namespace, name, workdir, extra_env=extra_env).start(timeout_s=timeout_s)
    pod.wait(timeout_s=timeout_s)
    return pod
