"""The API server restarts under a running operator: `shapeshift operator` as its own process
(harness.operator_process, never restarted) on the real control plane, with a real Prometheus.

The deployment (policy OnDrift, two consecutive checks, cooldown 1 h) says its forward pass was
compiled for short prompts; tests/drift/metrics_exporter.py stands in for its engine, fed long
prompts for the whole test. Two restarts (harness.controlplane.ControlPlane.restart_apiserver:
same flags, port, certificates and etcd):

  1. mid-drift: after the first check saw the drift (Drifting, 1 of 2), across the time the second
     falls due. That check fails (it cannot list the CompileRuns) and is retried; the operator's
     drift timer keeps checking after the API server returns and creates exactly one CompileRun;
     the operator's watch sees that run and creates its one Job, which the controller-manager and
     scheduler (reconnected too) turn into one bound pod.
  2. mid-run: while the run is Scheduled. The pod's command then runs with a stand-in `shapeshift`
     first on PATH (as in tests/operator/test_cluster_compile.py: the Job's fate, not the worker,
     is under test) and exits 0; the operator's resync sees the Job complete and the run becomes
     Succeeded, once, on the Job it started with, within seconds: the resync timers that failed
     during the outage run again after their interval (kopf's default backoff would hold them for
     60 s).

At the end: one CompileRun, one Job (the same uid), one pod, no ForwardPass (the stand-in publishes
none), the events JobCreated and Succeeded once each, and the deployment's drift status written
after the second restart (its timer still runs). The shared control plane is left as healthy as
before: discovery serves the CRDs again and the chart's admission policy is enforced again.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest
from harness.chart_operator import apply_admission_policy
from harness.cluster import wait_until
from harness.drift_stage import drifting_deployment, scrape_engine
from harness.controlplane import free_port
from harness.operator_process import operator_healthy, start_operator, stop_operator
from test_cluster_compile import bound_pod, event_reasons, jobs, run_status, stand_in_worker

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
CHECK_INTERVAL = 10  # the least checkIntervalSeconds the CRD allows


@pytest.fixture
def engine_metrics():
    """The drift tests' exporter (tests/drift/metrics_exporter.py), fed long prompts until the end."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "drift" / "metrics_exporter.py"
    spec = importlib.util.spec_from_file_location("drift_metrics_exporter", path)
    exporter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exporter)
    with exporter.exporter_process("tiny-llama") as target:
        stop = threading.Event()

        def feed():
            i = 0
            while not stop.is_set():
                exporter.observe(target, 150 + (i * 37) % 100, 40, 0, count=4)
                i += 1
                stop.wait(0.5)

        thread = threading.Thread(target=feed, daemon=True)
        thread.start()
        try:
            yield target
        finally:
            stop.set()
            thread.join(timeout=10)


