"""The harness itself: startup failures clean up, and the local kubelet reports like a kubelet."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness.cluster import wait_until
from harness.controlplane import ControlPlane, ControlPlaneError, POOL_LABEL

pytestmark = pytest.mark.cluster


def processes_in(directory: Path) -> list[int]:
    """PIDs whose working directory is `directory` (the control plane runs its parts there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == directory:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_failed_startup_stops_every_process_it_started(cluster, tmp_path):
    if not cluster.local:
        pytest.skip("checks the local control plane; this run uses $SHAPESHIFT_TEST_KUBECONFIG")
    plane = ControlPlane(tmp_path / "doomed")
    # Far too short for the API server to become ready, so start() must fail and clean up.
    with pytest.raises(ControlPlaneError, match="timed out waiting for kube-apiserver"):
        plane.start(timeout_s=0.5)
    assert (tmp_path / "doomed" / "logs" / "etcd.log").exists()  # it did get as far as etcd
    assert processes_in(plane.workdir) == []


def test_local_pod_resolves_env_and_reports_a_stop_like_a_kubelet(cluster, namespace, run_pod_locally):
    cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"A": "1", "B": "2"}})
    script = (
        "import json, os, time;"
        "print(json.dumps({k: os.environ.get(k) for k in ['CFG_A', 'CFG_B', 'POOL', 'CPU_LIMIT', 'MEM_MI', 'HOSTNAME']}),"
        " flush=True);"
        "time.sleep(300)"
    )
    cluster.core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "server", "labels": {"pool-wanted": "cpu"}},
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {POOL_LABEL: "cpu"},
                "containers": [
                    {
                        "name": "serve",
                        "image": "registry.invalid/server:1",
                        "command": [sys.executable, "-c", script],
                        "resources": {"limits": {"cpu": "1500m", "memory": "256Mi"}},
                        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
                        "env": [
                            {"name": "POOL", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['pool-wanted']"}}},
                            {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                            {
                                "name": "MEM_MI",
                                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
                            },
                        ],
                    }
                ],
            },
        },
    )
    pod = run_pod_locally(namespace, "server", background=True)
    printed = wait_until(lambda: pod.output().strip(), 30, "the server to print its environment")
    assert json.loads(printed) == {
        "CFG_A": "1", "CFG_B": "2", "POOL": "cpu", "CPU_LIMIT": "2", "MEM_MI": "256", "HOSTNAME": "server",
    }
    assert cluster.core.read_namespaced_pod("server", namespace).status.phase == "Running"

    assert pod.stop() == {"serve": 143}  # SIGTERM, reported as 128 + 15 like a container runtime
    status = cluster.core.read_namespaced_pod_status("server", namespace).status
    assert status.phase == "Failed"
    terminated = status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (143, "Error")
