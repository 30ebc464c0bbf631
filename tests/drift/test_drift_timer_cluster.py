"""The drift timer (kopf, shapeshift.operator.handlers.drift) on the real control plane
with a real Prometheus.

An InferenceDeployment (policy OnDrift, two consecutive checks) whose status says
its forward pass was compiled for short prompts; its engine is stood in for by
tests/drift/metrics_exporter.py (the engine's EngineMetrics series, real
observations), scraped by Prometheus with the deployment's target labels: the
test pins the snapshot's prefix-cache hit rate to exactly 0, which only the
exporter can promise, and the timer, not the engine, is under test (the same
chain with real engine pods is tests/e2e/test_drift_to_rollout.py). Long
prompts arrive; the operator must see drift on the first check, create exactly one
CompileRun owned by the deployment on the second, carrying the observed traffic,
and report it in status. Prometheus then stops: the next check writes
TrafficObserved=False (PrometheusUnreachable) and creates nothing.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time

import pytest

from harness.cluster import wait_until
from harness.drift_stage import drifting_deployment
from metrics_exporter import exporter_process, observe

os.environ.setdefault("SHAPESHIFT_DRIFT_TIMER_SECONDS", "2")  # only effective if imported first

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"


@contextlib.contextmanager
def malformed_prometheus():
    """A loopback HTTP server answering every query 200 with JSON that has no data.result."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = json.dumps({"status": "success", "data": {"resultType": "vector"}, "note": "secret-body"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def engine_metrics():
    with exporter_process("tiny-llama") as target:
        yield target


def test_long_prompts_trigger_one_compile_run_and_a_stopped_prometheus_triggers_nothing(
        crds, namespace, engine_metrics, prometheus, monkeypatch):
    from kopf.testing import KopfRunner

    from shapeshift.engine.contracts.traffic_profile import TrafficProfile

    server = prometheus([{
        "job_name": "engine", "scrape_interval": "1s", "scrape_timeout": "1s",
        "static_configs": [{"targets": [engine_metrics], "labels": {"namespace": namespace, "deployment": "llama"}}],
    }])
    server.wait_for(f'shapeshift_prompt_tokens_count{{namespace="{namespace}"}}', timeout_s=30)
    for i in range(40):  # long prompts, no prefix-cache hits
        observe(engine_metrics, 150 + (i * 37) % 100, 40, 0)
        time.sleep(0.05)
    server.wait_for(f'sum(shapeshift_prompt_tokens_count{{namespace="{namespace}"}})', lambda v: v >= 40)

    custom = crds.custom
    drifting_deployment(crds, namespace, server.url, replicas=1, cooldown_s=3600, check_interval_s=10)

    monkeypatch.setenv("KUBECONFIG", str(crds.kubeconfig))
    from shapeshift.operator.handlers import drift as drift_handlers  # registers the timer

    def idep() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", "llama")

    def runs() -> list[dict]:
        return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns")["items"]

    # The whole operator (the core handlers bring the login handler and the engine children),
    # the drift timer (operator/handlers/drift.py) among them.
    import shapeshift.operator.handlers  # noqa: F401

    args = ["run", "--standalone", "--namespace", namespace,
            "-m", "shapeshift.operator.handlers", "-m", "shapeshift.operator.handlers.drift"]
    with KopfRunner(args, timeout=120) as runner:
        created = wait_until(lambda: runs() or None, timeout_s=60 + 2 * drift_handlers.TIMER_SECONDS,
                             what="a drift-triggered CompileRun")
        assert len(created) == 1
        run = created[0]
        # The CompileRun is created before the deployment's status names it (two API
        # writes), so wait for the status patch instead of reading it once.
        status = wait_until(lambda: (idep().get("status") or {}).get("lastCompileRun") and idep()["status"],
                            timeout_s=30, what="status.lastCompileRun")
        assert status["lastCompileRun"] == run["metadata"]["name"]
        assert run["metadata"]["ownerReferences"][0]["name"] == "llama"
        assert run["spec"]["trigger"]["reason"] == "Drift"
        inline = TrafficProfile.model_validate(run["spec"]["traffic"]["inline"])
        assert 128 < inline.prompt_length.p50 <= 256  # the long prompts that triggered it
        assert inline.prefix_cache_hit_rate == 0.0
        assert status["drift"]["promptLengthRelativeChange"]["p50"] > 3
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["TrafficObserved"]["status"] == "True"
        assert conditions["Drifted"]["reason"] == "CompileRunCreated"

        # Prometheus goes away: the next check says so and compiles nothing.
        server.stop()
        before = status["drift"]["lastCheckTime"]

        def unreachable_reported():
            st = idep().get("status") or {}
            cond = {c["type"]: c for c in st.get("conditions") or []}.get("TrafficObserved") or {}
            return st["drift"]["lastCheckTime"] != before and cond.get("reason") == "PrometheusUnreachable" and cond

        condition = wait_until(unreachable_reported, timeout_s=30 + 2 * drift_handlers.TIMER_SECONDS,
                               what="TrafficObserved=False after Prometheus stopped")
        assert condition["status"] == "False"
        assert server.url.split("://", 1)[1] in condition["message"]  # host and port, nothing else
        assert len(runs()) == 1

        # A loopback server that answers 200 without data.result, then a metadata address: each
        # becomes TrafficObserved=False with its reason on the next check; no timer crashes.
        with malformed_prometheus() as malformed_url:
            for url, reason, fragment in [
                    (malformed_url, "PrometheusAnswerMalformed", "without data.result"),
                    ("http://169.254.169.254:9090", "OutboundRefused", "link-local or cloud metadata address")]:
                custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", "llama",
                                                      {"spec": {"prometheusUrl": url}})

                def reported(reason=reason):
                    st = idep().get("status") or {}
                    cond = {c["type"]: c for c in st.get("conditions") or []}.get("TrafficObserved") or {}
                    return cond.get("reason") == reason and cond

                condition = wait_until(reported, timeout_s=30 + 2 * drift_handlers.TIMER_SECONDS,
                                       what=f"TrafficObserved=False ({reason})")
                assert condition["status"] == "False" and fragment in condition["message"], condition
                assert "secret-body" not in condition["message"]
    assert runner.exception is None, runner.output[-4000:]
    # within two checks: the first one drifting (counted), the second one compiling
    decisions = [line.split("drift check: ", 1)[1].split()[0] for line in runner.output.splitlines()
                 if "drift check: " in line]
    assert decisions[:2] == ["Drifting", "Compile"], decisions
    assert "NoData" in decisions[2:] and decisions.count("Compile") == 1, decisions
    events = crds.core.list_namespaced_event(namespace).items
    reasons = {e.reason for e in events}
    assert "CompileRunCreated" in reasons and "PrometheusUnreachable" in reasons
