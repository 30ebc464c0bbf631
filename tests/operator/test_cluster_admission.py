"""The API server itself refuses bad specs, with a message a user can act on, and stores nothing.

No operator runs here: this is the CRD's OpenAPI schema and CEL rules at work.
"""

from __future__ import annotations

import copy
import json

import kubernetes
import pytest

pytestmark = pytest.mark.cluster

GROUP, VERSION = "shapeshift.dev", "v1alpha1"


def idep(name="llama", **spec_over):
    spec = {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "nvidia-h200"}, "replicas": 1}
    spec.update(spec_over)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": name}, "spec": spec}


def create(cluster, namespace, plural, body):
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)


def rejected(cluster, namespace, plural, body) -> str:
    with pytest.raises(kubernetes.client.ApiException) as info:
        create(cluster, namespace, plural, body)
    assert info.value.status == 422, info.value.body
    listed = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]
    assert not [o for o in listed if o["metadata"]["name"] == body["metadata"]["name"]], "a rejected object was stored"
    return json.loads(info.value.body)["message"]


@pytest.mark.parametrize("case, mutate, expect", [
    ("unknown accelerator", lambda s: s["hardware"].update(accelerator="tpu-v5"),
     ['spec.hardware.accelerator', 'Unsupported value: "tpu-v5"', '"nvidia-h200"', '"trainium2"']),
    ("negative budget", lambda s: s.update(compilation={"budget": {"wallClockSeconds": -60}}),
     ["spec.compilation.budget.wallClockSeconds", "should be greater than or equal to 0"]),
    ("missing model source", lambda s: s.pop("model"),
     ["spec.model", "Required value"]),
    ("empty model source (CEL)", lambda s: s.update(model={}),
     ["exactly one of spec.model.preset or spec.model.pvc must be set"]),
    ("replicas below zero", lambda s: s.update(replicas=-1),
     ["spec.replicas", "should be greater than or equal to 0"]),
    ("drift threshold out of range", lambda s: s.update(
        compilation={"policy": "OnDrift", "drift": {"prefixHitRateAbsoluteChange": 1.5}}),
     ["spec.compilation.drift.prefixHitRateAbsoluteChange", "should be less than or equal to 1"]),
    ("OnDrift without thresholds (CEL)", lambda s: s.update(compilation={"policy": "OnDrift"}),
     ["OnDrift requires spec.compilation.drift thresholds"]),
    ("canary larger than replicas (CEL)", lambda s: s.update(replicas=2, rollout={"canaryReplicas": 3}),
     ["spec.rollout.canaryReplicas must not exceed spec.replicas"]),
    ("budget with no limit (CEL)", lambda s: s.update(compilation={"budget": {"wallClockSeconds": 0, "trials": 0}}),
     ["a compile budget needs wallClockSeconds > 0 or trials > 0"]),
    ("batched tokens below batch size (CEL)", lambda s: s.update(engine={"maxBatchSize": 64, "maxNumBatchedTokens": 16}),
     ["maxNumBatchedTokens must be at least spec.engine.maxBatchSize"]),
    ("env name the operator sets (CEL)", lambda s: s.update(engine={"env": [{"name": "SHAPESHIFT_ENGINE_CONFIG", "value": "/x"}]}),
     ["spec.engine.env: this name is set by the operator itself"]),
    ("env name of an agent's key (CEL)", lambda s: s.update(engine={"env": [{"name": "SHAPESHIFT_AGENT_0_API_KEY"}]}),
     ["spec.engine.env: this name is set by the operator itself"]),
    ("admin API token name (CEL)", lambda s: s.update(engine={"env": [{"name": "SHAPESHIFT_ADMIN_TOKEN", "value": "t"}]}),
     ["spec.engine.env[].name is reserved", "SHAPESHIFT_PDL"]),
    ("loader preload (CEL)", lambda s: s.update(engine={"env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}),
     ["spec.engine.env[].name is reserved", "the loader (LD_*)"]),
    ("interpreter path (CEL)", lambda s: s.update(engine={"env": [{"name": "PYTHONPATH", "value": "/tmp"}]}),
     ["spec.engine.env[].name is reserved"]),
    *[(f"{name} reserved (CEL)", lambda s, name=name: s.update(engine={"env": [{"name": name, "value": "/tmp/x"}]}),
       ["spec.engine.env[].name is reserved", fragment])
      for name, fragment in [("TRITON_CACHE_DIR", "TRITON_*"), ("TORCHINDUCTOR_CACHE_DIR", "TORCH*"),
                             ("HF_ENDPOINT", "HF_*"), ("TRANSFORMERS_CACHE", "TRANSFORMERS_*"),
                             ("HTTPS_PROXY", "*_PROXY, any case"), ("https_proxy", "*_PROXY, any case"),
                             ("No_Proxy", "*_PROXY, any case"), ("SSL_CERT_FILE", "trust stores"),
                             ("REQUESTS_CA_BUNDLE", "trust stores"), ("CC", "the compilers (CC, CXX)"),
                             ("LD_LIBRARY_PATH", "the loader (LD_*)")]],
    ("literal credential (CEL)", lambda s: s.update(engine={"env": [{"name": "HF_TOKEN", "value": "hf_abc"}]}),
     ["spec.engine.env[].valueFrom.secretKeyRef: a credential"]),
    ("value and valueFrom (CEL)", lambda s: s.update(engine={"env": [
        {"name": "DEBUG_LEVEL", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}),
     ["spec.engine.env[]: set value or valueFrom, not both"]),
    ("prometheusUrl with a password (CEL)", lambda s: s.update(prometheusUrl="http://admin:hunter2@prom:9090"),
     ["spec.prometheusUrl must be an http(s):// URL with no user:password@"]),
    ("prometheusUrl with a token in the query (CEL)", lambda s: s.update(prometheusUrl="https://prom/?token=abc"),
     ["spec.prometheusUrl must be an http(s):// URL with no user:password@, query string or fragment"]),
    ("selector contradicting the pool (CEL)", lambda s: s["hardware"].update(
        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}),
     ["spec.hardware.nodeSelector['nvidia.com/gpu.product'] must be 'NVIDIA-H200' for accelerator nvidia-h200"]),
    ("Trainium with an NVIDIA selector (CEL)", lambda s: s.update(hardware={
        "accelerator": "trainium2", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}}),
     ["spec.hardware.nodeSelector: nvidia.com/ labels are only on NVIDIA nodes"]),
    ("CPU with a Trainium instance type (CEL)", lambda s: s.update(hardware={
        "accelerator": "cpu", "nodeSelector": {"node.kubernetes.io/instance-type": "trn2.48xlarge"}}),
     ["Trainium (trn*) instance types"]),
    ("CPU with a wildcard toleration (CEL)", lambda s: s.update(hardware={
        "accelerator": "cpu", "tolerations": [{"operator": "Exists"}]}),
     ["spec.hardware.tolerations: a CPU deployment may not tolerate every taint"]),
    ("CPU tolerating the GPU taint (CEL)", lambda s: s.update(hardware={
        "accelerator": "cpu", "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}),
     ["unless spec.hardware.widenTolerations is true"]),
    ("H200 with a wildcard toleration (CEL)", lambda s: s.update(hardware={
        "accelerator": "nvidia-h200", "tolerations": [{"operator": "Exists"}]}),
     ["spec.hardware.tolerations: a deployment on nvidia-h200 may not tolerate every taint (no key)"]),
    ("H100 tolerating the Neuron taint (CEL)", lambda s: s.update(hardware={
        "accelerator": "nvidia-h100", "tolerations": [{"key": "aws.amazon.com/neuron", "operator": "Exists"}]}),
     ["another accelerator pool's taint (aws.amazon.com/neuron)", "widenTolerations"]),
    ("Trainium tolerating the GPU taint (CEL)", lambda s: s.update(hardware={
        "accelerator": "trainium2", "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}),
     ["a deployment on trainium2 may not tolerate", "(nvidia.com/gpu)"]),
    ("CPU on a p5 instance type (CEL)", lambda s: s.update(hardware={
        "accelerator": "cpu", "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"}}),
     ["spec.hardware.nodeSelector['node.kubernetes.io/instance-type'] names a GPU instance type"]),
    ("CPU on an a3 machine type (CEL)", lambda s: s.update(hardware={
        "accelerator": "cpu", "nodeSelector": {"node.kubernetes.io/instance-type": "a3-highgpu-8g"}}),
     ["names a GPU instance type", "a cpu deployment would hold a GPU node"]),
    ("env name not an identifier", lambda s: s.update(engine={"env": [{"name": "SHAPESHIFT-PDL", "value": "0"}]}),
     ["spec.engine.env[0].name", "should match"]),
    ("env name twice", lambda s: s.update(engine={"env": [{"name": "SHAPESHIFT_PDL", "value": "0"},
                                                          {"name": "SHAPESHIFT_PDL", "value": "1"}]}),
     ["spec.engine.env[1]", "Duplicate value"]),
])
def test_bad_inference_deployment_is_rejected(crds, namespace, case, mutate, expect):
    body = idep()
    mutate(body["spec"])
    message = rejected(crds, namespace, "inferencedeployments", body)
    for fragment in expect:
        assert fragment in message, f"{case}: {fragment!r} not in {message}"


def test_names_outside_the_reserved_families_and_hf_token_from_a_secret_are_accepted(crds, namespace):
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
           {"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "PROXY_MODE", "value": "1"},
           {"name": "SHAPESHIFT_PDL", "value": "0"}]
    stored = create(crds, namespace, "inferencedeployments", idep(name="env-ok", engine={"env": env}))
    assert [e["name"] for e in stored["spec"]["engine"]["env"]] == ["HF_TOKEN", "NCCL_DEBUG", "PROXY_MODE", "SHAPESHIFT_PDL"]


def test_placement_that_narrows_the_pool_or_is_widened_explicitly_is_accepted(crds, namespace):
    for name, hardware in [("narrow", {"accelerator": "nvidia-h200", "nodeSelector": {"zone": "a",
                                                                                      "nvidia.com/gpu.product": "NVIDIA-H200"}}),
                           ("wide", {"accelerator": "cpu", "widenTolerations": True,
                                     "tolerations": [{"operator": "Exists"}]}),
                           ("wide-gpu", {"accelerator": "nvidia-h200", "widenTolerations": True,
                                         "tolerations": [{"operator": "Exists"}]}),
                           ("own-taint", {"accelerator": "trainium2", "tolerations": [
                               {"key": "aws.amazon.com/neuron", "operator": "Exists"}, {"key": "spot", "operator": "Exists"}]}),
                           ("cpu-type", {"accelerator": "cpu",
                                         "nodeSelector": {"node.kubernetes.io/instance-type": "m7i.2xlarge"}})]:
        create(crds, namespace, "inferencedeployments", idep(name=name, hardware=hardware))


@pytest.mark.parametrize("inline, fragment", [
    ({"promptLength": {"p50": 100, "p90": 50, "p99": 200}, "outputLength": {"p50": 8, "p90": 8, "p99": 8}},
     "length quantiles must be ordered min <= p50 <= p90 <= p99"),
    ({"promptLength": {"p50": 10, "p90": 20, "p99": 30, "histogram": [{"le": 64, "weight": 1}, {"le": 32, "weight": 1}]},
      "outputLength": {"p50": 8, "p90": 8, "p99": 8}}, "histogram must have at least one bucket, increasing le"),
    ({"promptLength": {"p50": 10, "p90": 20, "p99": 30}, "outputLength": {"p50": 8, "p90": 8, "p99": 8},
      "sharedPrefixRatio": 0.5}, "sharedPrefixRatio is above 0 but sharedPrefixLen is 0"),
    ({"promptLength": {"p50": 10, "p90": 20, "p99": 30}, "outputLength": {"p50": 8, "p90": 8, "p99": 8},
      "expertRouting": {"layers": [{"layer": 0, "shares": [0.5, 0.4]}]}}, "a layer's expert shares must sum to 1"),
    ({"promptLength": {"p50": 10, "p90": 20, "p99": 30}, "outputLength": {"p50": 8, "p90": 8, "p99": 8},
      "expertRouting": {"layers": [{"layer": 1, "shares": [0.5, 0.5]}, {"layer": 0, "shares": [1.0, 0.0]}]}},
     "expertRouting layers must come by increasing layer index"),
])
def test_a_traffic_profile_the_models_refuse_is_refused_by_the_api_server(crds, namespace, inline, fragment):
    """The CEL twins of the traffic profile's cross-field rules (it is embedded in CompileRuns)."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-traffic"},
            "spec": {"deploymentRef": {"name": "llama"}, "traffic": {"inline": inline}}}
    assert fragment in rejected(crds, namespace, "compileruns", body)


def test_an_expert_routing_histogram_is_stored_as_given(crds, namespace):
    routing = {"layers": [{"layer": 0, "shares": [0.25, 0.75]}, {"layer": 1, "shares": [1.0, 0.0]}], "routedTokens": 40}
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-routing"},
            "spec": {"deploymentRef": {"name": "llama"}, "traffic": {"inline": {
                "promptLength": {"p50": 10, "p90": 20, "p99": 30}, "outputLength": {"p50": 8, "p90": 8, "p99": 8},
                "expertRouting": routing}}}}
    stored = create(crds, namespace, "compileruns", body)
    assert stored["spec"]["traffic"]["inline"]["expertRouting"] == routing


def test_bad_compile_runs_are_rejected(crds, namespace):
    base = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run"},
            "spec": {"deploymentRef": {"name": "llama"}}}
    for mutate, fragment in [
        (lambda s: s.update(budget={"trials": -1}), "spec.budget.trials"),
        (lambda s: s.update(hardware={"accelerator": "gaudi3"}), "Unsupported value: \"gaudi3\""),
        (lambda s: s.update(agents=[{"kind": "llm"}]), "an agent of kind llm needs llm settings"),
        (lambda s: s.update(traffic={"builtin": "chat", "prometheus": {}}), "set at most one of spec.traffic"),
        (lambda s: s.pop("deploymentRef"), "spec.deploymentRef"),
        (lambda s: s.update(agents=[{"kind": "llm", "llm": {"endpoint": "http://api.example.com/v1", "model": "m",
                                                            "apiKeySecretRef": {"name": "k"}}}]),
         "spec.agents[].llm.endpoint must be https:// when spec.agents[].llm.apiKeySecretRef is set"),
        (lambda s: s.update(agents=[{"kind": "llm", "llm": {"endpoint": "https://me:pw@api.example.com/v1",
                                                            "model": "m"}}]),
         "spec.agents[].llm.endpoint must be an http(s):// URL with no user:password@"),
        (lambda s: s.update(agents=[]), "spec.agents must name at least one agent"),
        (lambda s: s.update(slo={"ttftP90Seconds": 0}), "spec.slo.ttftP90Seconds"),
        (lambda s: s.update(slo={"ttftP90Seconds": -1.5}), "spec.slo.ttftP90Seconds"),
        (lambda s: s.update(slo={"perUserTokensPerSecondP90": -3}), "spec.slo.perUserTokensPerSecondP90"),
        (lambda s: s.update(slo={"ttftP90Seconds": "fast"}), "spec.slo.ttftP90Seconds"),
    ]:
        body = copy.deepcopy(base)
        mutate(body["spec"])
        assert fragment in rejected(crds, namespace, "compileruns", body)
    long_name = copy.deepcopy(base)
    long_name["metadata"]["name"] = "r" * 60
    assert "at most 52 characters" in rejected(crds, namespace, "compileruns", long_name)


def test_an_agent_name_is_not_a_field_and_an_slo_is_stored_as_given(crds, namespace):
    """spec.agents[].name was never read, so it is not in the schema: a strict client is refused; the
    SLO is optional and stored as written (absent fields: the compile engine's defaults)."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-named"},
            "spec": {"deploymentRef": {"name": "llama"}, "agents": [{"kind": "evolutionary", "name": "evo"}]}}
    with pytest.raises(kubernetes.client.ApiException) as info:
        crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", body,
                                                    field_validation="Strict")
    assert 'unknown field "spec.agents[0].name"' in json.loads(info.value.body)["message"]
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-slo"},
            "spec": {"deploymentRef": {"name": "llama"}, "slo": {"ttftP90Seconds": 0.5}}}
    stored = create(crds, namespace, "compileruns", body)["spec"]
    assert stored["slo"] == {"ttftP90Seconds": 0.5}
    assert stored["agents"] == [{"kind": "coordinate-sweep", "replicas": 1}, {"kind": "evolutionary", "replicas": 1}]
    plain = copy.deepcopy(body)
    plain["metadata"]["name"], plain["spec"] = "run-plain", {"deploymentRef": {"name": "llama"}}
    assert "slo" not in create(crds, namespace, "compileruns", plain)["spec"]


def test_compile_run_spec_is_immutable(crds, namespace):
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run"},
            "spec": {"deploymentRef": {"name": "llama"}}}
    create(crds, namespace, "compileruns", body)
    with pytest.raises(kubernetes.client.ApiException) as info:
        crds.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run",
                                                   {"spec": {"budget": {"trials": 5}}})
    assert info.value.status == 422
    assert "spec of a CompileRun is immutable" in json.loads(info.value.body)["message"]


def test_defaults_are_applied_by_the_api_server(crds, namespace):
    stored = create(crds, namespace, "inferencedeployments", idep())
    spec = stored["spec"]
    assert spec["engine"]["kvBlockSize"] == 16 and spec["engine"]["dtype"] == "bfloat16"
    assert spec["compilation"] == {"policy": "Manual", "cooldownSeconds": 3600,
                                   "budget": {"wallClockSeconds": 3600, "trials": 0, "deadlineGraceSeconds": 600}}
    assert spec["rollout"]["strategy"] == "HotReload"
    from shapeshift.operator.api import InferenceDeploymentSpec

    # what the API server stores, the operator's model reads back unchanged
    assert InferenceDeploymentSpec.model_validate(spec).to_wire() == spec


def test_a_compile_run_template_is_stored_and_becomes_an_accepted_drift_compile_run(crds, namespace):
    """spec.compilation.template as the API server stores it (inner defaults filled in, nothing more),
    and the CompileRun the drift timer builds from it is one the API server accepts, carrying it."""
    from datetime import datetime, timezone

    from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile
    from shapeshift.operator.builders import Parent
    from shapeshift.operator.drift import Compile
    from shapeshift.operator.drift_check import build_drift_compile_run
    from shapeshift.operator.api import InferenceDeploymentSpec

    template = {"agents": [{"kind": "coordinate-sweep"}], "tiers": {"replayRequests": 24, "repeats": 2},
                "baseline": {"minSpeedup": 1.05}, "backoffLimit": 0,
                "slo": {"ttftP90Seconds": 0.4, "perUserTokensPerSecondP90": 25}}
    body = idep(compilation={"policy": "OnDrift", "drift": {}, "template": template})
    stored = create(crds, namespace, "inferencedeployments", body)
    kept = stored["spec"]["compilation"]["template"]
    assert kept == {"agents": [{"kind": "coordinate-sweep", "replicas": 1}],
                    "tiers": {"fast": True, "fastLayers": 2, "full": True, "replayRequests": 24, "repeats": 2},
                    "baseline": {"minSpeedup": 1.05}, "backoffLimit": 0,
                    "slo": {"ttftP90Seconds": 0.4, "perUserTokensPerSecondP90": 25}}, kept
    spec = InferenceDeploymentSpec.model_validate(stored["spec"])
    assert spec.to_wire() == stored["spec"]

    snapshot = TrafficProfile(name="observed", prompt_length=LengthDistribution(p50=160, p90=190, p99=200),
                              output_length=LengthDistribution(p50=8, p90=8, p99=8))
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)
    run = build_drift_compile_run(Parent.from_body(stored), spec, Compile(
        reason="prompt length p50 +300%", score=3.0, severity=10.0, snapshot=snapshot, dimensions=()), now)
    created = create(crds, namespace, "compileruns", run)["spec"]
    assert created["agents"] == kept["agents"] and created["tiers"] == kept["tiers"]
    assert created["baseline"] == {"minSpeedup": 1.05} and created["backoffLimit"] == 0
    assert created["slo"] == {"ttftP90Seconds": 0.4, "perUserTokensPerSecondP90": 25}
    # Not in the template: the API server's CompileRun defaults.
    assert created["verification"]["greedySteps"] == 64 and "hardware" not in created and "image" not in created


