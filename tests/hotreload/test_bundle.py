"""Bundles: create, read, verify, and detect every kind of tampering."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from shapeshift.engine.forward_pass.bundle import (BundleError, BundleTamperedError, Manifest, create_bundle, load_manifest,
                                      open_bundle, stock_bundle_dir, verify_bundle)
from shapeshift.engine.forward_pass.kv_layout import STOCK_KV_LAYOUT, kv_cache_tag

REPO = Path(__file__).resolve().parents[2]


def make_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "helpers").mkdir(parents=True)
    (src / "forward.py").write_text('CACHE_FORMAT_VERSION = 7\ndef build(model_config, weights, recipe):\n    return None\n')
    (src / "helpers" / "fused.py").write_text("SCALE = 2\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "forward.cpython-311.pyc").write_bytes(b"junk")
    return src


@pytest.mark.parametrize("archive", [False, True])
def test_create_and_verify_roundtrip(tmp_path, archive):
    src = make_source(tmp_path)
    out = tmp_path / ("b.tar.gz" if archive else "b")
    written = create_bundle(src, {"attention": "paged", "tile": [64, 128]}, out, name="cand-1")
    assert set(written.files) == {"forward.py", "helpers/fused.py", "recipe.yaml"}
    # read from forward.py without importing it: the stock layout under version 7
    assert written.cache_format == kv_cache_tag(7, "") and written.cache_format.startswith("kv-format-7-")
    assert written.kv_layout == {**STOCK_KV_LAYOUT, "version": 7}
    loaded = load_manifest(out)
    assert loaded.digest == written.digest and loaded.name == "cand-1"
    assert written.created_unix is not None and loaded.created_unix == written.created_unix  # stamped, and kept
    assert verify_bundle(out, expected_digest=written.digest).digest == written.digest
    opened = open_bundle(out)
    try:
        assert opened.recipe == {"attention": "paged", "tile": [64, 128]}
        assert opened.entry_path.read_text().startswith("CACHE_FORMAT_VERSION")
        assert opened.folder != out  # a private copy, not the caller's tree
    finally:
        opened.close()


def test_digest_does_not_depend_on_packing(tmp_path):
    src = make_source(tmp_path)
    folder = create_bundle(src, {"k": 1}, tmp_path / "f")
    archive = create_bundle(src, {"k": 1}, tmp_path / "a.tgz")
    assert folder.digest == archive.digest
    other = create_bundle(src, {"k": 2}, tmp_path / "g")
    assert other.digest != folder.digest  # the recipe is part of the identity


@pytest.mark.parametrize("tamper", ["change", "delete", "add", "wrong_expected", "edit_manifest_digest"])
def test_tamper_detected(tmp_path, tamper):
    src = make_source(tmp_path)
    out = tmp_path / "b"
    manifest = create_bundle(src, {}, out)
    expected = None
    if tamper == "change":
        (out / "helpers" / "fused.py").write_text("SCALE = 3\n")
        match = "changed"
    elif tamper == "delete":
        (out / "helpers" / "fused.py").unlink()
        match = "missing"
    elif tamper == "add":
        (out / "sneaky.py").write_text("import os\n")
        match = "not in the manifest"
    elif tamper == "wrong_expected":
        expected = "0" * 64
        match = "expected"
    else:
        data = json.loads((out / "manifest.json").read_text())
        data["files"]["forward.py"] = "f" * 64  # rewrite the table but keep the old digest
        (out / "manifest.json").write_text(json.dumps(data))
        match = "digest does not match|changed"
    with pytest.raises(BundleTamperedError, match=match):
        verify_bundle(out, expected_digest=expected)
    with pytest.raises(BundleTamperedError):
        open_bundle(out, expected_digest=expected)
    assert manifest.digest  # the original is intact data, only the tree changed


def test_tampered_archive_detected(tmp_path):
    src = make_source(tmp_path)
    archive = tmp_path / "b.tar.gz"
    create_bundle(src, {}, archive)
    # Repack with forward.py replaced but the original manifest kept.
    members = {}
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            members[m.name] = tar.extractfile(m).read()
    members["forward.py"] = b"def build(*a):\n    raise SystemExit\n"
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleTamperedError, match="forward.py"):
        verify_bundle(evil)


@pytest.mark.parametrize("member", ["../escape.py", "/abs.py"])
def test_unsafe_archive_refused(tmp_path, member):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo(member)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(BundleError, match="escapes"):
        open_bundle(evil)


def test_symlink_refused(tmp_path):
    src = make_source(tmp_path)
    (src / "link.py").symlink_to(src / "forward.py")
    with pytest.raises(BundleError, match="symlink"):
        create_bundle(src, {}, tmp_path / "b")


def test_missing_forward_and_bad_recipe(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BundleError, match="forward.py"):
        create_bundle(empty, {}, tmp_path / "b")
    src = make_source(tmp_path)
    (src / "recipe.yaml").write_text("- not\n- a mapping\n")
    with pytest.raises(BundleError, match="mapping"):
        create_bundle(src, None, tmp_path / "c")


def test_manifest_format_checked(tmp_path):
    with pytest.raises(BundleError, match="format"):
        Manifest.from_dict({"format": "other", "name": "x", "files": {}, "digest": ""})


def test_stock_manifest_is_fresh():
    """The committed stock manifest matches the stock files (regenerate with the hack script)."""
    folder = stock_bundle_dir()
    if not (folder / "forward.py").is_file():
        pytest.skip("the stock forward pass is not in the tree yet")
    result = subprocess.run([sys.executable, str(REPO / "hack" / "gen_stock_manifest.py"), "--check"],
                            capture_output=True, text=True, env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert verify_bundle(folder).name == "stock"
