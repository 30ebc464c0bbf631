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
status.podIP/hostIP) and resourceFieldRef (cpu/memory requests and limits).

downwardAPI volumes are emulated for the containers that mount them:

    pod spec volume {downwardAPI: items [{path, fieldRef}]} + container volumeMount(mountPath)
      -> <workdir>/<ns>_<pod>_<volume>/<path>   written like the kubelet writes them (labels and
         annotations as sorted key="value" lines, engine/rollout_protocol.format_downward_api_map;
         name, namespace, uid as plain text), replaced atomically
      -> every argv part and env value naming a path under mountPath is rewritten to that folder
         (a process cannot see the container's file system, so it is told the real path)
      -> a watch on the pod rewrites the files when its labels or annotations change, while the
         containers run (the kubelet refreshes these volumes on its sync loop the same way)

persistentVolumeClaim volumes are mapped to local folders the caller names:

    pvc_dirs {claimName: local folder} + pod volume {persistentVolumeClaim: {claimName}}
      + container volumeMount(mountPath, subPath?)
      -> <folder>/<subPath>   (created if missing), and every argv part and env value naming a
         path under mountPath is rewritten to it, as for downwardAPI volumes
    Several pods given the same folder share it, as pods share a ReadWriteMany claim. readOnly
    is not enforced (the processes run as this user); a claim not in pvc_dirs is not mounted.
    `local_claim` creates a PersistentVolume (hostPath: the folder) and a claim bound to it, so
    the scheduler places pods that mount the claim.

emptyDir and configMap volumes, only when the caller names a `volumes_root` (LocalPod(...,
volumes_root=folder); off by default):

    pod volume {emptyDir} + container volumeMount  -> <volumes_root>/<ns>_<pod>_<volume> (created empty)
    pod volume {configMap: name, items?}          -> the same folder, holding the ConfigMap's keys as
                                                     files (items: only those, at their paths)
    and argv parts and env values naming a path under mountPath are rewritten, as above.

A mount inside another mount (a claim's folder at /var/lib/shapeshift/run inside the emptyDir at
/var/lib/shapeshift) is a symlink at that place in the outer mount's folder (link_nested_mounts), so
a process that composes the path from the outer one ($SHAPESHIFT_WORK_DIR/<run>) reaches the inner
one, as it does in a container.

`flag_overrides` ({"--port": "18001"}) replaces the value after a flag in the command line, or
appends the flag: several pods of one Deployment, each given its own loopback port.

`kill()` SIGKILLs the containers' process groups (the OOM killer, a node's end) and reports exit
code 137, as a runtime does.

