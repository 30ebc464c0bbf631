"""The compile worker and the champion registry against the real API server (tests/conftest.py
`cluster`): ForwardPass objects, and a CompileRun read, reported to and published from."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.pod_environment import service_account_token, token_kubeconfig

from shapeshift.engine.compile.cli import main
from shapeshift.engine.compile.champions import ChampionEntry, ClusterRegistry, TrafficRegime, model_signature
from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.contracts.traffic_profile import builtin_profile

pytestmark = pytest.mark.cluster

GROUP, VERSION = "shapeshift.dev", "v1alpha1"

STORE = "file:///var/lib/shapeshift-artifacts"  # the artifact store's mount in compile and engine pods


def test_cluster_registry_publishes_and_finds_forward_passes(crds, namespace) -> None:
    cluster = crds
    sig = model_signature(ModelConfig.from_hf(PRESETS["tiny-llama"].hf_config))
    reg = ClusterRegistry(cluster.custom, namespace)
    for name, profile, speedup, digest in [("tiny-chat", "chat", 1.3, "a" * 64),
                                            ("tiny-agentic", "agentic-long-context", 2.0, "b" * 64)]:
        e = ChampionEntry(name=name, signature=sig, model="tiny-llama", family="llama", hardware="cpu",
                          regime=TrafficRegime.of(builtin_profile(profile)).to_dict(), bundle_digest=digest,
                          recipe={"fuse_qkv": True, "engine.max_num_seqs": 32}, speedup=speedup,
                          verification={"passed": True, "gates": {"smoke": True}},
                          metrics={"tokens_per_second": 10.0 * speedup, "baseline_tokens_per_second": 10.0},
                          profile=builtin_profile(profile).to_dict(), notes=[{"agent": "sweep", "note": "why"}])
        reg.publish(e, f"{STORE}/{digest[:8]}.tar.gz", 1234)
        assert reg.publish(e, f"{STORE}/{digest[:8]}.tar.gz")["metadata"]["name"] == name  # idempotent
    obj = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", "tiny-chat")
    assert obj["spec"]["recipe"]["engine.max_num_seqs"] == 32 and obj["spec"]["metrics"]["speedup"] == 1.3
    nearest = reg.nearest_champions(sig, "cpu", builtin_profile("chat"), k=2, family="llama")
    assert [n.name for n in nearest] == ["tiny-chat", "tiny-agentic"]
    assert nearest[0].candidate().recipe == {"fuse_qkv": True, "engine.max_num_seqs": 32}
    clash = ChampionEntry(name="tiny-chat", signature=sig, model="m", family="llama", hardware="cpu",
                          regime=nearest[0].regime, bundle_digest="c" * 64, recipe={})
    with pytest.raises(ValueError, match="another bundle"):
        reg.publish(clash, f"{STORE}/x.tar.gz")


def worker_kubeconfig(cluster, namespace: str, run: str, tmp_path: Path) -> Path:
    """A kubeconfig holding a token of the run's own ServiceAccount, with exactly the Role the
    operator gives compile workers (operator.builders.build_compile_rbac)."""
    from shapeshift.operator.builders import Parent, build_compile_rbac
    from shapeshift.operator.api import CompileRunSpec

    obj = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", run)
    cluster.apply(build_compile_rbac(Parent.from_body(obj), CompileRunSpec.model_validate(obj["spec"])), namespace)
    account = f"{run}-compile"
    token = service_account_token(cluster, namespace, account)
    return token_kubeconfig(cluster, namespace, account, token, tmp_path / "worker-kubeconfig")


@pytest.mark.slow
def test_worker_reads_compile_run_reports_status_and_publishes(crds, namespace, tmp_path: Path) -> None:
    cluster = crds
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": "llama"},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0}})
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-1"},
        "spec": {"deploymentRef": {"name": "llama"}, "traffic": {"builtin": "chat"},
                 "budget": {"wallClockSeconds": 0, "trials": 4},
                 "agents": [{"kind": "coordinate-sweep"}, {"kind": "model-based"}],
                 "tiers": {"fastLayers": 1, "replayRequests": 64, "repeats": 4},
                 "baseline": {"minSpeedup": 1.0}}})
    kubeconfig = worker_kubeconfig(cluster, namespace, "run-1", tmp_path)
    rc = main(["--compile-run", f"{namespace}/run-1", "--kubeconfig", str(kubeconfig), "--device", "cpu",
               "--screen-requests", "32", "--out", str(tmp_path / "out"), "--registry", str(tmp_path / "reg")])
    assert rc == 0
    run = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run-1")
    st = run["status"]
    assert st["trials"]["total"] == 4
    assert st["leaderboard"] and {"candidate", "tokensPerSecond"} <= set(st["leaderboard"][0])
    # the agents asked for, plus the named recipes every run measures first
    assert {e["agent"] for e in st["leaderboard"]} <= {"baseline", "recipes", "sweep", "bayes"}
    report = (tmp_path / "out" / "report.json").read_text()
    assert '"profile": "chat"' in report and '"model": "tiny-llama"' in report
    fps = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses")["items"]
    if st.get("champion"):
        [fp] = fps
        assert fp["metadata"]["name"] == st["champion"] and fp["spec"]["verification"]["passed"]
        assert st["bestSpeedup"] == pytest.approx(fp["spec"]["metrics"]["speedup"])
        assert f"champion {st['champion']}" in st["message"]
    else:
        assert fps == [] and "no verified improvement" in st["message"]
    # The worker's token can do only what it needs: not even read another run or a Secret.
    import kubernetes

    worker = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    with pytest.raises(kubernetes.client.ApiException) as denied:
        kubernetes.client.CoreV1Api(worker).list_namespaced_secret(namespace)
    assert denied.value.status == 403
