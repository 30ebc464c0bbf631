"""operator/provenance.py: a ForwardPass is trusted only when the CompileRun its spec names vouches
for it (the run's uid on the pass, the pass's name and spec digest in the run's status); a report
that contradicts itself or its artifact is refused by the model (and, as a CEL twin, by the API
server: tests/operator/test_cluster_rollout.py)."""

from __future__ import annotations

import copy
import re

import pytest
from pydantic import ValidationError

from shapeshift.operator.api import COMPILE_RUN_UID_ANNOTATION, ForwardPassSpec
from shapeshift.operator.provenance import provenance_problem, publishing_run

SHA = "c" * 64


def published(**spec_over):
    spec = {"model": {"name": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
            "artifact": {"uri": "/var/lib/shapeshift-artifacts/x.tar.gz", "sha256": SHA},
            "recipe": {"block": 64.0, "tiles": [1.0, 2.5]},
            "compileRun": "team-a/run-1",
            "verification": {"passed": True, "gates": [{"name": "greedy-match", "passed": True}],
                             "artifactSha256": SHA}}
    spec.update(spec_over)
    return {"metadata": {"name": "fp-1", "annotations": {COMPILE_RUN_UID_ANNOTATION: "uid-1"}}, "spec": spec}


def run_vouching_for(fp, uid="uid-1"):
    return {"metadata": {"name": "run-1", "uid": uid},
            "status": {"champion": fp["metadata"]["name"],
                       "championSpecSha256": ForwardPassSpec.model_validate(fp["spec"]).digest()}}


def test_a_pass_its_run_vouches_for_is_trusted_after_the_api_servers_round_trip():
    fp = published()
    run = run_vouching_for(fp)
    # the API server may return integral floats of free-form fields as ints, and fills in defaults
    stored = copy.deepcopy(fp)
    stored["spec"]["recipe"] = {"block": 64, "tiles": [1, 2.5]}
    stored["spec"]["metrics"] = {}
    assert provenance_problem("fp-1", stored, run) is None
    assert publishing_run(fp, "team-a") == "run-1" and publishing_run(fp, "team-b") is None
    assert publishing_run(published(compileRun="run-1"), "team-b") == "run-1"


def test_hand_written_and_tampered_passes_are_never_trusted():
    fp = published()
    run = run_vouching_for(fp)
    no_run = published(compileRun=None)
    assert "names no CompileRun (spec.compileRun)" in provenance_problem("fp-1", no_run, None)
    assert "not in this namespace" in provenance_problem("fp-1", fp, None)
    # a copy of the published spec with another recipe: the run recorded another digest
    changed = published(recipe={"block": 128})
    assert "does not record this ForwardPass with this spec" in provenance_problem("fp-1", changed, run)
    # the same spec under another name
    renamed = copy.deepcopy(fp)
    renamed["metadata"]["name"] = "fp-copy"
    assert "status.champion" in provenance_problem("fp-copy", renamed, run)
    # a run deleted and created again under the same name does not vouch for the old run's passes
    assert "annotation does not match CompileRun" in provenance_problem("fp-1", fp, run_vouching_for(fp, "uid-2"))
    no_uid = copy.deepcopy(fp)
    no_uid["metadata"]["annotations"] = {}
    assert "annotation does not match" in provenance_problem("fp-1", no_uid, run)


def test_a_report_that_contradicts_itself_or_its_artifact_is_refused():
    failed_gate = published(verification={"passed": True, "artifactSha256": SHA,
                                          "gates": [{"name": "kv-isolation", "passed": False}]})
    problem = provenance_problem("fp-1", failed_gate, None)
    assert "spec.verification.passed is true but a gate in spec.verification.gates failed (kv-isolation)" in problem
    other_bundle = published(verification={"passed": True, "artifactSha256": "d" * 64,
                                           "gates": [{"name": "greedy-match", "passed": True}]})
    assert "spec.verification.artifactSha256 differs from spec.artifact.sha256" in provenance_problem(
        "fp-1", other_bundle, None)
    no_gates = published(verification={"passed": True, "artifactSha256": SHA, "gates": []})
    assert "no gate results (spec.verification.gates)" in provenance_problem("fp-1", no_gates, None)
    unnamed = published(verification={"passed": True, "gates": [{"name": "greedy-match", "passed": True}]})
    assert "artifactSha256 is absent" in provenance_problem("fp-1", unnamed, None)
    assert "spec.verification.passed is false" in provenance_problem(
        "fp-1", published(verification={"passed": False, "gates": [{"name": "g", "passed": False}]}), None)
    with pytest.raises(ValidationError, match="spec.verification.passed is true but a gate"):
        ForwardPassSpec.model_validate(failed_gate["spec"])


@pytest.mark.parametrize("uri, fragment", [
    ("s3://bucket/x.tar.gz", "must be an absolute path, file:///path or an http(s):// URL"),
    ("file://host/x.tar.gz", "must be an absolute path"),
    ("http://u:p@store/x.tar.gz", "must carry no credentials"),
    ("https://store/x.tar.gz?sig=1", "must carry no credentials"),
    ("/store/../x.tar.gz", "'..' segments"),
])
def test_artifact_uris_outside_the_engines_schemes_or_with_credentials_are_refused(uri, fragment):
    with pytest.raises(ValidationError, match=re.escape(fragment)):
        ForwardPassSpec.model_validate(published(artifact={"uri": uri, "sha256": SHA})["spec"])
    # a pass stored before the rule existed is not trusted either (the rollout parses it first)
    assert fragment in provenance_problem("fp-1", published(artifact={"uri": uri, "sha256": SHA}), None)


@pytest.mark.parametrize("uri, fragment", [
    # local paths outside the artifact store: what an engine pod holds besides our bundles
    ("/etc/shadow", "must lie inside the artifact store /var/lib/shapeshift-artifacts/"),
    ("file:///proc/self/environ", "must lie inside the artifact store"),
    ("file://localhost/var/run/secrets/kubernetes.io/serviceaccount/token", "must lie inside the artifact store"),
    ("/var/lib/shapeshift-artifacts-other/x.tar.gz", "must lie inside the artifact store"),
    ("/var/lib/shapeshiftx/x.tar.gz", "must lie inside the artifact store"),
    ("file:///var/lib/shapeshift-artifacts/%2e%2e/%2e%2e/etc/shadow", "with no %-escapes"),
    # http(s) hosts at link-local and cloud metadata addresses, however spelled
    ("http://169.254.169.254/latest/meta-data/x.tar.gz", "link-local or cloud metadata address"),
    ("http://169.254.169.254:80/x.tar.gz", "link-local or cloud metadata address"),
    ("https://169.254.170.2/x.tar.gz", "link-local or cloud metadata address"),
    ("http://[fd00:ec2::254]/x.tar.gz", "link-local or cloud metadata address"),
    ("http://[FE80::1]/x.tar.gz", "link-local or cloud metadata address"),
    ("http://[::ffff:169.254.169.254]/x.tar.gz", "link-local or cloud metadata address"),
    ("http://[::ffff:a9fe:a9fe]/x.tar.gz", "link-local or cloud metadata address"),
    ("http://metadata.google.internal/computeMetadata/v1/x.tar.gz", "link-local or cloud metadata address"),
    ("https://METADATA.GOOGLE.INTERNAL./x.tar.gz", "link-local or cloud metadata address"),
    ("http://100.100.100.200/x.tar.gz", "link-local or cloud metadata address"),
    ("http://2852039166/x.tar.gz", "numeric spelling of an address"),
    ("http://0xa9fea9fe/x.tar.gz", "numeric spelling of an address"),
    ("http://0251.0376.0251.0376/x.tar.gz", "numeric spelling of an address"),
    ("http://169.16689662/x.tar.gz", "numeric spelling of an address"),
])
def test_local_paths_outside_the_store_and_metadata_hosts_are_refused(uri, fragment):
    with pytest.raises(ValidationError, match=re.escape(fragment)):
        ForwardPassSpec.model_validate(published(artifact={"uri": uri, "sha256": SHA})["spec"])
    assert fragment in provenance_problem("fp-1", published(artifact={"uri": uri, "sha256": SHA}), None)


def test_further_artifact_roots_come_from_the_setting_and_the_crds_generated_with_them(monkeypatch):
    from shapeshift.operator.api import forward_pass
    from shapeshift.operator.crdgen import render_all

    monkeypatch.setenv(forward_pass.ARTIFACT_ROOTS_ENV, "/data/store, /srv/passes/")
    assert forward_pass.artifact_roots() == ("/var/lib/shapeshift-artifacts/", "/var/lib/shapeshift/",
                                             "/data/store/", "/srv/passes/")
    for uri in ("/data/store/x.tar.gz", "file:///srv/passes/a/x.tar.gz", "file://localhost/data/store/x.tar.gz"):
        ForwardPassSpec.model_validate(published(artifact={"uri": uri, "sha256": SHA})["spec"])
    with pytest.raises(ValidationError, match="or /data/store/, /srv/passes/, with no %-escapes"):
        ForwardPassSpec.model_validate(published(artifact={"uri": "/data/storex/x.tar.gz", "sha256": SHA})["spec"])
    for bad in ("relative/dir", "/", "/a/../etc", "/a b"):
        with pytest.raises(ValueError, match="SHAPESHIFT_ARTIFACT_ROOTS"):
            forward_pass.parse_artifact_roots(bad)
    # the API server's twin: the CRDs generated with a root name it; the committed ones do not
    extended = render_all(("/data/store",))["shapeshift.dev_forwardpasses.yaml"]
    default = render_all()["shapeshift.dev_forwardpasses.yaml"]
    assert "file:///data/store/" in extended and "/data/store" not in default
    assert forward_pass.artifact_root_rule()["rule"] in yaml_rules(default)
    assert forward_pass.artifact_root_rule(forward_pass.artifact_roots())["rule"] not in yaml_rules(default)
    assert {k: v for k, v in render_all().items() if k != "shapeshift.dev_forwardpasses.yaml"} == {
        k: v for k, v in render_all(("/data/store",)).items() if k != "shapeshift.dev_forwardpasses.yaml"}


def yaml_rules(text: str) -> set[str]:
    import yaml

    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            found.update(v["rule"] for v in node.get("x-kubernetes-validations") or [])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load(text))
    return found


def test_the_engines_locations_are_accepted():
    for uri in ("/var/lib/shapeshift-artifacts/x.tar.gz", "file:///var/lib/shapeshift-artifacts/x.tar.gz",
                "file://localhost/var/lib/shapeshift-artifacts/x.tar.gz", "file:///var/lib/shapeshift/run/x.tar.gz",
                "https://store.example/x.tar.gz", "http://store.svc:8080/x.tar.gz", "http://10.0.0.5:8080/x.tar.gz",
                "https://cafe.be/x.tar.gz", "http://[fd00::1]/x.tar.gz", "https://0x.example/x.tar.gz"):
        ForwardPassSpec.model_validate(published(artifact={"uri": uri, "sha256": SHA})["spec"])
