"""The metric-names contract (engine/contracts/metric_names.py) is what a server exports."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from shapeshift.engine.contracts import metric_names
from shapeshift.engine.serving.metrics import EngineMetrics


def exported_series() -> set[str]:
    metrics = EngineMetrics("m")
    metrics.set_forward_pass("stock", "0" * 64)
    body, _content_type = metrics.render()
    text = body.decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


# Exported only where the served model is a mixture of experts (tests/engine/test_expert_routing.py).
MOE_ONLY = {"EXPERT_ROUTED_TOKENS"}


def contract_names() -> dict[str, str]:
    return {k: v for k, v in vars(metric_names).items()
            if isinstance(v, str) and v.startswith("shapeshift_") and k != "PREFIX" and k not in MOE_ONLY}


def test_every_contract_series_is_exported():
    series = exported_series()
    missing = {}
    for const, name in contract_names().items():
        candidates = {name, f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        if not candidates & series:
            missing[const] = name
    assert not missing, f"named in metric_names.py but not exported by EngineMetrics: {missing}"


def test_every_exported_series_is_in_the_contract():
    names = set(contract_names().values())
    stems = {s.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for s in exported_series()}
    stray = sorted(s for s in stems if s.startswith("shapeshift_") and s not in names
                   and not s.endswith("_created"))
    assert not stray, f"exported but missing from engine/contracts/metric_names.py: {stray}"


def test_client_name_strips_what_prometheus_client_appends():
    assert metric_names.client_name(metric_names.REQUESTS) == "shapeshift_requests"
    assert metric_names.client_name(metric_names.FORWARD_PASS_INFO) == "shapeshift_forward_pass"
    assert metric_names.client_name(metric_names.PROMPT_TOKENS) == metric_names.PROMPT_TOKENS
