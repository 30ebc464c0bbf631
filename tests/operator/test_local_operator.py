"""The local operator mode of docs/local-operator.md: hack/run-operator-local.sh against the
cluster of a kubeconfig (here the test control plane), and the manifest that page shows.

    hack/run-operator-local.sh -n NS --resync-seconds 2 --local-pods ...   (KUBECONFIG: the test cluster)
      -> hack/setup.sh, API server check, crds/ applied and Established
      -> `shapeshift operator --standalone --namespace NS --liveness http://127.0.0.1:PORT/healthz`
         beside hack/run-pods-local.py -n NS (the engine pod run as a local process), both stopped together
    kubectl apply <the page's cpu-tiny.yaml>  -> ConfigMap and Deployment tiny-engine, Service tiny,
                                                 the engine pod placed on a CPU-pool node
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from harness.docs import yaml_documents
from shapeshift.operator import api as models

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "run-operator-local.sh"
DOC = REPO / "docs" / "local-operator.md"


def doc_manifest() -> dict:
    docs = [d for d in yaml_documents(DOC) if d.get("kind") == "InferenceDeployment"]
    assert len(docs) == 1, f"{DOC.name} should show one InferenceDeployment, found {len(docs)}"
    return docs[0]


def test_the_page_manifest_is_a_cpu_deployment_the_models_accept() -> None:
    doc = doc_manifest()
    spec = models.InferenceDeploymentSpec.model_validate(doc["spec"])
    assert spec.hardware.accelerator == "cpu" and spec.model.preset == "tiny-llama"
    # the names the page says the operator creates
    text = DOC.read_text()
    assert f"`{doc['metadata']['name']}-engine`" in text and f"Service `{doc['metadata']['name']}`" in text


def test_readme_links_the_page() -> None:
    assert "docs/local-operator.md" in (REPO / "README.md").read_text()


def test_without_a_kubeconfig_it_says_what_to_do(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KUBECONFIG": str(tmp_path / "missing.yaml")})
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
    help_ = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--prometheus-url" in help_.stdout and "source" not in help_.stdout
    assert "--local-pods" in help_.stdout
    # the runner's options without the runner: refused before anything starts
    proc = subprocess.run(["bash", str(SCRIPT), "--port-base", "18100"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--port-base" in proc.stderr and "--local-pods" in proc.stderr, proc.stderr


@pytest.mark.cluster
def test_the_script_runs_the_operator_against_the_kubeconfig_cluster(crds, cluster, namespace, tmp_path) -> None:
    from harness import tools
    from harness.cluster import wait_until
    from harness.controlplane import free_port
    from harness.operator_process import operator_healthy, stop_operator

    port, port_base = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "SHAPESHIFT_OPERATOR_HEALTH_PORT": str(port),
           "KUBECTL": str(tools.kubectl())}
    log = tmp_path / "operator.log"
    # --local-pods: the one command of the page, the operator and hack/run-pods-local.py together
    with open(log, "ab") as out:
        proc = subprocess.Popen(["bash", str(SCRIPT), "-n", namespace, "--resync-seconds", "2", "--local-pods",
                                 "--port-base", str(port_base), "--workdir", str(tmp_path / "pods"),
                                 "--interval", "0.5"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: operator_healthy(port) or proc.poll() is not None, 120, "the operator's health endpoint")
        assert proc.poll() is None, log.read_text()[-3000:]
        text = log.read_text()
        assert "applying the CRDs" in text and f"--standalone -n {namespace}" in text, text[-3000:]

        manifest = doc_manifest()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
        name = manifest["metadata"]["name"]

        def children():
            try:
                dep = cluster.apps.read_namespaced_deployment(f"{name}-engine", namespace)
                cluster.core.read_namespaced_service(name, namespace)
                cluster.core.read_namespaced_config_map(f"{name}-engine", namespace)
            except Exception:  # noqa: BLE001 - not created yet
                return None
            return dep

        dep = wait_until(children, 60, "the engine Deployment, Service and ConfigMap")
        container = dep.spec.template.spec.containers[0]
        assert container.args[:3] == ["serve", "--model", "tiny-llama"]

        def placed():
            pods = cluster.core.list_namespaced_pod(
                namespace, label_selector=f"shapeshift.dev/inference-deployment={name}").items
            return pods if pods and all(p.spec.node_name for p in pods) else None

        pods = wait_until(placed, 60, "the engine pod scheduled")
        node = cluster.core.read_node(pods[0].spec.node_name)
        assert node.metadata.labels.get("shapeshift.dev/pool") == "cpu", node.metadata.labels
        # the runner the script started runs the pod (its load is not waited for: test_local_pods.py serves)
        started = f"pod {namespace}/{pods[0].metadata.name}: started shapeshift serve"
        wait_until(lambda: started in log.read_text() or proc.poll() is not None, 60, "the runner to start the engine",
                   interval_s=0.2)
        assert proc.poll() is None, log.read_text()[-3000:]
        assert f"serving on http://127.0.0.1:{port_base}" in log.read_text()
    finally:
        if proc.poll() is None:
            stop_operator(proc)
        elif proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
            pytest.fail(f"the script exited {proc.returncode}: {log.read_text()[-3000:]}")
    # stopping the script stopped the runner, which stopped the engine and reported it, as a kubelet would
    text = log.read_text()
    assert f"pod {namespace}/{pods[0].metadata.name}: stopped (runner stopping)" in text, text[-3000:]
    assert "stopped the operator and the local pods runner" in text, text[-3000:]
    status = cluster.core.read_namespaced_pod_status(pods[0].metadata.name, namespace).status
    assert status.container_statuses[0].state.terminated is not None, status
