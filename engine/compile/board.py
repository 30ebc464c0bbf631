"""The message board: an append-only JSON-lines log that agents and the loop share.

Data flow:
    agents / loop --append(kind, fields)--> one JSON object per line, fsync'd
    agents / loop / resume --entries() / leaderboard()--> parsed entries, best results

Entry kinds (field ``kind``):
    run           a compile run started or resumed (settings, seed)
    candidate     an agent proposed something (recipe, source, agent, note, parent)
    trial         the loop started measuring a candidate (trial_id, digest, tier)
    result        a measurement finished (trial_id, digest, tier, status, metrics, noise); status
                  ok, missed-slo (ran, no request met the SLO) or failed
    verification  the gates' verdict on a confirmed winner (digest, passed, report)
    incumbent     a verified candidate became the incumbent (digest, speedup)
    note          free text: why an agent did something, an agent error, garbage it returned

Durability: each append takes an exclusive ``flock`` on the file (processes) and a
``threading.Lock`` (threads of this process), writes one complete line with O_APPEND,
then ``fsync``s. A crash can leave at most the last line torn; readers ignore a line
without its trailing newline, and the next writer truncates such a tail before it
appends, so nothing that was completely written is ever lost or merged with new data.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

KINDS = ("run", "candidate", "trial", "result", "verification", "incumbent", "note")


@dataclass(frozen=True)
class LeaderRow:
    """One line of the leaderboard: the best finished result of one candidate on one tier."""

    digest: str
    agent: str
    tier: str
    throughput: float  # output tokens/s, mean over repeats
    low: float  # lower bound over repeats
    high: float  # upper bound over repeats
    speedup: float | None  # against the baseline measured on the same tier
    per_user_p90: float | None
    note: str
    trial_id: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Board:
    """Append-only, crash-safe, shared JSON-lines board (see module docstring)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(exist_ok=True)
        self._thread_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._entries: list[dict[str, Any]] = []
        self._offset = 0  # bytes of the file already parsed (always just after a newline)
        self.skipped_lines = 0  # complete lines that were not valid JSON objects

    # ------------------------------------------------------------------ writing

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one entry durably and return it (with id, ts, pid added)."""
        if kind not in KINDS:
            raise ValueError(f"board entry kind {kind!r} is not one of {KINDS}")
        entry = {"kind": kind, "id": uuid.uuid4().hex[:16], "ts": time.time(), "pid": os.getpid(), **fields}
        line = (json.dumps(entry, sort_keys=True, default=str) + "\n").encode("utf-8")
        with self._thread_lock:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    self._repair_torn_tail(fd)
                    written = 0
                    while written < len(line):  # os.write may write less than asked
                        written += os.write(fd, line[written:])
                    os.fsync(fd)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        return entry

    def note(self, agent: str, text: str, **fields: Any) -> dict[str, Any]:
        return self.append("note", agent=agent, text=text, **fields)

    def _repair_torn_tail(self, fd: int) -> None:
        """Under the lock: cut a torn last line (a writer died mid-write) back to the last newline."""
        size = os.fstat(fd).st_size
        if size == 0:
            return
        if os.pread(fd, 1, size - 1) == b"\n":
            return
        # Scan backwards in chunks for the last newline.
        end = size
        cut = 0
        while end > 0:
            start = max(0, end - 65536)
            chunk = os.pread(fd, end - start, start)
            pos = chunk.rfind(b"\n")
            if pos >= 0:
                cut = start + pos + 1
                break
            end = start
        log.warning("board %s: dropping a torn last line of %d bytes (a writer stopped mid-write)",
                    self.path, size - cut)
        os.ftruncate(fd, cut)

    # ------------------------------------------------------------------ reading

    def refresh(self) -> list[dict[str, Any]]:
        """Parse what other writers appended since the last call; returns the new entries."""
        with self._read_lock:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n")
            if end < 0:
                return []  # nothing complete yet (or only a torn line)
            new: list[dict[str, Any]] = []
            for raw in data[: end + 1].split(b"\n")[:-1]:
                if not raw.strip():
                    continue
                try:
                    entry = json.loads(raw)
                except ValueError:
                    self.skipped_lines += 1
                    log.warning("board %s: skipping a line that is not JSON: %.80r", self.path, raw)
                    continue
                if not isinstance(entry, dict) or "kind" not in entry:
                    self.skipped_lines += 1
                    continue
                new.append(entry)
            self._offset += end + 1
            self._entries.extend(new)
            return new

    def entries(self, kind: str | Iterable[str] | None = None) -> list[dict[str, Any]]:
        """All complete entries in file order (optionally of some kinds)."""
        self.refresh()
        with self._read_lock:
            entries = list(self._entries)
        if kind is None:
            return entries
        kinds = {kind} if isinstance(kind, str) else set(kind)
        return [e for e in entries if e["kind"] in kinds]

    def candidate(self, digest: str) -> dict[str, Any] | None:
        """The first candidate entry with this digest (it carries the recipe and source)."""
        for entry in self.entries("candidate"):
            if entry.get("digest") == digest:
                return entry
        return None

    def results(self, tier: str | None = None, status: str | None = "ok") -> list[dict[str, Any]]:
        out = []
        for e in self.entries("result"):
            if tier is not None and e.get("tier") != tier:
                continue
            if status is not None and e.get("status") != status:
                continue
            out.append(e)
        return out

    def finished_trials(self) -> dict[str, dict[str, Any]]:
        """trial_id -> its (last) result entry, whatever its status."""
        done: dict[str, dict[str, Any]] = {}
        for e in self.entries("result"):
            done[e["trial_id"]] = e
        return done

    def leaderboard(self, tier: str = "fast", k: int | None = 10) -> list[LeaderRow]:
        """Best ok result per candidate on `tier`, fastest first: by speedup over the stock pass
        where recorded (chained through paired comparisons, so the machine's drift between
        screens does not rank a pass against itself), else by throughput."""
        def rank(metrics: dict[str, Any]) -> tuple[float, float]:
            return ranking(metrics.get("speedup"), float(metrics["throughput"]))

        best: dict[str, dict[str, Any]] = {}
        for e in self.results(tier):
            metrics = e.get("metrics") or {}
            if metrics.get("throughput") is None:
                continue
            cur = best.get(e["digest"])
            if cur is None or rank(metrics) > rank(cur["metrics"]):
                best[e["digest"]] = e
        cands = {c["digest"]: c for c in self.entries("candidate")}
        rows = []
        for digest, e in best.items():
            m = e["metrics"]
            cand = cands.get(digest, {})
            rows.append(LeaderRow(
                digest=digest,
                agent=e.get("agent") or cand.get("agent", "?"),
                tier=tier,
                throughput=float(m["throughput"]),
                low=float(m.get("low", m["throughput"])),
                high=float(m.get("high", m["throughput"])),
                speedup=m.get("speedup"),
                per_user_p90=m.get("per_user_p90"),
                note=(cand.get("note") or "")[:120],
                trial_id=e["trial_id"],
            ))
        rows.sort(key=lambda r: (-(r.speedup if r.speedup is not None else -1.0), -r.throughput, r.digest))
        return rows if k is None else rows[:k]


def ranking(speedup: float | None, throughput: float) -> tuple[float, float]:
    """The board's order, leaderboard and agents alike: the speedup over the stock pass where
    recorded (chained through paired comparisons), then throughput. Raw throughput alone ranks a
    pass measured often (the baseline, re-measured beside every paired screen) by its luckiest
    draw on a drifting machine."""
    return (-1.0 if speedup is None else float(speedup), throughput)


def format_leaderboard(rows: list[LeaderRow]) -> str:
    """A fixed-width text table of leaderboard rows."""
    lines = [f"{'#':>2} {'digest':12} {'agent':8} {'tok/s':>10} {'range':>19} {'speedup':>8}  note"]
    for i, r in enumerate(rows, 1):
        speed = f"{r.speedup:.3f}x" if r.speedup is not None else "-"
        lines.append(f"{i:>2} {r.digest[:12]:12} {r.agent[:8]:8} {r.throughput:10.1f} "
                     f"{'[' + format(r.low, '.1f') + ', ' + format(r.high, '.1f') + ']':>19} {speed:>8}  {r.note}")
    return "\n".join(lines)