Not modelled: images (the process runs from the local PATH, so a container must set
`command`), other volumes, probes and restarts: an exit is final, whatever restartPolicy says.
"""

from __future__ import annotations

import base64
import datetime
import math
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import kubernetes
from kubernetes.client import ApiException, CoreV1Api, V1Pod

from harness.cluster import wait_until
from shapeshift.engine.contracts.pod_annotations import format_downward_api_map

# The process environment a workload starts from, before the pod's own env. A real
# container gets only the image's env; locally the tools must still be found.
# SHAPESHIFT_ARTIFACT_ROOTS: the local folders standing in for the mounts are where the worker's
# ForwardPasses point (operator/api/forward_pass.py).
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SHAPESHIFT_CACHE", "VIRTUAL_ENV", "PYTHONSAFEPATH",
                 "SHAPESHIFT_ARTIFACT_ROOTS")
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

    def read_data(kind: str, name: str, optional: bool | None) -> dict[str, str]:
        """The key/value data of ConfigMap or Secret `name` (a missing optional one reads as empty)."""
        try:
            if kind == "ConfigMap":
                return core.read_namespaced_config_map(name, namespace).data or {}
            data = core.read_namespaced_secret(name, namespace).data or {}
        except ApiException as error:
            if error.status == 404 and optional:
                return {}
            raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: {kind} {name!r}: {error.reason}") from error
        return {key: base64.b64decode(value).decode() for key, value in data.items()}

    for source in container.env_from or []:
        kind, ref = ("ConfigMap", source.config_map_ref) if source.config_map_ref else ("Secret", source.secret_ref)
        env.update({(source.prefix or "") + key: value for key, value in read_data(kind, ref.name, ref.optional).items()})

    for variable in container.env or []:
        source = variable.value_from
        if source is None:
            env[variable.name] = expand(variable.value or "", env)
        elif source.field_ref:
            env[variable.name] = _field_value(pod, source.field_ref.field_path)
        elif source.config_map_key_ref or source.secret_key_ref:
            kind, ref = (("ConfigMap", source.config_map_key_ref) if source.config_map_key_ref
                         else ("Secret", source.secret_key_ref))
            values = read_data(kind, ref.name, ref.optional)
            if ref.key in values:
                env[variable.name] = values[ref.key]
            elif not ref.optional:
                raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: key {ref.key!r} missing from {kind} {ref.name!r}")
        elif source.resource_field_ref:
            env[variable.name] = _resource_value(core, pod, container, source.resource_field_ref)
        else:
            raise PodSpecError(f"pod {namespace}/{pod.metadata.name}: env {variable.name!r} uses an unsupported valueFrom")
    return env


# ---- downwardAPI volumes ------------------------------------------------------------------


def downward_api_files(pod: V1Pod, volume) -> dict[str, str]:
    """{relative path: content} of one downwardAPI volume, as the kubelet would write them."""
    files: dict[str, str] = {}
    for item in volume.downward_api.items or []:
        if item.resource_field_ref is not None or item.field_ref is None:
            raise PodSpecError(f"pod {pod.metadata.namespace}/{pod.metadata.name}: downwardAPI volume "
                               f"{volume.name!r} item {item.path!r}: only fieldRef items are emulated locally")
        field_path = item.field_ref.field_path
        if field_path in ("metadata.annotations", "metadata.labels"):
            mapping = (pod.metadata.annotations if field_path == "metadata.annotations" else pod.metadata.labels) or {}
            files[item.path] = format_downward_api_map(dict(mapping))
        else:
            files[item.path] = _field_value(pod, field_path)
    return files


def write_files_atomically(root: Path, files: dict[str, str]) -> bool:
    """Write every file whose content changed (temp file + rename: readers never see half a file)."""
    changed = False
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.read_text() == content:
            continue
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(content)
        os.replace(tmp, path)
        changed = True
    return changed


def rewrite_paths(text: str, mounts: dict[str, Path]) -> str:
    """Paths under a container mount point -> the local folder standing in for it.

    Matches a whole argument (`/etc/x/file`) or the value of `--flag=/etc/x/file`."""
    for mount_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        mount_path = mount_path.rstrip("/")
        for prefix in ("", "="):
            start = 0
            while True:
                at = text.find(prefix + mount_path, start)
                if at < 0:
                    break
                if prefix == "" and at != 0:
                    start = at + 1
                    continue
                end = at + len(prefix) + len(mount_path)
                if end == len(text) or text[end] == "/":
                    text = text[:at] + prefix + str(local) + text[end:]
                    start = at + len(prefix) + len(str(local))
                else:
                    start = end
    return text


def override_flags(argv: list[str], overrides: dict[str, str]) -> list[str]:
    """Replace the value following each flag (`--port 8000` or `--port=8000`), or append the flag."""
    out = list(argv)
    for flag, value in overrides.items():
        for i, part in enumerate(out):
            if part == flag and i + 1 < len(out):
                out[i + 1] = value
                break
            if part.startswith(flag + "="):
                out[i] = f"{flag}={value}"
                break
        else:
            out += [flag, value]
    return out


class DownwardAPIVolumes:
    """The pod's mounted downwardAPI volumes as local folders, kept current by a pod watch."""

    def __init__(self, core: CoreV1Api, pod: V1Pod, workdir: Path):
        self.core, self.namespace, self.name = core, pod.metadata.namespace, pod.metadata.name
        mounted = {m.name for c in pod.spec.containers for m in c.volume_mounts or []}
        self.volumes = [v for v in pod.spec.volumes or [] if v.downward_api is not None and v.name in mounted]
        self.folders = {v.name: workdir / f"{self.namespace}_{self.name}_{v.name}" for v in self.volumes}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh(pod)

    def mounts_of(self, container) -> dict[str, Path]:
        """{mountPath: local folder} of the container's downwardAPI mounts."""
        return {m.mount_path: self.folders[m.name] for m in container.volume_mounts or [] if m.name in self.folders}

    def refresh(self, pod: V1Pod) -> bool:
        changed = False
        for volume in self.volumes:
            changed |= write_files_atomically(self.folders[volume.name], downward_api_files(pod, volume))
        return changed

    def start(self, resource_version: str | None) -> None:
        if self.volumes:
            self._thread = threading.Thread(target=self._watch, args=(resource_version,), daemon=True,
                                            name=f"downward-api-{self.name}")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, resource_version: str | None) -> None:
        while not self._stop.is_set():
            watcher = kubernetes.watch.Watch()
            try:
                for event in watcher.stream(self.core.list_namespaced_pod, self.namespace,
                                            field_selector=f"metadata.name={self.name}",
                                            resource_version=resource_version, timeout_seconds=2):
                    if self._stop.is_set():
                        break
                    if event["type"] in ("ADDED", "MODIFIED"):
                        resource_version = event["object"].metadata.resource_version
                        self.refresh(event["object"])
            except ApiException as error:
                if error.status == 410:  # the watch fell too far behind: start over from the pod as it is
                    pod = self.core.read_namespaced_pod(self.name, self.namespace)
                    resource_version = pod.metadata.resource_version
                    self.refresh(pod)
                elif not self._stop.is_set():
                    time.sleep(0.5)
            except Exception:  # the API going away while a test tears down ends nothing else
                if not self._stop.is_set():
                    time.sleep(0.5)
            finally:
                watcher.stop()


