"""Which commit of the repository a result came from (benchmarks, compile reports), the
installed package's version (`shapeshift --version`, the server's /version), and the name a
result is filed under in bench/results/.

Data flow: ``SHAPESHIFT_GIT_COMMIT`` (set by the caller where the tree is a copy whose git
metadata is stale or missing: a GPU machine, an image) or ``git rev-parse HEAD`` + ``git
status`` in the checkout -> (commit, dirty). A benchmark, a model, a device name and the
clock -> ``result_name`` (the scheme bench/results/README.md describes). No torch: hack/
scripts' dry runs import it.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import subprocess
from pathlib import Path

def package_version() -> str:
    """The installed shapeshift distribution's version ("unknown" in a tree run without installing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shapeshift")
    except PackageNotFoundError:
        return "unknown"


# What hack/ and the compile loop measure; a result's name starts with one of these.
RESULT_BENCHMARKS = (
    "agreement", "agreement-gate", "compile", "decode", "decode-curve", "decode-profile", "kernels",
    "kernels-quick", "kernels-tune", "kernels-quick-tune", "layer-tail", "parallel", "regimes", "reload",
    "serving", "operator-scale", "expert-routing", "compile-repeat", "measured-isolation",
)
_SLUG = r"[a-z0-9]+(?:[.-][a-z0-9]+)*"
# <benchmark>-<model>-<hardware>-<UTC stamp>, then -2, -3, ... for a second run started in the
# same second (hack/benchmeta.claim_result_name), then the extension (none for a folder).
RESULT_NAME = re.compile(
    r"(?P<benchmark>" + "|".join(sorted(RESULT_BENCHMARKS, key=len, reverse=True)) + r")"
    r"-(?P<model_and_hardware>" + _SLUG + r")-(?P<stamp>\d{8}T\d{6}Z)(?:-(?P<copy>[2-9]|[1-9]\d+))?"
    r"(?P<ext>\.[a-z]+)?")


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


def hardware_slug(device_name: str, count: int = 1) -> str:
    """The hardware part of a result name: "NVIDIA H200" -> "nvidia-h200" (the accelerator kind
    operator/hardware.py names it by); ``count`` devices of one host -> "nvidia-h200-x2"."""
    slug = re.sub(r"[^a-z0-9.]+", "-", device_name.lower()).strip("-.") or "unknown"
    return slug if count == 1 else f"{slug}-x{count}"


def result_name(benchmark: str, model: str, hardware: str, when: _dt.datetime | None = None) -> str:
    """``<benchmark>-<model>-<hardware>-<YYYYMMDDTHHMMSSZ>`` (UTC; ``when`` defaults to now): the
    name, without extension, of a results file or a compile run's folder under bench/results/.
    ``hardware`` is a ``hardware_slug``."""
    if benchmark not in RESULT_BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; add it to RESULT_BENCHMARKS in {__name__}")
    when = (when or _dt.datetime.now(_dt.timezone.utc)).astimezone(_dt.timezone.utc)
    model_slug = re.sub(r"[^a-z0-9.]+", "-", model.lower()).strip("-.")
    name = f"{benchmark}-{model_slug}-{hardware}-{when.strftime('%Y%m%dT%H%M%SZ')}"
    if not RESULT_NAME.fullmatch(name):
        raise ValueError(f"{name!r} breaks the result-name scheme (model {model!r}, hardware {hardware!r})")
    return name
