"""Result provenance: one git_commit for the benchmarks and the compile loop's reports."""

import subprocess
from pathlib import Path

from shapeshift.engine.compile.cli import _git_commit
from shapeshift.engine.provenance import git_commit


def test_the_caller_named_commit_wins_and_counts_as_clean(monkeypatch):
    monkeypatch.setenv("SHAPESHIFT_GIT_COMMIT", "0123abc")
    assert git_commit() == ("0123abc", False)
    assert _git_commit() == "0123abc"


def test_git_tells_the_commit_of_a_checkout_and_nothing_outside_one(monkeypatch, tmp_path):
    monkeypatch.delenv("SHAPESHIFT_GIT_COMMIT", raising=False)
    repo = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    if head.returncode == 0:
        assert git_commit(repo)[0] == head.stdout.strip()
    assert git_commit(tmp_path) == ("unknown", True)  # no checkout there
