"""Forward-pass bundles: the unit that is compiled, shipped, verified and hot-reloaded.

A bundle is a folder (or a ``.tar.gz`` of one) holding:

    forward.py       the module: ``build(model_config, weights, recipe) -> ForwardPass``
    *.py, ...        any helper modules or data files it imports or reads
    recipe.yaml      knob values (a mapping; may be empty)
    manifest.json    sha256 of every other file, plus one digest over all of them

Data flow:

    src folder + recipe --create_bundle--> bundle folder / .tar.gz (manifest written)
    bundle --verify_bundle--> Manifest (every file re-hashed; missing, extra, changed
                              or symlinked files raise BundleTamperedError)
    bundle --open_bundle--> Bundle(folder, manifest, recipe): a private local copy that
                            importer.import_bundle imports from

The digest is the bundle's identity (what a ForwardPass resource records and the
engine reports): sha256 over the sorted ``"<path>\\0<sha256>\\n"`` lines of every file
except manifest.json, so it does not depend on how the bundle was packed. The KV-cache
tag of a bundle's pass is ``kv_cache_tag`` (one rule for the engine, hot reload and the
verifier), derived from the KV layout forward.py declares (kv_layout.py), which the manifest
records as ``kv_layout``.

No torch and no pydantic here: the operator and the compile worker handle bundles
too, and the benchmark machines may lack pydantic. PyYAML is used when present;
without it, recipes written by ``create_bundle`` (JSON text, which is valid YAML)
still load.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shapeshift.engine.forward_pass.kv_layout import kv_cache_tag, layout_from_source

BUNDLE_FORMAT = "shapeshift.dev/forward-pass-bundle/v1"
MANIFEST_NAME = "manifest.json"
RECIPE_NAME = "recipe.yaml"
ENTRY_NAME = "forward.py"
# In a compiled bundle: the EngineConfig overrides (batch width, chunk budget, decode steps ...)
# the candidate was measured with, as JSON. Hashed like every file.
ENGINE_SETTINGS_FILE = "engine.json"
# Limits for unpacking uploaded archives (an archive is untrusted input).
MAX_BUNDLE_FILES = 256
MAX_BUNDLE_BYTES = 64 * 1024 * 1024
# The stock forward pass shipped with the engine (a bundle folder).
STOCK_BUNDLE_DIR = Path(__file__).resolve().parent.parent / "forward_passes" / "stock"
_SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


class BundleError(ValueError):
    """The bundle is malformed (missing forward.py, bad recipe, unsafe archive member...)."""


class BundleTamperedError(BundleError):
    """The bundle's files do not match its manifest (changed, missing or extra files)."""


