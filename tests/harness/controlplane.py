"""A real Kubernetes control plane on loopback, with kwok-managed fake node pools.

Data flow of `ControlPlane.start()`:

    cryptography  -> <workdir>/pki: one cluster CA that signs the API server's serving
                     cert and the client certs (admin in system:masters, the
                     controller-manager and scheduler identities), plus an EC key pair
                     that signs ServiceAccount tokens
    etcd          -> <workdir>/etcd (no fsync: the data is thrown away)
    kube-apiserver   127.0.0.1 only, RBAC, ServiceAccount admission, SA token signing
    kube-controller-manager  SA token/controller keys, per-controller SA credentials
    kube-scheduler
    kwok          -> fake kubelets: makes the pool nodes Ready, holds their leases and
                     moves scheduled pods to Running (never to Succeeded: a pod's
                     workload is run by harness.kubelet, which reports the exit)
    node pools    -> v1.Node objects created through the API (H200 GPUs, Trainium2, CPU)

`restart_apiserver()` stops kube-apiserver and starts it again on the same port, certificates
and etcd (fault tests: the other parts and the operator must reconnect).

Every binary comes from $SHAPESHIFT_BIN (see harness.tools). Processes are tracked by
PID and stopped in reverse start order, also when startup fails half way.

Used two ways:
  * from pytest (tests/conftest.py): `ControlPlane(tmpdir).start()` ... `.stop()`;
  * as a script behind hack/cluster.sh:
        python tests/harness/controlplane.py up|down|env|status [--dir DIR]
    `up` leaves the processes running detached and records them in DIR/state.json,
    `down` stops them by the recorded PIDs, `env` prints `export KUBECONFIG=...`.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

if __name__ == "__main__" and not __package__:
    # Run as a script: make `harness` importable (tests/ is its parent folder).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from harness import tools  # noqa: E402

KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
POOL_LABEL = "shapeshift.dev/pool"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
STOP_ORDER = ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


class ControlPlaneError(RuntimeError):
    """The control plane could not be started or is unhealthy; the message says which part."""


# --------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class NodePool:
    """A group of identical fake nodes that kwok keeps Ready."""

    name: str
    count: int
    instance_type: str
    capacity: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()

    def node_names(self) -> list[str]:
        return [f"{self.name}-{index}" for index in range(self.count)]

    def node_manifests(self) -> list[dict]:
        manifests = []
        for node_name in self.node_names():
            labels = {
                "kubernetes.io/hostname": node_name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": self.instance_type,
                "type": "kwok",
                POOL_LABEL: self.name,
                **self.labels,
            }
            manifests.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": node_name,
                        "labels": labels,
                        "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1]},
                    },
                    "spec": {"taints": [dict(taint) for taint in self.taints]},
                    # Nodes accept status on create; kwok's initialize stage keeps
                    # capacity/allocatable and fills in conditions and addresses.
                    "status": {"capacity": dict(self.capacity), "allocatable": dict(self.capacity)},
                }
            )
        return manifests


# Shapes follow the cloud instances they imitate: p5en.48xlarge (8x H200) and
# trn2.48xlarge (16 Trainium2 devices), each with 192 vCPUs and 2 TiB of memory.
DEFAULT_POOLS: tuple[NodePool, ...] = (
    NodePool(
        name="h200",
        count=2,
        instance_type="p5en.48xlarge",
        capacity={"cpu": "192", "memory": "2Ti", "pods": "110", "ephemeral-storage": "7Ti", "nvidia.com/gpu": "8"},
        labels={
            "nvidia.com/gpu.product": "NVIDIA-H200",
            "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.present": "true",
        },
        taints=({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},),
    ),
    NodePool(
        name="trn2",
        count=1,
        instance_type="trn2.48xlarge",
        capacity={
            "cpu": "192",
            "memory": "2Ti",
            "pods": "110",
            "ephemeral-storage": "1Ti",
            "aws.amazon.com/neuron": "16",
        },
        labels={"aws.amazon.com/neuron.present": "true"},
        taints=({"key": "aws.amazon.com/neuron", "value": "present", "effect": "NoSchedule"},),
    ),
    NodePool(
        name="cpu",
        count=2,
        instance_type="m7i.8xlarge",
        capacity={"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi"},
    ),
)


# --------------------------------------------------------------------------- kwok stages

# kwok plays "stages" on the objects it manages. kwokctl's default set includes a
# pod-complete stage that marks every Job pod Succeeded as soon as it runs, which
# would let Jobs pass without their workload ever running. These stages stop at
# Running; harness.kubelet reports Succeeded/Failed when the real process exits.
_NODE_STATUS = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- type: {{ .type | Quote }}
  status: {{ .status | Quote }}
  reason: {{ .reason | Quote }}
  message: {{ .message | Quote }}
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
addresses:
- type: InternalIP
  address: {{ NodeIP | Quote }}
- type: Hostname
  address: {{ .metadata.name | Quote }}
nodeInfo:
  architecture: amd64
  operatingSystem: linux
  kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
  kubeProxyVersion: {{ printf "kwok-%s" Version | Quote }}
  containerRuntimeVersion: {{ printf "kwok-%s" Version | Quote }}
  kernelVersion: {{ printf "kwok-%s" Version | Quote }}
  osImage: kwok
  machineID: ""
  systemUUID: ""
  bootID: ""
phase: Running
"""

