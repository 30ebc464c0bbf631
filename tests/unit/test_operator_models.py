"""Operator models: defaults, enums and the pydantic twins of the CRD's CEL rules."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from shapeshift.operator.api import hardware
from shapeshift.operator.api import (
    CompileRunSpec,
    CompileBudget,
    ForwardPassSpec,
    InferenceDeploymentSpec,
    set_condition,
    short_error,
)


def idep(**over):
    base = {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "nvidia-h200"}}
    base.update(over)
    return InferenceDeploymentSpec.model_validate(base)


def test_defaults_fill_a_minimal_spec():
    s = idep()
    assert s.replicas == 1
    assert s.engine.dtype == "bfloat16" and s.engine.kv_block_size == 16
    assert s.compilation.policy == "Manual" and s.compilation.budget.wall_clock_seconds == 3600
    assert s.rollout.strategy == "HotReload" and s.rollout.canary_replicas == 1
    assert s.hardware.count == 1


@pytest.mark.parametrize("over, match", [
    ({"hardware": {"accelerator": "tpu-v5"}}, "accelerator"),
    ({"replicas": -1}, "replicas"),
    ({"model": {}}, "exactly one of spec.model.preset or spec.model.pvc"),
    ({"model": {"preset": "a", "pvc": {"claimName": "weights"}}}, "exactly one"),
    ({"compilation": {"policy": "OnDrift"}}, "requires spec.compilation.drift"),
    ({"compilation": {"policy": "OnDrift", "drift": {"promptLengthRelativeChange": 0}}}, "promptLengthRelativeChange|prompt_length"),
    ({"compilation": {"budget": {"wallClockSeconds": -5}}}, "wallClockSeconds|wall_clock"),
    ({"compilation": {"budget": {"wallClockSeconds": 0, "trials": 0}}}, "wallClockSeconds > 0 or trials > 0"),
    ({"replicas": 2, "rollout": {"canaryReplicas": 3}}, "canaryReplicas must not exceed"),
    ({"engine": {"maxBatchSize": 64, "maxNumBatchedTokens": 32}}, "maxNumBatchedTokens"),
    ({"engine": {"kvBlockSize": 24}}, "kv_block_size|kvBlockSize"),
    ({"engine": {"dtype": "int3"}}, "dtype"),
    ({"surprise": 1}, "surprise"),
])
def test_invalid_inference_deployments_are_rejected(over, match):
    with pytest.raises(ValidationError) as info:
        idep(**over)
    assert __import__("re").search(match, str(info.value)), str(info.value)


def test_missing_model_source_is_rejected():
    with pytest.raises(ValidationError, match="model"):
        InferenceDeploymentSpec.model_validate({"hardware": {"accelerator": "cpu"}})


def test_scaled_to_zero_allows_the_default_canary():
    assert idep(replicas=0).rollout.canary_replicas == 1


def test_every_accelerator_kind_is_accepted_and_has_a_table_entry():
    for kind in hardware.ACCELERATORS:
        assert idep(hardware={"accelerator": kind}).hardware.accelerator == kind
    with pytest.raises(ValueError, match="supported kinds"):
        hardware.accelerator("nvidia-a100")


@pytest.mark.parametrize("device_name, kind", [
    ("nvidia-h200", "nvidia-h200"), ("NVIDIA H200 NVL", "nvidia-h200"),
    ("nvidia-h100-80gb-hbm3", "nvidia-h100"), ("NVIDIA H100 PCIe", "nvidia-h100"),
    ("trainium2", "trainium2"), ("aws-neuron-core", "trainium2"),
    ("cpu", "cpu"), ("nvidia-a100-sxm4-80gb", "cpu"), ("", "cpu"),
])
def test_a_device_name_maps_into_the_closed_set(device_name, kind):
    assert hardware.accelerator_of_device(device_name) == kind
    for known in hardware.ACCELERATORS:  # every kind's own name maps to itself
        assert hardware.accelerator_of_device(known) == known


def test_compile_run_defaults_and_rules():
    run = CompileRunSpec.model_validate({"deploymentRef": {"name": "llama"}})
    assert [a.kind for a in run.agents] == ["coordinate-sweep", "evolutionary"]
    assert run.budget.active_deadline_seconds == 3600 + 600
    assert CompileBudget(wall_clock_seconds=0, trials=10).active_deadline_seconds is None
    with pytest.raises(ValidationError, match="llm settings"):
        CompileRunSpec.model_validate({"deploymentRef": {"name": "x"}, "agents": [{"kind": "llm"}]})
    with pytest.raises(ValidationError, match="at most one"):
        CompileRunSpec.model_validate({"deploymentRef": {"name": "x"}, "traffic": {"builtin": "chat", "prometheus": {}}})
    with pytest.raises(ValidationError):
        CompileRunSpec.model_validate({"deploymentRef": {"name": "x"}, "traffic": {"builtin": "weekend"}})


def test_forward_pass_requires_a_real_sha256():
    spec = {
        "model": {"name": "tiny-llama"},
        "hardware": {"accelerator": "nvidia-h200"},
        "artifact": {"uri": "file:///var/lib/shapeshift-artifacts/b.tar", "sha256": "ab" * 32},
        "verification": {"passed": True},
        "recipe": {"attention": "triton", "tiles": {"m": 64}},
    }
    assert ForwardPassSpec.model_validate(spec).recipe["tiles"] == {"m": 64}
    spec["artifact"]["sha256"] = "not-a-hash"
    with pytest.raises(ValidationError, match="sha256"):
        ForwardPassSpec.model_validate(spec)


def test_wire_form_is_camel_case_and_round_trips():
    s = idep(engine={"maxModelLen": 4096})
    wire = s.to_wire()
    assert wire["engine"]["maxModelLen"] == 4096 and "max_model_len" not in wire["engine"]
    assert InferenceDeploymentSpec.model_validate(wire) == s


def test_conditions_keep_transition_time_until_status_changes():
    from datetime import datetime, timezone

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    t1 = datetime(2026, 1, 2, tzinfo=timezone.utc)
    c = set_condition([], "Ready", "False", "Waiting", now=t0)
    c = set_condition(c, "Ready", "False", "StillWaiting", "x", now=t1)
    assert c[0].last_transition_time == t0 and c[0].reason == "StillWaiting"
    c = set_condition(c, "Ready", "True", "Done", now=t1)
    assert c[0].last_transition_time == t1 and len(c) == 1


def test_short_error_names_the_wire_path():
    with pytest.raises(ValidationError) as info:
        idep(hardware={"accelerator": "tpu"})
    assert "hardware.accelerator" in short_error(info.value)


def test_placement_may_narrow_the_pool_never_contradict_it():
    import pytest
    from pydantic import ValidationError

    from shapeshift.operator.api import HardwareSpec

    HardwareSpec(accelerator="nvidia-h200", node_selector={"zone": "a", "nvidia.com/gpu.product": "NVIDIA-H200"})
    HardwareSpec(accelerator="cpu", node_selector={"node.kubernetes.io/instance-type": "m7i.large"})
    HardwareSpec(accelerator="cpu", widen_tolerations=True, tolerations=[{"operator": "Exists"}])
    HardwareSpec(accelerator="nvidia-h100", widen_tolerations=True, tolerations=[{"operator": "Exists"}])
    HardwareSpec(accelerator="nvidia-h200", tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"},
                                                         {"key": "spot", "operator": "Exists"}])
    HardwareSpec(accelerator="trainium2", tolerations=[{"key": "aws.amazon.com/neuron", "operator": "Exists"}])
    HardwareSpec(accelerator="cpu", node_selector={"node.kubernetes.io/instance-type": "c7g.4xlarge"})
    HardwareSpec(accelerator="nvidia-h200", node_selector={"node.kubernetes.io/instance-type": "p5e.48xlarge"})
    for hardware, message in [
        ({"accelerator": "nvidia-h200", "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
         "spec.hardware.nodeSelector['nvidia.com/gpu.product'] must be 'NVIDIA-H200'"),
        ({"accelerator": "trainium2", "node_selector": {"node.kubernetes.io/instance-type": "p5.48xlarge"}},
         "must be 'trn2.48xlarge' for accelerator trainium2"),
        ({"accelerator": "trainium2", "node_selector": {"nvidia.com/gpu.present": "true"}},
         "nvidia.com/ labels are only on NVIDIA nodes"),
        ({"accelerator": "nvidia-h200", "node_selector": {"node.kubernetes.io/instance-type": "trn1.32xlarge"}},
         "Trainium (trn*) instance types"),
        ({"accelerator": "cpu", "tolerations": [{"operator": "Exists"}]}, "may not tolerate every taint"),
        ({"accelerator": "cpu", "tolerations": [{"key": "aws.amazon.com/neuron", "operator": "Exists"}]},
         "widenTolerations"),
        # every accelerator: no wildcard, no other pool's taint, unless widened
        ({"accelerator": "nvidia-h100", "tolerations": [{"operator": "Exists"}]},
         "a deployment on nvidia-h100 may not tolerate every taint (no key)"),
        ({"accelerator": "nvidia-h200", "tolerations": [{"key": "", "operator": "Exists", "effect": "NoSchedule"}]},
         "a deployment on nvidia-h200 may not tolerate every taint"),
        ({"accelerator": "nvidia-h200", "tolerations": [{"key": "aws.amazon.com/neuron", "operator": "Exists"}]},
         "another accelerator pool's taint (aws.amazon.com/neuron) unless spec.hardware.widenTolerations is true"),
        ({"accelerator": "trainium2", "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
         "a deployment on trainium2 may not tolerate every taint (no key) or another accelerator pool's taint "
         "(nvidia.com/gpu)"),
        # a cpu deployment on a GPU instance type
        *[({"accelerator": "cpu", "node_selector": {"node.kubernetes.io/instance-type": t}},
           "names a GPU instance type") for t in ("p4d.24xlarge", "p5.48xlarge", "g5.xlarge", "g6e.12xlarge",
                                                   "a2-highgpu-1g", "a3-megagpu-8g", "Standard_ND96asr_v4")],
    ]:
        with pytest.raises(ValidationError, match=re.escape(message)):
            HardwareSpec.model_validate(hardware)
