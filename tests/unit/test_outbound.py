"""The operator's outbound policy (operator/outbound.py) and Prometheus answers it cannot use
(operator/prometheus.py): refused addresses are refused before any connection (nothing here leaves
loopback), malformed 200 answers become a TrafficQueryError with a reason, and messages quote the
host, never credentials or bodies."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import pytest
from pydantic import ValidationError

from shapeshift.operator.api import CompileRunSpec, InferenceDeploymentSpec
from shapeshift.operator.outbound import host_of, outbound_problem
from shapeshift.operator.prometheus import (PrometheusAnswerMalformed, PrometheusRedirected, PrometheusRefused,
                                            PrometheusTraffic, PrometheusUnreachable, SeriesSelector)
from shapeshift.operator.settings import OperatorSettings


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data", "http://[fe80::1]:9090",
                                 "http://[::ffff:169.254.169.254]:80", "http://100.100.100.200",
                                 "http://[fd00:ec2::254]"])
def test_link_local_and_metadata_addresses_are_refused_unless_allowed(url):
    problem = outbound_problem(url, what="spec.prometheusUrl")
    assert problem.startswith("spec.prometheusUrl: host ") and "SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS" in problem
    assert "meta-data" not in problem  # the host, not the path
    assert outbound_problem(url, ("169.254.0.0/16", "fe80::/10", "100.100.100.200/32", "fd00:ec2::/64")) is None


def test_loopback_and_names_that_resolve_there_are_used():
    assert outbound_problem("http://127.0.0.1:9090") is None
    assert outbound_problem("http://localhost:9090/prom") is None
    assert "user:password@" in outbound_problem("http://u:hunter2@127.0.0.1:9090")
    assert "hunter2" not in outbound_problem("http://u:hunter2@127.0.0.1:9090")
    assert host_of("https://u:p@prom.example:9443/x?y") == "prom.example:9443"


def test_the_allowed_cidrs_setting_is_read_and_checked():
    env = {"SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS": "169.254.10.0/24, fe80::/10"}
    assert OperatorSettings.from_environ(env).outbound_allowed_cidrs == ("169.254.10.0/24", "fe80::/10")
    assert OperatorSettings.from_environ({}).outbound_allowed_cidrs == ()
    with pytest.raises(ValueError, match="SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS: 'metadata' is not a CIDR"):
        OperatorSettings.from_environ({"SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS": "metadata"})


def test_a_refused_prometheus_gets_no_request():
    with PrometheusTraffic("http://169.254.169.254:9090") as prom:
        with pytest.raises(PrometheusRefused, match="link-local or cloud metadata") as info:
            prom.scalar("up")
    assert info.value.reason == "OutboundRefused"


@contextlib.contextmanager
def answering(status: int, payload, headers=None, seen=None):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if seen is not None:
                seen.append(self.path)
            body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


VECTOR = {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "7"]}]}}


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_an_error_naming_its_location_and_is_not_followed(status):
    """A loopback Prometheus answering 3xx towards another loopback server that would answer: the
    operator asks nothing there, and the error names where the redirect pointed (no credentials, no
    query string)."""
    followed: list[str] = []
    with answering(200, VECTOR, seen=followed) as target:
        location = target.replace("http://", "http://u:hunter2@") + "/elsewhere/api/v1/query?token=abc"
        with answering(status, b"", headers={"Location": location}) as url, PrometheusTraffic(url) as prom:
            with pytest.raises(PrometheusRedirected) as info:
                prom.scalar("up")
    message = str(info.value)
    assert info.value.reason == "OutboundRefused" and followed == []
    assert f"answered HTTP {status} redirecting to {target}/elsewhere/api/v1/query" in message, message
    assert "does not follow redirects" in message and "hunter2" not in message and "token" not in message
    with answering(200, VECTOR) as url, PrometheusTraffic(url) as prom:
        assert prom.scalar("up") == 7.0  # the same client reads a plain answer


def test_a_redirect_to_a_metadata_address_is_refused_without_a_request_there():
    with answering(302, b"", headers={"Location": "http://169.254.169.254/latest/meta-data"}) as url, \
            PrometheusTraffic(url) as prom:
        with pytest.raises(PrometheusRedirected, match="redirecting to http://169.254.169.254/latest/meta-data"):
            prom.query("up")
    with answering(302, b"", headers={"Location": "/prometheus/api/v1/query"}) as url, PrometheusTraffic(url) as prom:
        with pytest.raises(PrometheusRedirected, match="redirecting to /prometheus/api/v1/query"):
            prom.query("up")


@pytest.mark.parametrize("payload", [
    {"status": "success", "data": {"resultType": "vector"}},
    {"status": "success", "data": {"result": "not a list"}},
    {"status": "success", "data": {"result": [{"metric": {}, "value": [1, "many"]}]}},
    {"status": "success", "data": {"result": [{"metric": {}}]}},
    [1, 2, 3],
])
def test_a_200_answer_that_is_no_vector_is_a_malformed_answer(payload):
    with answering(200, payload) as url, PrometheusTraffic(url) as prom:
        with pytest.raises(PrometheusAnswerMalformed) as info:
            prom.observe(SeriesSelector(namespace="ns", deployment="d"), "60s")
    assert info.value.reason == "PrometheusAnswerMalformed" and url.split("//")[1] in str(info.value)


def test_an_error_answer_is_quoted_by_its_status_not_its_body():
    with answering(400, b'{"error": "secret-body token=abc"}') as url, PrometheusTraffic(url) as prom:
        with pytest.raises(PrometheusUnreachable) as info:
            prom.scalar("up")
    assert "HTTP 400" in str(info.value) and "secret-body" not in str(info.value)


def deployment(**over):
    return {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, **over}


@pytest.mark.parametrize("url", ["http://user:pw@prom:9090", "http://prom:9090/?token=abc", "ftp://prom",
                                 "http://prom:9090/#x"])
def test_prometheus_url_with_credentials_or_another_scheme_is_refused_by_the_model(url):
    with pytest.raises(ValidationError, match=r"prometheusUrl"):
        InferenceDeploymentSpec.model_validate(deployment(prometheusUrl=url))


def test_an_api_key_travels_only_over_https_or_to_a_cluster_service():
    def run(endpoint, key=True):
        llm = {"endpoint": endpoint, "model": "m", **({"apiKeySecretRef": {"name": "k"}} if key else {})}
        return CompileRunSpec.model_validate({"deploymentRef": {"name": "d"}, "agents": [{"kind": "llm", "llm": llm}]})

    run("https://api.example.com/v1")
    run("http://llm:8080/v1")
    run("http://llm.team-a.svc.cluster.local:8080/v1")
    run("http://api.example.com/v1", key=False)
    with pytest.raises(ValidationError, match=r"spec\.agents\[\]\.llm\.endpoint must be https://"):
        run("http://api.example.com/v1")
    with pytest.raises(ValidationError, match=r"no user:password@"):
        run("https://me:pw@api.example.com/v1")


def test_a_malformed_answer_becomes_traffic_observed_false_with_its_reason():
    from datetime import datetime, timezone

    from shapeshift.operator.api import InferenceDeploymentStatus
    from shapeshift.operator.drift import DriftPolicy, DriftState, NoData
    from shapeshift.operator.drift_check import drift_status_update, run_check

    with answering(200, {"status": "success", "data": {}}) as url, PrometheusTraffic(url) as prom:
        result = run_check(observe=lambda: prom.observe(SeriesSelector(namespace="ns"), "60s"), baseline=None,
                           policy=DriftPolicy(), state=DriftState(), active_compile_run=None,
                           now=datetime.now(timezone.utc))
    assert isinstance(result.decision, NoData) and result.decision.reason == "PrometheusAnswerMalformed"
    update = drift_status_update(result, InferenceDeploymentStatus(), now=datetime.now(timezone.utc))
    assert update.condition("TrafficObserved")[1:3] == ("False", "PrometheusAnswerMalformed")


def test_a_compile_run_whose_llm_endpoint_is_a_metadata_address_is_refused_before_its_job():
    from shapeshift.operator.handlers.compile_run import _refused_endpoints

    run = CompileRunSpec.model_validate({"deploymentRef": {"name": "d"}, "agents": [
        {"kind": "coordinate-sweep"},
        {"kind": "llm", "llm": {"endpoint": "http://169.254.169.254/v1", "model": "m"}}]})
    (problem,) = _refused_endpoints(run)
    assert problem.startswith("spec.agents[1].llm.endpoint: host 169.254.169.254 is 169.254.169.254")
    fine = CompileRunSpec.model_validate({"deploymentRef": {"name": "d"}, "agents": [
        {"kind": "llm", "llm": {"endpoint": "http://127.0.0.1:8080/v1", "model": "m"}}]})
    assert _refused_endpoints(fine) == []