@dataclass
class Manifest:
    name: str
    files: dict[str, str]  # relative posix path -> sha256 hex
    digest: str  # sha256 over the file list (see module docstring)
    entry: str = ENTRY_NAME
    format: str = BUNDLE_FORMAT
    # KV-cache format the forward pass writes; passes that share it may read each
    # other's cache across a hot swap. None: unknown, the cache is flushed on swap.
    cache_format: str | None = None
    # The KV layout forward.py declares (kv_layout.declared_layout: "model"/"engine" fields are
    # filled in by the engine that loads it); None: none declared.
    kv_layout: dict[str, Any] | None = None
    parent: str | None = None  # digest of the bundle this one was derived from
    description: str = ""
    created_unix: float | None = None  # None keeps generated manifests reproducible

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "manifest.json") -> Manifest:
        if not isinstance(data, dict):
            raise BundleError(f"{where}: expected a JSON object")
        if data.get("format") != BUNDLE_FORMAT:
            raise BundleError(f"{where}: format {data.get('format')!r} is not {BUNDLE_FORMAT!r}; "
                              "rebuild the bundle with shapeshift.engine.forward_pass.bundle.create_bundle")
        missing = [k for k in ("name", "files", "digest") if k not in data]
        if missing:
            raise BundleError(f"{where}: missing keys {missing}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def short_digest(self) -> str:
        return self.digest[:12]


# ------------------------------------------------------------------ hashing


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def compute_digest(files: dict[str, str]) -> str:
    """The bundle digest from its file table (path -> sha256)."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def _walk_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` that belongs in a bundle (sorted, relative).

    Symlinks are refused: a link could point the import at code outside the
    hashed tree.
    """
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for d in list(dirnames):
            if d in _SKIP_DIRS or d.startswith("."):
                dirnames.remove(d)
            elif (here / d).is_symlink():
                raise BundleError(f"{here / d}: symlinked folders are not allowed in a bundle")
        for name in filenames:
            path = here / name
            if name == MANIFEST_NAME and here == root:
                continue
            if name.startswith(".") or name.endswith(_SKIP_SUFFIXES):
                continue
            if path.is_symlink():
                raise BundleError(f"{path}: symlinks are not allowed in a bundle; copy the file instead")
            out.append(path.relative_to(root))
    return sorted(out)


def hash_files(root: str | Path) -> dict[str, str]:
    root = Path(root)
    return {p.as_posix(): sha256_file(root / p) for p in _walk_files(root)}


# ------------------------------------------------------------------ recipes


def load_recipe_text(text: str, where: str = RECIPE_NAME) -> dict[str, Any]:
    """A recipe mapping from YAML (or JSON) text; empty text is an empty recipe."""
    if not text.strip():
        return {}
    try:
        import yaml  # optional: benchmark machines may lack it
    except ImportError:
        yaml = None
    try:
        data = yaml.safe_load(text) if yaml is not None else json.loads(text)
    except Exception as exc:  # yaml.YAMLError / json.JSONDecodeError
        hint = "" if yaml is not None else " (PyYAML is not installed, so only JSON-style recipes load)"
        raise BundleError(f"{where}: cannot parse the recipe: {exc}{hint}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BundleError(f"{where}: a recipe must be a mapping of knob -> value, got {type(data).__name__}")
    return data


def dump_recipe_text(recipe: dict[str, Any]) -> str:
    """JSON text (valid YAML) so the recipe loads with or without PyYAML."""
    try:
        return json.dumps(recipe, indent=2, sort_keys=True) + "\n"
    except TypeError as exc:
        raise BundleError(f"recipe values must be JSON/YAML scalars, lists or mappings: {exc}") from exc


def load_recipe(bundle_dir: str | Path) -> dict[str, Any]:
    path = Path(bundle_dir) / RECIPE_NAME
    return load_recipe_text(path.read_text(), str(path)) if path.is_file() else {}


# ------------------------------------------------------------------ create / write


def declared_kv(bundle_dir: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """The KV layout forward.py declares (``kv_layout.layout_from_source``) and its
    ``kv_cache_tag``, read once without importing it; (None, None) when it declares none."""
    layout = layout_from_source(bundle_dir)
    return layout, (kv_cache_tag(layout, "") if layout is not None else None)


def declared_cache_format(bundle_dir: str | Path) -> str | None:
    """``kv_cache_tag`` of the layout forward.py declares; None when it declares none."""
    return declared_kv(bundle_dir)[1]


def write_manifest(bundle_dir: str | Path, *, name: str | None = None, cache_format: str | None = None,
                   parent: str | None = None, description: str = "",
                   created_unix: float | None = None) -> Manifest:
    """Hash the files of ``bundle_dir`` in place and write its manifest.json."""
    bundle_dir = Path(bundle_dir)
    if not (bundle_dir / ENTRY_NAME).is_file():
        raise BundleError(f"{bundle_dir}: a bundle needs {ENTRY_NAME} (the module with build())")
    files = hash_files(bundle_dir)
    if len(files) > MAX_BUNDLE_FILES:
        raise BundleError(f"{bundle_dir}: {len(files)} files, more than the limit {MAX_BUNDLE_FILES}")
    layout, declared_format = declared_kv(bundle_dir)
    manifest = Manifest(name=name or bundle_dir.name, files=files, digest=compute_digest(files),
                        cache_format=cache_format or declared_format, kv_layout=layout, parent=parent,
                        description=description, created_unix=created_unix)
    (bundle_dir / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest


def create_bundle(src_dir: str | Path, recipe: dict[str, Any] | None, out: str | Path, *,
                  name: str | None = None, cache_format: str | None = None, parent: str | None = None,
                  description: str = "") -> Manifest:
    """Copy ``src_dir`` (forward.py + helpers) with ``recipe`` into a bundle at ``out``.

    ``out`` ending in ``.tar.gz``/``.tgz`` gives an archive, anything else a folder
    (which must not exist yet). ``recipe=None`` keeps the source's recipe.yaml (or
    none). Returns the manifest written.
    """
    src_dir = Path(src_dir)
    out = Path(out)
    if not (src_dir / ENTRY_NAME).is_file():
        raise BundleError(f"{src_dir}: no {ENTRY_NAME}; a bundle source folder needs the forward-pass module")
    with tempfile.TemporaryDirectory(prefix="shapeshift-bundle-") as tmp:
        stage = Path(tmp) / (name or src_dir.name)
        stage.mkdir()
        for rel in _walk_files(src_dir):
            if rel.as_posix() == RECIPE_NAME and recipe is not None:
                continue
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src_dir / rel, stage / rel)
        if recipe is not None:
            (stage / RECIPE_NAME).write_text(dump_recipe_text(recipe))
        elif not (stage / RECIPE_NAME).exists():
            (stage / RECIPE_NAME).write_text("{}\n")
        load_recipe(stage)  # refuse an unparsable recipe now, not at load time
        manifest = write_manifest(stage, name=name or src_dir.name, cache_format=cache_format,
                                  parent=parent, description=description, created_unix=time.time())
        if _is_archive(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            pack_bundle(stage, out)
        else:
            if out.exists():
                raise BundleError(f"{out} exists; choose a new folder for the bundle")
            shutil.copytree(stage, out)
    return manifest


def pack_bundle(bundle_dir: str | Path, out: str | Path) -> Path:
    """A deterministic .tar.gz of a bundle folder (files at the archive root)."""
    bundle_dir, out = Path(bundle_dir), Path(out)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for rel in _walk_files(bundle_dir) + [Path(MANIFEST_NAME)]:
            data = (bundle_dir / rel).read_bytes()
            info = tarfile.TarInfo(rel.as_posix())
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    out.write_bytes(buf.getvalue())
    return out


def _is_archive(path: Path) -> bool:
    return path.name.endswith((".tar.gz", ".tgz"))


def unpack_archive(archive: str | Path, dest: str | Path) -> Path:
    """Extract a bundle archive safely into ``dest`` (created) and return the bundle folder.

    Refuses absolute paths, ``..``, links, devices, too many or too large members.
    A single top-level folder is accepted as the bundle root.
    """
    archive, dest = Path(archive), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    try:
        tar = tarfile.open(archive, mode="r:*")
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{archive}: not a readable tar archive: {exc}") from exc
    with tar:
        members = tar.getmembers()
        if len(members) > MAX_BUNDLE_FILES * 2:
            raise BundleError(f"{archive}: {len(members)} members, more than a bundle may hold")
        for m in members:
            rel = Path(m.name)
            if rel.is_absolute() or ".." in rel.parts:
                raise BundleError(f"{archive}: member {m.name!r} escapes the bundle folder")
            if m.isdir():
                (dest / rel).mkdir(parents=True, exist_ok=True)
                continue
            if not m.isfile():
                raise BundleError(f"{archive}: member {m.name!r} is not a regular file (links are refused)")
            total += m.size
            if total > MAX_BUNDLE_BYTES:
                raise BundleError(f"{archive}: more than {MAX_BUNDLE_BYTES} bytes unpacked")
            src = tar.extractfile(m)
            assert src is not None
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(src.read())
    if (dest / MANIFEST_NAME).is_file() or (dest / ENTRY_NAME).is_file():
        return dest
    children = [c for c in dest.iterdir()]
    if len(children) == 1 and children[0].is_dir():
        return children[0]
    raise BundleError(f"{archive}: no {MANIFEST_NAME} or {ENTRY_NAME} at the archive root")


# ------------------------------------------------------------------ read / verify


def load_manifest(path: str | Path) -> Manifest:
    """The manifest of a bundle folder or archive (not verified; see verify_bundle)."""
    path = Path(path)
    if path.is_file() and _is_archive(path):
        with tempfile.TemporaryDirectory(prefix="shapeshift-bundle-") as tmp:
            return load_manifest(unpack_archive(path, tmp))
    file = path / MANIFEST_NAME
    if not file.is_file():
        raise BundleError(f"{path}: no {MANIFEST_NAME}; create the bundle with create_bundle() "
                          "or hack/gen_stock_manifest.py")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{file}: not valid JSON: {exc}") from exc
    return Manifest.from_dict(data, str(file))


def verify_bundle(path: str | Path, expected_digest: str | None = None) -> Manifest:
    """Re-hash every file and compare with the manifest; return it when all match.

    Raises BundleTamperedError naming each changed, missing and extra file, or a
    digest that is not the expected one (e.g. the sha256 a ForwardPass resource pins).
    """
    path = Path(path)
    if path.is_file() and _is_archive(path):
        with tempfile.TemporaryDirectory(prefix="shapeshift-bundle-") as tmp:
            return verify_bundle(unpack_archive(path, tmp), expected_digest)
    manifest = load_manifest(path)
    actual = hash_files(path)
    changed = sorted(p for p in manifest.files if p in actual and actual[p] != manifest.files[p])
    missing = sorted(p for p in manifest.files if p not in actual)
    extra = sorted(p for p in actual if p not in manifest.files)
    problems = []
    if changed:
        problems.append(f"changed: {changed}")
    if missing:
        problems.append(f"missing: {missing}")
    if extra:
        problems.append(f"not in the manifest: {extra}")
    if compute_digest(manifest.files) != manifest.digest:
        problems.append("the manifest's digest does not match its own file table")
    if problems:
        raise BundleTamperedError(f"bundle {path} does not match its manifest ({'; '.join(problems)}); "
                                  "rebuild it with create_bundle or fetch it again")
    if expected_digest is not None and manifest.digest != expected_digest:
        raise BundleTamperedError(f"bundle {path} has digest {manifest.digest}, expected {expected_digest}")
    if manifest.entry not in manifest.files:
        raise BundleError(f"bundle {path}: entry {manifest.entry!r} is not among its files")
    return manifest


def read_engine_settings(folder: str | Path) -> dict[str, Any]:
    """The bundle's engine.json (EngineConfig overrides it was measured with); {} without one."""
    path = Path(folder) / ENGINE_SETTINGS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise BundleError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{path}: expected an object of EngineConfig fields, got {type(data).__name__}")
    return data


@dataclass
class Bundle:
    """A verified bundle on local disk (a private copy), ready to import."""

    folder: Path
    manifest: Manifest
    recipe: dict[str, Any]
    source: str  # what the caller passed (folder or archive path)
    _tmp: tempfile.TemporaryDirectory | None = None

    @property
    def entry_path(self) -> Path:
        return self.folder / self.manifest.entry

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def open_bundle(path: str | Path, expected_digest: str | None = None, *,
                allow_unmanifested: bool = False, ignore_manifest: bool = False) -> Bundle:
    """Verify a bundle (unpacking an archive to a private temp folder) and read its recipe.

    ``allow_unmanifested``: a folder without manifest.json gets one computed in memory
    (development use, e.g. the stock pass before its manifest is generated); archives
    and uploads must always carry one. ``ignore_manifest``: hash the files as they are
    (the stock pass shipped inside the engine package, whose manifest may lag an edit).
    """
    path = Path(path)
    if not path.exists():
        raise BundleError(f"bundle {path} does not exist")
    if path.is_file() and not _is_archive(path):
        raise BundleError(f"{path}: a bundle is a folder or a .tar.gz archive")
    # Always work on a private copy: verifying one tree and importing another
    # (changed after the check) would defeat the manifest.
    tmp = tempfile.TemporaryDirectory(prefix="shapeshift-bundle-")
    try:
        if path.is_file():
            folder = unpack_archive(path, tmp.name)
        else:
            folder = Path(tmp.name) / (path.name or "bundle")
            folder.mkdir()
            for rel in _walk_files(path) + ([Path(MANIFEST_NAME)] if (path / MANIFEST_NAME).is_file() else []):
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path / rel, folder / rel)
    except BaseException:
        tmp.cleanup()
        raise
    try:
        if ignore_manifest and path.is_dir():
            (folder / MANIFEST_NAME).unlink(missing_ok=True)
        if (allow_unmanifested or ignore_manifest) and path.is_dir() and not (folder / MANIFEST_NAME).exists():
            if not (folder / ENTRY_NAME).is_file():
                raise BundleError(f"{folder}: a bundle needs {ENTRY_NAME}")
            files = hash_files(folder)
            layout, declared_format = declared_kv(folder)
            manifest = Manifest(name=folder.name, files=files, digest=compute_digest(files),
                                cache_format=declared_format, kv_layout=layout,
                                description="manifest computed at load time")
            if expected_digest is not None and manifest.digest != expected_digest:
                raise BundleTamperedError(f"bundle {folder} has digest {manifest.digest}, expected {expected_digest}")
        else:
            manifest = verify_bundle(folder, expected_digest)
        recipe = load_recipe(folder)
    except BaseException:
        tmp.cleanup()
        raise
    return Bundle(folder=folder, manifest=manifest, recipe=recipe, source=str(path), _tmp=tmp)


def stock_bundle_dir() -> Path:
    """The stock forward pass shipped with the engine (a bundle folder)."""
    return STOCK_BUNDLE_DIR
