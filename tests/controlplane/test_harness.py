"""The harness itself: startup failures clean up, and the local kubelet reports like a kubelet."""

from __future__ import annotations

import json
import os
import sys
import time
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


def test_a_part_exiting_during_startup_fails_it_at_once_with_that_parts_log(cluster, tmp_path):
    if not cluster.local:
        pytest.skip("checks the local control plane; this run uses $SHAPESHIFT_TEST_KUBECONFIG")

    class BrokenEtcd(ControlPlane):
        def _start_etcd(self) -> None:
            self._spawn("etcd", ["--no-such-flag"])

    plane = BrokenEtcd(tmp_path / "broken")
    started = time.monotonic()
    with pytest.raises(ControlPlaneError, match=r"etcd exited with code \d+ while waiting for etcd") as failed:
        plane.start(timeout_s=60)
    assert time.monotonic() - started < 20  # the exit was noticed; the 60 s deadline was not waited out
    assert "no-such-flag" in str(failed.value)  # etcd's own complaint, from its log
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


def test_local_pod_emulates_a_downward_api_volume_and_follows_annotation_changes(
        cluster, namespace, run_pod_locally):
    from shapeshift.engine.contracts.pod_annotations import parse_downward_api_map

    # The process prints the file at the path its command line names, whenever it changes,
    # and the flag it was started with (overridden locally).
    script = (
        "import sys, time, json;"
        "path = sys.argv[sys.argv.index('--info') + 1]; last = None;"
        "print(json.dumps({'path': path, 'port': sys.argv[sys.argv.index('--port') + 1]}), flush=True);"
        "exec('while True:\\n text = open(path).read()\\n if text != last:\\n  last = text; print(repr(text), flush=True)\\n time.sleep(0.1)')"
    )
    cluster.core.create_namespaced_pod(namespace, {
        "metadata": {"name": "follower", "labels": {"app": "demo"},
                     "annotations": {"shapeshift.dev/forward-pass": "first", "note": 'has "quotes"\nand a newline'}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {POOL_LABEL: "cpu"},
            "containers": [{
                "name": "main", "image": "registry.invalid/follower:1",
                "command": [sys.executable, "-c", script],
                "args": ["--info", "/etc/podinfo/annotations", "--port", "8000"],
                "volumeMounts": [{"name": "podinfo", "mountPath": "/etc/podinfo", "readOnly": True}],
            }],
            "volumes": [{"name": "podinfo", "downwardAPI": {"items": [
                {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}}],
        },
    })
    pod = run_pod_locally(namespace, "follower", background=True, flag_overrides={"--port": "18123"})
    header = wait_until(lambda: pod.output().splitlines()[0] if pod.output().strip() else None, 30,
                        "the follower to start")
    started = json.loads(header)
    assert started["port"] == "18123"
    local = Path(started["path"])
    assert local != Path("/etc/podinfo/annotations") and local.name == "annotations" and local.is_file()
    assert parse_downward_api_map(local.read_text()) == {
        "shapeshift.dev/forward-pass": "first", "note": 'has "quotes"\nand a newline'}
    assert parse_downward_api_map((local.parent / "labels").read_text()) == {"app": "demo"}
    assert (local.parent / "name").read_text() == "follower"

    cluster.core.patch_namespaced_pod("follower", namespace, {"metadata": {"annotations": {
        "shapeshift.dev/forward-pass": "second", "note": None}}})
    wait_until(lambda: parse_downward_api_map(local.read_text()) == {"shapeshift.dev/forward-pass": "second"}, 15,
               "the annotations file to follow the patch")
    # The running process saw the new content through the same path.
    wait_until(lambda: "second" in pod.output(), 10, "the process to read the rewritten file")
    assert pod.stop() == {"main": 143}
