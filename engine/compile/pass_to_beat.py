"""The forward pass a compile run must beat besides the stock pass: a published bundle as a candidate.

Data flow:
    ForwardPass (spec.recipe, spec.artifact.uri + sha256)
      --fetch (file path, file://, http(s)://; sha256 checked)--> opened bundle
      --candidate_from_bundle--> Candidate: the published recipe with no source when the bundle's
         forward.py is the stock module plus the recipe's edits, else that forward.py as the
         source with every edit off; the published sha256 in ``extra``
      --the evaluator's materialize--> a bundle folder; its digest equals the published one when
         this engine's stock folder matches the one that built it (the compile CLI's
         `_check_rebuilt` warns when it does not)

A champion's recipe names its source edits (``edit.*`` knobs) and the bundle holds their
result. When that result is the stock module plus those edits, the candidate is the recipe
alone, as it was searched (agents can then move its edit knobs). Otherwise (a source an LLM
agent wrote) the candidate takes the bundle's forward.py as its source and switches the edits
off: the materialized bundle is the published pass, not the edits applied twice.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping

from shapeshift.engine.forward_pass.bundle import ENTRY_NAME, Bundle, open_bundle
from shapeshift.engine.compile.candidate import Candidate

AGENT = "pass-to-beat"


def candidate_from_bundle(bundle_folder: Path, recipe: Mapping[str, Any], stock_source: str, note: str,
                          sha256: str | None = None) -> Candidate:
    """The published pass in `bundle_folder` (verified) with the full recipe it was published
    with; `sha256` (the published digest) rides along in ``extra`` for the rebuild check."""
    from shapeshift.engine.compile.source_edits import SourceEditError, apply_edits

    source = (Path(bundle_folder) / ENTRY_NAME).read_text()
    extra = {"sha256": sha256} if sha256 else {}
    edits = [name.partition(".")[2] for name, value in recipe.items() if name.startswith("edit.") and value]
    try:
        derived = apply_edits(stock_source, edits)
    except SourceEditError:
        derived = None
    if source == derived:  # the stock module plus the recipe's edits: the candidate as it was searched
        return Candidate(dict(recipe), None, AGENT, note, extra=extra)
    knobs = {name: (False if name.startswith("edit.") else value) for name, value in recipe.items()}
    return Candidate(knobs, source, AGENT, note, extra=extra)


def fetch_bundle(artifact: str, sha256: str | None, cache_dir: Path) -> Bundle:
    """Open the artifact at `artifact` (a path, file:// or http(s):// URL of a .tar.gz), checked
    against `sha256`. Raises ValueError saying what failed."""
    from shapeshift.engine.forward_pass.bundle import BundleError
    from shapeshift.engine.rollout.agent import ArtifactFetcher, AttemptFailed, RolloutSettings

    # The engine's own fetcher (size limit, download deadline, cache by digest); the compile
    # worker has no annotations file to watch, so that setting names nothing that is read.
    fetcher = ArtifactFetcher(RolloutSettings(annotations_file=Path(tempfile.gettempdir()) / "unused",
                                              cache_dir=cache_dir))
    try:
        path = fetcher.fetch(artifact, sha256 or "")
        return open_bundle(path, sha256 or None)
    except AttemptFailed as exc:
        raise ValueError(str(exc)) from exc
    except BundleError as exc:
        raise ValueError(f"artifact {artifact}: {exc}") from exc


def from_forward_pass(obj: Mapping[str, Any], stock_source: str, cache_dir: Path) -> Candidate:
    """The ForwardPass object `obj` as a candidate (its artifact fetched and verified).
    Raises ValueError when it is not verified or its artifact cannot be read."""
    name = (obj.get("metadata") or {}).get("name", "?")
    spec = obj.get("spec") or {}
    if not (spec.get("verification") or {}).get("passed"):
        raise ValueError(f"ForwardPass {name} did not pass verification")
    artifact = spec.get("artifact") or {}
    if not artifact.get("uri"):
        raise ValueError(f"ForwardPass {name} names no artifact")
    return from_artifact(artifact["uri"], artifact.get("sha256"), spec.get("recipe") or {}, stock_source,
                         f"ForwardPass {name}", cache_dir)


def from_artifact(uri: str, sha256: str | None, recipe: Mapping[str, Any], stock_source: str, note: str,
                  cache_dir: Path) -> Candidate:
    """The bundle at `uri` (checked against `sha256`) with the `recipe` it was published with, as a
    candidate. Raises ValueError when it cannot be read."""
    opened = fetch_bundle(uri, sha256, cache_dir)
    try:
        return candidate_from_bundle(opened.folder, recipe, stock_source, note, opened.manifest.digest)
    finally:
        opened.close()
