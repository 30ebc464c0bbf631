"""The regime library: which verified champion serves which traffic regime, and when to switch.

    observed TrafficProfile --regime_key--> its bucket (median prompt length, prefix-cache hit rate,
        concurrency, median output length; for MoE traffic the dominant experts:
        engine/contracts/traffic_regime.py, the champion registry's too)
      --place--> the regime it counts in: its bucket's; else one recorded under an older, coarser key
        that covers it; else the nearest known regime within NEAR_DISTANCE of it; else its bucket (new)
    status.regimes + status.currentRegime (RegimeLibrary), spec.regimes (RegimePolicy), the
        deployment's model, dtype, accelerator and engine env (ServingTarget), the clock
        --decide--> RegimeDecision: Stay | Settling | Switch (to a known regime's verified champion,
        no CompileRun) | Compile (a new regime, or its champion missing, stale or verified for
        something else) | CoolingDown | Pinned | Uneconomic (spec.compilation.maxPaybackHours: a
        compile would not pay for itself, judged from past compiles and how long regimes lasted),
        with the reason for the condition and the event,
        and the library to write back
    a finished CompileRun started for a regime (pending_champions) --record_champion--> that
        regime's champion, once the rollout's trust rules (operator/rollout_target.resolve_target) accept it
    spec, status, the CompileRuns (newest_champion) --target_forward_pass--> what the rollout should run
    a CompileRun's Job times, its accelerators, the champion's speedup and baseline throughput, the
        deployment's served tokens/s (Prometheus, read by operator/compile_economics.py) and accelerators
        --economics--> accelerator-seconds spent, accelerator-hours saved per day at that load, payback time

Hysteresis: the observed traffic must sit in a new regime for spec.regimes.switchChecks checks in
a row (and spec.regimes.minDwellSeconds) before the library moves there; a cooldown
(spec.regimes.switchCooldownSeconds) separates two switches. Pins win over the library: a
pinned regime is served whatever the traffic does, a pinned champion wins over the one
recorded for its regime, and spec.forwardPass wins over everything (GitOps: the spec wins).

Pure: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Literal, Mapping, Sequence

from shapeshift.engine.contracts.engine_env import PERFORMANCE_ENV
from shapeshift.engine.contracts.traffic_profile import TrafficProfile
from shapeshift.engine.contracts.traffic_regime import NEAR_DISTANCE, TrafficPoint, TrafficRegime, hit_rate
from shapeshift.operator.api import (REGIMES_KEPT, CurrentRegime, InferenceDeploymentSpec, InferenceDeploymentStatus,
                                     RegimeChampion, RegimePolicy, RegimeStatus, VerifiedForwardPass)
from shapeshift.operator.rollout_target import champion_of

__all__ = [
    "Placement", "RegimeDecision", "RegimeLibrary", "ServingTarget", "place", "same_regime",
    "Economics", "champion_problem", "decide", "economics", "refresh_savings", "engine_env_sha256", "expected_payback", "newest_champion", "pending_champions", "record_champion",
    "record_rollback",
    "record_compile_run", "regime_distance", "regime_key", "target_forward_pass",
]

Kind = Literal["Stay", "Settling", "Switch", "Compile", "CoolingDown", "Pinned", "Uneconomic", "NoData"]


def regime_key(profile: TrafficProfile) -> str:
    """``p<prompt>-h<hit rate>-c<concurrency>-o<output>[-e<experts>]``: the champion registry's key."""
    return TrafficRegime.of(profile).key


def regime_distance(a: str | TrafficProfile | RegimeStatus, b: str | TrafficProfile | RegimeStatus) -> float:
    """How far apart two regimes are. Keys: buckets apart, summed over the dimensions both know
    (TrafficRegime.distance). A profile or a regime with its last observed traffic: bucket widths
    apart on the continuous axes (TrafficPoint.distance), what ``place`` compares with NEAR_DISTANCE;
    a regime without observed traffic counts through its key."""
    if isinstance(a, str) and isinstance(b, str):
        return TrafficRegime.parse(a).distance(TrafficRegime.parse(b))
    pa, pb = _point(a), _point(b)
    if pa is None or pb is None:
        return TrafficRegime.parse(_key_of(a)).distance(TrafficRegime.parse(_key_of(b)))
    return pa.distance(pb)


def _key_of(x: str | TrafficProfile | RegimeStatus) -> str:
    return x if isinstance(x, str) else x.name if isinstance(x, RegimeStatus) else regime_key(x)


