"""charts/shapeshift with the real helm binary: lint, template with defaults and with
options, the values schema refusing bad values, least-privilege RBAC, and CRDs in step
with crds/."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from chart_helpers import CHART, by_kind, helm, one, render, rule_triples, set_args
from shapeshift.operator.builders import Parent, build_compile_rbac, compile_account_name
from shapeshift.operator.api import CompileRunSpec

REPO = CHART.parents[1]

OPTIONS = {
    "watch.allNamespaces": "false",
    "watch.namespaces": '["team-a","team-b"]',
    "serviceMonitor.enabled": "true",
    "serviceMonitor.labels": '{"release":"kube-prometheus-stack"}',
    "prometheus.url": "http://prometheus.monitoring.svc:9090",
    "prometheus.deploymentLabel": "shapeshift_deployment",
    "prometheus.namespaceLabel": "kubernetes_namespace",
    "peering.enabled": "true",
    "replicaCount": "2",
    "operator.logLevel": "verbose",
    "serviceAccount.annotations": '{"iam.gke.io/gcp-service-account":"op@example.iam"}',
    "image.tag": "0.1.0-rc1",
}


def test_helm_lint_passes_with_defaults_and_with_options():
    out = helm("lint", str(CHART), "--strict").stdout
    assert "0 chart(s) failed" in out
    out = helm("lint", str(CHART), "--strict", *set_args(OPTIONS)).stdout
    assert "0 chart(s) failed" in out


def test_defaults_render_a_standalone_cluster_wide_operator():
    objects = render()
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding", "Deployment",
                     "ServiceAccount", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "shapeshift/operator:0.1.0"
    assert container["args"][:3] == ["operator", "--all-namespaces", "--standalone"]
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # never two standalone operators at once
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SHAPESHIFT_PROMETHEUS_URL"] == "http://prometheus-operated.monitoring.svc:9090"
    assert env["SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL"] == "deployment"
    assert env["SHAPESHIFT_DRIFT_MIN_REQUESTS"] == "20"
    assert env["SHAPESHIFT_PROMETHEUS_POD_LABEL"] == "pod" and env["SHAPESHIFT_ROLLOUT_MIN_REQUESTS"] == "20"
    assert pod["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"] == "ss-shapeshift"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for binding in by_kind(objects, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ss-shapeshift",
                                        "namespace": "shapeshift-system"}]


def test_options_render_namespaced_rbac_peering_and_a_service_monitor():
    objects = render(OPTIONS)
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert "--standalone" not in container["args"] and "--peering=shapeshift" in container["args"]
    assert "--verbose" in container["args"]
    assert container["image"] == "shapeshift/operator:0.1.0-rc1"
    assert one(objects, "Deployment")["spec"]["replicas"] == 2

    # application rights only in the watched namespaces
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"]["name"] == "ss-shapeshift-application" for b in bindings)
    assert [b["metadata"]["name"] for b in by_kind(objects, "ClusterRoleBinding")] == ["ss-shapeshift-framework"]
    framework = rule_triples(one(objects, "ClusterRole", "-framework")["rules"])
    assert ("", "namespaces", "watch") in framework
    application = rule_triples(one(objects, "ClusterRole", "-application")["rules"])
    assert ("kopf.dev", "kopfpeerings", "patch") in application

    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    relabel = monitor["spec"]["endpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_shapeshift_dev_inference_deployment"],
            "targetLabel": "shapeshift_deployment"} in relabel
    assert {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "kubernetes_namespace"} in relabel
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL"] == "shapeshift_deployment"
    # peering: the pod's name is its kopf identity, and the keep-alive lifetime is passed
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--peering-lifetime=30" in container["args"]
    # the peering object the replicas elect through: one per watched namespace
    assert sorted(p["metadata"]["namespace"] for p in by_kind(objects, "KopfPeering")) == ["team-a", "team-b"]
    assert {p["metadata"]["name"] for p in by_kind(objects, "KopfPeering")} == {"shapeshift"}


def test_peering_object_is_cluster_wide_when_every_namespace_is_watched_and_absent_without_peering():
    clusterwide = render({"watch.allNamespaces": "true", "peering.enabled": "true", "replicaCount": "3"})
    assert [p["metadata"]["name"] for p in by_kind(clusterwide, "ClusterKopfPeering")] == ["shapeshift"]
    assert not by_kind(clusterwide, "KopfPeering")
    standalone = render(None)
    assert not by_kind(standalone, "ClusterKopfPeering") and not by_kind(standalone, "KopfPeering")


def test_service_monitor_selects_the_services_the_operator_creates():
    from shapeshift.operator.builders import build_engine_service
    from shapeshift.operator.api import InferenceDeploymentSpec

    spec = InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}})
    service = build_engine_service(Parent("InferenceDeployment", "llama", "team-a", "uid"), spec)
    monitor = one(render({"serviceMonitor.enabled": "true"}), "ServiceMonitor")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in [p["name"] for p in service["spec"]["ports"]]


ALL_RENDERS = [None, OPTIONS, {"watch.allNamespaces": "true", "peering.enabled": "true", "replicaCount": "3"}]


@pytest.mark.parametrize("values", ALL_RENDERS, ids=["defaults", "namespaced", "clusterwide-peering"])
def test_rbac_has_no_wildcards_and_no_secrets(values):
    roles = [o for o in render(values) if o["kind"] in ("ClusterRole", "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for key in ("verbs", "resources", "apiGroups"):
                assert "*" not in rule.get(key, []), f"{role['metadata']['name']}: wildcard in {key}: {rule}"
            assert "secrets" not in rule.get("resources", [])
            assert not {"escalate", "bind", "impersonate", "delete", "deletecollection"} & set(rule["verbs"]), rule


def test_the_operator_holds_every_right_it_grants_a_compile_worker():
    # RBAC refuses to create a Role granting more than the creator holds.
    run = CompileRunSpec.model_validate({"deploymentRef": {"name": "llama"}})
    _, role, _ = build_compile_rbac(Parent("CompileRun", "llama-run", "team-a", "uid"), run)
    application = rule_triples(one(render(), "ClusterRole", "-application")["rules"])
    missing = rule_triples(role["rules"]) - application
    assert not missing, f"the compile Role grants what the operator lacks: {sorted(missing)}"


def test_the_admission_policy_holds_compile_workers_to_their_own_run():
    """On by default; the CEL itself is exercised by the API server in
    tests/operator/test_cluster_compile_worker_identity.py."""
    objects = render()
    policy, binding = one(objects, "ValidatingAdmissionPolicy"), one(objects, "ValidatingAdmissionPolicyBinding")
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert policy["metadata"]["name"] == binding["spec"]["policyName"] == "ss-shapeshift-compile-forwardpasses"
    assert binding["spec"]["validationActions"] == ["Deny"] and "matchResources" not in binding["spec"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["shapeshift.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
        "resources": ["forwardpasses"]}]
    (condition,) = policy["spec"]["matchConditions"]
    assert '"system:serviceaccount:"' in condition["expression"] and '"-compile"' in condition["expression"]
    assert compile_account_name("run") == "run-compile"  # the account name the condition matches
    assert any("spec.compileRun" in v["messageExpression"] for v in policy["spec"]["validations"])

    kinds = {o["kind"] for o in render({"admissionPolicy.enabled": "false"})}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def test_rbac_covers_the_drift_timer():
    application = rule_triples(one(render(), "ClusterRole", "-application")["rules"])
    for needed in [("shapeshift.dev", "compileruns", "list"), ("shapeshift.dev", "compileruns", "create"),
                   ("shapeshift.dev", "inferencedeployments/status", "patch"), ("", "events", "create")]:
        assert needed in application


def test_rbac_covers_replacing_children_and_the_rollout():
    """kube.Kube.ensure replaces (PUT) changed children; the rollout timer patches engine pods'
    annotations, reads the ForwardPass it rolls out and writes its status."""
    application = rule_triples(one(render(), "ClusterRole", "-application")["rules"])
    for group, resource in [("apps", "deployments"), ("", "services"), ("", "configmaps"),
                            ("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                            ("rbac.authorization.k8s.io", "rolebindings")]:
        for verb in ("get", "create", "update"):
            assert (group, resource, verb) in application, (group, resource, verb)
    for needed in [("", "pods", "patch"), ("", "pods", "list"), ("", "pods", "watch"),
                   ("shapeshift.dev", "forwardpasses", "get"), ("shapeshift.dev", "compileruns", "list"),
                   ("shapeshift.dev", "forwardpasses/status", "patch")]:
        assert needed in application, needed
    assert ("", "pods", "create") not in application and ("", "pods", "delete") not in application


@pytest.mark.parametrize("values, complaint", [
    ({"replicaCount": "2"}, "replicaCount"),  # two standalone operators would both act
    ({"watch.allNamespaces": "false"}, "namespaces"),  # and no namespaces named
    ({"watch.allNamespaces": "false", "watch.namespaces": '["team-*"]'}, "namespaces"),  # no globs
    ({"prometheus.url": "prometheus:9090"}, "url"),
    ({"image.pullPolicy": "Sometimes"}, "pullPolicy"),
    ({"operator.logLevel": "loud"}, "logLevel"),
    ({"drift.minRequests": "0"}, "minRequests"),
    ({"rollout.minRequests": "0"}, "minRequests"),
    ({"prometheus.podLabel": "pod-name"}, "podLabel"),  # not a Prometheus label name
    ({"prometheus.deploymentLabel": "inference-deployment"}, "deploymentLabel"),  # not a Prometheus label name
    ({"serviceAccount.create": "false"}, "name"),
    ({"serviceMonitor.interval": "fast"}, "interval"),
    ({"replicas": "1"}, "replicas"),  # a typo of replicaCount: unknown keys are refused
])
def test_values_schema_rejects_bad_values(values, complaint):
    result = helm("template", "ss", str(CHART), *set_args(values), check=False)
    assert result.returncode != 0, f"helm accepted {values}:\n{result.stdout[:400]}"
    assert "schema" in result.stderr.lower() and complaint in result.stderr, result.stderr


def test_values_yaml_documents_every_key():
    """A comment line sits right above every top-level key and every key of a settings block
    (the blocks whose schema is closed); keys inside free-form blocks (resources,
    securityContext ...) are Kubernetes fields documented by their parent's comment."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    settings_blocks = {name for name, node in schema.items() if node.get("additionalProperties") is False}
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, block = [], None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        key = stripped.split(":", 1)[0]
        if indent == 0:
            block = key
        needs_comment = indent == 0 or (indent == 2 and block in settings_blocks)
        if needs_comment and not lines[i - 1].strip().startswith("#"):
            undocumented.append(f"values.yaml line {i + 1}: {block + '.' if indent else ''}{key}")
    assert not undocumented, undocumented
    assert settings_blocks >= {"image", "watch", "prometheus", "drift", "serviceMonitor"}