# ---- emptyDir and configMap volumes ------------------------------------------------------


def local_volume_mounts(core: CoreV1Api, pod: V1Pod, container, root: Path) -> dict[str, Path]:
    """{mountPath: local folder} of the container's emptyDir and configMap mounts under `root`."""
    volumes = {v.name: v for v in pod.spec.volumes or [] if v.empty_dir is not None or v.config_map is not None}
    mounts: dict[str, Path] = {}
    for mount in container.volume_mounts or []:
        volume = volumes.get(mount.name)
        if volume is None:
            continue
        folder = root / f"{pod.metadata.namespace}_{pod.metadata.name}_{volume.name}"
        folder.mkdir(parents=True, exist_ok=True)
        if volume.config_map is not None:
            source = volume.config_map
            try:
                data = core.read_namespaced_config_map(source.name, pod.metadata.namespace).data or {}
            except ApiException as error:
                if error.status == 404 and source.optional:
                    data = {}
                else:
                    raise PodSpecError(f"pod {pod.metadata.namespace}/{pod.metadata.name}: configMap volume "
                                       f"{volume.name!r}: ConfigMap {source.name!r}: {error.reason}") from error
            items = {i.key: i.path for i in source.items} if source.items else {key: key for key in data}
            files = {path: data[key] for key, path in items.items() if key in data}
            if any(p.startswith("/") or ".." in p.split("/") for p in files):
                raise PodSpecError(f"pod {pod.metadata.namespace}/{pod.metadata.name}: configMap volume "
                                   f"{volume.name!r} names a path outside the volume")
            write_files_atomically(folder, files)
        folder = within_sub_path(pod, mount, folder)
        mounts[mount.mount_path] = folder
    return mounts


def within_sub_path(pod: V1Pod, mount, folder: Path) -> Path:
    """`folder`, or its mount's subPath inside it (refused where the subPath leaves the volume)."""
    if not mount.sub_path:
        return folder
    if mount.sub_path.startswith("/") or ".." in mount.sub_path.split("/"):
        raise PodSpecError(f"pod {pod.metadata.namespace}/{pod.metadata.name}: volumeMount {mount.name!r} "
                           f"subPath {mount.sub_path!r} leaves the volume")
    return folder / mount.sub_path


# ---- persistentVolumeClaim volumes --------------------------------------------------------


def pvc_mounts(pod: V1Pod, container, pvc_dirs: dict[str, Path]) -> dict[str, Path]:
    """{mountPath: local folder} of the container's mounts of claims that `pvc_dirs` maps."""
    claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.spec.volumes or []
              if v.persistent_volume_claim is not None}
    mounts: dict[str, Path] = {}
    for mount in container.volume_mounts or []:
        claim = claims.get(mount.name)
        if claim is None or claim not in pvc_dirs:
            continue
        folder = Path(pvc_dirs[claim])
        folder = within_sub_path(pod, mount, folder)
        folder.mkdir(parents=True, exist_ok=True)
        mounts[mount.mount_path] = folder
    return mounts


def link_nested_mounts(mounts: dict[str, Path]) -> None:
    """Each mount that lies inside another one: a symlink to its folder at that place in the outer
    mount's folder (a container sees the inner volume there). A real folder already in that place
    is refused: a container would not see it, a local process would."""
    for inner, folder in mounts.items():
        inner = inner.rstrip("/")
        outers = [m for m in mounts if inner.startswith(m.rstrip("/") + "/")]
        if not outers:
            continue
        outer = max(outers, key=len)
        link = mounts[outer] / inner[len(outer.rstrip("/")) + 1:]
        if link.is_symlink() and link.resolve() == Path(folder).resolve():
            continue
        if link.exists() or link.is_symlink():
            raise PodSpecError(f"mount {inner} lies inside mount {outer}, whose folder {mounts[outer]} already "
                               f"holds {link}")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(folder, target_is_directory=True)