def _parsed(name: str | None) -> TrafficRegime | None:
    try:
        return TrafficRegime.parse(name or "")
    except ValueError:
        return None


def _point(x: str | TrafficProfile | RegimeStatus) -> TrafficPoint | None:
    if isinstance(x, TrafficProfile):
        return TrafficPoint.of(x)
    if isinstance(x, RegimeStatus) and x.prompt_length_p50 is not None:
        parsed = _parsed(x.name)
        return TrafficPoint.at(x.prompt_length_p50, x.prefix_cache_hit_rate, x.concurrency, x.output_length_p50,
                               parsed.experts if parsed is not None else None)
    return None


def same_regime(a: str | None, b: str | None) -> bool:
    """Whether two names are one regime: equal, or one an older, coarser key (no output or routing
    bucket) that covers the other, so a regime recorded or pinned under an old key still matches."""
    if a is None or b is None:
        return a == b
    if a == b:
        return True
    pa, pb = _parsed(a), _parsed(b)
    return pa is not None and pb is not None and (pa.covers(pb) or pb.covers(pa))


def engine_env_sha256(env: Sequence[Mapping[str, Any]] | None) -> str:
    """Digest of the engine performance switches (PERFORMANCE_ENV) among ``env`` ({name, value} items)."""
    chosen = sorted((e["name"], e.get("value") or "") for e in env or [] if e.get("name") in PERFORMANCE_ENV)
    return hashlib.sha256(json.dumps(chosen).encode()).hexdigest()


@dataclass(frozen=True)
class ServingTarget:
    """What a champion must have been verified for to serve this deployment now."""

    models: frozenset[str]  # names the deployment's model goes by (preset, served name, folder)
    dtype: str
    accelerator: str
    engine_env_sha256: str
    engine_image: str | None = None  # spec.engine.image
    # The digest of the model config it serves, as far as the operator knows: the one its newest
    # recorded champion was verified for (the operator reads no config.json; None: none recorded).
    model_config_sha256: str | None = None

    @classmethod
    def of(cls, spec: InferenceDeploymentSpec, library: "RegimeLibrary | None" = None) -> "ServingTarget":
        names = {spec.model.display_name}
        if spec.model.preset:
            names.add(spec.model.preset)
        env = [{"name": e.name, "value": getattr(e, "value", None)} for e in spec.engine.env or []]
        return cls(frozenset(names), spec.engine.dtype, spec.hardware.accelerator, engine_env_sha256(env),
                   spec.engine.image, library.model_config_sha256() if library is not None else None)


def champion_problem(champion: RegimeChampion | None, target: ServingTarget, now: datetime,
                     max_age: timedelta | None) -> str | None:
    """Why ``champion`` cannot serve ``target`` now (None: it can). The model config digest and the
    engine image are compared where the champion records one and the target knows one."""
    if champion is None:
        return "it has no verified champion"
    name = champion.forward_pass
    if champion.rolled_back_at is not None:
        return (f"its champion {name} was rolled back here at {champion.rolled_back_at.isoformat()} "
                f"({champion.rolled_back_reason or 'no reason recorded'})")
    if champion.accelerator != target.accelerator:
        return f"its champion {name} was verified on {champion.accelerator}, the deployment runs on {target.accelerator}"
    if champion.model not in target.models:
        return f"its champion {name} was verified for model {champion.model}, the deployment serves {sorted(target.models)[0]}"
    if (champion.model_config_sha256 and target.model_config_sha256
            and champion.model_config_sha256 != target.model_config_sha256):
        return (f"its champion {name} was verified for another config of model {champion.model} "
                f"(configSha256 {champion.model_config_sha256[:12]}, the deployment's newest champion was verified "
                f"for {target.model_config_sha256[:12]})")
    if champion.dtype != target.dtype:
        return f"its champion {name} was verified in {champion.dtype}, the deployment runs {target.dtype}"
    if champion.engine_env_sha256 != target.engine_env_sha256:
        return f"its champion {name} was measured under another spec.engine.env"
    if champion.engine_image and target.engine_image and champion.engine_image != target.engine_image:
        return (f"its champion {name} was recorded under engine image {champion.engine_image}, the deployment "
                f"runs {target.engine_image} (spec.engine.image)")
    if max_age is not None and champion.verified_at is not None and now - champion.verified_at > max_age:
        return (f"its champion {name} is stale (verified {champion.verified_at.isoformat()}, more than "
                f"{int(max_age.total_seconds())}s ago)")
    return None