def test_schema_and_values_agree():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    assert set(schema["required"]) <= set(values)


def test_chart_crds_match_the_generated_ones():
    result = subprocess.run(["bash", str(REPO / "hack" / "sync-chart-crds.sh"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    generated = sorted(p.name for pattern in ("shapeshift.dev_*.yaml", "kopf.dev_*.yaml")
                       for p in (REPO / "crds").glob(pattern))
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == generated
    crds = [o for o in render(include_crds=True) if o["kind"] == "CustomResourceDefinition"]
    names = sorted(c["metadata"]["name"] for c in crds)
    assert [n for n in names if n.endswith(".shapeshift.dev")] == [
        "compileruns.shapeshift.dev", "forwardpasses.shapeshift.dev", "inferencedeployments.shapeshift.dev"]
    assert any(n.endswith("peerings.kopf.dev") for n in names), names  # the chart's peering.enabled needs them


def test_sync_check_notices_a_stale_chart_crd(tmp_path):
    # The check must be able to fail: run it on a copy of the repository layout with one CRD edited.
    (tmp_path / "hack").mkdir()
    (tmp_path / "hack" / "sync-chart-crds.sh").write_text((REPO / "hack" / "sync-chart-crds.sh").read_text())
    (tmp_path / "crds").mkdir()
    for p in (REPO / "crds").glob("shapeshift.dev_*.yaml"):
        (tmp_path / "crds" / p.name).write_text(p.read_text())
    subprocess.run(["bash", str(tmp_path / "hack" / "sync-chart-crds.sh")], check=True, capture_output=True)
    edited = next((tmp_path / "crds").glob("*.yaml"))
    edited.write_text(edited.read_text() + "# changed\n")
    result = subprocess.run(["bash", str(tmp_path / "hack" / "sync-chart-crds.sh"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 1 and edited.name in result.stderr
