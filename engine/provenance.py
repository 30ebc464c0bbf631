"""Which commit of the repository a result came from (benchmarks, compile reports).

Data flow: ``SHAPESHIFT_GIT_COMMIT`` (set by the caller where the tree is a copy whose git
metadata is stale or missing: a GPU machine, an image) or ``git rev-parse HEAD`` + ``git
status`` in the checkout -> (commit, dirty). No torch: hack/ scripts' dry runs import it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit(repo: Path = Path(__file__).resolve().parent) -> tuple[str, bool]:
    """(commit sha, tracked files modified) of the checkout holding ``repo`` (default: this
    package's); ("unknown", True) where neither the environment nor git can tell. A commit
    from the environment counts as clean: the caller vouches for it."""
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
