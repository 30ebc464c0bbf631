"""The traffic profile's expert-routing histogram: validation, distance, backward compatibility."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from shapeshift.engine.contracts.expert_routing import ExpertRouting, LayerRouting
from shapeshift.engine.contracts.traffic_profile import TrafficProfile, builtin_profile


def test_shares_must_be_non_negative_and_sum_to_one_per_layer():
    LayerRouting(layer=0, shares=[0.25, 0.25, 0.5, 0.0])
    with pytest.raises(ValidationError, match="sum to 1"):
        LayerRouting(layer=0, shares=[0.25, 0.25, 0.25, 0.0])
    with pytest.raises(ValidationError):
        LayerRouting(layer=0, shares=[1.5, -0.5])
    with pytest.raises(ValidationError, match="increasing layer index"):
        ExpertRouting(layers=[LayerRouting(layer=1, shares=[1.0, 0.0]), LayerRouting(layer=0, shares=[0.5, 0.5])])
    with pytest.raises(ValidationError, match="as many shares as experts"):
        ExpertRouting(layers=[LayerRouting(layer=0, shares=[1.0, 0.0]), LayerRouting(layer=1, shares=[1.0, 0, 0])])


def test_from_counts_and_distance():
    a = ExpertRouting.from_counts({0: [10, 10, 0, 0], 1: [5, 5, 5, 5], 2: [0, 0, 0, 0]})
    assert a.shares() == {0: [0.5, 0.5, 0.0, 0.0], 1: [0.25] * 4}  # a layer that routed nothing is left out
    assert a.routed_tokens == 20
    b = ExpertRouting.from_counts({0: [0, 0, 10, 10], 1: [5, 5, 5, 5]})
    d = a.distance(b)
    assert d.per_layer == {0: 1.0, 1: 0.0} and d.max == 1.0 and d.worst_layer == 0
    assert not d.representative(0.5) and a.distance(a).representative(0.0)
    assert ExpertRouting.from_counts({0: [0, 0]}) is None
    with pytest.raises(ValueError, match="different models"):
        a.distance(ExpertRouting.from_counts({0: [1, 1]}))


def test_profiles_without_routing_stay_valid_and_the_field_round_trips():
    old = builtin_profile("chat").to_dict()
    assert "expertRouting" not in old
    assert TrafficProfile.model_validate(old).expert_routing is None
    routing = ExpertRouting.from_counts({0: [3, 1, 0, 0], 1: [1, 1, 1, 1]})
    profile = builtin_profile("chat").model_copy(update={"expert_routing": routing})
    wire = yaml.safe_load(profile.to_yaml())
    assert wire["expertRouting"]["layers"][0] == {"layer": 0, "shares": [0.75, 0.25, 0.0, 0.0]}
    again = TrafficProfile.model_validate(wire)
    assert again.expert_routing == routing
    assert again.scaled(0.5).expert_routing == routing  # lengths scale, routing does not
    wire["expertRouting"]["layers"][0]["shares"] = [0.75, 0.75, 0.0, 0.0]
    with pytest.raises(ValidationError, match="sum to 1"):
        TrafficProfile.model_validate(wire)
