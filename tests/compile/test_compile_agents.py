"""Search space and the offline agents: valid proposals, learning from the board, failures logged."""

from __future__ import annotations

import queue
import random
import threading
import time
from pathlib import Path

import pytest

from shapeshift.engine.compile.agents import (AgentWorker, BayesAgent, EvolveAgent, SweepAgent, check_candidate,
                                              make_agents, scored)
from shapeshift.engine.compile.agents.base import Agent, GarbageCandidate
from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.search_space import build_search_space, split_recipe


@pytest.fixture
def space():
    return build_search_space(device="cpu", model_family="llama", stock_recipe={"attention_backend": "torch"},
                              concurrency=32)


def post(board: Board, cand: Candidate, throughput: float | None, tier: str = "fast") -> None:
    """An agent's input: a candidate and its result as the loop would record them."""
    board.append("candidate", **cand.to_entry())
    if throughput is None:
        board.append("result", trial_id=f"t-{cand.short}", digest=cand.digest, tier=tier, status="failed",
                     metrics={}, error="crashed")
    else:
        board.append("result", trial_id=f"t-{cand.short}", digest=cand.digest, tier=tier, status="ok",
                     metrics={"throughput": throughput})


def test_space_validity_sampling_and_walks(space) -> None:
    default = space.default()
    assert space.is_valid(default)
    assert any(n.startswith("edit.") for n in space.names) and "engine.max_num_seqs" in space.names
    assert "attention_backend" in space.names and space.knob("attention_backend").values == ("torch",)  # no triton on CPU
    assert not any(n.startswith("kernel.") for n in space.names)
    assert space.validate({"nope": 1}) == ["unknown knob 'nope'"]
    assert "not one of" in space.validate({"engine.max_num_seqs": 3})[0]
    # sampling is seeded and always valid
    a = [space.sample(random.Random(7)) for _ in range(3)]
    b = [space.sample(random.Random(7)) for _ in range(3)]
    assert a == b and all(space.is_valid(r) for r in a)
    points = list(space.enumerate(limit=40))
    assert len(points) == 40 and points[0] == default
    assert len({tuple(sorted(p.items())) for p in points}) == 40
    for r in space.neighbors(default, "engine.max_num_seqs"):
        assert {k for k in r if r[k] != default[k]} == {"engine.max_num_seqs"}
    recipe, engine, edits = split_recipe({**default, "edit.index_select_gather": True, "fuse_qkv": True,
                                          "engine.max_num_seqs": 16})
    assert edits == ["index_select_gather"] and recipe["fuse_qkv"] is True and engine["max_num_seqs"] == 16 and "attention_backend" in recipe


def test_constraints_reject_conflicting_values() -> None:
    from shapeshift.engine.compile.search_space import Knob, SearchSpace, _constraint_batch_budget

    small = SearchSpace([Knob("engine.max_num_seqs", (8, 64), 8), Knob("engine.max_num_batched_tokens", (16, 32), 32)],
                        [("batch budget", _constraint_batch_budget)])
    assert small.is_valid({"engine.max_num_seqs": 8, "engine.max_num_batched_tokens": 16})
    assert "batch budget" in small.validate({"engine.max_num_seqs": 64})[0]
    assert all(r["engine.max_num_batched_tokens"] >= r["engine.max_num_seqs"] for r in small.enumerate())
    assert len(list(small.enumerate())) == 2
    cuda = build_search_space(device="cuda", concurrency=128)
    assert "engine.cuda_graph_max_batch" in cuda.names and "triton" in cuda.knob("attention_backend").values
    bad = {**cuda.default(), "engine.max_num_seqs": 8, "engine.cuda_graph_max_batch": 64}
    assert any("graph" in p for p in cuda.validate(bad))


