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
    # the libraries the engine imports: compiler hooks, cache folders, hub endpoints
    ("TRITON_CACHE_DIR", "/tmp/evil", "names starting with TRITON_ are reserved"),
    ("TRITON_LIBCUDA_PATH", "/tmp", "names starting with TRITON_ are reserved"),
    ("TORCHINDUCTOR_CACHE_DIR", "/tmp", "names starting with TORCH are reserved"),
    ("TORCH_EXTENSIONS_DIR", "/tmp", "names starting with TORCH are reserved"),
    ("HF_ENDPOINT", "https://mirror.example", "names starting with HF_ are reserved"),
    ("HF_HOME", "/tmp", "names starting with HF_ are reserved"),
    ("TRANSFORMERS_CACHE", "/tmp", "names starting with TRANSFORMERS_ are reserved"),
    # traffic redirected: the HTTP clients' proxies in any case, their trust stores
    ("HTTP_PROXY", "http://10.0.0.9:3128", "names ending in _PROXY (any case) are reserved"),
    ("HTTPS_PROXY", "http://10.0.0.9:3128", "names ending in _PROXY (any case) are reserved"),
    ("ALL_PROXY", "socks5://10.0.0.9", "names ending in _PROXY (any case) are reserved"),
    ("NO_PROXY", "*", "names ending in _PROXY (any case) are reserved"),
    ("http_proxy", "http://10.0.0.9:3128", "names ending in _PROXY (any case) are reserved"),
    ("https_proxy", "http://10.0.0.9:3128", "names ending in _PROXY (any case) are reserved"),
    ("all_proxy", "socks5://10.0.0.9", "names ending in _PROXY (any case) are reserved"),
    ("no_proxy", "*", "names ending in _PROXY (any case) are reserved"),
    ("Https_Proxy", "http://10.0.0.9:3128", "names ending in _PROXY (any case) are reserved"),
    ("SSL_CERT_FILE", "/tmp/ca.pem", "is set or read by the operator, the engine or the runtime"),
    ("SSL_CERT_DIR", "/tmp", "is set or read by the operator, the engine or the runtime"),
    ("REQUESTS_CA_BUNDLE", "/tmp/ca.pem", "is set or read by the operator, the engine or the runtime"),
    ("CURL_CA_BUNDLE", "/tmp/ca.pem", "is set or read by the operator, the engine or the runtime"),
    # code loaded: the compilers Triton builds its launchers with, the loader, the interpreter
    ("CC", "/tmp/cc", "is set or read by the operator, the engine or the runtime"),
    ("CXX", "/tmp/cxx", "is set or read by the operator, the engine or the runtime"),
    ("LD_LIBRARY_PATH", "/tmp", "names starting with LD_ are reserved"),
])
def test_reserved_names_and_literal_credentials_are_refused(name, value, fragment):
    with pytest.raises(ValidationError) as info:
        spec([{"name": name, "value": value}])
    assert fragment in str(info.value)


@pytest.mark.parametrize("name", ["NCCL_DEBUG", "OMP_NUM_THREADS", "MY_APP_FLAG", "PROXY_MODE", "SHAPESHIFT_PDL"])
def test_names_outside_the_reserved_families_are_accepted(name):
    assert spec([{"name": name, "value": "1"}]).engine.env[0].name == name


def test_the_cel_rule_names_every_reserved_family():
    """The API server's twin of reserved_reason: the rule lists each name and prefix, and the proxy
    pattern, and lets the performance switches and HF_TOKEN (from a Secret) through."""
    from shapeshift.engine.contracts import engine_env as policy
    from shapeshift.operator.api.common import RESERVED_ENV_NAMES, EnvVar

    (rule,) = [r["rule"] for r in EnvVar.model_config["json_schema_extra"]["x-kubernetes-validations"]
               if "startsWith('TORCH')" in r["rule"]]
    for prefix in ("TRITON_", "TORCH", "HF_", "TRANSFORMERS_", "LD_", "PYTHON"):
        assert f"!self.name.startsWith('{prefix}')" in rule
    for name in ("CC", "CXX", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        assert name in RESERVED_ENV_NAMES and f"'{name}'" in rule
    assert f"!self.name.matches('{policy.PROXY_NAME_PATTERN}')" in rule
    assert rule.startswith("self.name in [") and "'HF_TOKEN'" in rule.split("||")[0]


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
