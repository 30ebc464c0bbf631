"""The regime buckets beyond prompt length, hit rate and concurrency, and where traffic counts when
its own bucket has no regime (engine/contracts/traffic_regime.py, operator/regimes.py place).

Median output length is a bucket of its own; mixture-of-experts traffic with a routing histogram
adds its dominant experts. A regime recorded under a key from before those buckets (p0-h0-c1)
still takes the traffic of its cell, pins under either form name the same regime, and traffic
just across a bucket edge from a known regime counts in that regime (NEAR_DISTANCE).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from shapeshift.engine.contracts.expert_routing import ExpertRouting, LayerRouting
from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile
from shapeshift.engine.contracts.traffic_regime import NEAR_DISTANCE, TrafficPoint, TrafficRegime, routing_signature
from shapeshift.operator.api import InferenceDeploymentSpec, InferenceDeploymentStatus, RegimeStatus
from shapeshift.operator.regimes import (RegimeLibrary, decide, place, record_champion, regime_distance, regime_key,
                                         same_regime, target_forward_pass)

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
CHECK = timedelta(seconds=60)


def profile(p50: int, hit: float = 0.0, concurrency: int = 4, output: int = 16,
            routing: ExpertRouting | None = None) -> TrafficProfile:
    return TrafficProfile(prompt_length=LengthDistribution(p50=p50, p90=p50 + 10, p99=p50 + 20),
                          output_length=LengthDistribution(p50=output, p90=output, p99=output),
                          prefix_cache_hit_rate=hit, concurrency=concurrency, expert_routing=routing)


def routing(*hot: int, experts: int = 8, layers: int = 2) -> ExpertRouting:
    """Half the tokens to the ``hot`` experts (evenly), the rest spread over all."""
    rest = 0.5 if hot else 1.0
    shares = [rest / experts + (0.5 / len(hot) if e in hot else 0.0) for e in range(experts)]
    return ExpertRouting(layers=[LayerRouting(layer=i, shares=shares) for i in range(layers)])


def spec(**extra) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({
        "model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "engine": {"dtype": "float32"},
        **extra})


def forward_pass(name: str, sha: str) -> dict:
    return {"metadata": {"name": name}, "spec": {
        "model": {"name": "tiny-llama", "dtype": "float32"}, "hardware": {"accelerator": "cpu"},
        "artifact": {"uri": f"/var/lib/shapeshift-artifacts/{sha}.tar.gz", "sha256": sha}, "metrics": {"speedup": 1.4}}}


def run(library: RegimeLibrary, traffic: TrafficProfile, at: datetime, s=None, active=None):
    return decide(library, traffic, spec=s or spec(), now=at, interval=CHECK, active_forward_pass=active)


def test_the_median_output_length_is_a_bucket():
    assert regime_key(profile(100, output=16)) == "p0-h0-c1-o0"
    assert regime_key(profile(100, output=64)) == "p0-h0-c1-o0"  # <=64, <=256, <=1k, <=4k, longer
    assert regime_key(profile(100, output=200)) == "p0-h0-c1-o1"
    assert regime_key(profile(100, output=5000)) == "p0-h0-c1-o4"
    assert regime_distance("p0-h0-c1-o0", "p0-h0-c1-o3") == 3
    assert TrafficRegime.parse("p0-h0-c1-o1") == TrafficRegime.of(profile(100, output=200))
    # short chat answers and long generations of the same prompts are two regimes
    lib = run(RegimeLibrary(), profile(100, output=16), T0).library
    d = run(lib, profile(100, output=800), T0 + CHECK)
    assert d.regime == "p0-h0-c1-o2" and d.kind == "Settling"
    assert d.library.get("p0-h0-c1-o2").output_length_p50 == 800


def test_moe_traffic_adds_its_dominant_experts():
    assert routing_signature(None) is None
    assert routing_signature(routing()) == "u"  # spread evenly: no dominant expert
    assert routing_signature(routing(3)) == "3"
    assert routing_signature(routing(5, 3)) == "3.5"
    assert routing_signature(routing(1, 4, 6, experts=16)) == "1.4"  # at most two, the largest (ties: lower index)
    assert routing_signature(routing(1, 4, 6)) == "u"  # 8 experts: 0.23 each, under twice the uniform 0.125
    hot_3, hot_6 = profile(100, routing=routing(3)), profile(100, routing=routing(6))
    assert regime_key(hot_3) == "p0-h0-c1-o0-e3" and regime_key(hot_6) == "p0-h0-c1-o0-e6"
    assert regime_key(profile(100)) == "p0-h0-c1-o0"  # dense: no routing part
    assert regime_key(profile(100, routing=routing())) == "p0-h0-c1-o0-eu"
    assert TrafficRegime.parse("p0-h0-c1-o0-e3.5").experts == "3.5"
    assert regime_distance("p0-h0-c1-o0-e3", "p0-h0-c1-o0-e6") == 1
    assert TrafficPoint.of(hot_3).distance(TrafficPoint.of(hot_6)) == 1.0  # never near
    # the status and the pins take the longest names
    InferenceDeploymentSpec.model_validate({**spec().to_wire(), "regimes": {"pin": "p5-h2-c4-o4-e1023.1022"}})
    with pytest.raises(ValueError):
        spec(regimes={"pin": "p0-h0-c1-o0-e3.5.7"})
    # other experts are another regime: its own compile, not the first one's champion
    lib = run(RegimeLibrary(), hot_3, T0).library
    lib = record_champion(lib, regime_key(hot_3), forward_pass("fp-3", "3" * 64), "run-3", T0)
    for i in range(2):
        d = run(lib, hot_6, T0 + (1 + i) * CHECK, active="fp-3")
        lib = d.library
    assert d.kind == "Compile" and d.regime == "p0-h0-c1-o0-e6"


def test_a_regime_recorded_under_an_older_key_still_takes_its_traffic():
    """Status written before the output bucket existed: regime p0-h0-c1 with its champion. Traffic
    of that cell (any output length) counts in it and switches back to its champion; pins under
    either name are one regime."""
    old = RegimeStatus(name="p0-h0-c1", prompt_length_p50=100, prefix_cache_hit_rate=0.0, concurrency=4,
                       first_seen=T0, last_seen=T0, checks=3, visits=1)
    lib = RegimeLibrary().put(old)
    lib = record_champion(lib, "p0-h0-c1", forward_pass("fp-old", "a" * 64), "run-old", T0)
    status = InferenceDeploymentStatus.model_validate({"regimes": [r.to_wire() for r in lib.regimes]})
    lib = RegimeLibrary.of(status)
    assert TrafficRegime.parse("p0-h0-c1").covers(TrafficRegime.parse("p0-h0-c1-o3"))
    assert not TrafficRegime.parse("p0-h0-c1-o0").covers(TrafficRegime.parse("p0-h0-c1-o3"))
    assert place(lib, profile(120, output=300)).key == "p0-h0-c1"
    # B elsewhere, then back in the old regime's cell: a switch to its champion, no CompileRun
    lib = run(lib, profile(120), T0 + CHECK).library  # the first regime observed is where the deployment is
    for i in range(2):
        lib = run(lib, profile(3000, 0.8), T0 + (2 + i) * CHECK, active="fp-old").library
    assert lib.current.name == "p2-h2-c1-o0"
    kinds = []
    for i in range(2):
        d = run(lib, profile(120, output=300), T0 + (4 + i) * CHECK, active="fp-b")
        lib = d.library
        kinds.append(d.kind)
    assert kinds == ["Settling", "Switch"] and d.regime == "p0-h0-c1" and d.champion.forward_pass == "fp-old"
    assert "which regime p0-h0-c1 (an older key) covers" in d.reason
    assert "p0-h0-c1-o1" not in {r.name for r in lib.regimes}  # no new regime beside the old one
    # pins: an old name and a new one name the same regime
    assert same_regime("p0-h0-c1", "p0-h0-c1-o1") and same_regime("p0-h0-c1-o1", "p0-h0-c1")
    assert not same_regime("p0-h0-c1-o0", "p0-h0-c1-o1") and not same_regime("p0-h0-c1", "p0-h0-c2")
    d = run(lib, profile(3000, 0.8), T0 + 10 * CHECK, s=spec(regimes={"pin": "p0-h0-c1-o1"}), active="fp-old")
    assert d.kind == "Pinned" and d.champion.forward_pass == "fp-old" and d.blocks_compile
    assert "spec.regimes.pin holds regime p0-h0-c1-o1 (champion fp-old" in d.reason
    pinned = spec(regimes={"champions": [{"regime": "p0-h0-c1-o1", "forwardPass": "fp-hand"}]})
    assert target_forward_pass(pinned, InferenceDeploymentStatus.model_validate(lib.to_wire()), None) == "fp-hand"


def test_traffic_just_across_a_bucket_edge_counts_in_the_known_regime():
    """Regime X's traffic had a median prompt of 240 tokens (bucket p0). Traffic at 300 (bucket p1,
    which has no regime) is a fifth of a bucket width from it: it counts in X and gets X's champion;
    traffic at 700 is further than NEAR_DISTANCE: a new regime."""
    x_traffic = profile(240)
    key_x = regime_key(x_traffic)
    lib = run(RegimeLibrary(), x_traffic, T0).library
    lib = record_champion(lib, key_x, forward_pass("fp-x", "a" * 64), "run-x", T0)
    near, far = profile(300), profile(700)
    assert regime_key(near) != key_x
    # log(300 / 240) / log(4): prompt buckets are 4x apart
    assert regime_distance(near, lib.get(key_x)) == pytest.approx(0.161, abs=1e-3)
    assert regime_distance(far, lib.get(key_x)) == pytest.approx(0.772, abs=1e-3)
    assert regime_distance(near, lib.get(key_x)) <= NEAR_DISTANCE < regime_distance(far, lib.get(key_x))
    assert regime_distance(regime_key(near), key_x) == 1  # keys alone: a bucket apart
    placed = place(lib, near)
    assert (placed.key, placed.bucket, placed.distance) == (key_x, regime_key(near), pytest.approx(0.161, abs=1e-3))
    # in B for a while, then the near traffic: a switch back to fp-x within two checks, no compile
    for i in range(2):
        lib = run(lib, profile(3000, 0.8), T0 + (1 + i) * CHECK, active="fp-x").library
    kinds = []
    for i in range(2):
        d = run(lib, near, T0 + (3 + i) * CHECK, active="fp-b")
        lib = d.library
        kinds.append(d.kind)
    assert kinds == ["Settling", "Switch"] and d.champion.forward_pass == "fp-x", (kinds, d.reason)
    assert f"0.16 bucket widths from regime {key_x}'s last observed traffic (at most 0.5)" in d.reason
    assert d.library.current.reason == d.reason
    # X's anchor stays where its own bucket's traffic put it: nearby traffic does not move it
    assert lib.get(key_x).prompt_length_p50 == 240 and regime_key(near) not in {r.name for r in lib.regimes}
    # far traffic: its own regime, compiled
    for i in range(2):
        d = run(lib, far, T0 + (5 + i) * CHECK, active="fp-x")
        lib = d.library
    assert d.kind == "Compile" and d.regime == regime_key(far) and "bucket widths" not in d.reason
    # once its bucket has a regime, traffic there counts in it, however near another regime's is
    assert place(lib, profile(300)).key == regime_key(far)


def test_the_champion_registry_reads_old_and_new_labels():
    from shapeshift.engine.compile.champions import ClusterRegistry, rank

    class Api:
        def __init__(self, items):
            self.items = items

        def list_namespaced_custom_object(self, *args):
            return {"items": self.items}

    def obj(name: str, label: str) -> dict:
        return {"metadata": {"name": name, "labels": {"shapeshift.dev/regime": label, "shapeshift.dev/hardware": "cpu",
                                                      "shapeshift.dev/model-signature": "sig"}},
                "spec": {"model": {"name": "tiny-llama"}, "artifact": {"sha256": "a" * 64, "uri": "/x"}}}

    entries = ClusterRegistry(Api([obj("old", "p1-h0-c2"), obj("new", "p1-h0-c2-o3"),
                                   obj("moe", "p1-h0-c2-o0-e3")]), "ns").entries()
    regimes = {e.name: TrafficRegime(**e.regime) for e in entries}
    assert regimes == {"old": TrafficRegime(1, 0, 2), "new": TrafficRegime(1, 0, 2, 3),
                       "moe": TrafficRegime(1, 0, 2, 0, "3")}
    # the nearest: an old entry counts only the dimensions it knows, dense traffic no routing
    wanted = profile(600, concurrency=16, output=16)  # p1-h0-c2-o0
    ranked = [e.name for e in rank(entries, "sig", "cpu", wanted, None, 3)]
    assert set(ranked[:2]) == {"old", "moe"} and ranked[2] == "new"