def test_each_agent_proposes_valid_fresh_candidates(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    post(board, Candidate(space.default(), agent="baseline"), 100.0)
    for agent in make_agents(["sweep", "evolve", "bayes"], space, board, seed=3):
        proposals = agent.propose(2)
        assert proposals, agent.name
        for cand in proposals:
            check_candidate(space, cand)
            assert cand.agent == agent.name and cand.note
            assert board.candidate(cand.digest) is None  # nothing already on the board


def test_sweep_moves_around_the_best(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    base = space.default()
    best = {**base, "edit.index_select_gather": True}
    post(board, Candidate(base, agent="baseline"), 100.0)
    post(board, Candidate(best, agent="x"), 150.0)
    sweep = SweepAgent(space, board, seed=0)
    seen_knobs = set()
    for _ in range(6):
        props = sweep.propose(1)
        for c in props:
            # every proposal is one knob away from the best recipe
            diff = {k for k in c.recipe if c.recipe[k] != best[k]}
            assert len(diff) == 1, diff
            seen_knobs |= diff
            post(board, c, 90.0)
    assert len(seen_knobs) >= 3


def test_sweep_tries_the_binding_knobs_first_when_the_slo_binds(tmp_path: Path, space) -> None:
    """Where the best result's requests miss the SLO, the sweep's first line search is over the
    settings that move the side that binds, and its note says so; where the SLO is met it keeps
    the space's order (code paths first)."""
    from shapeshift.engine.compile.agents.sweep import slo_guidance

    def first_line(missed: dict) -> list[Candidate]:
        board = Board(tmp_path / f"b{len(list(tmp_path.iterdir()))}.jsonl")
        base = Candidate(space.default(), agent="baseline")
        board.append("candidate", **base.to_entry())
        board.append("result", trial_id="t0", digest=base.digest, tier="fast", status="ok",
                     metrics={"throughput": 100.0, "slo_attainment": 0.5, **missed})
        return SweepAgent(space, board, seed=0).propose(1)

    def changed(cands: list[Candidate]) -> set[str]:
        default = space.default()
        return {k for c in cands for k in c.recipe if c.recipe[k] != default[k]}

    slow = first_line({"slo_missed_per_user": 0.6, "slo_missed_ttft": 0.05})
    assert changed(slow) == {"engine.max_num_seqs"} and len(slow) == len(space.knob("engine.max_num_seqs").values) - 1
    assert all("60% of requests streamed slower" in c.note for c in slow)
    late = first_line({"slo_missed_per_user": 0.0, "slo_missed_ttft": 0.4})
    assert changed(late) == {"engine.max_num_batched_tokens"} and "first token late" in late[0].note
    met = first_line({"slo_missed_per_user": 0.05, "slo_missed_ttft": 0.02})
    assert changed(met) and not any(k.startswith("engine.") for k in changed(met)) and "SLO" not in met[0].note
    assert slo_guidance(None) == ((), None) and slo_guidance({"slo_missed_ttft": 0.1})[0] == ()


def test_a_sweep_line_starts_next_to_the_current_value(tmp_path: Path, space) -> None:
    """The token budget's line around 2048 goes 1024, 4096, 512, 8192, ...: the nearest values
    first, so a budget that ends inside the line has screened the likeliest ones."""
    board = Board(tmp_path / "b.jsonl")
    base = Candidate(space.default(), agent="baseline")
    board.append("candidate", **base.to_entry())
    board.append("result", trial_id="t0", digest=base.digest, tier="fast", status="ok",
                 metrics={"throughput": 100.0, "slo_attainment": 0.5, "slo_missed_ttft": 0.4})
    line = SweepAgent(space, board, seed=0).propose(1)
    knob = space.knob("engine.max_num_batched_tokens")
    values = list(knob.values)
    here = values.index(space.default()["engine.max_num_batched_tokens"])
    order = [values.index(c.recipe["engine.max_num_batched_tokens"]) for c in line]
    assert [abs(i - here) for i in order] == sorted(abs(i - here) for i in order), order
    assert order[0] == here - 1 and (here + 1 >= len(values) or order[1] == here + 1), (values, order)


def test_settings_the_traffic_does_not_fit_are_swept_first_wider_first(tmp_path: Path) -> None:
    """Traffic that keeps 8 requests in flight at a deployment serving batches of 2 queues whatever
    the code does: the sweep's first line is the batch width, from the narrowest width that admits
    all 8 outward, narrower than now last, each note saying why; once the best admits the whole
    concurrency the space's order (code paths first) is back. Prompts longer than the step's token
    budget likewise put the budget first; where both misfit, the worse (needed over set) goes first;
    the pass to beat's least fitting settings are the seeds measured before anything else."""
    from shapeshift.engine.compile.agents.sweep import first_fitting, traffic_guidance
    from shapeshift.engine.compile.search_space import Knob, SearchSpace

    narrow = build_search_space(device="cpu", concurrency=8, max_model_len=256, engine_defaults={"max_num_seqs": 2})
    board = Board(tmp_path / "b.jsonl")
    post(board, Candidate(narrow.default(), agent="baseline"), 100.0)
    line = SweepAgent(narrow, board, seed=0).propose(1)
    widths = [c.recipe["engine.max_num_seqs"] for c in line]
    assert widths == [8, 4, 16, 32, 64], widths
    assert all({k for k in c.recipe if c.recipe[k] != narrow.default()[k]} == {"engine.max_num_seqs"} for c in line)
    assert all("the traffic keeps 8 in flight, the batch takes 2" in c.note for c in line)
    [seed] = first_fitting(narrow)
    assert seed.recipe == {**narrow.default(), "engine.max_num_seqs": 8} and seed.agent == "traffic"
    # the best now admits everyone: no queue, the sweep goes on in the space's order
    wide = {**narrow.default(), "engine.max_num_seqs": 8}
    post(board, Candidate(wide, agent="sweep"), 150.0)
    assert traffic_guidance(narrow, wide) == []
    after = SweepAgent(narrow, board, seed=0).propose(1)
    assert after and not any(k.startswith("engine.") for c in after for k in c.recipe if c.recipe[k] != wide[k])
    # no traffic known, or settings already as wide as it: no guidance, no seeds
    assert traffic_guidance(SearchSpace([Knob("engine.max_num_seqs", (2, 8), 2)]), {"engine.max_num_seqs": 2}) == []
    assert first_fitting(build_search_space(device="cpu", concurrency=8, prompt_tokens_p90=512)) == []
    # prompts of 195 tokens (p90) at a step of 16 tokens and 8 in flight at a batch of 2: the token
    # budget misfits 12x, the batch 4x, so the budget's line comes first, from 256 (the first >= 195)
    both = build_search_space(device="cpu", concurrency=8, prompt_tokens_p90=195, max_model_len=256,
                              engine_defaults={"max_num_seqs": 2, "max_num_batched_tokens": 16})
    assert [k for k, _, _ in traffic_guidance(both, both.default())] == ["engine.max_num_batched_tokens",
                                                                         "engine.max_num_seqs"]
    budget = SweepAgent(both, Board(tmp_path / "c.jsonl"), seed=0).propose(1)
    assert [c.recipe["engine.max_num_batched_tokens"] for c in budget][:2] == [256, 512]
    # once the wider values are on the board, the line proposes no narrower one: those fit the
    # traffic worse still (on an H200, 2048 down to 256 after a winning 8192: 0.03x to 0.61x)
    mid = build_search_space(device="cpu", concurrency=8, prompt_tokens_p90=3000, max_model_len=4096,
                             engine_defaults={"max_num_seqs": 8, "max_num_batched_tokens": 512})
    wider_seen = Board(tmp_path / "d.jsonl")
    post(wider_seen, Candidate(mid.default(), agent="baseline"), 100.0)
    line = SweepAgent(mid, wider_seen, seed=0).propose(1)
    assert [c.recipe["engine.max_num_batched_tokens"] for c in line] == [4096, 2048, 8192, 1024]  # no 256
    for c in line:
        post(wider_seen, c, 90.0)
    after_wider = SweepAgent(mid, wider_seen, seed=0).propose(1)
    assert after_wider and not any("p90 prompts are 3000 tokens" in c.note for c in after_wider)
    assert "p90 prompts are 195 tokens, a step takes 16" in budget[0].note
    assert [(c.recipe["engine.max_num_batched_tokens"], c.recipe["engine.max_num_seqs"]) for c in first_fitting(both)] \
        == [(256, 2), (16, 8)]
    # a p90 prompt beyond the context is read within it
    assert build_search_space(device="cpu", prompt_tokens_p90=100_000, max_model_len=1024).prompt_tokens_p90 == 1024


def test_evolve_recombines_the_best(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    rng = random.Random(0)
    good = []
    for i in range(8):
        r = space.sample(rng)
        c = Candidate(r, agent="x", note=str(i))
        post(board, c, 100.0 + 10 * i)
        good.append(c)
    post(board, Candidate(space.sample(rng), agent="x", note="failed"), None)
    top = {c.digest for c in good}
    evolve = EvolveAgent(space, board, seed=1)
    children = evolve.propose(5)
    assert len(children) == 5
    for child in children:
        assert child.parent in top and "crossover" in child.note
        check_candidate(space, child)


def test_bayes_learns_which_value_is_fast(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    rng = random.Random(5)
    # Throughput on this board depends on one knob only: sdpa decode attention on = fast.
    for _ in range(24):
        r = space.sample(rng)
        post(board, Candidate(r, agent="x"), 200.0 if r["edit.index_select_gather"] else 100.0)
    bayes = BayesAgent(space, board, seed=0)
    proposals = []
    for _ in range(12):
        for c in bayes.propose(1):
            proposals.append(c)
            board.append("candidate", **c.to_entry())
    assert len(proposals) >= 8
    share = sum(c.recipe["edit.index_select_gather"] for c in proposals) / len(proposals)
    assert share >= 0.75, share


class RaisingAgent(Agent):
    name = "raiser"

    def propose(self, n=1):
        self.calls = getattr(self, "calls", 0) + 1
        raise RuntimeError(f"thinking failed #{self.calls}")


class GarbageAgent(Agent):
    name = "garbage"

    def propose(self, n=1):
        return [Candidate({"no_such_knob": 1}), "not a candidate",
                Candidate(self.space.default(), source="def build(:\n"),
                Candidate({**self.space.default(), "fuse_qkv": True}, agent="garbage", note="ok one")]


def test_failing_and_garbage_agents_are_logged_and_go_on(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    experiments: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()
    raiser, garbage = RaisingAgent(space, board), GarbageAgent(space, board)
    workers = [AgentWorker(a, board, space, experiments, stop, idle_sleep_s=0.05, max_backoff_s=0.1)
               for a in (raiser, garbage)]
    for w in workers:
        w.start()
    got = experiments.get(timeout=10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sum("thinking failed" in n["text"] for n in board.entries("note")) < 3:
        try:  # drain like the loop does; a full queue parks every agent (by design)
            experiments.get(timeout=0.05)
        except queue.Empty:
            pass
    stop.set()
    for w in workers:
        w.join(timeout=5)
    assert got.recipe["fuse_qkv"] is True and got.agent == "garbage"
    notes = board.entries("note")
    assert sum("thinking failed" in n["text"] for n in notes) >= 3  # kept retrying after each error
    garbage_notes = [n["text"] for n in notes if n.get("garbage")]
    assert any("unknown knob" in t for t in garbage_notes)
    assert any("not a list" in t or "expected a Candidate" in t for t in garbage_notes)
    assert any("does not parse" in t for t in garbage_notes)
    with pytest.raises(GarbageCandidate):
        check_candidate(space, Candidate({"no_such_knob": 1}))


def test_agents_rank_by_the_paired_speedup_not_by_a_lucky_remeasure(tmp_path: Path, space) -> None:
    """The baseline is re-measured beside every paired screen; on a drifting machine its best draw
    can beat a candidate's one raw figure although the paired speedup says the candidate is faster
    (on an H200, an 8192-token budget at 1.112x lost the sweep's base to the default that way).
    Agents see the leaderboard's order: paired speedup first, then throughput."""
    board = Board(tmp_path / "b.jsonl")
    base = Candidate(space.default(), agent="baseline")
    board.append("candidate", **base.to_entry())
    for i, tput in enumerate((100.0, 104.0, 118.0)):  # the last one a lucky draw
        board.append("result", trial_id=f"t{i}", digest=base.digest, tier="fast", status="ok",
                     metrics={"throughput": tput, "speedup": 1.0})
    better = Candidate({**space.default(), "fuse_qkv": True}, agent="sweep")
    board.append("candidate", **better.to_entry())
    board.append("result", trial_id="t9", digest=better.digest, tier="fast", status="ok",
                 metrics={"throughput": 112.0, "speedup": 1.11})
    rows = scored(board, space)
    assert [r.digest for r in rows] == [better.digest, base.digest], rows
    assert rows[0].rank > rows[1].rank and rows[1].throughput == 118.0
    assert board.leaderboard("fast")[0].digest == better.digest  # the same order as the report's


def test_scored_view_marks_failures(tmp_path: Path, space) -> None:
    board = Board(tmp_path / "b.jsonl")
    post(board, Candidate(space.default(), agent="a"), 50.0)
    post(board, Candidate({**space.default(), "fuse_qkv": True}, agent="b"), None)
    rows = scored(board, space)
    assert [r.failed for r in rows] == [False, True] and rows[1].throughput == 0.0