@dataclass(frozen=True)
class RegimeLibrary:
    """status.regimes and status.currentRegime."""

    regimes: tuple[RegimeStatus, ...] = ()
    current: CurrentRegime = field(default_factory=CurrentRegime)

    @classmethod
    def of(cls, status: InferenceDeploymentStatus) -> "RegimeLibrary":
        return cls(tuple(status.regimes or ()), status.current_regime or CurrentRegime())

    def get(self, name: str | None) -> RegimeStatus | None:
        return next((r for r in self.regimes if r.name == name), None)

    def put(self, regime: RegimeStatus) -> "RegimeLibrary":
        """With ``regime`` in place of the one of its name; past REGIMES_KEPT, the least recently seen
        regime without a champion goes first, then the least recently seen one."""
        rest = [r for r in self.regimes if r.name != regime.name]
        kept = [*rest, regime]
        while len(kept) > REGIMES_KEPT:
            never = datetime.min.replace(tzinfo=timezone.utc)
            victims = [r for r in kept[:-1] if r.champion is None] or kept[:-1]
            oldest = min(victims, key=lambda r: r.last_seen or never)
            kept.remove(oldest)
        return replace(self, regimes=tuple(kept))

    def model_config_sha256(self) -> str | None:
        """The model config digest of the newest champion that records one (None: none does)."""
        never = datetime.min.replace(tzinfo=timezone.utc)
        recorded = [r.champion for r in self.regimes if r.champion is not None and r.champion.model_config_sha256]
        newest = max(recorded, key=lambda c: c.verified_at or never, default=None)
        return newest.model_config_sha256 if newest is not None else None

    def with_economics(self) -> "RegimeLibrary":
        """status.currentRegime with the economics of the current regime's champion (the printer
        columns Saved/Day and Payback read them there: a column cannot pick an entry of
        status.regimes); none where that champion has none or the regime has no champion."""
        entry = self.get(self.current.name)
        champ = entry.champion if entry is not None else None
        saved = champ.saved_accelerator_seconds_per_hour if champ is not None else None
        payback = champ.payback_seconds if champ is not None else None
        current = self.current.model_copy(update={
            "saved_accelerator_hours_per_day": None if saved is None else round(saved / 150, 6),
            "payback_hours": None if payback is None else round(payback / 3600, 6)})
        return replace(self, current=current)

    def to_wire(self) -> dict[str, Any]:
        current = self.with_economics().current
        # explicit nulls: the status is merge-patched, so a figure the new current regime lacks is removed
        economics = {"savedAcceleratorHoursPerDay": current.saved_accelerator_hours_per_day,
                     "paybackHours": current.payback_hours}
        return {"regimes": [r.to_wire() for r in self.regimes], "currentRegime": {**current.to_wire(), **economics}}


@dataclass(frozen=True)
class RegimeDecision:
    kind: Kind
    regime: str | None  # the regime the decision is about (the observed one, or the pinned one)
    reason: str  # the condition's message and the event's
    library: RegimeLibrary  # what to write back
    champion: RegimeChampion | None = None  # Switch: what to roll out; else the regime's usable champion
    # A drift-triggered CompileRun must not start: the traffic has not settled in a regime yet, the
    # regime has a verified champion (served, switched to, or after the cooldown), or spec.regimes.pin
    # holds the deployment. Only Compile, NoData and a spec.forwardPass pin leave the drift path as it was.
    blocks_compile: bool = True


def _policy(spec: InferenceDeploymentSpec) -> RegimePolicy:
    return spec.regimes or RegimePolicy()


def _champion_for(policy: RegimePolicy, regime: RegimeStatus | None, name: str | None) -> RegimeChampion | None:
    """The pinned champion of regime ``name`` (spec.regimes.champions) or the library's."""
    pinned = next((p for p in policy.champions or [] if same_regime(p.regime, name)), None)
    if pinned is not None:
        recorded = regime.champion if regime is not None else None
        if recorded is not None and recorded.forward_pass == pinned.forward_pass:
            return recorded
        return None  # a pinned champion is judged by the rollout (provenance), not by the library
    return regime.champion if regime is not None else None


def _pinned_name(policy: RegimePolicy, name: str | None) -> str | None:
    return next((p.forward_pass for p in policy.champions or [] if same_regime(p.regime, name)), None)