@pytest.fixture
def restart_apiserver(crds):
    """restart_apiserver() -> seconds: the shared plane's API server restarted, then the chart's
    admission policy waited for until enforced again (the API server loads it asynchronously)."""
    plane = crds.control_plane
    if plane is None:
        pytest.skip("restarting the API server needs the local control plane (not $SHAPESHIFT_TEST_KUBECONFIG)")

    def restart() -> float:
        started = time.monotonic()
        plane.restart_apiserver()
        apply_admission_policy(crds)
        return time.monotonic() - started

    return restart


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_operator_carries_on_across_apiserver_restarts_mid_drift_and_mid_run(
        crds, namespace, kube, engine_metrics, prometheus, restart_apiserver, run_pod_locally, tmp_path):
    from shapeshift.engine.contracts.traffic_profile import TrafficProfile

    server = scrape_engine(prometheus, namespace, engine_metrics)
    custom = crds.custom
    drifting_deployment(crds, namespace, server.url, replicas=0, cooldown_s=3600, check_interval_s=CHECK_INTERVAL)

    def status() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments",
                                                   "llama").get("status") or {}

    def runs() -> list[dict]:
        return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns")["items"]

    log, port = tmp_path / "operator.log", free_port()
    operator = start_operator(crds, namespace, log, port, env={"SHAPESHIFT_DRIFT_TIMER_SECONDS": "2"})
    try:
        wait_until(lambda: operator_healthy(port), 30, "the operator's health endpoint")
        first = wait_until(lambda: (lambda st: st if (st.get("drift") or {}).get("consecutiveChecks") == 1 else None)(
            status()), 3 * CHECK_INTERVAL, "the first drifting check (1 of 2)")
        assert not runs()

        # 1. mid-drift: down from just before the second check falls due until after it, so that
        #    check's read of the CompileRuns fails and is retried once the API server is back
        due = _utc(first["drift"]["lastCheckTime"]).timestamp() + CHECK_INTERVAL  # seconds: at most 1 s early
        time.sleep(max(0.0, due - 2.0 - time.time()))
        outage = restart_apiserver()
        assert operator.poll() is None, log.read_text(errors="replace")[-4000:]
        (run,) = wait_until(runs, 3 * CHECK_INTERVAL, "the CompileRun of the drift check after the restart")
        name = run["metadata"]["name"]
        assert run["spec"]["trigger"]["reason"] == "Drift"
        assert _utc(run["metadata"]["creationTimestamp"]) >= _utc(first["drift"]["lastCheckTime"])
        st = wait_until(lambda: (lambda s: s if s.get("lastCompileRun") == name else None)(status()), 30,
                        "status.lastCompileRun")
        assert {c["type"]: c for c in st["conditions"]}["Drifted"]["reason"] == "CompileRunCreated"
        (job,) = wait_until(lambda: jobs(kube, namespace, name), 30, "the run's Job")
        pod = wait_until(lambda: bound_pod(kube, namespace, name), 30, "the run's pod bound to a node")
        wait_until(lambda: run_status(crds, namespace, name).get("phase") in ("Scheduled", "Running"), 30,
                   "the run Scheduled")

        # 2. mid-run
        outage += restart_apiserver()
        restarted = datetime.now(timezone.utc)
        assert operator.poll() is None, log.read_text(errors="replace")[-4000:]
        worker = stand_in_worker(tmp_path, 0)
        run_pod_locally(namespace, pod["metadata"]["name"], extra_env={"PATH": worker["PATH"]}, timeout_s=60)
        # the resync timers failed while the API server was down and run again at their interval
        # (kopf's default for an unexpected error is 60 s): the run's fate is seen within seconds
        done = wait_until(lambda: (lambda s: s if s.get("phase") == "Succeeded" else None)(
            run_status(crds, namespace, name)), 20, "the run Succeeded")

        # the drift timer still checks: a status written after the second restart
        current = wait_until(lambda: (lambda st: st if _utc(st["drift"]["lastCheckTime"]) > restarted else None)(
            status()), 3 * CHECK_INTERVAL, "a drift check after the second restart")
        assert current["lastCompileRun"] == name
        time.sleep(4)  # two more resyncs: nothing else appears
        assert [r["metadata"]["name"] for r in runs()] == [name]
        (after,) = jobs(kube, namespace, name)
        assert after["metadata"]["uid"] == job["metadata"]["uid"], "the Job was recreated"
        assert len(kube.list("Pod", namespace, {"shapeshift.dev/compile-run": name})) == 1
        assert custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses")["items"] == []
        assert run_status(crds, namespace, name) == done
        reasons = event_reasons(crds, namespace, name)
        assert reasons.count("JobCreated") == 1 and reasons.count("Succeeded") == 1, reasons
        assert operator.poll() is None and operator_healthy(port)
    finally:
        stop_operator(operator)
    assert outage < 60, outage
    text = log.read_text(errors="replace")
    assert "drift check of llama failed" in text, "no drift check fell into the first outage"
    assert "will try again in 60" not in text, [line for line in text.splitlines() if "will try again" in line]
