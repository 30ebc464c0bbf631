"""Provenance of benchmark results: which commit of the repository produced them.

Data flow: ``SHAPESHIFT_GIT_COMMIT`` (exported by hack/gpu_run.sh, whose GPU machine has the
tree but no git) or ``git rev-parse HEAD`` + ``git status`` in the repository -> (commit,
dirty) -> the result document of hack/bench_*.py. No torch here: the dry runs of the
benchmarks import it without a GPU stack.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_commit(repo: Path = REPO_ROOT) -> tuple[str, bool]:
    """(commit sha, tracked files modified); ("unknown", True) where neither the environment
    nor git can tell. A commit from the environment counts as clean: the caller vouches for it."""
    if os.environ.get("SHAPESHIFT_GIT_COMMIT"):
        return os.environ["SHAPESHIFT_GIT_COMMIT"], False
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", True