_NODE_HEARTBEAT = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- type: {{ .type | Quote }}
  status: {{ .status | Quote }}
  reason: {{ .reason | Quote }}
  message: {{ .message | Quote }}
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
"""

_POD_RUNNING = """\
{{ $now := Now }}
conditions:
- {type: PodReadyToStartContainers, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  imageID: ""
  ready: true
  started: true
  restartCount: 0
  state: {running: {startedAt: {{ $now | Quote }}}}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  imageID: ""
  ready: true
  restartCount: 0
  state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
{{ end }}
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""


def _stage(name: str, kind: str, match: list[dict], next_: dict, delay_ms: int = 0, jitter_ms: int = 0) -> dict:
    spec: dict = {"resourceRef": {"apiGroup": "v1", "kind": kind}, "selector": {"matchExpressions": match}, "next": next_}
    if delay_ms:
        spec["delay"] = {"durationMilliseconds": delay_ms, "jitterDurationMilliseconds": jitter_ms or delay_ms}
    return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}


_NOT_READY = {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status', "operator": "NotIn", "values": ["True"]}
_READY = {"key": '.status.conditions.[] | select( .type == "Ready" ) | .status', "operator": "In", "values": ["True"]}
_NOT_DELETING = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}

KWOK_STAGES: tuple[dict, ...] = (
    _stage("node-initialize", "Node", [_NOT_READY], {"statusTemplate": _NODE_STATUS}),
    # Leases carry the liveness signal; this only refreshes the conditions now and then.
    _stage("node-heartbeat", "Node", [_READY], {"statusTemplate": _NODE_HEARTBEAT}, delay_ms=60_000, jitter_ms=90_000),
    _stage(
        "pod-running",
        "Pod",
        [_NOT_DELETING, {"key": ".status.phase", "operator": "In", "values": ["Pending"]}],
        {"statusTemplate": _POD_RUNNING},
    ),
    # A deleted pod has no kubelet to finish the graceful deletion: remove it.
    _stage("pod-delete", "Pod", [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}], {"delete": True}),
)


class _LiteralDumper(yaml.SafeDumper):
    """Writes multi-line strings (the Go templates) as readable `|` blocks."""


_LiteralDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def stages_yaml(stages: tuple[dict, ...] = KWOK_STAGES) -> str:
    return yaml.dump_all(stages, Dumper=_LiteralDumper, sort_keys=False)


