"""The regime library's decisions (operator/regimes.py), without a cluster.

Traffic A (short prompts, no prefix hits) and B (long prompts, many hits) on a cpu deployment
of tiny-llama: a new regime is compiled, a known one with a verified champion is switched to
after the switch checks, flapping between them inside the hysteresis switches nothing, a
cooldown separates switches, stale or foreign champions are compiled again, pins win.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from shapeshift.engine.contracts.traffic_regime import TrafficRegime
from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile
from shapeshift.operator.api import (REGIMES_KEPT, InferenceDeploymentSpec, InferenceDeploymentStatus,
                                     RegimeStatus)
from shapeshift.operator.regimes import (RegimeLibrary, decide, engine_env_sha256, record_champion,
                                         record_compile_run, regime_distance, regime_key, target_forward_pass)

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
CHECK = timedelta(seconds=60)
SHA_A, SHA_B = "a" * 64, "b" * 64


def profile(p50: int, hit: float, concurrency: int = 4) -> TrafficProfile:
    return TrafficProfile(prompt_length=LengthDistribution(p50=p50, p90=p50 + 10, p99=p50 + 20),
                          output_length=LengthDistribution(p50=16, p90=16, p99=16),
                          prefix_cache_hit_rate=hit, concurrency=concurrency)


A, B = profile(100, 0.0), profile(2000, 0.8)
KEY_A, KEY_B = regime_key(A), regime_key(B)


def spec(**extra) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({
        "model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "engine": {"dtype": "float32"},
        **extra})


def forward_pass(name: str, sha: str, accelerator: str = "cpu", dtype: str = "float32", env=None,
                 config: str | None = None) -> dict:
    model = {"name": "tiny-llama", "dtype": dtype, **({"configSha256": config} if config else {})}
    body = {"metadata": {"name": name}, "spec": {
        "model": model, "hardware": {"accelerator": accelerator},
        "artifact": {"uri": f"/var/lib/shapeshift-artifacts/{sha}.tar.gz", "sha256": sha}, "metrics": {"speedup": 1.4}}}
    if env is not None:
        body["spec"]["engine"] = {"env": env}
    return body


def run(library: RegimeLibrary, traffic: TrafficProfile, at: datetime, s=None, active=None):
    return decide(library, traffic, spec=s or spec(), now=at, interval=CHECK, active_forward_pass=active)


def library_with_champions(**fp_over) -> RegimeLibrary:
    """A and B seen, each compiled (champions fp-a, fp-b), traffic served in B by fp-b."""
    lib = RegimeLibrary()
    lib = run(lib, A, T0).library
    lib = record_champion(record_compile_run(lib, KEY_A, "run-a", T0), KEY_A, forward_pass("fp-a", SHA_A, **fp_over),
                          "run-a", T0 + CHECK)
    at = T0 + 2 * CHECK
    for i in range(2):
        lib = run(lib, B, at + i * CHECK).library
    lib = record_champion(lib, KEY_B, forward_pass("fp-b", SHA_B), "run-b", at + 2 * CHECK)
    return lib


def test_regime_keys_are_the_champion_registrys():
    for traffic in (A, B, profile(5000, 0.3, 64), profile(70000, 1.0, 500), profile(1, 0.2, 1)):
        assert regime_key(traffic) == TrafficRegime.of(traffic).key
    assert KEY_A != KEY_B
    assert regime_distance(KEY_A, KEY_B) == TrafficRegime.of(A).distance(TrafficRegime.of(B)) == 4
    # The buckets themselves: median prompt <=256/1k/4k/16k/64k, hit rate <=0.2/0.6, concurrency
    # <=1/8/32/128, median output <=64/256/1k/4k (16 tokens here: o0).
    assert regime_key(profile(5000, 0.3, 64)) == "p3-h1-c3-o0"
    assert regime_key(profile(70000, 1.0, 500)) == "p5-h2-c4-o0"
    assert regime_key(profile(1, 0.2, 1)) == "p0-h0-c0-o0"
    assert TrafficRegime.parse("p3-h1-c3-o0") == TrafficRegime.of(profile(5000, 0.3, 64))
    with pytest.raises(ValueError, match="not like p1-h0-c2"):
        TrafficRegime.parse("chat")


def test_a_new_regime_is_compiled_and_its_first_check_only_settles():
    lib = run(RegimeLibrary(), A, T0).library  # the first regime is where the deployment is
    assert lib.current.name == KEY_A
    first = run(lib, B, T0 + CHECK)
    assert first.kind == "Settling" and first.blocks_compile  # no compile before the traffic settled
    assert "1 of 2 checks" in first.reason
    second = run(first.library, B, T0 + 2 * CHECK)
    assert second.kind == "Compile" and not second.blocks_compile
    assert f"new regime {KEY_B}" in second.reason
    assert second.library.current.name == KEY_B
    entry = second.library.get(KEY_B)
    assert entry.checks == 2 and entry.visits == 1 and entry.first_seen == T0 + CHECK and entry.dwell_seconds == 120
    assert entry.prompt_length_p50 == 2000 and entry.prefix_cache_hit_rate == 0.8


def test_back_to_a_known_regime_switches_to_its_champion_after_the_switch_checks():
    lib = library_with_champions()
    at = T0 + 10 * CHECK
    first = run(lib, A, at, active="fp-b")
    assert first.kind == "Settling" and first.blocks_compile  # a champion waits: no compile meanwhile
    second = run(first.library, A, at + CHECK, active="fp-b")
    assert second.kind == "Switch" and second.blocks_compile
    assert second.champion.forward_pass == "fp-a" and second.champion.sha256 == SHA_A
    assert "no CompileRun" in second.reason and "x1.40" in second.reason
    current = second.library.current
    assert (current.name, current.forward_pass, current.sha256, current.last_switch_time) == (
        KEY_A, "fp-a", SHA_A, at + CHECK)
    # the switch is what the rollout runs, until a CompileRun finishes later
    status = InferenceDeploymentStatus.model_validate(second.library.to_wire())
    assert target_forward_pass(spec(), status, ("2026-12-01T12:05:00Z", "fp-b")) == "fp-a"
    assert target_forward_pass(spec(), status, ("2026-12-01T13:00:00Z", "fp-new")) == "fp-new"
    assert target_forward_pass(spec(forwardPass="mine"), status, None) == "mine"
    # the next check in A stays
    third = run(second.library, A, at + 2 * CHECK, active="fp-a")
    assert third.kind == "Stay" and third.blocks_compile and third.library.current.forward_pass == "fp-a"


def test_flapping_inside_the_hysteresis_window_switches_nothing():
    lib = library_with_champions()
    at = T0 + 10 * CHECK
    kinds = []
    for i in range(8):
        decision = run(lib, A if i % 2 == 0 else B, at + i * CHECK, active="fp-b")
        lib = decision.library
        kinds.append(decision.kind)
    assert "Switch" not in kinds and lib.current.forward_pass is None
    assert set(kinds) <= {"Settling", "Stay"}


def test_min_dwell_holds_a_switch_until_the_traffic_sat_there_long_enough():
    lib = library_with_champions()
    s = spec(regimes={"switchChecks": 1, "minDwellSeconds": 150})
    at = T0 + 10 * CHECK
    decisions = []
    for i in range(4):
        d = run(lib, A, at + i * CHECK, s=s, active="fp-b")
        lib, _ = d.library, decisions.append(d.kind)
    assert decisions[:3] == ["Settling", "Settling", "Settling"] and decisions[3] == "Switch"


def test_a_cooldown_separates_two_switches():
    lib = library_with_champions()
    s = spec(regimes={"switchCooldownSeconds": 600})
    at = T0 + 10 * CHECK
    for i in range(2):
        d = run(lib, A, at + i * CHECK, s=s, active="fp-b")
        lib = d.library
    assert d.kind == "Switch"
    kinds = []
    for i in range(2, 12):
        d = run(lib, B, at + i * CHECK, s=s, active="fp-a")
        lib = d.library
        kinds.append(d.kind)
    # B settled on its second check (i=3), cooled down until 600 s after the switch (i=1 -> i=11)
    assert kinds[:1] == ["Settling"] and set(kinds[1:9]) == {"CoolingDown"} and kinds[9] == "Switch", kinds
    assert lib.current.forward_pass == "fp-b"


def test_inside_a_cooldown_a_regime_whose_champion_is_served_stays_and_every_switch_waits():
    """Back in the served regime during a cooldown: Stay (no switch to hold, so no CoolingDown);
    traffic in the current regime whose champion is not the one served (the library moved off it
    before): a switch like any other, held by the cooldown until it ends."""
    lib = library_with_champions()
    s = spec(regimes={"switchCooldownSeconds": 600, "switchChecks": 1})
    at = T0 + 10 * CHECK
    d = run(lib, A, at, s=s, active="fp-b")
    assert d.kind == "Switch" and d.library.current.forward_pass == "fp-a"
    lib = d.library
    d = run(lib, B, at + CHECK, s=s, active="fp-a")  # settled in B, inside the cooldown
    assert d.kind == "CoolingDown" and "spec.regimes.switchCooldownSeconds" in d.reason
    lib = d.library
    d = run(lib, A, at + 2 * CHECK, s=s, active="fp-a")  # back in A: fp-a is served
    assert d.kind == "Stay" and d.library.current.forward_pass == "fp-a", (d.kind, d.reason)
    lib = d.library
    # The current regime is A, but (a rollout put) fp-b in service: the way back to fp-a is a switch
    # the cooldown holds, and once it ends, the switch happens.
    served = replace(lib, current=lib.current.model_copy(update={"forward_pass": "fp-b", "sha256": SHA_B}))
    d = run(served, A, at + 3 * CHECK, s=s, active="fp-b")
    assert d.library.current.name == KEY_A and d.kind == "CoolingDown", (d.kind, d.reason)
    d = run(served, A, at + 11 * CHECK, s=s, active="fp-b")
    assert d.kind == "Switch" and d.library.current.forward_pass == "fp-a", (d.kind, d.reason)


@pytest.mark.parametrize("over, fragment", [
    ({"accelerator": "nvidia-h100"}, "verified on nvidia-h100"),
    ({"dtype": "bfloat16"}, "verified in bfloat16"),
    ({"env": [{"name": "SHAPESHIFT_PDL", "value": "0"}]}, "another spec.engine.env"),
])
def test_a_champion_verified_for_something_else_is_compiled_again(over, fragment):
    lib = library_with_champions(**over)
    at = T0 + 10 * CHECK
    for i in range(2):
        d = run(lib, A, at + i * CHECK, active="fp-b")
        lib = d.library
    assert d.kind == "Compile" and fragment in d.reason and not d.blocks_compile


def test_a_stale_champion_is_compiled_again():
    lib = library_with_champions()
    s = spec(regimes={"championMaxAgeSeconds": 3600})
    at = T0 + timedelta(hours=3)
    for i in range(2):
        d = run(lib, A, at + i * CHECK, s=s, active="fp-b")
        lib = d.library
    assert d.kind == "Compile" and "stale" in d.reason


def test_pins_win_over_the_library():
    lib = library_with_champions()
    at = T0 + 10 * CHECK
    # spec.regimes.pin: the pinned regime's champion, whatever the traffic (no hysteresis)
    d = run(lib, A, at, s=spec(regimes={"pin": KEY_B}), active="fp-b")
    assert d.kind == "Pinned" and d.blocks_compile and d.library.current.forward_pass is None
    d = run(lib, B, at, s=spec(regimes={"pin": KEY_A}), active="fp-b")
    assert d.kind == "Switch" and d.champion.forward_pass == "fp-a" and "spec.regimes.pin" in d.reason
    # a pinned regime without a champion holds everything, saying so
    d = run(lib, A, at, s=spec(regimes={"pin": "p4-h2-c4"}), active="fp-b")
    assert d.kind == "Pinned" and d.blocks_compile and "not in the library" in d.reason
    # spec.forwardPass: nothing is switched; the drift path compiles as it did
    d = run(lib, A, at, s=spec(forwardPass="mine"), active="mine")
    assert d.kind == "Pinned" and not d.blocks_compile
    # a pinned champion is the rollout's target in its regime
    pinned = spec(regimes={"champions": [{"regime": KEY_B, "forwardPass": "fp-hand"}]})
    status = InferenceDeploymentStatus.model_validate(lib.to_wire())
    assert target_forward_pass(pinned, status, ("2026-12-01T13:00:00Z", "fp-new")) == "fp-hand"
    with pytest.raises(ValueError, match="at most once"):
        spec(regimes={"champions": [{"regime": KEY_B, "forwardPass": "x"}, {"regime": KEY_B, "forwardPass": "y"}]})
    with pytest.raises(ValueError, match="set one of them"):
        spec(forwardPass="mine", regimes={"pin": KEY_A})


def test_no_data_changes_nothing_and_the_library_keeps_its_size():
    lib = library_with_champions()
    d = decide(lib, None, spec=spec(), now=T0 + 10 * CHECK, interval=CHECK)
    assert d.kind == "NoData" and d.library == lib
    lib = lib.put(RegimeStatus(name="p9-h1-c9"))  # never seen (a run's record without times)
    for i in range(REGIMES_KEPT + 4):
        lib = lib.put(RegimeStatus(name=f"p{i}-h0-c9", last_seen=T0 + i * CHECK))
    names = {r.name for r in lib.regimes}
    assert len(lib.regimes) == REGIMES_KEPT and {KEY_A, KEY_B} <= names  # champions are kept longest
    assert "p9-h1-c9" not in names and "p0-h0-c9" not in names


def test_engine_env_digest_counts_only_performance_switches():
    assert engine_env_sha256(None) == engine_env_sha256([{"name": "MY_APP_FLAG", "value": "1"}])
    assert engine_env_sha256([{"name": "SHAPESHIFT_PDL", "value": "0"}]) != engine_env_sha256([])


def test_compile_economics_by_hand():
    from shapeshift.operator.regimes import economics

    def cost_of(served: float | None, speedup: float | None = 1.25, serving: int = 8, **times):
        return economics(started=times.get("started", T0), completed=times.get("completed", T0 + timedelta(minutes=30)),
                         compile_accelerators=2, speedup=speedup, served_tokens_per_second=served,
                         baseline_tokens_per_second_per_accelerator=500.0, serving_accelerators=serving)

    # 2 accelerators for 30 min; 4000 tokens/s served keep 4000 / 500 = 8 accelerators busy at the old
    # speed, 8 / 1.25 = 6.4 at x1.25: 1.6 accelerator-seconds saved per second, 38.4 accelerator-hours a day
    cost = cost_of(4000.0)
    assert cost.compile_accelerator_seconds == 3600.0
    assert cost.saved_accelerator_seconds_per_hour == pytest.approx(1.6 * 3600)
    assert cost.saved_accelerator_hours_per_day == pytest.approx(38.4)
    assert cost.payback_seconds == pytest.approx(3600 / 1.6)  # 2250 s of serving in the regime
    assert cost.payback_hours == pytest.approx(2250 / 3600)
    # the per-day and hourly figures are the same numbers in other units, never computed apart
    assert cost.saved_accelerator_hours_per_day * 150 == pytest.approx(cost.saved_accelerator_seconds_per_hour)
    assert cost.payback_hours * 3600 == pytest.approx(cost.payback_seconds)
    lib = record_champion(RegimeLibrary(), KEY_A, forward_pass("fp-a", SHA_A), "run-a", T0, cost)
    champion = lib.get(KEY_A).champion
    assert (champion.compile_accelerator_seconds, champion.payback_seconds) == (3600.0, 2250.0)
    # a quarter of the load saves a quarter; more load than the pods' replay throughput saves at most
    # what the serving accelerators are
    assert cost_of(1000.0).saved_accelerator_hours_per_day == pytest.approx(9.6)
    assert cost_of(10_000.0).saved_accelerator_hours_per_day == pytest.approx(38.4)
    # no faster than the default, or no traffic: never pays back; unknown times or rate: unknown
    assert cost_of(4000.0, speedup=1.0).payback_seconds is None
    assert cost_of(0.0).payback_hours is None and cost_of(0.0).saved_accelerator_hours_per_day == 0.0
    assert cost_of(None).saved_accelerator_hours_per_day is None and cost_of(None).payback_hours is None
    assert cost_of(4000.0, started=None).compile_accelerator_seconds is None


def test_economics_inputs_from_the_job_and_the_champion():
    from shapeshift.operator.api import CompileEconomics
    from shapeshift.operator.compile_economics import baseline_per_accelerator, job_times, of_record
    from shapeshift.operator.prometheus import SeriesSelector
    from shapeshift.operator.served_rate import served_rate_query

    job = {"status": {"startTime": "2026-12-01T12:00:00Z", "conditions": [
        {"type": "Complete", "status": "True", "lastTransitionTime": "2026-12-01T12:10:00Z"}]}}
    assert job_times(job, {}) == (T0, T0 + timedelta(minutes=10), None)
    start, end, note = job_times(None, {"startTime": "2026-12-01T12:00:00Z", "completionTime": "2026-12-01T12:01:00Z"})
    assert (start, end) == (T0, T0 + CHECK) and "Job is gone" in note
    metrics = {"speedup": 1.25, "tokensPerSecond": 1250.0}
    assert baseline_per_accelerator({"spec": {"metrics": {**metrics, "baselineTokensPerSecond": 1000.0},
                                              "hardware": {"count": 2}}}) == 500.0
    assert baseline_per_accelerator({"spec": {"metrics": metrics}}) == 1000.0  # tokensPerSecond / speedup
    assert baseline_per_accelerator({"spec": {"metrics": {"speedup": 1.25}}}) is None
    record = CompileEconomics(accelerators=2, job_start_time=T0, job_completion_time=T0 + timedelta(minutes=30),
                              served_tokens_per_second=4000.0, baseline_tokens_per_second_per_accelerator=500.0,
                              serving_accelerators=8, speedup=1.25)
    assert of_record(record).payback_seconds == pytest.approx(2250.0)
    assert served_rate_query(SeriesSelector(namespace="ns", deployment="llama"), 60) == (
        'sum(rate(shapeshift_generated_tokens_total{namespace="ns",deployment="llama"}[60s]))')


def test_max_payback_skips_a_compile_that_would_not_pay_for_itself():
    from shapeshift.operator.regimes import economics, expected_payback

    # A's compile: 1 accelerator for an hour; 8 busy serving accelerators at x1.25 save 1.6 a second: 2250 s payback
    cost = economics(started=T0, completed=T0 + timedelta(hours=1), compile_accelerators=1, speedup=1.25,
                     served_tokens_per_second=4000.0, baseline_tokens_per_second_per_accelerator=500.0,
                     serving_accelerators=8)
    lib = run(RegimeLibrary(), A, T0).library
    lib = record_champion(lib, KEY_A, forward_pass("fp-a", SHA_A), "run-a", T0, cost)
    new = profile(5000, 0.3)  # a third regime
    at = T0 + CHECK

    def settle(s):
        d = run(lib, new, at, s=s, active="fp-a")
        return run(d.library, new, at + CHECK, s=s, active="fp-a")

    assert expected_payback(lib) == (pytest.approx(2250.0), None)  # one visit, not ended yet
    assert settle(spec()).kind == "Compile"  # no policy: compile regardless of cost
    # A lasted two hours
    lib = lib.put(lib.get(KEY_A).model_copy(update={"visits": 1, "dwell_seconds": 7200}))
    capped = settle(spec(compilation={"maxPaybackHours": 0.5}))
    assert capped.kind == "Uneconomic" and capped.blocks_compile
    assert "0.62 h, is longer than spec.compilation.maxPaybackHours 0.5 h" in capped.reason
    assert settle(spec(compilation={"maxPaybackHours": 1})).kind == "Compile"
    # regimes that lasted 20 minutes a visit: a 2250 s payback is longer than that
    lib = lib.put(lib.get(KEY_A).model_copy(update={"visits": 3, "dwell_seconds": 3600}))
    assert expected_payback(replace(lib, current=lib.current.model_copy(update={"observed": KEY_B}))) == (
        pytest.approx(2250.0), pytest.approx(1200.0))
    lasted = settle(spec(compilation={"maxPaybackHours": 1}))
    assert lasted.kind == "Uneconomic" and "longer than regimes have lasted so far (1200 s on average)" in lasted.reason


def test_a_champion_published_after_the_last_switch_is_not_switched_to_again():
    lib = library_with_champions()
    at = T0 + 10 * CHECK
    for i in range(2):  # back to A: a switch to fp-a
        lib = run(lib, A, at + i * CHECK, active="fp-b").library
    assert lib.current.forward_pass == "fp-a"
    # a new regime C, compiled; its champion finishes after the switch and is the rollout's target already
    c = profile(5000, 0.3)
    key_c = regime_key(c)
    for i in range(2, 4):
        lib = run(lib, c, at + i * CHECK, active="fp-a").library
    lib = record_champion(record_compile_run(lib, key_c, "run-c", at + 3 * CHECK), key_c,
                          forward_pass("fp-c", "c" * 64), "run-c", at + 5 * CHECK)
    d = run(lib, c, at + 6 * CHECK, active="fp-a")
    assert d.kind == "Stay" and d.blocks_compile and d.library.current.last_switch_time == at + CHECK
    status = InferenceDeploymentStatus.model_validate(d.library.to_wire())
    assert target_forward_pass(spec(), status, ("2026-12-01T12:15:00Z", "fp-c")) == "fp-c"
    # a pinned regime wins over a CompileRun that finished later
    assert target_forward_pass(spec(regimes={"pin": KEY_B}), status, ("2026-12-01T12:15:00Z", "fp-c")) == "fp-b"


def test_the_drift_check_switches_instead_of_compiling_and_compiles_a_new_regime():
    from shapeshift.operator.builders import Parent
    from shapeshift.operator.drift import Compile
    from shapeshift.operator.drift_check import check_drift
    from shapeshift.operator.prometheus import DataQuality, ObservedTraffic
    from shapeshift.operator.settings import OperatorSettings

    now = T0 + 20 * CHECK
    s = spec(compilation={"policy": "OnDrift", "cooldownSeconds": 0,
                          "drift": {"consecutiveChecks": 2, "checkIntervalSeconds": 60}})
    lib = library_with_champions()  # current regime B, served by fp-b

    def status(observed: str, checks: int) -> InferenceDeploymentStatus:
        wire = lib.to_wire()
        wire["currentRegime"].update({"observed": observed, "observedChecks": checks,
                                      "observedSince": "2026-12-01T12:18:00Z"})
        return InferenceDeploymentStatus.model_validate({
            **wire, "compiledFor": B.to_dict(), "drift": {"consecutiveChecks": 1},
            "activeForwardPass": {"name": "fp-b"}})

    def check(traffic: TrafficProfile, st: InferenceDeploymentStatus):
        quality = DataQuality(requests=100, targets=1, window_seconds=60, evaluated_at=now,
                              prefix_cache_queried_tokens=1000.0)
        return check_drift(spec=s, status=st, parent=Parent(kind="InferenceDeployment", name="llama",
                                                              namespace="team-a", uid="u1"),
                           observe=lambda: ObservedTraffic(traffic, quality), active_compile_run=None,
                           settings=OperatorSettings(), now=now, library=RegimeLibrary.of(st))

    # A on its first check: the drift detector would compile, the library waits for the traffic to settle
    first = check(A, status(KEY_B, 2))
    assert isinstance(first.result.decision, Compile) and first.compile_run is None
    assert first.regime.kind == "Settling" and first.result.state.consecutive == 2
    assert "no CompileRun: traffic in regime" in first.update.condition("Drifted")[3]
    assert first.update.condition("Regime")[1:3] == ("False", "Settling")
    # A on its second check: a switch to fp-a, no CompileRun
    second = check(A, status(KEY_A, 1))
    assert second.regime.kind == "Switch" and second.compile_run is None and second.write
    assert second.update.fields["currentRegime"]["forwardPass"] == "fp-a"
    assert second.update.condition("Regime")[1:3] == ("True", "SwitchedToChampion")
    # a new regime, settled: the CompileRun the drift detector builds, recorded as the regime's
    c = profile(5000, 0.3)
    settled = check(c, status(regime_key(c), 1))
    assert settled.regime.kind == "Compile" and settled.compile_run is not None
    name = settled.compile_run["metadata"]["name"]
    assert settled.compile_run["metadata"]["annotations"]["shapeshift.dev/regime"] == regime_key(c)
    recorded = {r["name"]: r for r in settled.update.fields["regimes"]}[regime_key(c)]
    assert recorded["compileRun"] == name and "champion" not in recorded
    assert name in settled.update.condition("Regime")[3]


def test_a_champion_the_rollout_rolled_back_is_not_switched_to_again_and_its_regime_compiles():
    """The rollout retries a target only once the target changes, so a switch back to a pass it
    rolled back would leave the deployment on the previous pass while the library says otherwise.
    The drift check marks the rolled-back champion in the library (time and the rollout's reason);
    traffic returning to its regime then compiles, and the drift check creates the CompileRun."""
    from shapeshift.operator.builders import Parent
    from shapeshift.operator.drift_check import check_drift
    from shapeshift.operator.prometheus import DataQuality, ObservedTraffic
    from shapeshift.operator.regimes import record_rollback
    from shapeshift.operator.settings import OperatorSettings

    lib = library_with_champions()  # traffic in B, served by fp-b; A's champion fp-a
    when = T0 + 5 * CHECK
    marked = record_rollback(lib, "fp-a", when, "canary regressed: p90 latency +40%")
    assert record_rollback(marked, "fp-a", when + CHECK, "again") == marked  # marked once, with the first reason
    assert record_rollback(lib, "fp-unknown", when, "x") == lib
    champ = marked.get(KEY_A).champion
    assert (champ.rolled_back_at, champ.rolled_back_reason) == (when, "canary regressed: p90 latency +40%")
    assert marked.get(KEY_B).champion.rolled_back_at is None
    at = T0 + 10 * CHECK
    for i in range(2):
        d = run(marked, A, at + i * CHECK, active="fp-b")
        marked = d.library
    assert d.kind == "Compile" and "rolled back here" in d.reason and "canary regressed" in d.reason
    assert not d.blocks_compile and marked.current.forward_pass is None
    # the unmarked library switches (the control)
    control = lib
    for i in range(2):
        c = run(control, A, at + i * CHECK, active="fp-b")
        control = c.library
    assert c.kind == "Switch" and c.champion.forward_pass == "fp-a"
    # a new champion recorded for A replaces the marked one
    again = record_champion(marked, KEY_A, forward_pass("fp-a2", "c" * 64), "run-a2", at + 3 * CHECK)
    assert again.get(KEY_A).champion.rolled_back_at is None

    # Through the drift check: the status says the rollout rolled fp-a back; traffic settled in A.
    now = T0 + 20 * CHECK
    s = spec(compilation={"policy": "OnDrift", "cooldownSeconds": 0,
                          "drift": {"consecutiveChecks": 1, "checkIntervalSeconds": 60}})
    wire = lib.to_wire()
    wire["currentRegime"].update({"observed": KEY_A, "observedChecks": 1, "observedSince": "2026-12-01T12:18:00Z"})
    status = InferenceDeploymentStatus.model_validate({
        **wire, "compiledFor": B.to_dict(), "activeForwardPass": {"name": "fp-b"},
        "rollout": {"phase": "RolledBack", "desired": {"name": "fp-a"}, "previous": {"name": "fp-b"},
                    "phaseSince": "2026-12-01T12:10:00Z", "message": "rolled back to fp-b: canary regressed"}})
    quality = DataQuality(requests=100, targets=1, window_seconds=60, evaluated_at=now,
                          prefix_cache_queried_tokens=1000.0)
    checked = check_drift(spec=s, status=status, parent=Parent(kind="InferenceDeployment", name="llama",
                                                                 namespace="team-a", uid="u1"),
                          observe=lambda: ObservedTraffic(A, quality), active_compile_run=None,
                          settings=OperatorSettings(), now=now, library=RegimeLibrary.of(status))
    assert checked.regime.kind == "Compile" and checked.compile_run is not None
    recorded = {r["name"]: r for r in checked.update.fields["regimes"]}[KEY_A]
    assert recorded["champion"]["forwardPass"] == "fp-a"
    assert recorded["champion"]["rolledBackAt"].startswith("2026-12-01T12:10:00")
    assert "canary regressed" in recorded["champion"]["rolledBackReason"]
    assert checked.update.condition("Regime")[1] == "False"


CONFIG_1, CONFIG_2 = "1" * 64, "2" * 64


def test_a_champion_of_another_config_of_the_same_name_is_refused_naming_the_field():
    from shapeshift.operator.regimes import ServingTarget, champion_problem

    # A's champion verified for config 1; B's, newer, for config 2 (the model folder was replaced)
    lib = RegimeLibrary()
    lib = run(lib, A, T0).library
    lib = record_champion(lib, KEY_A, forward_pass("fp-a", SHA_A, config=CONFIG_1), "run-a", T0 + CHECK)
    for i in range(2):
        lib = run(lib, B, T0 + (2 + i) * CHECK).library
    lib = record_champion(lib, KEY_B, forward_pass("fp-b", SHA_B, config=CONFIG_2), "run-b", T0 + 4 * CHECK)
    assert lib.get(KEY_A).champion.model_config_sha256 == CONFIG_1
    assert lib.model_config_sha256() == CONFIG_2  # the newest champion's
    target = ServingTarget.of(spec(), lib)
    assert target.model_config_sha256 == CONFIG_2 and target.engine_image == "shapeshift/engine:0.1.0"
    problem = champion_problem(lib.get(KEY_A).champion, target, T0, None)
    assert problem is not None and "configSha256" in problem and "another config of model tiny-llama" in problem
    assert champion_problem(lib.get(KEY_B).champion, target, T0, None) is None
    # a champion that records no config (published before it was recorded) is not compared
    bare = lib.get(KEY_A).champion.model_copy(update={"model_config_sha256": None})
    assert champion_problem(bare, target, T0, None) is None
    # back to A: compiled again, not switched to
    at = T0 + 10 * CHECK
    for i in range(2):
        d = run(lib, A, at + i * CHECK, active="fp-b")
        lib = d.library
    assert d.kind == "Compile" and "configSha256" in d.reason and not d.blocks_compile
    # all of one config: the switch as before
    same = library_with_champions(config=CONFIG_2)
    for i in range(2):
        d = run(same, A, at + i * CHECK, active="fp-b")
        same = d.library
    assert d.kind == "Switch" and d.champion.forward_pass == "fp-a"


def test_a_champion_recorded_under_another_engine_image_is_refused_naming_the_field():
    from shapeshift.operator.regimes import ServingTarget, champion_problem

    lib = RegimeLibrary()
    lib = run(lib, A, T0).library
    lib = record_champion(lib, KEY_A, forward_pass("fp-a", SHA_A), "run-a", T0 + CHECK,
                          engine_image="shapeshift/engine:0.0.9")
    champion = lib.get(KEY_A).champion
    assert champion.engine_image == "shapeshift/engine:0.0.9"
    problem = champion_problem(champion, ServingTarget.of(spec()), T0, None)
    assert problem is not None and "spec.engine.image" in problem and "shapeshift/engine:0.0.9" in problem
    assert champion_problem(champion, ServingTarget.of(spec(engine={"dtype": "float32", "image":
                                                                    "shapeshift/engine:0.0.9"})), T0, None) is None
    # a champion that records no image is not compared
    assert champion_problem(champion.model_copy(update={"engine_image": None}), ServingTarget.of(spec()),
                            T0, None) is None
    # the wire form keeps both fields
    wire = lib.to_wire()["regimes"][0]["champion"]
    assert wire["engineImage"] == "shapeshift/engine:0.0.9" and "modelConfigSha256" not in wire


def test_the_compile_worker_records_the_model_config_digest():
    from shapeshift.engine.compile.champions import ChampionEntry, forward_pass_spec
    from shapeshift.engine.contracts.model_config import config_sha256
    from shapeshift.engine.models.presets import PRESETS, model_config_sha256

    digest = model_config_sha256("tiny-llama")
    assert digest == config_sha256(PRESETS["tiny-llama"].hf_config) and len(digest) == 64
    assert model_config_sha256("tiny-qwen3") != digest and model_config_sha256("no-such-model") is None
    entry = ChampionEntry(name="c", signature="s", model="tiny-llama", family="llama", hardware="cpu",
                          regime={"prompt": 0, "hit": 0, "concurrency": 1}, bundle_digest=SHA_A, recipe={},
                          config_sha256=digest)
    wire = forward_pass_spec(entry, f"/var/lib/shapeshift-artifacts/{SHA_A}.tar.gz").to_wire()
    assert wire["model"]["configSha256"] == digest
    lib = record_champion(RegimeLibrary(), KEY_A, {"metadata": {"name": "c"}, "spec": wire}, "run", T0)
    assert lib.get(KEY_A).champion.model_config_sha256 == digest


def test_a_model_folders_config_digest_ignores_formatting(tmp_path):
    import json

    from shapeshift.engine.models.presets import model_config_sha256

    (tmp_path / "config.json").write_text(json.dumps({"b": 1, "a": [1, 2]}, indent=4))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"a":[1,2],"b":1}')
    assert model_config_sha256(str(tmp_path)) == model_config_sha256(str(other)) is not None


def test_the_printer_columns_show_the_current_regime_and_its_champions_economics():
    """`kubectl get infd` shows the regime (REGIME), `-o wide` also the current regime's champion's
    economics (SAVED/DAY, PAYBACK): status.currentRegime carries them, since a printer column cannot
    pick the current regime's entry out of status.regimes."""
    from shapeshift.operator.api import INFERENCE_DEPLOYMENT
    from shapeshift.operator.crdgen import build_crd
    from shapeshift.operator.regimes import economics

    version = build_crd(INFERENCE_DEPLOYMENT)["spec"]["versions"][0]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Regime"]["jsonPath"] == ".status.currentRegime.name" and "priority" not in columns["Regime"]
    assert (columns["Saved/Day"]["jsonPath"], columns["Saved/Day"]["type"], columns["Saved/Day"]["priority"]) == (
        ".status.currentRegime.savedAcceleratorHoursPerDay", "number", 1)
    assert (columns["Payback"]["jsonPath"], columns["Payback"]["type"], columns["Payback"]["priority"]) == (
        ".status.currentRegime.paybackHours", "number", 1)
    names = list(columns)
    assert names.index("Regime") < names.index("Saved/Day") < names.index("Payback") < names.index("Age")
    current = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["currentRegime"]
    assert {"savedAcceleratorHoursPerDay", "paybackHours"} <= set(current["properties"])

    def cell(wire: dict, path: str):
        for part in path.strip(".").split(".")[1:]:  # below .status
            wire = (wire or {}).get(part)
        return wire

    # A's champion: 1 accelerator-hour spent, 1.6 accelerators saved a second: 38.4 h a day, 2250 s payback
    cost = economics(started=T0, completed=T0 + timedelta(hours=1), compile_accelerators=1, speedup=1.25,
                     served_tokens_per_second=4000.0, baseline_tokens_per_second_per_accelerator=500.0,
                     serving_accelerators=8)
    lib = run(RegimeLibrary(), A, T0).library
    lib = record_champion(lib, KEY_A, forward_pass("fp-a", SHA_A), "run-a", T0, cost)
    wire = lib.to_wire()
    assert cell(wire, columns["Regime"]["jsonPath"]) == KEY_A
    assert cell(wire, columns["Saved/Day"]["jsonPath"]) == pytest.approx(cost.saved_accelerator_hours_per_day)
    assert cell(wire, columns["Payback"]["jsonPath"]) == pytest.approx(2250 / 3600)
    # the status reads back to the same library, and a write carries the figures again
    assert RegimeLibrary.of(InferenceDeploymentStatus.model_validate(wire)).to_wire() == wire
    # traffic settles in B, which has no champion: the figures go (explicit nulls: the status is merge-patched)
    for i in range(2):
        lib = run(lib, B, T0 + (1 + i) * CHECK, active="fp-a").library
    wire = lib.to_wire()
    assert cell(wire, columns["Regime"]["jsonPath"]) == KEY_B
    assert wire["currentRegime"]["savedAcceleratorHoursPerDay"] is None and wire["currentRegime"]["paybackHours"] is None
