"""The compile worker's cluster side, piece by piece, on the real API server with the worker's own token.

    CompileRun spec + engine.yaml --job_request--> the job (engine fields, verification, artifact folder)
    champion bundle --publish--> <sha256>.tar.gz (shared artifact folder, or the work folder)
      + ForwardPass (artifact URI, size, shapeshift.dev/artifact-durable annotation)
    CompileResult without a champion --finish--> status without bestSpeedup / champion

Plus the search space the worker builds: no recipe the stock forward pass refuses at build time.
"""

from __future__ import annotations

import tarfile
import urllib.parse
from pathlib import Path

import pytest

from shapeshift.engine.forward_pass.bundle import stock_bundle_dir, verify_bundle
from shapeshift.engine.compile.job import CompileJob, JobRequest
from shapeshift.engine.compile.measure import Measurement
from shapeshift.engine.compile.champions import ChampionEntry, TrafficRegime
from shapeshift.engine.compile.search_space import build_search_space
from shapeshift.engine.contracts.traffic_profile import builtin_profile

GROUP, VERSION = "shapeshift.dev", "v1alpha1"


# ---- the search space (no cluster) ------------------------------------------------------------


def test_cpu_space_offers_no_triton_only_fusions_and_cuda_space_constrains_them() -> None:
    cpu = build_search_space(device="cpu", concurrency=32)
    assert "fuse_gate_up_activation" not in cpu.names and "fuse_norm_into_linear" not in cpu.names
    cuda = build_search_space(device="cuda", concurrency=32)
    base = cuda.default()
    assert not cuda.is_valid({**base, "fuse_gate_up_activation": True})
    assert any("linear_backend=triton" in p for p in cuda.validate({**base, "fuse_norm_into_linear": True}))
    assert cuda.is_valid({**base, "linear_backend": "triton", "fuse_gate_up": True, "fuse_gate_up_activation": True})
    assert not cuda.is_valid({**base, "linear_backend": "triton", "fuse_qkv": True, "fuse_norm_into_linear": True})
    # a sweep around the default never proposes a fusion the forward pass would refuse
    assert not cuda.neighbors(base, "fuse_gate_up_activation")


def test_engine_defaults_make_the_stock_candidate_the_deployed_engine() -> None:
    space = build_search_space(device="cpu", concurrency=32,
                               engine_defaults={"max_num_seqs": 12, "enable_prefix_caching": False,
                                                "max_num_batched_tokens": 3000})
    default = space.default()
    assert default["engine.max_num_seqs"] == 12 and 12 in space.knob("engine.max_num_seqs").values
    assert default["engine.enable_prefix_caching"] is False
    assert default["engine.max_num_batched_tokens"] == 3000 and space.is_valid(default)


# ---- on the API server, as the worker ---------------------------------------------------------


@pytest.fixture
def worker(crds, namespace, tmp_path, monkeypatch):
    """A CompileRunContext for run-1, connected with the run's ServiceAccount token."""
    from test_compile_cluster import worker_kubeconfig

    from shapeshift.engine.compile.worker import CompileRunContext

    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": "llama"},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0}})
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": "run-1"},
        "spec": {"deploymentRef": {"name": "llama"}, "budget": {"trials": 4},
                 "verification": {"greedySteps": 8, "freshPrompts": 2}}})
    kubeconfig = worker_kubeconfig(crds, namespace, "run-1", tmp_path)
    for name in ("SHAPESHIFT_ENGINE_CONFIG", "SHAPESHIFT_WORK_DIR", "SHAPESHIFT_ARTIFACT_DIR", "SHAPESHIFT_ENGINE_ENV_NAMES"):
        monkeypatch.delenv(name, raising=False)
    return CompileRunContext.connect(f"{namespace}/run-1", str(kubeconfig))


def _entry(digest: str) -> ChampionEntry:
    profile = builtin_profile("chat")
    return ChampionEntry(name=f"tiny-llama-chat-{digest[:10]}", signature="0" * 16, model="tiny-llama", family="llama",
                         hardware="cpu", regime=TrafficRegime.of(profile).to_dict(), bundle_digest=digest,
                         recipe={"fuse_qkv": False}, speedup=1.25, metrics={"dtype": "float32"},
                         verification={"passed": True, "gates": {"smoke": True}}, profile=profile.to_dict())


