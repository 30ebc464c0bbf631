"""Two `shapeshift operator` replicas with kopf peering on one control plane: the leader is
SIGKILLed while a CompileRun's pod runs; the other replica takes over within a bound that the
peering lifetime explains, and the run finishes once (one Job, one CompileRun, one JobCreated
and one Succeeded event).

Mechanism (operator/main.py): both replicas write keep-alives into the namespace's KopfPeering
`shapeshift`; the live one with the highest --priority acts, the other pauses its handlers and
timers (so the drift scheduler, fed by a timer, has nothing to run). A keep-alive is valid for
--peering-lifetime seconds (here LIFETIME_S) and is renewed every max(1, lifetime - 5..10) s,
so a killed leader's last keep-alive lapses at most LIFETIME_S after the kill; the follower
sleeps until exactly then, re-reads the peering object and resumes. The bound allows
TAKEOVER_SLACK_S beyond that for the re-read, the resumed watch and a loaded machine.

The compile pod's command runs through the harness's run_pod_locally with a stand-in
`shapeshift` that exits 0 (as in test_cluster_compile.py): the worker is not under test.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness.cluster import wait_until
from harness.controlplane import free_port
from harness.operator_process import operator_healthy, start_operator, stop_operator

from test_cluster_compile import (
    GROUP, VERSION, bound_pod, event_reasons, jobs, make_deployment, make_run, run_status, stand_in_worker)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PEERING = "shapeshift"
LIFETIME_S = 10
TAKEOVER_SLACK_S = 10
RESUMED = "Resuming operations after the pause"


def replica(crds, namespace, tmp_path, name, priority):
    port = free_port()
    log = tmp_path / f"{name}.log"
    process = start_operator(crds, namespace, log, port, env={"POD_ID": name},
                             peering=["--peering", PEERING, "--priority", str(priority),
                                      "--peering-lifetime", str(LIFETIME_S)])
    return process, port, log


def peers(crds, namespace) -> dict:
    obj = crds.custom.get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", PEERING)
    return obj.get("status") or {}


def test_leader_killed_mid_run_the_other_replica_finishes_it_once(crds, namespace, kube, run_pod_locally, tmp_path):
    began = time.monotonic()
    crds.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}}, namespace)
    leader, leader_port, leader_log = replica(crds, namespace, tmp_path, "replica-a", 200)
    follower = None
    try:
        wait_until(lambda: operator_healthy(leader_port), 30, "the leader's health endpoint")
        follower, follower_port, follower_log = replica(crds, namespace, tmp_path, "replica-b", 100)
        wait_until(lambda: operator_healthy(follower_port), 30, "the follower's health endpoint")
        wait_until(lambda: {"replica-a", "replica-b"} <= set(peers(crds, namespace)), 30, "both keep-alives")
        # kopf starts a peered replica paused; the leader logs its resumption, the follower does not
        wait_until(lambda: RESUMED in leader_log.read_text(errors="replace"), 30, "the leader to resume")
        assert RESUMED not in follower_log.read_text(errors="replace")

        make_deployment(crds, namespace)
        make_run(crds, namespace)
        (job,) = wait_until(lambda: jobs(kube, namespace), 30, "the compile Job")
        pod = wait_until(lambda: bound_pod(kube, namespace), 30, "the compile pod to be bound")
        wait_until(lambda: run_status(crds, namespace).get("phase") in ("Scheduled", "Running"), 30, "run scheduled")

        os.killpg(leader.pid, signal.SIGKILL)
        killed = time.monotonic()
        leader.wait(timeout=10)

        resumed = wait_until(lambda: RESUMED in follower_log.read_text(errors="replace"),
                             LIFETIME_S + TAKEOVER_SLACK_S + 10, "the follower to resume")
        takeover_s = time.monotonic() - killed
        assert resumed
        print(f"takeover {takeover_s:.1f} s after the SIGKILL (lifetime {LIFETIME_S} s)")
        assert takeover_s <= LIFETIME_S + TAKEOVER_SLACK_S, takeover_s
        wait_until(lambda: "replica-a" not in peers(crds, namespace), 30, "the dead leader's keep-alive cleaned")

        env = stand_in_worker(tmp_path, 0)
        run_pod_locally(namespace, pod["metadata"]["name"], extra_env={"PATH": env["PATH"]}, timeout_s=60)
        st = wait_until(lambda: (lambda s: s if s.get("phase") == "Succeeded" else None)(run_status(crds, namespace)),
                        60, "phase Succeeded on the follower")
        time.sleep(4)  # a few resync periods: a duplicate would show now
        (after,) = jobs(kube, namespace)
        assert after["metadata"]["uid"] == job["metadata"]["uid"], "the Job was recreated"
        assert len(kube.list("Pod", namespace, {"shapeshift.dev/compile-run": "run-1"})) == 1
        runs = crds.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns")["items"]
        assert [r["metadata"]["name"] for r in runs] == ["run-1"]
        assert run_status(crds, namespace) == st
        reasons = event_reasons(crds, namespace)
        assert reasons.count("JobCreated") == 1 and reasons.count("Succeeded") == 1, reasons
        # the leader created the Job; the follower ran no handler, timer or drift check before resuming
        assert "created Job run-1-compile" in leader_log.read_text(errors="replace")
        assert "kopf.objects" not in follower_log.read_text(errors="replace").split(RESUMED)[0], "acted while paused"
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(timeout=10)
        if follower is not None:
            stop_operator(follower)
    text = follower_log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
    print(f"test body {time.monotonic() - began:.1f} s")
