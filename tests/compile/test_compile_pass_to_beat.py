"""The forward pass a compile run must beat besides the stock pass (engine/compile/pass_to_beat.py).

    a champion exported by the real evaluator (a source edit on, an engine knob moved)
      -> <sha256>.tar.gz + a ForwardPass-shaped object -> from_forward_pass
      -> a candidate whose materialized bundle has the published sha256 (not the edit applied twice)
    on the API server, with the compile worker's own token:
      deployment status.activeForwardPass / CompileRun spec.baseline.forwardPass
      -> CompileRunContext.pass_to_beat -> that candidate, or None (active pass unreadable), or
         an error naming the field (a named pass unreadable)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeshift.engine.forward_pass.bundle import pack_bundle
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.pass_to_beat import AGENT, from_forward_pass
from shapeshift.engine.contracts.traffic_profile import builtin_profile

GROUP, VERSION = "shapeshift.dev", "v1alpha1"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(evaluator, champion candidate, archive path, digest): a champion as a compile pod publishes it."""
    from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings

    tmp = tmp_path_factory.mktemp("published")
    ev = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(model="tiny-llama", device="cpu",
                                                                    work_dir=str(tmp / "work")))
    space = ev.space()
    champion = Candidate({**space.default(), "edit.index_select_gather": True, "fuse_qkv": True,
                          "engine.max_num_seqs": 32}, None, "sweep", "a champion")
    assert space.is_valid(champion.recipe)
    exported = ev.export(champion, tmp / "champion")
    (tmp / "shared").mkdir()
    archive = pack_bundle(exported["path"], tmp / "shared" / f"{exported['digest']}.tar.gz")
    return ev, champion, archive, exported["digest"]


def forward_pass(name, recipe, uri, sha, passed=True):
    return {"metadata": {"name": name},
            "spec": {"recipe": dict(recipe), "artifact": {"uri": uri, "sha256": sha},
                     "verification": {"passed": passed}, "hardware": {"accelerator": "cpu"},
                     "model": {"name": "tiny-llama"}}}


def test_a_published_pass_rebuilds_to_its_own_digest(published, tmp_path) -> None:
    from shapeshift.engine.forward_pass.bundle import verify_bundle

    ev, champion, archive, digest = published
    cand = from_forward_pass(forward_pass("fp-1", champion.recipe, archive.as_uri(), digest), ev.stock_source,
                             tmp_path / "cache")
    # stock source plus the recipe's edit: the candidate as it was searched
    assert cand.recipe == champion.recipe and cand.source is None and cand.digest == champion.digest
    assert cand.agent == AGENT and cand.note == "ForwardPass fp-1" and cand.extra["sha256"] == digest
    assert verify_bundle(ev.materialize(cand)).digest == digest

    # a source of its own (as an LLM agent writes) plus an edit: the bundle's forward.py is the
    # source and the edit knob is off, so the edit is not applied a second time
    written = Candidate(champion.recipe, ev.stock_source + "\n# written by an agent\n", "llm", "own source")
    exported = ev.export(written, tmp_path / "written")
    own = pack_bundle(exported["path"], tmp_path / f"{exported['digest']}.tar.gz")
    cand = from_forward_pass(forward_pass("fp-2", written.recipe, own.as_uri(), exported["digest"]),
                             ev.stock_source, tmp_path / "cache")
    assert cand.recipe["edit.index_select_gather"] is False and cand.recipe["engine.max_num_seqs"] == 32
    assert "# written by an agent" in cand.source and "index_select" in cand.source.split("# written by")[1]
    assert verify_bundle(ev.materialize(cand)).digest == exported["digest"]
    # a plain path works like file://
    assert from_forward_pass(forward_pass("fp-1", champion.recipe, str(archive), digest), ev.stock_source,
                             tmp_path / "cache").digest == champion.digest


def test_a_pass_that_cannot_be_trusted_or_read_is_refused(published, tmp_path) -> None:
    ev, champion, archive, digest = published
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="did not pass verification"):
        from_forward_pass(forward_pass("fp-1", champion.recipe, archive.as_uri(), digest, passed=False),
                          ev.stock_source, cache)
    with pytest.raises(ValueError, match="expected " + "0" * 64):
        from_forward_pass(forward_pass("fp-1", champion.recipe, archive.as_uri(), "0" * 64), ev.stock_source, cache)
    with pytest.raises(ValueError, match="does not exist"):
        from_forward_pass(forward_pass("fp-1", champion.recipe, str(tmp_path / "gone.tar.gz"), digest),
                          ev.stock_source, cache)