def _lookup(library: RegimeLibrary, name: str) -> RegimeStatus | None:
    """The regime ``name`` names: of that name, else one it is the same regime as (same_regime)."""
    return library.get(name) or next((r for r in library.regimes if same_regime(r.name, name)), None)


@dataclass(frozen=True)
class Placement:
    """The regime a check's traffic counts in."""

    key: str  # a regime of the library, or the traffic's own bucket (a new regime)
    bucket: str  # the traffic's own bucket (regime_key)
    distance: float | None = None  # from the regime's last observed traffic, when placed by distance

    @property
    def note(self) -> str | None:
        """What the reasons add when the regime is not the traffic's own bucket."""
        if self.key == self.bucket:
            return None
        if self.distance is None:
            return f"traffic in bucket {self.bucket}, which regime {self.key} (an older key) covers"
        return (f"traffic in bucket {self.bucket}, {self.distance:.2f} bucket widths from regime {self.key}'s last "
                f"observed traffic (at most {NEAR_DISTANCE:g})")


def place(library: RegimeLibrary, profile: TrafficProfile) -> Placement:
    """The regime ``profile`` counts in: its bucket's regime; else one recorded under an older,
    coarser key that covers the bucket (the most recently seen); else the known regime whose last
    observed traffic is nearest, when at most NEAR_DISTANCE bucket widths away; else its bucket."""
    bucket = regime_key(profile)
    if library.get(bucket) is not None:
        return Placement(bucket, bucket)
    observed = TrafficRegime.parse(bucket)
    never = datetime.min.replace(tzinfo=timezone.utc)
    older = [r for r in library.regimes if (k := _parsed(r.name)) is not None and k.covers(observed)]
    if older:
        return Placement(max(older, key=lambda r: r.last_seen or never).name, bucket)
    point = TrafficPoint.of(profile)
    near = sorted((point.distance(p), r.name) for r in library.regimes if (p := _point(r)) is not None)
    if near and near[0][0] <= NEAR_DISTANCE:
        return Placement(near[0][1], bucket, round(near[0][0], 3))
    return Placement(bucket, bucket)


def observe(library: RegimeLibrary, profile: TrafficProfile, now: datetime,
            interval: timedelta, placement: Placement | None = None) -> tuple[RegimeLibrary, str]:
    """The library after one check observed ``profile``: the regime's entry (first/last seen,
    dwell, checks, summary) and the observed-regime counter of status.currentRegime. Traffic placed
    by distance leaves the regime's summary as it was (its anchor: no creeping regime by regime)."""
    placement = placement or Placement(regime_key(profile), regime_key(profile))
    key = placement.key
    current = library.current
    entry = library.get(key) or RegimeStatus(name=key, first_seen=now)
    dwell = entry.dwell_seconds
    if current.observed == key and entry.last_seen is not None:
        # traffic stayed: count the time since the previous check (at most two check intervals)
        dwell += int(min(now - entry.last_seen, 2 * interval).total_seconds())
    else:  # a new visit: one check interval
        dwell += int(interval.total_seconds())
    summary = {} if placement.distance is not None else {
        "prompt_length_p50": round(profile.prompt_length.p50, 3), "prefix_cache_hit_rate": round(hit_rate(profile), 6),
        "concurrency": profile.concurrency, "output_length_p50": round(profile.output_length.p50, 3)}
    entry = entry.model_copy(update={
        **summary, "last_seen": now, "dwell_seconds": max(dwell, 0), "checks": entry.checks + 1,
        "visits": entry.visits + (0 if current.observed == key else 1),
    })
    if current.observed == key:
        current = current.model_copy(update={"observed_checks": current.observed_checks + 1})
    else:
        current = current.model_copy(update={"observed": key, "observed_checks": 1, "observed_since": now})
    if current.name is None:  # the first regime ever observed is where the deployment is
        current = current.model_copy(update={"name": key, "since": now})
    return replace(library.put(entry), current=current), key


def _switch(library: RegimeLibrary, name: str, champion: RegimeChampion, now: datetime, reason: str) -> RegimeDecision:
    current = library.current.model_copy(update={
        "name": name, "since": now if library.current.name != name else library.current.since,
        "forward_pass": champion.forward_pass, "sha256": champion.sha256, "last_switch_time": now, "reason": reason})
    return RegimeDecision("Switch", name, reason, replace(library, current=current), champion, blocks_compile=True)