def test_a_bad_compile_run_template_is_rejected(crds, namespace):
    for template, fragment in [
        ({"agents": [{"kind": "llm"}]}, "an agent of kind llm needs llm settings"),
        ({"agents": []}, "spec.compilation.template.agents"),
        ({"backoffLimit": 11}, "spec.compilation.template.backoffLimit"),
        ({"baseline": {"minSpeedup": 0.5}}, "spec.compilation.template.baseline.minSpeedup"),
        ({"slo": {"ttftP90Seconds": 0}}, "spec.compilation.template.slo.ttftP90Seconds"),
        ({"slo": {"perUserTokensPerSecondP90": -1}}, "spec.compilation.template.slo.perUserTokensPerSecondP90"),
    ]:
        message = rejected(crds, namespace, "inferencedeployments", idep(compilation={"template": template}))
        assert fragment in message, f"{template}: {fragment!r} not in {message}"


def test_a_valid_forward_pass_is_accepted_and_immutable(crds, namespace):
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass", "metadata": {"name": "fp-1"},
            "spec": {"model": {"name": "tiny-llama"}, "hardware": {"accelerator": "nvidia-h200"},
                     "artifact": {"uri": "file:///var/lib/shapeshift-artifacts/fp-1.tar", "sha256": "a" * 64},
                     "verification": {"passed": True, "gates": [{"name": "greedy", "passed": True}]},
                     "recipe": {"attention": "triton", "tiles": {"m": 64, "n": 128}},
                     "metrics": {"speedup": 1.31}}}
    stored = create(crds, namespace, "forwardpasses", body)
    assert stored["spec"]["recipe"] == {"attention": "triton", "tiles": {"m": 64, "n": 128}}  # kept, not pruned
    with pytest.raises(kubernetes.client.ApiException) as info:
        crds.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", "fp-1",
                                                   {"spec": {"metrics": {"speedup": 9.0}}})
    assert "spec of a ForwardPass is immutable" in json.loads(info.value.body)["message"]


