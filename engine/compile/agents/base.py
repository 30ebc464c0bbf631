"""What every search agent shares: the board view it learns from, and the thread that runs it.

Data flow:
    board (results of the fast tier) --scored()--> agent.propose(n) --> candidates
    AgentWorker thread: propose -> validate against the space -> board "candidate" entry
                        -> bounded experiment queue (blocks while full; the loop drains it)
    errors / garbage --> board "note" entries; the worker backs off and keeps going

An agent never measures anything itself; it only reads the board (what was tried, what
it scored) and proposes. Agents are independent of one another and of the measuring
loop, so a slow thinker (the LLM agent) never stalls the device.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from shapeshift.engine.compile.board import Board, ranking
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.search_space import SearchSpace

log = logging.getLogger(__name__)

SCREEN_TIER = "fast"


@dataclass(frozen=True)
class Scored:
    """One measured candidate as agents see it."""

    digest: str
    recipe: dict[str, Any]
    source: str | None
    throughput: float  # 0.0 for a candidate that failed (crashed, NaN, refused)
    failed: bool
    agent: str
    # over the stock pass, chained through paired comparisons (None where the board recorded none)
    speedup: float | None = None

    @property
    def rank(self) -> tuple[float, float]:
        """The leaderboard's order (board.ranking)."""
        return ranking(self.speedup, self.throughput)


def scored(board: Board, space: SearchSpace, tier: str = SCREEN_TIER) -> list[Scored]:
    """Every candidate with a finished result on `tier` (best result per digest), best first."""
    cands = {c["digest"]: c for c in board.entries("candidate")}
    best: dict[str, Scored] = {}
    for r in board.entries("result"):
        if r.get("tier") != tier or r["digest"] not in cands:
            continue
        c = cands[r["digest"]]
        ok = r.get("status") == "ok"
        metrics = r.get("metrics") or {}
        tput = float(metrics.get("throughput") or 0.0) if ok else 0.0
        speedup = metrics.get("speedup") if ok else None
        s = Scored(r["digest"], space.complete(c.get("recipe") or {}), c.get("source"), tput, not ok,
                   c.get("agent", "?"), None if speedup is None else float(speedup))
        if r["digest"] not in best or s.rank > best[r["digest"]].rank:
            best[r["digest"]] = s
    return sorted(best.values(), key=lambda s: (-s.rank[0], -s.rank[1], s.digest))


def proposed_digests(board: Board) -> set[str]:
    """Digests any agent already proposed (measured or still queued)."""
    return {c["digest"] for c in board.entries("candidate")}


class Agent:
    """Base class: subclasses implement `propose`."""

    name = "agent"

    def __init__(self, space: SearchSpace, board: Board, seed: int = 0):
        self.space = space
        self.board = board
        self.rng = random.Random(f"{self.name}:{seed}")
        self.seed = seed
        self.state = "idle"
        self.proposed = 0
        self.errors = 0

    def propose(self, n: int = 1) -> list[Candidate]:
        raise NotImplementedError

    def fresh(self, candidates: list[Candidate], seen: set[str] | None = None) -> list[Candidate]:
        """Drop candidates already on the board (and duplicates within the list)."""
        seen = set(proposed_digests(self.board) if seen is None else seen)
        out = []
        for c in candidates:
            if c.digest not in seen:
                seen.add(c.digest)
                out.append(c)
        return out

    def describe(self) -> dict[str, Any]:
        return {"agent": self.name, "state": self.state, "proposed": self.proposed, "errors": self.errors}


class GarbageCandidate(ValueError):
    """An agent returned something that is not a valid candidate."""


def check_candidate(space: SearchSpace, candidate: Any) -> Candidate:
    """Raise GarbageCandidate unless `candidate` is a Candidate with a valid recipe."""
    if not isinstance(candidate, Candidate):
        raise GarbageCandidate(f"expected a Candidate, got {type(candidate).__name__}")
    problems = space.validate(candidate.recipe)
    if problems:
        raise GarbageCandidate("invalid recipe: " + "; ".join(problems))
    if candidate.source is not None:
        if not isinstance(candidate.source, str) or "def build" not in candidate.source:
            raise GarbageCandidate("source does not define build()")
        try:
            compile(candidate.source, "<candidate forward.py>", "exec")
        except SyntaxError as exc:
            raise GarbageCandidate(f"source does not parse: {exc}") from None
    return candidate


def submit(agent: Agent, board: Board, space: SearchSpace, proposals: Any) -> list[Candidate]:
    """Validate an agent's proposals, log garbage to the board, post the good ones as candidates."""
    good: list[Candidate] = []
    if not isinstance(proposals, (list, tuple)):
        board.note(agent.name, f"garbage: propose() returned {type(proposals).__name__}, not a list", garbage=True)
        return good
    for proposal in proposals:
        try:
            cand = check_candidate(space, proposal)
        except GarbageCandidate as exc:
            agent.errors += 1
            board.note(agent.name, f"garbage candidate skipped: {exc}", garbage=True)
            continue
        cand = Candidate(space.complete(cand.recipe), cand.source, agent.name, cand.note, cand.parent)
        board.append("candidate", **cand.to_entry())
        agent.proposed += 1
        good.append(cand)
    return good


class AgentWorker(threading.Thread):
    """Runs one agent until `stop` is set: propose, validate, post, enqueue."""

    def __init__(self, agent: Agent, board: Board, space: SearchSpace, experiments: "queue.Queue[Candidate]",
                 stop: threading.Event, batch: int = 1, idle_sleep_s: float = 0.2, max_backoff_s: float = 5.0):
        super().__init__(name=f"agent-{agent.name}", daemon=True)
        self.agent, self.board, self.space = agent, board, space
        self.experiments, self.stop_event = experiments, stop
        self.batch, self.idle_sleep_s, self.max_backoff_s = batch, idle_sleep_s, max_backoff_s

    def run(self) -> None:
        backoff = self.idle_sleep_s
        while not self.stop_event.is_set():
            if self.experiments.full():
                self.agent.state = "waiting: queue full"
                self.stop_event.wait(self.idle_sleep_s)
                continue
            self.agent.state = "thinking"
            try:
                proposals = self.agent.propose(self.batch)
            except Exception as exc:  # noqa: BLE001 - an agent's failure must not end the run
                self.agent.errors += 1
                self.agent.state = f"error: {type(exc).__name__}"
                log.warning("agent %s raised %s: %s", self.agent.name, type(exc).__name__, exc)
                self.board.note(self.agent.name, f"agent raised {type(exc).__name__}: {exc}",
                                error=True, traceback=traceback.format_exc(limit=5))
                self.stop_event.wait(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)
                continue
            good = submit(self.agent, self.board, self.space, proposals)
            if not good:
                # Nothing new until the board changes: back off, so an idle agent does not
                # take CPU from the measurement.
                self.agent.state = "idle: nothing new to propose"
                self.stop_event.wait(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)
                continue
            backoff = self.idle_sleep_s
            for cand in good:
                while not self.stop_event.is_set():
                    try:
                        self.experiments.put(cand, timeout=self.idle_sleep_s)
                        break
                    except queue.Full:
                        self.agent.state = "waiting: queue full"
        self.agent.state = "stopped"
