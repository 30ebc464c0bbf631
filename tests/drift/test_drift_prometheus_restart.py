"""Prometheus stops while a deployment is drifting, then comes back: the drift timer
(shapeshift.operator.handlers.drift) on the real control plane with a real Prometheus.

The deployment (policy OnDrift, two consecutive checks, cooldown 0, so no cooldown can be what
holds a compile back) says its forward pass was compiled for short prompts; its engine is stood
in for by tests/drift/metrics_exporter.py, fed long prompts without prefix-cache hits for the
whole test, before, during and after the outage. The first check sees the drift (Drifting, 1 of
2): the next one would compile. Prometheus stops before it. Every check while it is down is
NoData (TrafficObserved=False, PrometheusUnreachable; Drifted=Unknown), resets the count to 0
(a gap breaks "persisting", operator/drift.py) and creates nothing. Prometheus then restarts on
the same port with the same data folder (the TSDB keeps the samples from before the outage): the
first check after it counts from 1 again (Drifting, not Compile), the second creates exactly one
CompileRun with the long-prompt traffic, and the check after that creates no other.

What each check decided is read from the operator's own check_drift, wrapped in this process to
record its decision (the operator runs in-process under kopf.testing.KopfRunner): a check that
changes nothing but the check time writes no status, so status alone cannot count the checks.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from harness.cluster import wait_until
from harness.drift_stage import drifting_deployment, scrape_engine
from metrics_exporter import exporter_process, observe

os.environ.setdefault("SHAPESHIFT_DRIFT_TIMER_SECONDS", "2")  # only effective if imported first

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
CHECK_INTERVAL = 10  # the least checkIntervalSeconds the CRD allows


@pytest.fixture
def engine_metrics():
    """The exporter, fed 4 long-prompt requests every half second until the test ends."""
    with exporter_process("tiny-llama") as target:
        stop = threading.Event()

        def feed():
            i = 0
            while not stop.is_set():
                observe(target, 150 + (i * 37) % 100, 40, 0, count=4)
                i += 1
                stop.wait(0.5)

        thread = threading.Thread(target=feed, daemon=True)
        thread.start()
        try:
            yield target
        finally:
            stop.set()
            thread.join(timeout=10)


def test_prometheus_outage_mid_drift_compiles_nothing_then_exactly_once_after_restart(
        crds, namespace, engine_metrics, prometheus, monkeypatch):
    from kopf.testing import KopfRunner

    from shapeshift.engine.contracts.traffic_profile import TrafficProfile

    server = scrape_engine(prometheus, namespace, engine_metrics)

    custom = crds.custom
    drifting_deployment(crds, namespace, server.url, replicas=0, cooldown_s=0, check_interval_s=CHECK_INTERVAL)

    monkeypatch.setenv("KUBECONFIG", str(crds.kubeconfig))
    import shapeshift.operator.handlers  # noqa: F401  (the core handlers: CompileRun -> Job)
    from shapeshift.operator.handlers import drift as drift_handlers

    checks: list[tuple[float, str, str]] = []  # (monotonic time, decision kind, reason) of each check
    real_check_drift = drift_handlers.check_drift

    def recording_check_drift(**kwargs):
        check = real_check_drift(**kwargs)
        decision = check.result.decision
        checks.append((time.monotonic(), decision.kind, getattr(decision, "reason", "")))
        return check

    monkeypatch.setattr(drift_handlers, "check_drift", recording_check_drift)

    def idep() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", "llama")

    def runs() -> list[dict]:
        return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns")["items"]

    def conditions(st: dict) -> dict:
        return {c["type"]: c for c in st.get("conditions") or []}

    def kinds_since(t: float) -> list[str]:
        return [kind for at, kind, _ in checks if at >= t]

    args = ["run", "--standalone", "--namespace", namespace,
            "-m", "shapeshift.operator.handlers", "-m", "shapeshift.operator.handlers.drift"]
    timeout = 3 * CHECK_INTERVAL
    with KopfRunner(args, timeout=120) as runner:
        # 1. drifting, one check short of a compile
        status = wait_until(lambda: (lambda st: st if (st.get("drift") or {}).get("consecutiveChecks") == 1 else None)(
            idep().get("status") or {}), timeout, "the first drifting check (1 of 2)")
        assert conditions(status)["Drifted"]["reason"] == "Drifting", status
        assert checks and checks[-1][1] == "Drifting", checks

        # 2. Prometheus stops before the second check: every check while it is down is NoData
        server.stop()
        stopped = time.monotonic()
        wait_until(lambda: kinds_since(stopped).count("NoData") >= 2, 3 * CHECK_INTERVAL,
                   "two checks while Prometheus is down")
        down = kinds_since(stopped)
        assert set(down) == {"NoData"}, checks
        assert {reason for at, _, reason in checks if at >= stopped} == {"PrometheusUnreachable"}, checks
        status = idep()["status"]
        cond = conditions(status)
        assert cond["TrafficObserved"]["status"] == "False", cond
        assert cond["TrafficObserved"]["reason"] == "PrometheusUnreachable", cond
        assert cond["Drifted"]["status"] == "Unknown", cond
        assert status["drift"]["consecutiveChecks"] == 0, status["drift"]
        assert runs() == [], "a CompileRun was created while Prometheus was down"
        assert "lastCompileRun" not in status

        # 3. back on the same port with the same data folder: counting starts again from 1
        server.restart()
        back = time.monotonic()
        created = wait_until(lambda: runs() or None, 3 * CHECK_INTERVAL, "the CompileRun after Prometheus returned")
        assert len(created) == 1, created
        after = kinds_since(back)
        assert after[:2] == ["Drifting", "Compile"], checks
        run = created[0]
        status = wait_until(lambda: (idep().get("status") or {}).get("lastCompileRun") and idep()["status"],
                            30, "status.lastCompileRun")
        assert status["lastCompileRun"] == run["metadata"]["name"]
        cond = conditions(status)
        assert cond["TrafficObserved"]["status"] == "True", cond
        assert cond["Drifted"]["reason"] == "CompileRunCreated", cond
        assert run["spec"]["trigger"]["reason"] == "Drift"
        assert run["metadata"]["ownerReferences"][0]["name"] == "llama"
        inline = TrafficProfile.model_validate(run["spec"]["traffic"]["inline"])
        assert 128 < inline.prompt_length.p50 <= 256 and inline.prefix_cache_hit_rate == 0.0, inline

        # 4. the check after the compile creates no other run (cooldown 0: only the count and the
        #    active run hold it back); the run has its one Job
        compiled = time.monotonic()
        wait_until(lambda: kinds_since(compiled), 2 * CHECK_INTERVAL, "the check after the compile")
        jobs = wait_until(lambda: crds.batch.list_namespaced_job(namespace).items or None, 30, "the run's Job")
        assert len(runs()) == 1 and len(jobs) == 1, (runs(), [j.metadata.name for j in jobs])
    assert runner.exception is None, runner.output[-4000:]
    assert [kind for _, kind, _ in checks].count("Compile") == 1, checks
    reasons = [e.reason for e in crds.core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=llama").items]
    assert reasons.count("CompileRunCreated") == 1 and "PrometheusUnreachable" in reasons, reasons