def _archive_digest(archive: Path, into: Path) -> str:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return verify_bundle(into).digest


@pytest.mark.cluster
def test_worker_takes_engine_fields_verification_and_artifact_folder(worker, tmp_path, monkeypatch) -> None:
    engine_yaml = tmp_path / "engine.yaml"
    engine_yaml.write_text("model: tiny-llama\ndtype: float32\nmax_model_len: 256\nmax_num_seqs: 8\n"
                           "block_size: 16\nenable_prefix_caching: false\ngpu_memory_utilization: 0.9\n")
    monkeypatch.setenv("SHAPESHIFT_ENGINE_CONFIG", str(engine_yaml))
    monkeypatch.setenv("SHAPESHIFT_ARTIFACT_DIR", str(tmp_path / "shared"))
    job = CompileJob.from_request(worker.job_request(JobRequest()))
    assert job.model == "tiny-llama" and job.dtype == "float32" and job.max_model_len == 256
    assert job.engine_base == {"max_num_seqs": 8, "block_size": 16, "enable_prefix_caching": False}
    assert (job.verification.steps, job.verification.prompts) == (8, 2)
    assert job.artifact_dir == worker.artifact_dir == str(tmp_path / "shared")


@pytest.mark.cluster
@pytest.mark.parametrize("shared", [True, False])
def test_publish_stores_the_archive_and_says_whether_it_is_durable(worker, crds, namespace, tmp_path, shared,
                                                                  monkeypatch) -> None:
    import shutil

    from shapeshift.engine.forward_pass.bundle import create_bundle

    # A bundle of the stock source, built here (the shipped stock manifest may lag an edit of forward.py).
    source = tmp_path / "src"
    shutil.copytree(stock_bundle_dir(), source, ignore=shutil.ignore_patterns("__pycache__", "manifest.json"))
    bundle = tmp_path / "work" / "run-1" / "champion"
    create_bundle(source, {}, bundle, name="champion")
    digest = verify_bundle(bundle).digest
    worker.artifact_dir = str(tmp_path / "shared") if shared else None
    if shared:  # as in an operator's compile pod: the deployment's spec.engine.env, and their names
        monkeypatch.setenv("SHAPESHIFT_ENGINE_ENV_NAMES", "SHAPESHIFT_PDL")
        monkeypatch.setenv("SHAPESHIFT_PDL", "0")
    worker.publish(_entry(digest), bundle)

    fp = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", worker.champion_name)
    uri = urllib.parse.urlparse(fp["spec"]["artifact"]["uri"])
    path = Path(urllib.parse.unquote(uri.path))
    assert uri.scheme == "file" and path.name == f"{digest}.tar.gz"
    assert path.parent == ((tmp_path / "shared") if shared else bundle.parent).resolve()
    assert fp["spec"]["artifact"]["sha256"] == digest and fp["spec"]["artifact"]["sizeBytes"] == path.stat().st_size
    assert _archive_digest(path, tmp_path / "unpacked") == digest
    assert fp["metadata"]["annotations"]["shapeshift.dev/artifact-durable"] == ("true" if shared else "false")
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".partial-")]
    # the engine env it was measured under, accepted by the API server's schema (absent: not recorded)
    assert fp["spec"].get("engine") == ({"env": [{"name": "SHAPESHIFT_PDL", "value": "0"}]} if shared else None)
    # the run vouches for it with its own status (the run's Role), so the rollout trusts it as stored
    from shapeshift.operator.provenance import provenance_problem

    run = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run-1")
    assert run["status"]["champion"] == worker.champion_name
    assert fp["spec"]["verification"]["artifactSha256"] == digest
    assert provenance_problem(worker.champion_name, fp, run) is None