# --------------------------------------------------------------------------- certificates


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def write_pki(pki: Path) -> None:
    """Write the CA, serving, client and ServiceAccount keys into `pki`.

    EC P-256 everywhere: generating it takes milliseconds where RSA takes a noticeable
    fraction of a second, and every part of Kubernetes accepts it (tokens are ES256).
    """
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pki.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7)

    def name(common_name: str, orgs: tuple[str, ...] = ()) -> x509.Name:
        parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in orgs]
        return x509.Name(parts + [x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("shapeshift-test-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (pki / "ca.crt").write_bytes(_pem_cert(ca_cert))
    (pki / "ca.key").write_bytes(_pem_key(ca_key))

    def issue(stem: str, subject: x509.Name, *, server: bool) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.DNSName("kubernetes.default.svc.cluster.local"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        (pki / f"{stem}.crt").write_bytes(_pem_cert(cert))
        (pki / f"{stem}.key").write_bytes(_pem_key(key))

    issue("apiserver", name("kube-apiserver"), server=True)
    issue("admin", name("shapeshift-admin", ("system:masters",)), server=False)
    # The identities RBAC's bootstrap policy already binds to their roles.
    issue("controller-manager", name("system:kube-controller-manager"), server=False)
    issue("scheduler", name("system:kube-scheduler"), server=False)

    sa_key = ec.generate_private_key(ec.SECP256R1())
    (pki / "sa.key").write_bytes(_pem_key(sa_key))
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def kubeconfig_for(server: str, pki: Path, user: str, cert_stem: str) -> dict:
    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "shapeshift", "cluster": {"server": server, "certificate-authority-data": b64(pki / "ca.crt")}}
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(pki / f"{cert_stem}.crt"),
                    "client-key-data": b64(pki / f"{cert_stem}.key"),
                },
            }
        ],
        "contexts": [{"name": "shapeshift", "context": {"cluster": "shapeshift", "user": user}}],
        "current-context": "shapeshift",
    }


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the test process dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # Field 3 is the state; a zombie has exited and only waits to be reaped.
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _pid_runs(pid: int, binary: str) -> bool:
    """True when `pid` is alive and still runs `binary` (guards against PID reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return pid_alive(pid) and Path(cmdline).name == binary


def stop_pids(pids: dict[str, int], grace_s: float = 10.0) -> None:
    """Stop the recorded processes one by one in STOP_ORDER: SIGTERM, wait, then SIGKILL.

    One at a time on purpose: an API server whose etcd vanishes during its graceful
    shutdown keeps retrying etcd until it is killed, turning a 1 s stop into `grace_s`.
    """
    for name in STOP_ORDER:
        pid = pids.get(name)
        if pid is None or not _pid_runs(pid, name):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + grace_s
        while pid_alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.02)
        if _pid_runs(pid, name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def spawn(argv: list[str], log_path: Path, *, cwd: Path, env: dict[str, str] | None = None,
          detach: bool = False) -> subprocess.Popen:
    """Start `argv` with stdin closed and stdout+stderr appended to `log_path`.

    `env` is added to this process's environment. detach=False: the child gets SIGTERM when
    this process dies, so a crashed test run leaves nothing behind; detach=True: it runs in
    its own session and outlives this process (`hack/cluster.sh up`).
    """
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=None if env is None else {**os.environ, **env},
            start_new_session=detach,
            preexec_fn=None if detach else _die_with_parent,
        )


def wait_ready(
    probe: Callable[[], bool],
    deadline: float,
    what: str,
    processes: dict[str, tuple[subprocess.Popen, Path]],
    log: Path,
    error: type[Exception] = RuntimeError,
) -> None:
    """Poll `probe` every 0.1 s until it returns True.

    Raises `error` at once when one of `processes` ({name: (process, its log)}) exits, or when
    time.monotonic() passes `deadline`; the message ends with the tail of the log that explains
    it (`log` for a timeout). A probe raising OSError (refused connection, an HTTP error status,
    TLS not up yet: URLError and SSLError are OSErrors) counts as not ready.
    """
    while True:
        for name, (process, process_log) in processes.items():
            if process.poll() is not None:
                raise error(
                    f"{name} exited with code {process.returncode} while waiting for {what}; "
                    f"last lines of {process_log}:\n{_tail(process_log)}"
                )
        try:
            if probe():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise error(f"timed out waiting for {what}; last lines of {log}:\n{_tail(log)}")
        time.sleep(0.1)


# --------------------------------------------------------------------------- control plane


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok under `workdir`.

    `workdir` receives pki/, etcd/, logs/<component>.log, the kubeconfigs and
    state.json (ports and PIDs). `detach=True` starts the processes in their own
    session so they outlive this Python process (used by `up`); otherwise they get
    SIGTERM when it dies.
    """

    def __init__(self, workdir: Path | str, pools: tuple[NodePool, ...] = DEFAULT_POOLS, *, detach: bool = False):
        self.workdir = Path(workdir).resolve()
        self.pools = pools
        self.detach = detach
        self.pki = self.workdir / "pki"
        self.logs = self.workdir / "logs"
        self.pids: dict[str, int] = {}
        self.ports: dict[str, int] = {}
        self._children: dict[str, subprocess.Popen] = {}

    # ---- paths

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state.json"

    # ---- lifecycle

    def start(self, timeout_s: float = 60.0) -> ControlPlane:
        missing = tools.missing()
        if missing:
            raise tools.ToolMissing(f"control-plane binaries missing from {tools.bin_dir()}: {missing}; {tools.SETUP_HINT}")
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        try:
            self._prepare()
            self._start_etcd()
            self._wait(deadline, "etcd", self._etcd_healthy)
            self._start_apiserver()
            self._wait(deadline, "kube-apiserver", lambda: self._get("/readyz") == 200)
            self._start_controller_manager()
            self._start_scheduler()
            self._start_kwok()
            self._save_state()
            client = self.api_client()
            try:
                self._create_nodes(client)
                self._wait_ready(client, deadline)
            finally:
                client.close()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        stop_pids(self.pids)
        for child in self._children.values():
            try:
                child.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self._children.clear()
        self.pids.clear()
        if self.state_file.exists():
            self.state_file.unlink()

    def restart_apiserver(self, timeout_s: float = 90.0, grace_s: float = 3.0) -> float:
        """Stop kube-apiserver (SIGTERM, SIGKILL after `grace_s`: it stops listening at once, then its
        graceful shutdown can hang for longer) and start it again with the same flags,
        port, certificates and etcd, so every client (operator, controller-manager, scheduler, kwok,
        kubelets) reconnects to the same address; return the seconds it took.

        Returns once /readyz answers, discovery serves every CustomResourceDefinition's served
        versions again, and the rest of the plane passes the start's checks (default ServiceAccount,
        scheduler health, pool nodes Ready): a shared plane stays usable for the tests after.
        Admission policies load asynchronously and are not waited for here."""
        started = time.monotonic()
        deadline = started + timeout_s
        name = "kube-apiserver"
        stop_pids({name: self.pids[name]}, grace_s=grace_s)
        old = self._children.pop(name, None)
        if old is not None:
            try:
                old.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self._start_apiserver()
        if self.state_file.exists():
            self._save_state()
        self._wait(deadline, name, lambda: self._get("/readyz") == 200)
        client = self.api_client()
        try:
            self._wait(deadline, name, lambda: self._crds_discovered(client), "CRDs in discovery")
            self._wait_ready(client, deadline)
        finally:
            client.close()
        return time.monotonic() - started

    def _crds_discovered(self, client) -> bool:
        """Every served version of every Established CRD is listed by API discovery."""
        import kubernetes
        import urllib3

        try:
            crds = kubernetes.client.ApiextensionsV1Api(client).list_custom_resource_definition().items
        except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError):
            return False
        for crd in crds:
            conditions = {c.type: c.status for c in (crd.status.conditions or [])} if crd.status else {}
            if conditions.get("Established") != "True":
                return False
            for version in (v.name for v in crd.spec.versions if v.served):
                try:
                    listing = kubernetes.client.CustomObjectsApi(client).get_api_resources(crd.spec.group, version)
                except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError):
                    return False
                if not any(resource.name == crd.spec.names.plural for resource in listing.resources):
                    return False
        return True

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def api_client(self):
        import kubernetes

        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    # ---- steps

    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        write_pki(self.pki)
        for component in ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
            self.ports[component] = free_port()
        for stem, user, filename in (
            ("admin", "shapeshift-admin", "admin.kubeconfig"),
            ("controller-manager", "system:kube-controller-manager", "controller-manager.kubeconfig"),
            ("scheduler", "system:kube-scheduler", "scheduler.kubeconfig"),
        ):
            path = self.workdir / filename
            path.write_text(yaml.safe_dump(kubeconfig_for(self.server, self.pki, user, stem)))
            path.chmod(0o600)
        (self.workdir / "kwok-stages.yaml").write_text(stages_yaml())
        # kwok always loads ~/.kwok/kwok.yaml if present; give it an empty home.
        (self.workdir / "kwok-home").mkdir(exist_ok=True)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        child = spawn([str(tools.require(name)), *args], self._log(name), cwd=self.workdir, env=env, detach=self.detach)
        self._children[name] = child
        self.pids[name] = child.pid

    def _log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._spawn(
            "etcd",
            [
                "--name=shapeshift",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=shapeshift={peer}",
                "--unsafe-no-fsync=true",  # test data: durability is not wanted, speed is
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self) -> None:
        p = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                # Loopback only; an explicit advertise address also avoids the
                # "no default routes found" failure on machines without a default route.
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['kube-apiserver']}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                "--authorization-mode=RBAC",
                "--enable-admission-plugins=ServiceAccount,NamespaceLifecycle,LimitRanger,DefaultTolerationSeconds",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                # The default reconciler writes the advertise address into the
                # `kubernetes` Endpoints, which rejects loopback addresses.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
            ],
        )

    def _component_flags(self, name: str) -> list[str]:
        """What controller-manager and scheduler share: their own kubeconfig (for the API and
        for delegated authentication/authorization) and a loopback-only secure port."""
        kubeconfig = self.workdir / f"{name.removeprefix('kube-')}.kubeconfig"
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports[name]}",
            "--profiling=false",
        ]

    def _start_controller_manager(self) -> None:
        self._spawn(
            "kube-controller-manager",
            [
                *self._component_flags("kube-controller-manager"),
                # Token controller: signs legacy SA token secrets and puts the CA in them.
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                # Each controller acts as its own ServiceAccount, as in kubeadm clusters,
                # so RBAC mistakes in bootstrap roles would show up here too.
                "--use-service-account-credentials=true",
                f"--cluster-signing-cert-file={self.pki / 'ca.crt'}",
                f"--cluster-signing-key-file={self.pki / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--leader-elect=false",  # one instance; skips waiting for a lease
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
            ],
        )

    def _start_scheduler(self) -> None:
        self._spawn("kube-scheduler", [*self._component_flags("kube-scheduler"), "--leader-elect=false"])

    def _start_kwok(self) -> None:
        key, value = KWOK_NODE_ANNOTATION
        self._spawn(
            "kwok",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--config={self.workdir / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={key}={value}",
                f"--cidr={POD_CIDR}",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{self.ports['kwok']}",
            ],
            env={"HOME": str(self.workdir / "kwok-home")},
        )

    def _create_nodes(self, client) -> None:
        import kubernetes

        core = kubernetes.client.CoreV1Api(client)
        for pool in self.pools:
            for manifest in pool.node_manifests():
                core.create_node(manifest)

    def _wait_ready(self, client, deadline: float) -> None:
        import kubernetes

        core = kubernetes.client.CoreV1Api(client)
        expected = {name for pool in self.pools for name in pool.node_names()}

        def default_service_account() -> bool:
            # Created by the controller-manager's serviceaccount controller; pods in
            # the namespace are rejected by the ServiceAccount admission plugin until then.
            try:
                core.read_namespaced_service_account("default", "default")
                return True
            except kubernetes.client.ApiException as error:
                if error.status == 404:
                    return False
                raise

        def nodes_schedulable() -> bool:
            ready = set()
            for node in core.list_node(label_selector="type=kwok").items:
                conditions = {c.type: c.status for c in node.status.conditions or []}
                # The node lifecycle controller taints a node node.kubernetes.io/not-ready
                # until it sees Ready; the scheduler would keep pods off until then.
                lifecycle_taints = [t for t in node.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
                if conditions.get("Ready") == "True" and not lifecycle_taints:
                    ready.add(node.metadata.name)
            return expected <= ready

        self._wait(deadline, "kube-controller-manager", default_service_account, "default ServiceAccount")
        self._wait(deadline, "kube-scheduler", lambda: self._get_component("kube-scheduler", "/healthz") == 200)
        self._wait(deadline, "kwok", nodes_schedulable, "pool nodes Ready and untainted")

    # ---- probes

    def _wait(self, deadline: float, component: str, probe: Callable[[], bool], detail: str = "") -> None:
        """Wait for `component` to pass `probe`; fail early if any part exits, at `deadline`
        with the tail of `component`'s log."""
        children = {name: (child, self._log(name)) for name, child in self._children.items()}
        what = f"{component} ({detail})" if detail else component
        wait_ready(probe, deadline, what, children, self._log(component), error=ControlPlaneError)

    def _etcd_healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['etcd']}/health", timeout=2) as response:
            return json.load(response).get("health") == "true"

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return context

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.server + path, context=self._ssl_context(), timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    def _get_component(self, name: str, path: str) -> int:
        # Scheduler and controller-manager serve self-signed certs; only liveness matters here.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        url = f"https://127.0.0.1:{self.ports[name]}{path}"
        try:
            with urllib.request.urlopen(url, context=context, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    def healthy(self) -> bool:
        try:
            return self._get("/readyz") == 200
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return False

    # ---- state for the script

    def _save_state(self) -> None:
        state = {"pids": self.pids, "ports": self.ports, "kubeconfig": str(self.kubeconfig)}
        self.state_file.write_text(json.dumps(state, indent=2))

    @classmethod
    def load(cls, workdir: Path | str) -> ControlPlane:
        plane = cls(workdir, detach=True)
        state = json.loads(plane.state_file.read_text())
        plane.pids = {name: int(pid) for name, pid in state["pids"].items()}
        plane.ports = {name: int(port) for name, port in state["ports"].items()}
        return plane

    def running(self) -> dict[str, bool]:
        return {name: _pid_runs(pid, name) for name, pid in self.pids.items()}


# --------------------------------------------------------------------------- script


def default_dir() -> Path:
    return Path(os.environ.get("SHAPESHIFT_CLUSTER_DIR") or tools.cache_dir() / "cluster")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Local Kubernetes control plane with kwok node pools.")
    parser.add_argument("command", choices=("up", "down", "env", "status"))
    parser.add_argument("--dir", type=Path, default=default_dir(), help="state directory (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness on `up`")
    args = parser.parse_args(argv)
    workdir: Path = args.dir.resolve()
    state_file = workdir / "state.json"

    existing = ControlPlane.load(workdir) if state_file.exists() else None
    if args.command == "up":
        if existing and all(existing.running().values()) and existing.healthy():
            print(f"control plane already running: export KUBECONFIG={existing.kubeconfig}", file=sys.stderr)
            return 0
        if existing:
            existing.stop()
        if workdir.exists():
            shutil.rmtree(workdir)  # a fresh etcd and fresh certificates each time
        plane = ControlPlane(workdir, detach=True).start(timeout_s=args.timeout)
        nodes = sum(pool.count for pool in plane.pools)
        print(
            f"control plane up in {plane.startup_seconds:.1f}s ({nodes} kwok nodes); logs in {plane.logs}\n"
            f"export KUBECONFIG={plane.kubeconfig}",
            file=sys.stderr,
        )
        return 0
    if args.command == "down":
        if existing is None:
            print(f"no control plane recorded in {workdir}", file=sys.stderr)
            return 0
        existing.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        print("control plane stopped", file=sys.stderr)
        return 0
    if args.command == "env":
        if existing is None:
            print(f"error: no control plane in {workdir}; run `hack/cluster.sh up` first", file=sys.stderr)
            return 1
        print(f"export KUBECONFIG={existing.kubeconfig}")
        print(f"export SHAPESHIFT_TEST_KUBECONFIG={existing.kubeconfig}")
        return 0
    # status
    if existing is None:
        print(f"down (nothing recorded in {workdir})")
        return 1
    running = existing.running()
    for name, alive in running.items():
        print(f"{name:25s} pid {existing.pids[name]:>7d}  {'running' if alive else 'STOPPED'}")
    healthy = existing.healthy()
    print(f"{'kube-apiserver /readyz':25s} {existing.server}  {'ok' if healthy else 'FAILING'}")
    return 0 if healthy and all(running.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
