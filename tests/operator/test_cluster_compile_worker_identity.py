"""A compile worker's token against the real API server: it publishes ForwardPasses of its own
CompileRun only (the chart's ValidatingAdmissionPolicy, templates/admission-policy.yaml, which the
`crds` fixture applies) and patches the status of its own CompileRun only (its Role, RBAC).

No operator runs here: the worker's ServiceAccount, Role and RoleBinding are applied as
operator/builders.py build_compile_rbac writes them.
"""

from __future__ import annotations

import json

import kubernetes
import pytest

from harness.pod_environment import service_account_token

pytestmark = pytest.mark.cluster

GROUP, VERSION = "shapeshift.dev", "v1alpha1"


def forward_pass(name: str, compile_run: str | None) -> dict:
    spec = {"model": {"name": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
            "artifact": {"uri": f"/var/lib/shapeshift-artifacts/{name}.tar.gz", "sha256": "a" * 64},
            "verification": {"passed": True, "gates": [{"name": "greedy", "passed": True}]}}
    if compile_run is not None:
        spec["compileRun"] = compile_run
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass", "metadata": {"name": name}, "spec": spec}


def token_client(cluster, token: str) -> kubernetes.client.ApiClient:
    """An API client authenticated by `token` alone."""
    admin = cluster.api_client.configuration
    config = kubernetes.client.Configuration()
    config.host, config.ssl_ca_cert, config.verify_ssl = admin.host, admin.ssl_ca_cert, True
    config.api_key, config.api_key_prefix = {"authorization": token}, {"authorization": "Bearer"}
    return kubernetes.client.ApiClient(config)


def refused(call) -> tuple[int, str]:
    with pytest.raises(kubernetes.client.ApiException) as info:
        call()
    return info.value.status, json.loads(info.value.body)["message"]


def test_a_compile_worker_publishes_and_reports_for_its_own_run_only(crds, namespace):
    from shapeshift.operator.api import CompileRunSpec
    from shapeshift.operator.builders import Parent, build_compile_rbac

    for run in ("run-a", "run-b"):
        crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": run},
            "spec": {"deploymentRef": {"name": "llama"}}})
    run_a = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run-a")
    crds.apply(build_compile_rbac(Parent.from_body(run_a), CompileRunSpec.model_validate(run_a["spec"])), namespace)
    token = service_account_token(crds, namespace, "run-a-compile", expiration_s=600)

    with token_client(crds, token) as client:
        custom = kubernetes.client.CustomObjectsApi(client)

        def create(body):
            return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", body)

        # its own run, as the worker writes it (NAMESPACE/NAME) and bare: stored
        assert create(forward_pass("fp-own", f"{namespace}/run-a"))["spec"]["compileRun"] == f"{namespace}/run-a"
        create(forward_pass("fp-own-bare", "run-a"))

        # another run of its namespace, its run's name in another namespace, or none: refused
        for name, compile_run in [("fp-other", f"{namespace}/run-b"), ("fp-other-bare", "run-b"),
                                  ("fp-elsewhere", "default/run-a"), ("fp-none", None)]:
            status, message = refused(lambda: create(forward_pass(name, compile_run)))
            assert status == 403, message
            assert "ValidatingAdmissionPolicy" in message and "spec.compileRun must be" in message, message
            assert f"{namespace}/run-a" in message, message
        stored = {o["metadata"]["name"] for o in crds.custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, "forwardpasses")["items"]}
        assert stored == {"fp-own", "fp-own-bare"}

        # status: its own run's is patched, another run's is refused by RBAC before admission
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "compileruns", "run-a",
                                                     {"status": {"phase": "Running"}})
        status, message = refused(lambda: custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, "compileruns", "run-b", {"status": {"champion": "fp-other"}}))
        assert status == 403 and 'cannot patch resource "compileruns/status"' in message, message
        assert "ValidatingAdmissionPolicy" not in message, message

    # other users are not matched: the admin may publish a pass naming any run
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses",
                                                forward_pass("fp-by-admin", f"{namespace}/run-b"))