@pytest.fixture
def cluster_pass(crds, namespace, published):
    """A ForwardPass object fp-1 pinning the published archive, and the deployment `llama` running it."""
    ev, champion, archive, digest = published
    from shapeshift.operator.api import ForwardPassSpec

    spec = forward_pass("fp-1", champion.recipe, archive.as_uri(), digest)["spec"]
    spec["verification"]["gates"] = [{"name": "smoke", "passed": True}]
    spec = ForwardPassSpec.model_validate(spec).model_dump(mode="json", by_alias=True, exclude_none=True)
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass", "metadata": {"name": "fp-1"}, "spec": spec})
    return ev


def _start_run(crds, namespace, tmp_path, name, baseline=None):
    from test_compile_cluster import worker_kubeconfig

    from shapeshift.engine.compile.worker import CompileRunContext

    spec = {"deploymentRef": {"name": "llama"}, "budget": {"trials": 4}}
    if baseline:
        spec["baseline"] = baseline
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": name}, "spec": spec})
    kubeconfig = worker_kubeconfig(crds, namespace, name, tmp_path / name)
    return CompileRunContext.connect(f"{namespace}/{name}", str(kubeconfig))


@pytest.mark.cluster
def test_the_worker_beats_the_deployments_active_pass_or_the_named_one(crds, namespace, cluster_pass, tmp_path,
                                                                       caplog) -> None:
    ev = cluster_pass
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": "llama"},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0}})
    (tmp_path / "run-1").mkdir()
    worker = _start_run(crds, namespace, tmp_path, "run-1")
    assert worker.pass_to_beat(ev.stock_source, tmp_path / "cache") is None  # nothing active yet: stock only

    def set_active(name):
        crds.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "inferencedeployments", "llama",
                                                          {"status": {"activeForwardPass": {"name": name}}})

    set_active("fp-1")
    cand = worker.pass_to_beat(ev.stock_source, tmp_path / "cache")
    assert cand is not None and cand.note == "ForwardPass fp-1" and worker.pass_to_beat_name == "fp-1"
    set_active("fp-gone")  # the active one is best effort: unreadable -> the stock pass alone, said in the log
    with caplog.at_level("WARNING", logger="shapeshift.engine.compile.worker"):
        assert worker.pass_to_beat(ev.stock_source, tmp_path / "cache") is None
    assert "fp-gone" in caplog.text and "404" in caplog.text

    def unfit(cand):
        raise ValueError("its recipe does not fit this run's search space: unknown knob 'x'")

    set_active("fp-1")  # an active pass the run cannot fit is dropped too, with the reason in the log
    with caplog.at_level("WARNING", logger="shapeshift.engine.compile.worker"):
        assert worker.pass_to_beat(ev.stock_source, tmp_path / "cache", unfit) is None
    assert "unknown knob 'x'" in caplog.text

    (tmp_path / "run-2").mkdir()
    named = _start_run(crds, namespace, tmp_path, "run-2", {"forwardPass": "fp-1"})
    assert named.pass_to_beat(ev.stock_source, tmp_path / "cache").note == "ForwardPass fp-1"
    with pytest.raises(ValueError, match="unknown knob 'x'"):  # a named one: the run fails, saying why
        named.pass_to_beat(ev.stock_source, tmp_path / "cache", unfit)
    (tmp_path / "run-3").mkdir()
    missing = _start_run(crds, namespace, tmp_path, "run-3", {"forwardPass": "fp-9"})
    with pytest.raises(ValueError, match=r"fp-9 \(spec.baseline.forwardPass\) cannot be compared with: 404"):
        missing.pass_to_beat(ev.stock_source, tmp_path / "cache")