def _with_reason(kind: Kind, regime: str | None, library: RegimeLibrary, reason: str,
                 champion: RegimeChampion | None = None, blocks: bool = False, **current: Any) -> RegimeDecision:
    updated = library.current.model_copy(update={**current, "reason": reason})
    return RegimeDecision(kind, regime, reason, replace(library, current=updated), champion,
                          blocks_compile=blocks or kind != "Compile")


def expected_payback(library: RegimeLibrary) -> tuple[float, float | None] | None:
    """(expected payback seconds of one more compile, expected seconds a regime lasts) from the
    library: the mean spent over the mean saved per second of the champions recorded with their
    economics, and the mean visit of the other regimes than the one traffic is in now (their visits
    have ended; None before any has). None: no champion with economics yet."""
    costs = [r.champion for r in library.regimes if r.champion is not None
             and r.champion.compile_accelerator_seconds is not None and r.champion.saved_accelerator_seconds_per_hour]
    if not costs:
        return None
    spent = sum(c.compile_accelerator_seconds or 0.0 for c in costs) / len(costs)
    saved = sum(c.saved_accelerator_seconds_per_hour or 0.0 for c in costs) / len(costs) / 3600
    ended = [r for r in library.regimes if r.name != library.current.observed]
    visits = sum(r.visits for r in ended)
    lasting = sum(r.dwell_seconds for r in ended) / visits if visits else None
    return spent / saved, lasting


def _uneconomic(library: RegimeLibrary, spec: InferenceDeploymentSpec) -> str | None:
    """Why compiling is not worth it under spec.compilation.maxPaybackHours (None: it is, or unknown)."""
    limit = spec.compilation.max_payback_hours
    expected = expected_payback(library) if limit is not None else None
    if limit is None or expected is None:
        return None
    payback, lasting = expected
    if payback > limit * 3600:
        return (f"the expected payback of a compile, {payback / 3600:.2f} h, is longer than "
                f"spec.compilation.maxPaybackHours {limit:g} h")
    if lasting is not None and payback > lasting:
        return (f"the expected payback of a compile, {payback:.0f} s, is longer than regimes have lasted so far "
                f"({lasting:.0f} s on average)")
    return None


def _compile(library: RegimeLibrary, spec: InferenceDeploymentSpec, key: str, reason: str,
             **current: Any) -> RegimeDecision:
    """Compile, unless spec.compilation.maxPaybackHours says it would not pay for itself."""
    uneconomic = _uneconomic(library, spec)
    if uneconomic is not None:
        return _with_reason("Uneconomic", key, library, f"{reason}; not compiled: {uneconomic}", **current)
    return _with_reason("Compile", key, library, reason, **current)


def _serving(library: RegimeLibrary, champion: RegimeChampion, active: str | None) -> bool:
    """Whether ``champion`` is what the deployment runs or was last switched to."""
    return champion.forward_pass in (active, library.current.forward_pass)


def decide(library: RegimeLibrary, profile: TrafficProfile | None, *, spec: InferenceDeploymentSpec,
           now: datetime, interval: timedelta, active_forward_pass: str | None = None) -> RegimeDecision:
    """One check's regime decision (``profile`` None: the check observed no traffic)."""
    policy = _policy(spec)
    target = ServingTarget.of(spec, library)
    max_age = timedelta(seconds=policy.champion_max_age_seconds) if policy.champion_max_age_seconds else None
    if profile is None:
        return RegimeDecision("NoData", library.current.observed, "no traffic observed", library, blocks_compile=False)
    placement = place(library, profile)
    library, key = observe(library, profile, now, interval, placement)
    decision = _decide(library, key, spec=spec, policy=policy, target=target, max_age=max_age, now=now,
                       active_forward_pass=active_forward_pass)
    note = placement.note
    if note is None:
        return decision
    reason = f"{decision.reason} ({note})"[:1024]
    current = decision.library.current.model_copy(update={"reason": reason})
    return replace(decision, reason=reason, library=replace(decision.library, current=current))