def local_claim(api_client: kubernetes.client.ApiClient, namespace: str, claim: str, folder: Path,
                access_mode: str = "ReadWriteMany") -> str:
    """A PersistentVolume backed by `folder` (hostPath) and the claim `claim` bound to it.
    Returns the volume's name (cluster-scoped: the caller deletes it after the namespace)."""
    core = CoreV1Api(api_client)
    folder.mkdir(parents=True, exist_ok=True)
    volume = f"{namespace}-{claim}"[:253]
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [access_mode], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder)},
                 "claimRef": {"namespace": namespace, "name": claim}}})
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
        "spec": {"accessModes": [access_mode], "storageClassName": "", "volumeName": volume,
                 "resources": {"requests": {"storage": "1Gi"}}}})
    wait_until(lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound", 30,
               f"claim {namespace}/{claim} to bind to PersistentVolume {volume} "
               "(is the controller-manager's persistentvolume-binder running?)", interval_s=0.2)
    return volume


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
        flag_overrides: dict[str, str] | None = None,
        pvc_dirs: dict[str, Path] | None = None,
        volumes_root: Path | None = None,
    ):
        self.core = CoreV1Api(api_client)
        self.namespace, self.name = namespace, name
        self.workdir = Path(workdir)
        self.extra_env = dict(extra_env or {})
        self.flag_overrides = dict(flag_overrides or {})
        self.pvc_dirs = {claim: Path(folder) for claim, folder in (pvc_dirs or {}).items()}
        self.volumes_root = Path(volumes_root) if volumes_root is not None else None
        self.containers: list[ContainerRun] = []
        self.reported = False
        self.downward_api: DownwardAPIVolumes | None = None

    # ---- lifecycle

    def start(self, timeout_s: float = 60.0) -> LocalPod:
        pod = self._wait_running(timeout_s)
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        base["HOSTNAME"] = pod.metadata.name
        self.downward_api = DownwardAPIVolumes(self.core, pod, self.workdir)
        for container in pod.spec.containers:
            if not container.command:
                raise PodSpecError(
                    f"pod {self.namespace}/{self.name} container {container.name!r} has no `command`; "
                    "without an image there is no entrypoint to run locally, so set command (and args)"
                )
            mounts = {**self.downward_api.mounts_of(container), **pvc_mounts(pod, container, self.pvc_dirs)}
            if self.volumes_root is not None:
                mounts.update(local_volume_mounts(self.core, pod, container, self.volumes_root))
            link_nested_mounts(mounts)
            env = {**base, **resolve_env(self.core, pod, container), **self.extra_env}
            env = {key: rewrite_paths(value, mounts) for key, value in env.items()}
            argv = [rewrite_paths(expand(part, env), mounts) for part in [*container.command, *(container.args or [])]]
            argv = override_flags(argv, self.flag_overrides)
            cwd = container.working_dir if container.working_dir and Path(container.working_dir).is_dir() else self.workdir
            log_path = self.workdir / f"{self.namespace}_{self.name}_{container.name}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, so stop() reaches its children
                )
            self.containers.append(ContainerRun(container.name, container.image, argv, log_path, process, _now()))
        self.downward_api.start(pod.metadata.resource_version)
        return self

    def wait(self, timeout_s: float = 120.0) -> dict[str, int]:
        """Wait for every container to exit; report the pod's final status; return exit codes."""
        deadline = time.monotonic() + timeout_s
        for run in self.containers:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                code = run.process.wait(timeout=remaining)
                # A signal shows as a negative return code; runtimes report 128 + signal (137: SIGKILL).
                run.exit_code = 128 - code if code < 0 else code
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(
                    f"pod {self.namespace}/{self.name} container {run.name!r} still running after {timeout_s}s; "
                    f"stopped it. Output so far:\n{run.output[-2000:]}"
                ) from None
            run.finished_at = _now()
        if self.downward_api is not None:
            self.downward_api.stop()
        self.report()
        return self.exit_codes

    def stop(self, grace_s: float = 10.0) -> dict[str, int]:
        """Terminate the containers like a pod deletion would, then report."""
        if self.downward_api is not None:
            self.downward_api.stop()
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
                run.exit_code = 128 - code if code < 0 else code  # as in wait()
                run.finished_at = _now()
        if not self.reported:
            self.report()
        return self.exit_codes

    def kill(self) -> dict[str, int]:
        """SIGKILL every container's process group, as the OOM killer or a lost node does (no
        grace period), then report the exits (137)."""
        for run in self.containers:
            if run.process.poll() is None:
                os.killpg(run.process.pid, signal.SIGKILL)
        return self.stop(grace_s=5)

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