@pytest.mark.cluster
@pytest.mark.slow
def test_a_compile_run_measures_the_active_pass_and_says_what_it_had_to_beat(crds, namespace, cluster_pass,
                                                                            tmp_path) -> None:
    """`shapeshift compile --compile-run` end to end (small tiers): the active pass is measured
    first and the outcome names it, champion or not."""
    import json

    from shapeshift.engine.compile.cli import main

    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": "llama"},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0}})
    crds.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "inferencedeployments", "llama",
                                                      {"status": {"activeForwardPass": {"name": "fp-1"}}})
    (tmp_path / "run-1").mkdir()
    _start_run(crds, namespace, tmp_path, "run-1")
    kubeconfig = tmp_path / "run-1" / "worker-kubeconfig"
    rc = main(["--compile-run", f"{namespace}/run-1", "--kubeconfig", str(kubeconfig), "--device", "cpu",
               "--budget-trials", "1", "--agents", "sweep", "--no-recipe-seeds", "--no-registry", "--deterministic",
               "--screen-requests", "8", "--confirm-requests", "8", "--confirm-repeats", "2", "--final-repeats", "2",
               "--verify-steps", "4", "--verify-prompts", "1", "--out", str(tmp_path / "out")])
    assert rc == 0
    board = [json.loads(line) for line in (tmp_path / "out" / "board.jsonl").read_text().splitlines()]
    screened = {e["digest"] for e in board if e.get("kind") == "result" and e.get("tier") == "fast"}
    [proposed] = [e for e in board if e.get("kind") == "candidate" and e.get("agent") == AGENT]
    assert proposed["digest"] in screened and proposed["note"] == "ForwardPass fp-1"
    st = crds.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", "run-1")["status"]
    if st.get("champion"):  # it beat fp-1 in a paired comparison at the end
        assert any(e.get("kind") == "note" and e.get("final_vs_pass") and e.get("won") for e in board)
    else:
        assert st["message"].startswith("no verified improvement over the shipped serving default and ForwardPass fp-1")


@pytest.mark.cluster
@pytest.mark.slow
def test_a_champion_with_its_own_source_seeds_the_next_run_with_that_source(crds, namespace, published,
                                                                             tmp_path) -> None:
    """A ForwardPass records its recipe, not its source: a source an LLM agent wrote reaches the
    next run's seeds only through the bundle, which the worker now reads."""
    import json

    from shapeshift.engine.compile.cli import main
    from shapeshift.engine.compile.champions import ChampionEntry, ClusterRegistry, TrafficRegime, model_signature

    ev = published[0]
    written = Candidate(published[1].recipe, ev.stock_source + "\n# written by an agent\n", "llm", "own source")
    exported = ev.export(written, tmp_path / "written")
    archive = pack_bundle(exported["path"], tmp_path / f"{exported['digest']}.tar.gz")
    profile = builtin_profile("chat")
    ClusterRegistry(crds.custom, namespace).publish(ChampionEntry(
        name="tiny-written", signature=model_signature(ev.model_config()), model="tiny-llama", family="llama",
        hardware="cpu", regime=TrafficRegime.of(profile).to_dict(), bundle_digest=exported["digest"],
        recipe=dict(written.recipe), speedup=1.2, verification={"passed": True, "gates": {"smoke": True}},
        profile=profile.to_dict()), archive.as_uri(), archive.stat().st_size)
    crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": "llama"},
        "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 0}})
    (tmp_path / "run-1").mkdir()
    _start_run(crds, namespace, tmp_path, "run-1")
    rc = main(["--compile-run", f"{namespace}/run-1", "--kubeconfig", str(tmp_path / "run-1" / "worker-kubeconfig"),
               "--device", "cpu", "--budget-trials", "1", "--agents", "sweep", "--no-recipe-seeds", "--deterministic",
               "--registry", str(tmp_path / "reg"), "--screen-requests", "8", "--confirm-requests", "8",
               "--confirm-repeats", "2", "--final-repeats", "2", "--verify-steps", "4", "--verify-prompts", "1",
               "--out", str(tmp_path / "out")])
    assert rc == 0
    board = [json.loads(line) for line in (tmp_path / "out" / "board.jsonl").read_text().splitlines()]
    [seed] = [e for e in board if e.get("kind") == "candidate" and e.get("agent") == "registry"]
    assert "# written by an agent" in seed["source"] and "champion tiny-written" in seed["note"]
    assert seed["recipe"]["edit.index_select_gather"] is False  # already in the source, not applied twice
