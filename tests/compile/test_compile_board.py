"""The message board: durable appends, concurrent writers (threads and processes), torn tails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shapeshift.engine.compile.board import Board, format_leaderboard

PY = sys.executable


def _result(board: Board, digest: str, tput: float, tier: str = "fast", trial: str | None = None) -> None:
    board.append("candidate", digest=digest, recipe={"k": digest}, agent="t", note=f"n-{digest}", source=None)
    board.append("result", trial_id=trial or f"t-{digest}", digest=digest, tier=tier, status="ok",
                 metrics={"throughput": tput, "low": tput * 0.9, "high": tput * 1.1})


def test_append_read_and_leaderboard(tmp_path: Path) -> None:
    board = Board(tmp_path / "b.jsonl")
    _result(board, "aaa", 10.0)
    _result(board, "bbb", 30.0)
    _result(board, "ccc", 20.0)
    _result(board, "aaa", 12.0, trial="t-aaa-2")
    board.append("result", trial_id="t-ddd", digest="ddd", tier="fast", status="failed", metrics={}, error="boom")
    rows = board.leaderboard("fast")
    assert [r.digest for r in rows] == ["bbb", "ccc", "aaa"]  # failed one absent, best result per digest
    assert rows[2].throughput == 12.0
    assert "bbb" in format_leaderboard(rows)
    # A second reader sees exactly the same entries.
    assert len(Board(board.path).entries()) == len(board.entries()) == 9
    with pytest.raises(ValueError, match="kind"):
        board.append("bogus")


def test_threads_and_processes_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    board = Board(path)
    payload = "x" * 3000  # long lines: a torn or interleaved write would show up as bad JSON

    def writer(n: int) -> None:
        for i in range(40):
            board.append("note", agent=f"thread{n}", text=payload, i=i)

    script = ("import sys; from shapeshift.engine.compile.board import Board; b = Board(sys.argv[1]);\n"
              "[b.append('note', agent='proc' + sys.argv[2], text='y' * 3000, i=i) for i in range(40)]")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    procs = [subprocess.Popen([PY, "-c", script, str(path), str(p)], env=env) for p in range(2)]
    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        assert p.wait(timeout=120) == 0
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    entries = [json.loads(line) for line in lines[:-1]]  # every line is one complete JSON object
    assert len(entries) == 5 * 40
    assert len({e["id"] for e in entries}) == 200
    per_writer = {}
    for e in entries:
        per_writer.setdefault(e["agent"], []).append(e["i"])
    assert all(v == list(range(40)) for v in per_writer.values())  # each writer's order kept
    assert board.skipped_lines == 0 and len(board.entries()) == 200


def test_torn_last_line_is_ignored_then_repaired(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    board = Board(path)
    for i in range(5):
        board.append("note", agent="a", text=f"entry {i}")
    with open(path, "ab") as f:  # a writer that died mid-line
        f.write(b'{"kind": "note", "agent": "dead", "text": "half a li')
    reader = Board(path)
    assert [e["text"] for e in reader.entries()] == [f"entry {i}" for i in range(5)]
    reader.append("note", agent="b", text="after the crash")
    again = Board(path)
    texts = [e["text"] for e in again.entries()]
    assert texts == [f"entry {i}" for i in range(5)] + ["after the crash"]
    assert b"half a li" not in path.read_bytes()
    assert again.skipped_lines == 0


def test_writer_killed_mid_run_loses_only_its_last_line(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    script = ("import sys; from shapeshift.engine.compile.board import Board; b = Board(sys.argv[1]);\n"
              "i = 0\nwhile True:\n    b.append('note', agent='w', text='z' * 20000, i=i); i += 1")
    proc = subprocess.Popen([PY, "-c", script, str(path)], env={**os.environ, "PYTHONSAFEPATH": "1"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < 2_000_000):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    entries = Board(path).entries()
    assert len(entries) > 50
    assert [e["i"] for e in entries] == list(range(len(entries)))  # a prefix of what was written, no gaps
    Board(path).append("note", agent="next", text="resumed")
    assert Board(path).entries()[-1]["text"] == "resumed"
