"""hack/run-pods-local.py, the local kubelet of docs/local-operator.md, as a user runs it:

    docs/examples/inferencedeployment-cpu.yaml --operator (in-process)--> engine Deployment
      --scheduler, kwok--> a pod Running on a CPU node
      --hack/run-pods-local.py -n NS (its own process)--> the pod's `shapeshift serve` on 127.0.0.1,
        its configMap volume a local folder
      --> /health and a completion answer; the pod deleted: its engine stopped, the ReplicaSet's
          new pod's engine started; SIGTERM to the runner stops the engine and reports the container's exit
          in the pod's status, as a kubelet would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from harness.cluster import wait_until
from harness.controlplane import free_port
from shapeshift.operator.api import GROUP, VERSION

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "inferencedeployment-cpu.yaml"


def test_runner_serves_an_engine_pod_and_reports_its_stop(crds, namespace, operator, tmp_path):
    body = yaml.safe_load(EXAMPLE.read_text())
    assert body["spec"]["hardware"]["accelerator"] == "cpu"
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", body)
    name = body["metadata"]["name"]
    selector = f"shapeshift.dev/inference-deployment={name}"

    port_base = free_port()
    log = tmp_path / "runner.log"
    env = {**os.environ, "SHAPESHIFT_CACHE": str(tmp_path / "cache"), "PYTHONSAFEPATH": "1"}
    with open(log, "wb") as out:
        runner = subprocess.Popen(
            [sys.executable, str(REPO / "hack" / "run-pods-local.py"), "--kubeconfig", str(crds.kubeconfig),
             "-n", namespace, "--port-base", str(port_base), "--workdir", str(tmp_path / "pods"),
             "--interval", "0.5"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pod = wait_until(lambda: next(iter(crds.core.list_namespaced_pod(namespace, label_selector=selector).items),
                                      None), 60, "the operator's engine pod")
        url = f"http://127.0.0.1:{port_base}"
        wait_until(lambda: f"pod {namespace}/{pod.metadata.name}: started shapeshift serve" in log.read_text()
                   or runner.poll() is not None, 60, "the runner to start the engine", interval_s=0.2)
        assert runner.poll() is None, log.read_text()[-3000:]
        assert f"serving on {url}" in log.read_text()

        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 60, f"the engine at {url} to answer /health", interval_s=0.3)
        assert json.loads((tmp_path / "pods" / "endpoints.json").read_text()) == {
            f"{namespace}/{pod.metadata.name}": url}
        assert json.loads((tmp_path / "pods" / "prometheus-targets.json").read_text()) == [{
            "targets": [url.removeprefix("http://")],
            "labels": {"namespace": namespace, "deployment": name, "pod": pod.metadata.name}}]
        # the engine's configMap volume is a local folder holding the operator's ConfigMap
        config_map = crds.core.read_namespaced_config_map(f"{name}-engine", namespace).data
        volume = tmp_path / "pods" / "volumes" / f"{namespace}_{pod.metadata.name}_engine-config"
        assert {p.name: p.read_text() for p in volume.iterdir()} == config_map
        answer = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": body["spec"]["model"]["preset"], "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1

        # a deleted pod's engine is stopped; the ReplicaSet's new pod gets an engine of its own
        crds.core.delete_namespaced_pod(pod.metadata.name, namespace)
        first = pod.metadata.name

        def replacement():
            pods = crds.core.list_namespaced_pod(namespace, label_selector=selector).items
            return next((p for p in pods if p.metadata.name != first and p.status.phase == "Running"), None)

        pod = wait_until(replacement, 60, "the ReplicaSet's new engine pod")
        wait_until(lambda: f"{namespace}/{pod.metadata.name}" in json.loads(
            (tmp_path / "pods" / "endpoints.json").read_text()), 30, "the runner to start the new pod", interval_s=0.2)
        url = json.loads((tmp_path / "pods" / "endpoints.json").read_text())[f"{namespace}/{pod.metadata.name}"]
        assert re.search(rf"pod {namespace}/{first}: stopped \((deleted|gone)\)", log.read_text()), log.read_text()
        assert len(json.loads((tmp_path / "pods" / "endpoints.json").read_text())) == 1
        # (not waited for: a second engine load would double the test's time; the first one served)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGTERM)
        code = runner.wait(timeout=30)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert f"pod {namespace}/{pod.metadata.name}: stopped (runner stopping)" in output, output[-3000:]
    status = crds.core.read_namespaced_pod_status(pod.metadata.name, namespace).status
    (engine,) = status.container_statuses
    assert engine.name == "engine" and engine.state.terminated is not None, status
    assert status.phase in ("Succeeded", "Failed")
    assert not healthy()


def test_the_pages_prometheus_config_reads_the_runners_targets(tmp_path):
    """docs/local-operator.md's prometheus.yml, pointed at a targets file in the runner's format,
    passes `promtool check config` (which also reads the file_sd file)."""
    import shutil

    from harness import tools

    promtool = shutil.which("promtool", path=str(tools.prometheus().resolve().parent))
    assert promtool, "promtool not found next to prometheus; it ships in Debian's prometheus package"
    text = (REPO / "docs" / "local-operator.md").read_text()
    (config,) = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "file_sd_configs" in b]
    targets = tmp_path / "prometheus-targets.json"
    targets.write_text(json.dumps([{"targets": ["127.0.0.1:18000"],
                                    "labels": {"namespace": "default", "deployment": "tiny", "pod": "tiny-engine-0"}}]))
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"][0].endswith("/local-pods/prometheus-targets.json")
    job["file_sd_configs"][0]["files"] = [str(targets)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
