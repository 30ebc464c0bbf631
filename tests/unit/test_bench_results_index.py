"""bench/results/ stays curated: every result follows the naming scheme, every result is named
by a doc, a comment or the index, and whatever the index or a doc names exists."""

from __future__ import annotations

import datetime as dt
import glob
import json
import re
import subprocess
from pathlib import Path
from typing import get_args

import pytest

from shapeshift.engine.provenance import RESULT_NAME, hardware_slug, result_name
from shapeshift.operator.api import AcceleratorKind

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
INDEX_FILES = {"README.md", "index.json"}
# Where a result may be named (the folders a reader greps), and what counts as text there.
NAMING_PLACES = ("README.md", "docs", "tests", "hack", "engine", "operator", "kernels", "charts")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".json", ".txt", ".toml"}
HARDWARE = re.compile(r"-(?P<kind>" + "|".join(re.escape(k) for k in get_args(AcceleratorKind)) + r")(?:-x\d+)?$")
SCHEME = "<benchmark>-<model>-<hardware>-<UTC stamp YYYYMMDDTHHMMSSZ>.<ext> (a folder for a compile run)"


def shallow_clone() -> bool:
    out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() == "true"


def results() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.name not in INDEX_FILES)


def index() -> dict:
    return json.loads((RESULTS / "index.json").read_text())


def naming_texts() -> dict[str, str]:
    """Path -> text of every file a result may be named in, bench/results' README and index included."""
    files = [RESULTS / name for name in INDEX_FILES]
    for place in NAMING_PLACES:
        root = REPO / place
        files += [root] if root.is_file() else [
            p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    texts = {}
    for path in files:
        if path.resolve() == Path(__file__).resolve() or path.stat().st_size > 2_000_000:
            continue
        try:
            texts[str(path.relative_to(REPO))] = path.read_text()
        except UnicodeDecodeError:
            continue
    return texts


def test_every_result_follows_the_naming_scheme():
    broken = []
    for path in results():
        match = RESULT_NAME.fullmatch(path.name)
        if not match or not HARDWARE.search(match["model_and_hardware"]):
            broken.append(f"{path.name}: not {SCHEME}, hardware one of {get_args(AcceleratorKind)}")
        elif (match["benchmark"] == "compile") != path.is_dir() or (match["ext"] is None) != path.is_dir():
            broken.append(f"{path.name}: compile runs are folders without an extension, every other result a file")
    assert not broken, (
        "bench/results entries that break the naming scheme:\n  " + "\n  ".join(broken) + "\n"
        "Rename each with `git mv` (engine/provenance.py's result_name spells the name; the stamp is the run's "
        "start in UTC) and update every doc, comment and index entry that names it.")


def test_every_result_is_named_by_a_doc_a_comment_or_the_index():
    texts = "\n".join(naming_texts().values())
    unnamed = []
    for path in results():
        # Named with or without its extension; a plot (.png) goes with its JSON of the same stem.
        if (path.stem if path.is_file() else path.name) not in texts:
            unnamed.append(path.name)
    assert not unnamed, (
        "bench/results entries that nothing names:\n  " + "\n  ".join(unnamed) + "\n"
        "Quote each where its figure is used (a headline figure: a row of bench/results/README.md and of "
        "bench/results/index.json; otherwise the doc or comment that cites it), or `git rm` it: git history keeps it.")


def test_the_index_and_its_readme_name_the_same_files_and_they_exist():
    figures = index()["figures"]
    missing = [f["file"] for f in figures if not (RESULTS / f["file"]).exists()]
    assert not missing, (
        f"bench/results/index.json names files that do not exist: {missing}. Fix the name in index.json and "
        "bench/results/README.md, or restore the file (`git log --all -- bench/results/<name>` finds it).")
    readme = (RESULTS / "README.md").read_text()
    absent = sorted({f["file"] for f in figures if f["file"] not in readme})
    assert not absent, (
        f"bench/results/README.md's table lacks the files {absent} that index.json names: add their rows, or "
        "drop them from index.json, so the two tables agree.")
    for figure in figures:
        for key in ("figure", "value", "measured_against", "hardware", "command", "file"):
            assert figure.get(key), f"index.json figure {figure.get('figure')!r} has no {key!r}: fill it in"


# A history doc (docs/history/) names the results of its time: they are in git at the commit its
# text names ("in `bench/results/` at commit `<sha>`"), not necessarily in the tree today.
HISTORY_COMMIT = re.compile(r"in `bench/results/` at commit `([0-9a-f]{7,40})`")


def _results_at(commit: str) -> set[str] | None:
    """The entries of bench/results at `commit` (files and folders); None where git cannot tell
    (no git, or a shallow clone without that commit)."""
    try:
        out = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "bench/results/"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    names = set()
    for line in out.splitlines():
        parts = line.split("/")
        names.add(parts[2])
    return names


def test_docs_name_only_results_that_exist():
    """A doc or comment naming a scheme-named result that is not there (a rename missed, a file
    dropped); a history doc's names must be in git at the commit it names. Tests are left out:
    they spell made-up names for their own temporary folders."""
    name = re.compile(RESULT_NAME.pattern.replace("(?P<ext>\\.[a-z]+)?", "(?P<ext>\\.(?:json|png|jsonl|md))?"))
    dangling = []
    for path, text in naming_texts().items():
        if path.startswith("tests/"):
            continue
        then = None
        if path.startswith("docs/history/"):
            commit = HISTORY_COMMIT.search(text)
            assert commit, f"{path} names results of its time but no commit that holds them (say `in `bench/results/` at commit `<sha>``)"
            then = _results_at(commit[1])
            if then is None and shallow_clone():
                then = set()  # nothing to check against here; a full clone checks it
            assert then is not None, f"{path}: git does not know commit {commit[1]}"
        for match in name.finditer(text):
            target = match[0]
            if (RESULTS / target).exists() or any(RESULTS.glob(f"{glob.escape(target)}.*")):
                continue
            if then is not None and (not then or target in then or any(n.startswith(target + ".") for n in then)):
                continue
            dangling.append(f"{path}: {target}")
    assert not dangling, (
        "these name results that bench/results does not hold:\n  " + "\n  ".join(sorted(set(dangling))) + "\n"
        "Fix the name (ls bench/results), or restore the file (`git log --all -- bench/results/<name>`).")


def test_the_benchmarks_write_names_that_follow_the_scheme():
    """engine/provenance.py's result_name, which every hack/ benchmark names its output with."""
    when = dt.datetime(2026, 11, 30, 20, 31, 3, tzinfo=dt.timezone.utc)
    assert hardware_slug("NVIDIA H200") == "nvidia-h200" and hardware_slug("NVIDIA H200", 2) == "nvidia-h200-x2"
    name = result_name("decode-curve", "llama-3.2-1b-shape", hardware_slug("NVIDIA H200"), when)
    assert name == "decode-curve-llama-3.2-1b-shape-nvidia-h200-20261130T203103Z"
    match = RESULT_NAME.fullmatch(name + ".json")
    assert match["benchmark"] == "decode-curve" and HARDWARE.search(match["model_and_hardware"])
    local = dt.datetime(2026, 11, 30, 21, 31, 3, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert result_name("decode-curve", "llama-3.2-1b-shape", "nvidia-h200", local) == name  # stamped in UTC
    with pytest.raises(ValueError, match="RESULT_BENCHMARKS"):
        result_name("decode-table", "llama-3.2-1b-shape", "nvidia-h200", when)