@pytest.mark.cluster
def test_finish_without_champion_clears_a_best_speedup_reported_during_the_search(worker, crds, namespace) -> None:
    from shapeshift.engine.compile.candidate import Candidate
    from shapeshift.engine.compile.loop import CompileResult, Incumbent

    worker.patch_status({"trials": 3, "best_speedup": 1.24, "leaderboard": [], "phase": "Succeeded"})
    run = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run-1")
    assert run["status"]["bestSpeedup"] == 1.24
    baseline = Measurement(samples=[100.0, 101.0])
    result = CompileResult(baseline_fast=baseline, baseline_full=baseline, incumbent=Incumbent(Candidate({}), baseline, baseline),
                           champion=None, speedup=None, trials=4, confirms=2, verifications=1, elapsed_s=3.0,
                           stop_reason="final comparison with the stock pass within noise")
    worker.finish(result, None)
    status = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run-1")["status"]
    assert "bestSpeedup" not in status and "champion" not in status, status
    assert status["trials"]["total"] == 4 and "no verified improvement" in status["message"]


def test_the_compile_pod_measures_on_its_pools_chip_or_refuses():
    import pytest

    from shapeshift.engine.compile.worker import device_for_accelerator

    assert device_for_accelerator("cpu", cuda_available=False) == "cpu"
    assert device_for_accelerator("nvidia-h200", cuda_available=True) == "cuda"
    with pytest.raises(ValueError, match="no CUDA device"):
        device_for_accelerator("nvidia-h100", cuda_available=False)
    with pytest.raises(ValueError, match="no Neuron backend"):
        device_for_accelerator("trainium2", cuda_available=True)
    with pytest.raises(ValueError, match="unknown accelerator"):
        device_for_accelerator("tpu-v5", cuda_available=False)


def test_fields_the_worker_does_not_act_on_are_named():
    from shapeshift.engine.compile.worker import unhonored_fields
    from shapeshift.operator.api import CompileRunSpec

    def spec(**fields):
        return CompileRunSpec.model_validate({"deploymentRef": {"name": "d"}, **fields})

    assert unhonored_fields(spec()) == []
    # The CRD's defaults, written out, are not complaints.
    assert unhonored_fields(spec(tiers={"fast": True, "full": True, "repeats": 5},
                                 verification={"logprobTolerance": 0.05, "kvContamination": True},
                                 baseline={"minSpeedup": 1.05}, agents=[{"kind": "coordinate-sweep", "replicas": 1}])) == []
    notes = unhonored_fields(spec(tiers={"full": False}, verification={"logprobTolerance": 0.2, "kvContamination": False},
                                  baseline={"forwardPass": "fp-1"}, agents=[{"kind": "evolutionary", "replicas": 3}]))
    assert [n.split(" ", 1)[0] for n in notes] == ["tiers.full=false", "verification.logprobTolerance=0.2",
                                                   "verification.kvContamination=false"]
    # acted on now: the pass a champion must beat besides the stock pass (test_compile_pass_to_beat.py)
    # and agents' replicas (below)


def test_agent_replicas_become_instances_with_their_own_names_and_seeds(tmp_path):
    from shapeshift.engine.compile.agents import make_agents
    from shapeshift.engine.compile.board import Board
    from shapeshift.engine.compile.search_space import Knob, SearchSpace
    from shapeshift.engine.compile.worker import agent_names
    from shapeshift.operator.api import AgentSpec

    names, llm_index = agent_names([AgentSpec.model_validate(a) for a in (
        {"kind": "coordinate-sweep"}, {"kind": "evolutionary", "replicas": 3},
        {"kind": "llm", "llm": {"endpoint": "http://a/v1", "model": "m"}, "replicas": 2},
        {"kind": "llm", "llm": {"endpoint": "http://b/v1", "model": "m"}})])
    assert names == ["sweep", "evolve", "evolve", "evolve", "llm", "llm"] and llm_index == 2
    space = SearchSpace([Knob("a", tuple(range(50)), 0), Knob("b", tuple(range(50)), 0)])
    board = Board(tmp_path / "board.jsonl")
    agents = make_agents(names[:4], space, board, seed=7)
    assert [a.name for a in agents] == ["sweep", "evolve", "evolve-2", "evolve-3"]
    assert [a.seed for a in agents] == [7, 7, 8, 9]
    # replicas explore apart: their first random points differ
    firsts = [tuple(sorted(a.propose(1)[0].recipe.items())) for a in agents[1:]]
    assert len(set(firsts)) == 3
