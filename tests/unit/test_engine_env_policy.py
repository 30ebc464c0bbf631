"""spec.engine.env's policy (engine/contracts/engine_env.py): every variable the engine, the kernels,
the compile worker and the operator read is either one of the engine's documented performance
switches or reserved; credentials come from Secrets; only performance switches reach a
ForwardPass or count in the rollout's comparison."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from shapeshift.engine.compile.worker import engine_env
from shapeshift.engine.contracts.engine_env import PERFORMANCE_ENV, reserved_reason
from shapeshift.operator import builders
from shapeshift.operator.api import InferenceDeploymentSpec

ROOT = Path(__file__).resolve().parents[2]
_READ = re.compile(r"""(?:environ\.get|getenv|environ\.setdefault|environ\[)\(?\s*["']([A-Z][A-Z0-9_]*)["']"""
                   r"""|["']([A-Z][A-Z0-9_]*)["']\s+(?:not\s+)?in\s+os\.environ""")


def spec(env):
    return InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"},
                                                   "engine": {"env": env}})


def test_every_variable_the_code_reads_is_a_performance_switch_or_reserved():
    read: dict[str, str] = {}
    for folder in ("engine", "kernels", "operator"):
        for path in (ROOT / folder).rglob("*.py"):
            for match in _READ.finditer(path.read_text()):
                read.setdefault(match.group(1) or match.group(2), str(path.relative_to(ROOT)))
    assert {"SHAPESHIFT_ADMIN_TOKEN", "SHAPESHIFT_PDL", "KUBECONFIG", "RANK"} <= read.keys()
    loose = {name: where for name, where in read.items() if name not in PERFORMANCE_ENV and reserved_reason(name) is None}
    assert not loose, ("read by the code but neither reserved nor a documented performance switch (add it to "
                       f"engine/contracts/engine_env.py): {loose}")


@pytest.mark.parametrize("name, value, fragment", [
    ("SHAPESHIFT_ADMIN_TOKEN", "s3cret", "spec.engine.env[].name is reserved"),
    ("SHAPESHIFT_CACHE", "/tmp", "not one of the engine's performance switches"),
    ("LD_PRELOAD", "/tmp/x.so", "names starting with LD_ are reserved"),
    ("PYTHONPATH", "/tmp", "names starting with PYTHON are reserved"),
    ("CUDA_VISIBLE_DEVICES", "1", "names starting with CUDA_ are reserved"),
    ("NCCL_NET_PLUGIN", "evil", "reserved"),
    ("KUBERNETES_SERVICE_HOST", "10.0.0.1", "reserved"),
    ("HF_TOKEN", "hf_abc", "spec.engine.env[].valueFrom.secretKeyRef: HF_TOKEN looks like a credential"),
])
def test_reserved_names_and_literal_credentials_are_refused(name, value, fragment):
    with pytest.raises(ValidationError) as info:
        spec([{"name": name, "value": value}])
    assert fragment in str(info.value)


def test_a_credential_from_a_secret_reaches_the_engine_pod_only():
    s = spec([{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
              {"name": "SHAPESHIFT_PDL", "value": "0"}, {"name": "NCCL_DEBUG", "value": "WARN"}])
    parent = builders.Parent("InferenceDeployment", "llama", "team-a", "uid-1")
    (engine,) = builders.build_engine_deployment(parent, s)["spec"]["template"]["spec"]["containers"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in engine["env"]
    assert "hf_" not in str(engine)
    with pytest.raises(ValidationError, match="set value or valueFrom, not both"):
        spec([{"name": "DEBUG_LEVEL", "value": "1", "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}}}])


def test_only_performance_switches_are_copied_into_a_forward_pass():
    environ = {"SHAPESHIFT_ENGINE_ENV_NAMES": "NCCL_DEBUG,SHAPESHIFT_PDL,SHAPESHIFT_GEMV_PREFETCH",
               "NCCL_DEBUG": "WARN", "SHAPESHIFT_PDL": "0", "SHAPESHIFT_GEMV_PREFETCH": "1"}
    assert engine_env(environ) == [{"name": "SHAPESHIFT_GEMV_PREFETCH", "value": "1"},
                                   {"name": "SHAPESHIFT_PDL", "value": "0"}]
    assert engine_env({}) is None
