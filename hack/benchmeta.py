"""Provenance of benchmark results: which commit of the repository produced them.

``git_commit`` is shapeshift.engine.provenance's, shared with the compile loop's reports
(SHAPESHIFT_GIT_COMMIT, exported by hack/gpu_run.sh whose GPU machine has the tree but no
git, else git itself); ``REPO_ROOT`` is the checkout the hack/ scripts write results into.
"""

from __future__ import annotations

from pathlib import Path

from shapeshift.engine.provenance import git_commit

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = ["REPO_ROOT", "git_commit"]
