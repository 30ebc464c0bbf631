"""Champion registry: signatures, traffic regimes, nearest champions, publishing bundles."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shapeshift.engine.forward_pass.bundle import create_bundle, stock_bundle_dir
from shapeshift.engine.compile.champions import (ChampionEntry, ClusterRegistry, LocalRegistry, TrafficRegime,
                                                forward_pass_spec, model_signature, project_recipe, rank)
from shapeshift.engine.compile.search_space import build_search_space
from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.models.presets import PRESETS
from shapeshift.engine.contracts.traffic_profile import TrafficProfile, builtin_profile
from shapeshift.operator.api import ForwardPassSpec

STORE = "file:///var/lib/shapeshift-artifacts"  # the artifact store's mount in compile and engine pods


def cfg(name: str) -> ModelConfig:
    return ModelConfig.from_hf(PRESETS[name].hf_config)


def entry(name, signature, hardware="cpu", profile="chat", speedup=1.2, family="llama", digest="0" * 64, recipe=None):
    return ChampionEntry(name=name, signature=signature, model="m", family=family, hardware=hardware,
                         regime=TrafficRegime.of(builtin_profile(profile)).to_dict(), bundle_digest=digest,
                         recipe=recipe or {"fuse_qkv": True}, speedup=speedup)


def test_signature_tracks_architecture_not_name() -> None:
    a = cfg("tiny-llama")
    assert model_signature(a) == model_signature(ModelConfig.from_hf(dict(PRESETS["tiny-llama"].hf_config)))
    assert model_signature(a) != model_signature(cfg("tiny-qwen3")) != model_signature(cfg("tiny-moe"))
    assert model_signature(a) == model_signature(a.__dict__ | {"eos_token_ids": [1, 2]})  # tokens are not shape


def test_regimes_bucket_traffic() -> None:
    chat, agentic, burst = (TrafficRegime.of(builtin_profile(p)) for p in ("chat", "agentic-long-context", "burst"))
    assert chat != agentic and chat.distance(agentic) > chat.distance(burst) - 10
    assert agentic.prompt > chat.prompt and agentic.hit > burst.hit and burst.concurrency > agentic.concurrency
    assert chat.distance(chat) == 0


def test_nearest_champions_order() -> None:
    sig = model_signature(cfg("tiny-llama"))
    other = model_signature(cfg("tiny-qwen3"))
    entries = [
        entry("same-sig-other-hw", sig, hardware="nvidia-h200", speedup=3.0),
        entry("same-sig-far-traffic", sig, profile="agentic-long-context", speedup=2.0),
        entry("same-sig-exact", sig, speedup=1.1),
        entry("same-family", other, speedup=5.0),
        entry("other-family", "ffff", family="moe", speedup=9.0),
    ]
    names = [e.name for e in rank(entries, sig, "cpu", builtin_profile("chat"), family="llama", k=5)]
    assert names == ["same-sig-exact", "same-sig-far-traffic", "same-sig-other-hw", "same-family"]
    assert [e.name for e in rank(entries, sig, "cpu", builtin_profile("chat"), k=5)] == names[:3]


def test_local_registry_publish_and_lookup(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    manifest = create_bundle(stock_bundle_dir(), {"fuse_qkv": True}, bundle, name="champ")
    reg = LocalRegistry(tmp_path / "reg")
    sig = model_signature(cfg("tiny-llama"))
    e = entry("tiny-llama-chat-1", sig, digest=manifest.digest)
    reg.publish(e, bundle)
    with pytest.raises(ValueError, match="digest"):
        reg.publish(entry("bad", sig, digest="1" * 64), bundle)
    again = LocalRegistry(tmp_path / "reg")
    [found] = again.nearest_champions(sig, "cpu", builtin_profile("chat"), k=3, family="llama")
    assert found.name == "tiny-llama-chat-1" and (again.bundle_dir(found) / "forward.py").is_file()
    cand = found.candidate()
    assert cand.recipe == {"fuse_qkv": True} and cand.agent == "registry"
    # re-publishing under the same name replaces the entry
    reg.publish(entry("tiny-llama-chat-1", sig, digest=manifest.digest, speedup=1.5), bundle)
    assert [x.speedup for x in again.entries()] == [1.5]
    shutil.rmtree(bundle)


def test_project_recipe_into_another_space() -> None:
    space = build_search_space(device="cpu", concurrency=32)
    gpu_recipe = {"attention_backend": "triton", "fuse_qkv": True, "engine.cuda_graph_max_batch": 64,
                  "engine.max_num_seqs": 32}
    projected = project_recipe(gpu_recipe, space)
    assert space.is_valid(projected)
    assert projected["fuse_qkv"] is True and projected["engine.max_num_seqs"] == 32
    assert projected["attention_backend"] == "torch" and "engine.cuda_graph_max_batch" not in projected


def test_cluster_object_validates_against_the_crd_model() -> None:
    sig = model_signature(cfg("tiny-llama"))
    e = entry("Tiny Llama/chat #1", sig, digest="a" * 64)
    e.verification = {"passed": True, "gates": {"smoke": True, "outputs.agreement": True}}
    e.metrics = {"tokens_per_second": 12.5, "baseline_tokens_per_second": 10.0, "per_user_p90": 1.0, "dtype": "float32"}
    e.profile = builtin_profile("chat").to_dict()
    obj = ClusterRegistry(api=None, namespace="ns").to_object(e, f"{STORE}/x.tar.gz")
    assert obj["metadata"]["name"] == "tiny-llama-chat-1"
    assert obj["spec"]["artifact"]["sha256"] == "a" * 64
    assert obj["spec"]["verification"]["gates"][0] == {"name": "smoke", "passed": True}
    assert obj["spec"]["model"]["dtype"] == "float32"
    assert obj["metadata"]["labels"]["shapeshift.dev/model-signature"] == sig
    assert "engine" not in obj["spec"]  # not recorded: published outside an operator's compile pod


def test_cluster_object_records_the_engine_env_it_was_measured_under() -> None:
    from shapeshift.engine.compile.worker import engine_env

    environ = {"SHAPESHIFT_ENGINE_ENV_NAMES": "SHAPESHIFT_PDL, NCCL_DEBUG, SHAPESHIFT_GEMV_PREFETCH,",
               "SHAPESHIFT_PDL": "0", "NCCL_DEBUG": "WARN"}
    recorded = engine_env(environ)
    # a listed name missing from the process environment reads as the empty value it would serve with;
    # only the engine's performance switches are recorded (NCCL_DEBUG is not one)
    assert recorded == [{"name": "SHAPESHIFT_GEMV_PREFETCH", "value": ""}, {"name": "SHAPESHIFT_PDL", "value": "0"}]
    assert engine_env({}) is None and engine_env({"SHAPESHIFT_ENGINE_ENV_NAMES": ""}) == []
    e = entry("tiny/chat", model_signature(cfg("tiny-llama")), digest="b" * 64)
    e.verification = {"passed": True, "gates": {"smoke": True}}
    obj = ClusterRegistry(api=None, namespace="ns").to_object(e, f"{STORE}/b.tar.gz", engine_env=recorded)
    assert obj["spec"]["engine"] == {"env": recorded}
    empty = ClusterRegistry(api=None, namespace="ns").to_object(e, f"{STORE}/b.tar.gz", engine_env=[])
    assert empty["spec"]["engine"] == {"env": []}


def test_forward_pass_object_is_built_from_the_crd_model_and_round_trips() -> None:
    sig = model_signature(cfg("tiny-llama"))
    e = entry("Tiny Llama/chat #1", sig, hardware="nvidia-h100-80gb-hbm3", digest="c" * 64)
    e.verification = {"passed": False, "gates": {"smoke": True, "outputs.agreement": False}}
    e.metrics = {"tokens_per_second": 12.5, "baseline_tokens_per_second": 10.0, "per_user_p50": 0.5,
                 "per_user_p90": 1.0, "ttft_p50": 0.01, "ttft_p90": 0.02, "noise": 0.03, "dtype": "int8"}
    e.profile = builtin_profile("chat").to_dict()
    e.notes = [{"agent": "sweep-0", "note": "fused qkv"}]
    e.parent, e.compile_run = "Parent Pass/v1", "ns/run-1"
    env = [{"name": "SHAPESHIFT_PDL", "value": "0"}]
    obj = ClusterRegistry(api=None, namespace="ns").to_object(
        e, f"{STORE}/b.tar.gz", size_bytes=99, annotations={"shapeshift.dev/artifact-durable": "true"}, engine_env=env)

    spec = obj["spec"]
    assert ForwardPassSpec.model_validate(spec).model_dump(mode="json", by_alias=True, exclude_none=True) == spec
    assert spec == forward_pass_spec(e, f"{STORE}/b.tar.gz", 99, env).to_wire()
    assert obj["apiVersion"] == "shapeshift.dev/v1alpha1" and obj["kind"] == "ForwardPass"
    assert obj["metadata"] == {
        "name": "tiny-llama-chat-1", "namespace": "ns",
        "labels": {"shapeshift.dev/model-signature": sig, "shapeshift.dev/hardware": "nvidia-h100-80gb-hbm3",
                   "shapeshift.dev/regime": TrafficRegime(**e.regime).key, "shapeshift.dev/family": "llama"},
        "annotations": {"shapeshift.dev/artifact-durable": "true"}}
    assert list(spec) == ["model", "hardware", "traffic", "artifact", "recipe", "metrics", "verification", "engine",
                          "reasoning", "parent", "compileRun"]
    assert spec["model"] == {"name": "m", "architecture": "llama", "dtype": "bfloat16"}  # int8: not a CRD dtype
    assert spec["hardware"] == {"accelerator": "nvidia-h100", "count": 1}  # the GPU name, in the closed set
    assert spec["traffic"] == TrafficProfile.model_validate(e.profile).model_dump(mode="json", by_alias=True,
                                                                                   exclude_none=True)
    assert spec["artifact"] == {"uri": f"{STORE}/b.tar.gz", "sha256": "c" * 64, "sizeBytes": 99}
    assert spec["recipe"] == {"fuse_qkv": True}
    assert spec["metrics"] == {"tokensPerSecond": 12.5, "baselineTokensPerSecond": 10.0, "speedup": 1.2,
                               "perUserTokensPerSecondP50": 0.5, "perUserTokensPerSecondP90": 1.0,
                               "ttftP50Seconds": 0.01, "ttftP90Seconds": 0.02, "noise": 0.03}
    assert spec["verification"] == {"passed": False, "gates": [{"name": "smoke", "passed": True},
                                                               {"name": "outputs.agreement", "passed": False}],
                                    "artifactSha256": "c" * 64}  # the report names the bundle it verified
    assert spec["engine"] == {"env": env}
    assert spec["reasoning"] == [{"agent": "sweep-0", "note": "fused qkv"}]
    assert (spec["parent"], spec["compileRun"]) == ("parent-pass-v1", "ns/run-1")


def test_a_minimal_entry_leaves_the_optional_fields_out_and_a_bad_one_is_refused() -> None:
    from pydantic import ValidationError

    e = entry("tiny/chat", model_signature(cfg("tiny-llama")), digest="d" * 64, speedup=None)
    spec = ClusterRegistry(api=None, namespace="ns").to_object(e, f"{STORE}/d.tar.gz", size_bytes=0)["spec"]
    assert spec == {"model": {"name": "m", "architecture": "llama", "dtype": "bfloat16"},
                    "hardware": {"accelerator": "cpu", "count": 1},
                    "artifact": {"uri": f"{STORE}/d.tar.gz", "sha256": "d" * 64},
                    "recipe": {"fuse_qkv": True}, "metrics": {},
                    "verification": {"passed": False, "gates": [], "artifactSha256": "d" * 64}}
    with pytest.raises(ValidationError, match="sha256"):  # always validated against the CRD's model
        ClusterRegistry(api=None, namespace="ns").to_object(entry("x", "s", digest="not-a-digest"), "file:///x")