def _decide(library: RegimeLibrary, key: str, *, spec: InferenceDeploymentSpec, policy: RegimePolicy,
            target: ServingTarget, max_age: timedelta | None, now: datetime,
            active_forward_pass: str | None) -> RegimeDecision:
    """decide, once the check's traffic is counted in regime ``key``."""
    if spec.forward_pass:
        return RegimeDecision("Pinned", key, f"spec.forwardPass pins {spec.forward_pass}; traffic in regime {key}, "
                                             "the library switches nothing",
                              replace(library, current=library.current.model_copy(update={
                                  "reason": f"spec.forwardPass pins {spec.forward_pass}"})), blocks_compile=False)
    if policy.pin:
        pinned = _lookup(library, policy.pin)
        champion = _champion_for(policy, pinned, policy.pin)
        problem = champion_problem(champion, target, now, None) if pinned is not None else "it is not in the library"
        if champion is not None and problem is None:
            if not _serving(library, champion, active_forward_pass):
                return _switch(library, policy.pin, champion, now,
                               f"spec.regimes.pin holds regime {policy.pin}: switching to its champion "
                               f"{champion.forward_pass} (traffic in {key})")
            return _with_reason("Pinned", policy.pin, library, f"spec.regimes.pin holds regime {policy.pin} "
                                                                f"(champion {champion.forward_pass}; traffic in {key})",
                                champion, blocks=True)
        return _with_reason("Pinned", policy.pin, library,
                            f"spec.regimes.pin holds regime {policy.pin}, but {problem}; "
                            f"nothing is switched or compiled for traffic in {key}", blocks=True)

    current = library.current
    entry = library.get(key)
    pinned_champion = _pinned_name(policy, key)
    champion = _champion_for(policy, entry, key)
    problem = champion_problem(champion, target, now, max_age)
    if pinned_champion is not None and champion is None:
        problem = f"its pinned champion {pinned_champion} has not been verified by a CompileRun of this deployment"
    usable = champion if problem is None else None
    cooldown_until = (current.last_switch_time + timedelta(seconds=policy.switch_cooldown_seconds)
                      if current.last_switch_time is not None else None)
    cooling = cooldown_until is not None and now < cooldown_until
    if key == current.name:
        published_since = (usable is not None and usable.verified_at is not None
                           and current.last_switch_time is not None and usable.verified_at > current.last_switch_time)
        if (usable is not None and not _serving(library, usable, active_forward_pass) and current.forward_pass
                and not published_since):  # a champion published after the last switch is the target already
            # the library chose another champion for this regime before: come back to this one, a
            # switch like any other (the cooldown bounds every switch, docs/regimes.md)
            if cooling:
                return _cooling_down(library, key, usable, cooldown_until)
            return _switch(library, key, usable, now, f"traffic in regime {key}; its champion "
                                                      f"{usable.forward_pass} is not the one served")
        if usable is None and problem is not None:
            return _compile(library, spec, key, f"traffic in regime {key}, but {problem}")
        return _with_reason("Stay", key, library, f"traffic in regime {key}", usable)
    settled_checks = current.observed_checks >= policy.switch_checks
    dwell = now - (current.observed_since or now)
    if not settled_checks or dwell < timedelta(seconds=policy.min_dwell_seconds):
        return _with_reason("Settling", key, library, (
            f"traffic in regime {key} for {current.observed_checks} of {policy.switch_checks} checks "
            f"({int(dwell.total_seconds())}s of at least {policy.min_dwell_seconds}s); serving regime "
            f"{current.name}"), usable)
    if usable is None:
        reason = f"traffic settled in regime {key} (from {current.name}), but {problem}"
        if entry is None or (entry.champion is None and entry.compile_run is None):
            reason = f"traffic settled in a new regime {key} (from {current.name})"
        return _compile(library, spec, key, reason, name=key, since=now)
    # Served already (the regime came back before anything switched away): no switch to hold.
    if _serving(library, usable, active_forward_pass) and current.forward_pass == usable.forward_pass:
        return _with_reason("Stay", key, library, f"traffic back in regime {key}, its champion "
                                                  f"{usable.forward_pass} is served", usable, blocks=True, name=key,
                                                  since=now)
    if cooling:
        return _cooling_down(library, key, usable, cooldown_until)
    speed = f" (x{usable.speedup:.2f} over the shipped default)" if usable.speedup else ""
    return _switch(library, key, usable, now, f"traffic settled in regime {key} (from {current.name}) for "
                                              f"{current.observed_checks} checks: switching to its verified "
                                              f"champion {usable.forward_pass}{speed}, no CompileRun")


def _cooling_down(library: RegimeLibrary, key: str, champion: Any, until: datetime) -> RegimeDecision:
    return _with_reason("CoolingDown", key, library, (
        f"traffic settled in regime {key} (champion {champion.forward_pass}); next switch allowed after "
        f"{until.isoformat()} (spec.regimes.switchCooldownSeconds)"), champion, blocks=True)


