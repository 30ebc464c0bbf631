"""Provenance of benchmark results: which commit of the repository produced them, and where
they are written.

``git_commit`` is shapeshift.engine.provenance's, shared with the compile loop's reports
(SHAPESHIFT_GIT_COMMIT, exported by hack/gpu_run.sh whose GPU machine has the tree but no
git, else git itself); ``REPO_ROOT`` is the checkout the hack/ scripts write results into;
``result_name`` / ``hardware_slug`` (shapeshift.engine.provenance's) spell a result's name,
``claim_result_name`` gives each run a results file of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from shapeshift.engine.provenance import git_commit, hardware_slug, result_name

REPO_ROOT = Path(__file__).resolve().parent.parent


def claim_result_name(out_dir: Path, base_name: str) -> str:
    """`base_name`, or base_name-2, -3, ... when a run started in the same second (one per GPU
    of a host, say) holds it: the .json is created exclusively, so no run overwrites another's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        name = base_name if n == 1 else f"{base_name}-{n}"
        try:
            os.close(os.open(out_dir / f"{name}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return name
        except FileExistsError:
            continue
    raise RuntimeError(f"no free result name for {base_name} in {out_dir}")


__all__ = ["REPO_ROOT", "claim_result_name", "git_commit", "hardware_slug", "result_name"]
