"""Kube.write_status on the real API server: a copy the caller already read saves the read,
a stale copy neither loses another writer's change nor writes twice.

    create InferenceDeployment --GET--> obj
    write_status(update, read=obj)  --> PATCH status (resourceVersion of obj), no GET
    another writer patches status   --> obj is now stale
    write_status(update2, read=obj) --> PATCH conflicts (409) --> GET --> merged PATCH
    write_status(same, read=fresh)  --> nothing to change: no GET, no PATCH
"""

from __future__ import annotations

import pytest

from shapeshift.operator.kube import Kube
from shapeshift.operator.api import GROUP, INFERENCE_DEPLOYMENT, VERSION
from shapeshift.operator.status import StatusUpdate

pytestmark = pytest.mark.cluster


class CountingKube(Kube):
    """The real Kube, counting its reads of custom objects."""

    reads = 0

    def get_custom(self, kind, namespace, name):
        self.reads += 1
        return super().get_custom(kind, namespace, name)


def test_write_status_uses_the_callers_read_and_rereads_only_on_a_conflict(crds, namespace):
    kube = CountingKube(crds.api_client)
    plural = INFERENCE_DEPLOYMENT.plural
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": "llama"},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0}})
    obj = kube.get_custom(INFERENCE_DEPLOYMENT, namespace, "llama")
    kube.reads = 0

    changed, status = kube.write_status(INFERENCE_DEPLOYMENT, namespace, "llama",
                                        StatusUpdate({"phase": "Pending"}), read=obj)
    assert changed and status["phase"] == "Pending"
    assert kube.reads == 0

    # Another writer (the rollout timer, say) changes the status: `obj` is stale now.
    kube.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, plural, "llama",
                                                      {"status": {"lastCompileRun": "run-1"}})
    changed, status = kube.write_status(INFERENCE_DEPLOYMENT, namespace, "llama",
                                        StatusUpdate({"phase": "Ready", "message": "all pods ready"}), read=obj)
    assert changed and kube.reads == 1  # the stale patch conflicted, the retry read afresh
    stored = kube.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, "llama")
    assert stored["status"] == status
    assert (status["phase"], status["message"]) == ("Ready", "all pods ready")
    assert status["lastCompileRun"] == "run-1"  # the other writer's change survived

    kube.reads = 0
    version = stored["metadata"]["resourceVersion"]
    changed, _ = kube.write_status(INFERENCE_DEPLOYMENT, namespace, "llama",
                                   StatusUpdate({"phase": "Ready", "message": "all pods ready"}), read=stored)
    assert not changed and kube.reads == 0
    after = kube.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, "llama")
    assert after["metadata"]["resourceVersion"] == version

    # Without a copy, it reads once itself.
    changed, _ = kube.write_status(INFERENCE_DEPLOYMENT, namespace, "llama", StatusUpdate({"phase": "Ready"}))
    assert not changed and kube.reads == 1


def test_a_finished_compile_runs_phase_is_not_moved_back(crds, namespace):
    """The worker sets Succeeded while a handler holds an update made from an older copy (phase
    Running): the stale writer's other fields land, the phase stays Succeeded."""
    from shapeshift.operator.api import COMPILE_RUN

    kube = Kube(crds.api_client)
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, COMPILE_RUN.plural, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-1"},
        "spec": {"deploymentRef": {"name": "llama"}}})
    stale = kube.get_custom(COMPILE_RUN, namespace, "run-1")
    kube.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, COMPILE_RUN.plural, "run-1",
                                                      {"status": {"phase": "Succeeded", "message": "champion fp-1"}})
    changed, status = kube.write_status(COMPILE_RUN, namespace, "run-1",
                                        StatusUpdate({"phase": "Running", "jobName": "run-1-compile"}), read=stale)
    assert changed and status["phase"] == "Succeeded" and status["jobName"] == "run-1-compile"
    assert status["message"] == "champion fp-1"
    # Before it finishes, a phase moves as written.
    kube.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, COMPILE_RUN.plural, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-2"},
        "spec": {"deploymentRef": {"name": "llama"}}})
    changed, status = kube.write_status(COMPILE_RUN, namespace, "run-2", StatusUpdate({"phase": "Running"}))
    assert changed and status["phase"] == "Running"