def record_compile_run(library: RegimeLibrary, regime: str, compile_run: str, now: datetime) -> RegimeLibrary:
    """The library after a CompileRun was started for ``regime``."""
    entry = library.get(regime) or RegimeStatus(name=regime, first_seen=now, last_seen=now)
    return library.put(entry.model_copy(update={"compile_run": compile_run}))


@dataclass(frozen=True)
class Economics:
    """What a compile cost and when it pays for itself; per day and in hours as the CompileRun's
    status.economics and its printer columns say them."""

    compile_accelerator_seconds: float | None
    saved_accelerator_seconds_per_hour: float | None
    payback_seconds: float | None

    @property
    def saved_accelerator_hours_per_day(self) -> float | None:
        saved = self.saved_accelerator_seconds_per_hour
        return None if saved is None else round(saved * 24 / 3600, 6)

    @property
    def payback_hours(self) -> float | None:
        return None if self.payback_seconds is None else round(self.payback_seconds / 3600, 6)


def economics(*, started: datetime | None, completed: datetime | None, compile_accelerators: int,
              speedup: float | None, served_tokens_per_second: float | None,
              baseline_tokens_per_second_per_accelerator: float | None, serving_accelerators: int) -> Economics:
    """The compile economics of a champion, at the load served when it is recorded.

    spent = compile accelerators x the Job's wall time (completion - start), accelerator-seconds;
    busy  = min(serving accelerators, served output tokens/s / baseline tokens/s per accelerator):
            the accelerators busy serving that rate at the old speed (the baseline's replay
            throughput per accelerator); at the new speed the same rate keeps busy / speedup busy;
    saved = busy - busy / speedup = busy x (1 - 1/speedup) accelerator-seconds per second of serving,
            reported per hour (x 3600 accelerator-seconds) and per day (x 24 accelerator-hours);
    payback = spent / saved seconds (/ 3600: hours) of serving at that load.

    Unknown (None) where a time, the served rate, the baseline or the speedup is missing; no payback
    where the champion saves nothing (a speedup of at most 1, or no traffic)."""
    spent = None
    if started is not None and completed is not None:
        spent = round(compile_accelerators * max((completed - started).total_seconds(), 0.0), 3)
    saved = None  # accelerator-seconds per second
    if (speedup is not None and speedup > 0 and served_tokens_per_second is not None
            and baseline_tokens_per_second_per_accelerator):
        busy = min(float(serving_accelerators), served_tokens_per_second / baseline_tokens_per_second_per_accelerator)
        saved = busy * max(0.0, 1.0 - 1.0 / speedup)
    payback = spent / saved if spent is not None and saved else None
    return Economics(
        compile_accelerator_seconds=spent,
        saved_accelerator_seconds_per_hour=round(saved * 3600, 3) if saved is not None else None,
        payback_seconds=round(payback, 3) if payback is not None else None,
    )


def refresh_savings(library: RegimeLibrary, regime: str, cost: Economics, measured_at: datetime) -> RegimeLibrary:
    """The library with ``regime``'s champion's saved and payback as ``cost`` says at the load read
    at ``measured_at`` (its spent unchanged)."""
    entry = library.get(regime)
    if entry is None or entry.champion is None:
        return library
    champion = entry.champion.model_copy(update={
        "saved_accelerator_seconds_per_hour": cost.saved_accelerator_seconds_per_hour,
        "payback_seconds": cost.payback_seconds, "savings_measured_at": measured_at})
    return library.put(entry.model_copy(update={"champion": champion}))


def record_rollback(library: RegimeLibrary, forward_pass: str, when: datetime, why: str | None) -> RegimeLibrary:
    """The library after the deployment's rollout rolled ``forward_pass`` back: every regime whose
    champion it is keeps it, marked, so that no switch goes back to a pass the rollout will not retry
    (it retries a target only once the target changes) and traffic in that regime compiles instead.
    A champion recorded later for the regime (a new CompileRun's) replaces the marked one."""
    for entry in library.regimes:
        champ = entry.champion
        if champ is not None and champ.forward_pass == forward_pass and champ.rolled_back_at is None:
            library = library.put(entry.model_copy(update={"champion": champ.model_copy(update={
                "rolled_back_at": when, "rolled_back_reason": (why or "")[:1024] or None})}))
    return library