def test_a_verification_report_that_contradicts_itself_or_its_artifact_is_rejected(crds, namespace):
    """Two CEL twins of the ForwardPassSpec validators: a passed report with a failed gate, and a
    report about another bundle than the pass's artifact."""
    def body(verification):
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass", "metadata": {"name": "fp-bad"},
                "spec": {"model": {"name": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
                         "artifact": {"uri": "/var/lib/shapeshift-artifacts/fp.tar.gz", "sha256": "a" * 64},
                         "verification": verification}}
    message = rejected(crds, namespace, "forwardpasses", body(
        {"passed": True, "gates": [{"name": "kv-isolation", "passed": False}, {"name": "greedy", "passed": True}]}))
    assert "spec.verification.passed is true but a gate in spec.verification.gates failed" in message, message
    message = rejected(crds, namespace, "forwardpasses", body(
        {"passed": True, "artifactSha256": "b" * 64, "gates": [{"name": "greedy", "passed": True}]}))
    assert "spec.verification.artifactSha256 differs from spec.artifact.sha256" in message, message


@pytest.mark.parametrize("uri, fragment", [
    ("s3://bucket/fp.tar.gz", "spec.artifact.uri must be an absolute path, file:///path or an http(s):// URL"),
    ("configmap://fp", "the engine fetches no other location"),
    ("relative/fp.tar.gz", "spec.artifact.uri must be an absolute path"),
    ("", "spec.artifact.uri"),
    ("https://user:hunter2@store.example/fp.tar.gz", "spec.artifact.uri must carry no credentials"),
    ("https://store.example/fp.tar.gz?X-Amz-Signature=abc", "no user:password@, query string or fragment"),
    ("/var/lib/shapeshift-artifacts/../../etc/fp.tar.gz", "spec.artifact.uri must not contain '..' segments"),
    ("/etc/shadow", "spec.artifact.uri: a local path (/path or file:///path) must lie inside the artifact store"),
    ("file:///proc/self/environ", "must lie inside the artifact store /var/lib/shapeshift-artifacts/"),
    ("file:///var/lib/shapeshift-artifacts/%2e%2e/%2e%2e/etc/shadow", "with no %-escapes"),
    ("http://169.254.169.254/latest/meta-data/fp.tar.gz", "must not be a link-local or cloud metadata address"),
    ("http://[fd00:ec2::254]/fp.tar.gz", "must not be a link-local or cloud metadata address"),
    ("https://metadata.google.internal/fp.tar.gz", "must not be a link-local or cloud metadata address"),
    ("http://2852039166/fp.tar.gz", "a numeric spelling of an address"),
])
def test_an_artifact_uri_the_engine_cannot_fetch_or_that_carries_credentials_is_rejected(crds, namespace, uri,
                                                                                         fragment):
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass", "metadata": {"name": "fp-uri"},
            "spec": {"model": {"name": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
                     "artifact": {"uri": uri, "sha256": "a" * 64},
                     "verification": {"passed": True, "gates": [{"name": "greedy", "passed": True}]}}}
    message = rejected(crds, namespace, "forwardpasses", body)
    assert fragment in message and "hunter2" not in message, message


@pytest.mark.parametrize("example", ["inferencedeployment.yaml", "compilerun.yaml"])
def test_the_documented_examples_are_accepted(crds, namespace, example):
    """docs/examples/*.yaml, as a user would `kubectl apply` them: the API server's schema and CEL
    rules accept them, and the operator's models read what it stored."""
    from pathlib import Path

    import yaml

    from shapeshift.operator.api import CompileRunSpec, InferenceDeploymentSpec

    body = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs" / "examples" / example).read_text())
    plural, model = {"InferenceDeployment": ("inferencedeployments", InferenceDeploymentSpec),
                     "CompileRun": ("compileruns", CompileRunSpec)}[body["kind"]]
    body["metadata"].pop("namespace", None)
    stored = create(crds, namespace, plural, body)  # a refusal raises ApiException 422, naming the field
    spec = model.model_validate(stored["spec"])  # and the operator reads what was stored
    assert spec.model_dump(by_alias=True, exclude_unset=True).keys() >= body["spec"].keys()