def record_champion(library: RegimeLibrary, regime: str, forward_pass: Mapping[str, Any], compile_run: str,
                    completed: datetime | None, cost: Economics | None = None,
                    engine_image: str | None = None, measured_at: datetime | None = None) -> RegimeLibrary:
    """The library after ``forward_pass`` (a ForwardPass object the rollout's trust rules accepted)
    was published by ``compile_run`` for ``regime``; ``cost``: what that compile cost and saves
    (at the load read at ``measured_at``); ``engine_image``: the deployment's spec.engine.image it
    was recorded under."""
    spec = forward_pass.get("spec") or {}
    engine = spec.get("engine")
    champion = RegimeChampion(
        forward_pass=forward_pass["metadata"]["name"],
        sha256=(spec.get("artifact") or {}).get("sha256"),
        speedup=(spec.get("metrics") or {}).get("speedup"),
        accelerator=(spec.get("hardware") or {}).get("accelerator"),
        model=(spec.get("model") or {}).get("name"),
        dtype=(spec.get("model") or {}).get("dtype"),
        model_config_sha256=(spec.get("model") or {}).get("configSha256"),
        engine_image=engine_image,
        # a pass that recorded no engine env was measured with none set
        engine_env_sha256=engine_env_sha256((engine or {}).get("env")),
        compile_run=compile_run,
        verified_at=completed,
        compile_accelerator_seconds=cost.compile_accelerator_seconds if cost else None,
        saved_accelerator_seconds_per_hour=cost.saved_accelerator_seconds_per_hour if cost else None,
        payback_seconds=cost.payback_seconds if cost else None,
        savings_measured_at=measured_at,
    )
    entry = library.get(regime) or RegimeStatus(name=regime, first_seen=completed, last_seen=completed)
    return library.put(entry.model_copy(update={"champion": champion}))


def target_forward_pass(spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus,
                        newest_champion: tuple[str, str] | None) -> str | None:
    """What the rollout should run: spec.forwardPass; else the champion of spec.regimes.pin's regime;
    else a pinned champion of the current regime; else the champion the library last switched to,
    unless a CompileRun finished after that switch (``newest_champion``: (completion time as the API
    server writes it, champion) of the deployment's newest successful CompileRun), whose champion
    wins as before the library existed."""
    if spec.forward_pass:
        return spec.forward_pass
    current = status.current_regime
    policy = _policy(spec)
    if policy.pin:  # the pinned regime's champion, pinned or recorded, whatever finished since
        pinned = _pinned_name(policy, policy.pin)
        recorded = next((r.champion for r in status.regimes or [] if same_regime(r.name, policy.pin) and r.champion),
                        None)
        if pinned is not None or recorded is not None:
            return pinned or recorded.forward_pass  # type: ignore[union-attr]
    if current is not None and current.name is not None:
        pinned = _pinned_name(policy, current.name)
        if pinned is not None:
            return pinned
    if current is not None and current.forward_pass and current.last_switch_time is not None:
        switched = current.last_switch_time.strftime("%Y-%m-%dT%H:%M:%SZ")
        if newest_champion is None or newest_champion[0] <= switched:
            return current.forward_pass
    return newest_champion[1] if newest_champion else None


def pending_champions(library: RegimeLibrary, compile_runs: Sequence[Mapping[str, Any]]
                      ) -> list[tuple[str, Mapping[str, Any]]]:
    """(regime, CompileRun) for each regime whose last CompileRun succeeded with a champion the
    library has not recorded yet."""
    by_name = {run["metadata"]["name"]: run for run in compile_runs}
    pending = []
    for regime in library.regimes:
        run = by_name.get(regime.compile_run or "")
        if run is None or (regime.champion is not None and regime.champion.compile_run == regime.compile_run):
            continue
        status = run.get("status") or {}
        if status.get("phase") == "Succeeded" and status.get("champion"):
            pending.append((regime.name, run))
    return pending


def newest_champion(compile_runs: Sequence[Mapping[str, Any]], deployment: str,
                    verified: Sequence[VerifiedForwardPass] = ()) -> tuple[str, str] | None:
    """(completion time, champion) of what operator/rollout_target.champion_of picks."""
    name = champion_of(list(compile_runs), deployment, verified)
    if name is None:
        return None
    times = [(run.get("status") or {}).get("completionTime") or "" for run in compile_runs
             if (run.get("spec") or {}).get("deploymentRef", {}).get("name") == deployment
             and (run.get("status") or {}).get("champion") == name]
    times += [r.completion_time.strftime("%Y-%m-%dT%H:%M:%SZ") for r in verified
              if r.name == name and r.completion_time is not None]
    return (max(times) if times else "", name)
