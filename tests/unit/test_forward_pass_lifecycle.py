"""The forward-pass lifecycle's single homes: one KV-cache tag rule, one importer, one record of
the active pass (set by the engine, read by the metrics, the admin listing and the rollout
agent), a worker-thread deadline, and no import of the verifier."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shapeshift.engine.forward_pass.bundle import (STOCK_BUNDLE_DIR, create_bundle, declared_cache_format, kv_cache_tag,
                                                   load_manifest)
from shapeshift.engine.forward_pass.deadline import DeadlineExceeded, run_with_deadline
from shapeshift.engine.forward_pass.importer import load_bundle

FORWARD_PASS_DIR = Path(__file__).resolve().parents[2] / "engine" / "forward_pass"
# The stock pass under another name and without a CACHE_FORMAT_VERSION: its KV tag is its digest.
UNVERSIONED_SOURCE = '''from shapeshift.engine.forward_pass.importer import import_stock_module

stock = import_stock_module()
FORWARD_PASS_NAME = "unversioned"


def build(model_config, weights, recipe):
    return stock.build(model_config, weights, recipe)
'''


def tiny_engine(**overrides):
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="tiny-llama", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
                                  num_kv_blocks=32, **overrides))


def unversioned_bundle(tmp_path: Path) -> Path:
    src = tmp_path / "unversioned-src"
    src.mkdir()
    (src / "forward.py").write_text(UNVERSIONED_SOURCE)
    create_bundle(src, {}, tmp_path / "unversioned")
    return tmp_path / "unversioned"


def test_one_kv_cache_tag_rule():
    """The tag is derived from the declared KV layout: a bare version is the stock layout under it."""
    from shapeshift.engine.forward_pass.kv_layout import STOCK_KV_LAYOUT, declared_layout

    assert kv_cache_tag(1, "ab" * 32) == kv_cache_tag(declared_layout(1), "cd" * 32)
    assert kv_cache_tag(1, "ab" * 32).startswith("kv-format-1-")
    assert kv_cache_tag("bf16-v2", "ab" * 32).startswith("kv-format-bf16-v2-")
    assert kv_cache_tag(None, "ab" * 32) == "kv-format-" + "ab" * 32
    # any field of the layout moves the tag
    assert kv_cache_tag(declared_layout(1, {"k_scale": 2.0}), "") != kv_cache_tag(1, "")
    assert kv_cache_tag(declared_layout(1, {"rotary_base": 500000.0}), "") != kv_cache_tag(1, "")
    stock = load_bundle(STOCK_BUNDLE_DIR)
    try:  # read from the source without importing it, or from the imported module: the same tag
        assert stock.cache_format == declared_cache_format(STOCK_BUNDLE_DIR) == kv_cache_tag(1, stock.manifest.digest)
        assert stock.kv_layout == load_manifest(STOCK_BUNDLE_DIR).kv_layout == {**STOCK_KV_LAYOUT, "version": 1}
    finally:
        stock.unload()


def test_the_importer_gives_each_load_its_own_module_and_lays_the_recipe_override_over_recipe_yaml(tmp_path):
    folder = unversioned_bundle(tmp_path)
    a = load_bundle(folder, {"fuse_qkv": True})
    b = load_bundle(folder)
    try:
        assert a.module is not b.module and a.package != b.package
        assert a.recipe == {"fuse_qkv": True} and b.recipe == {}
        assert a.name == "unversioned" and a.manifest.digest == load_manifest(folder).digest
        assert a.cache_format == kv_cache_tag(None, a.manifest.digest)
    finally:
        a.unload()
        b.unload()


def test_engine_start_and_hot_reload_tag_a_pass_alike(tmp_path):
    """A pass without a declared cache format started with, then reloaded: one tag rule, so its
    own KV blocks are not flushed."""
    from shapeshift.engine.forward_pass.swap import ForwardPassManager

    folder = unversioned_bundle(tmp_path)
    engine = tiny_engine(forward_pass=str(folder))
    digest = load_manifest(folder).digest
    assert engine.block_manager.tag == engine.active_forward_pass.cache_format == kv_cache_tag(None, digest)
    result = ForwardPassManager(engine).reload(folder)
    assert result.flushed_kv is False and result.digest == digest


def test_the_engine_keeps_the_active_pass_and_every_reader_sees_it(tmp_path):
    from shapeshift.engine.forward_pass.identity import ActiveForwardPass
    from shapeshift.engine.forward_pass.swap import ForwardPassManager
    from shapeshift.engine.serving.async_engine import forward_pass_identity

    engine = tiny_engine()
    start = engine.active_forward_pass
    assert isinstance(start, ActiveForwardPass)
    assert (start.name, start.digest, start.source) == ("stock", load_manifest(STOCK_BUNDLE_DIR).digest,
                                                        str(STOCK_BUNDLE_DIR))
    # the engine tags blocks with the layout resolved against its model, cache and dtype
    assert start.kv_layout["num_kv_heads"] == engine.model_config.num_key_value_heads
    assert start.kv_layout["block_size"] == engine.config.block_size
    assert start.cache_format == engine.block_manager.tag and start.cache_format.startswith("kv-format-1-")
    with pytest.raises(dataclasses.FrozenInstanceError):
        start.name = "other"  # type: ignore[misc]
    manager = ForwardPassManager(engine)
    assert manager.active.identity is start
    folder = unversioned_bundle(tmp_path)
    manager.reload(folder)
    now = engine.active_forward_pass
    assert (now.name, now.digest, now.source) == ("unversioned", load_manifest(folder).digest, str(folder))
    assert engine.forward_pass_name == engine.stats().forward_pass_name == "unversioned"
    assert engine.block_manager.tag == now.cache_format
    manager.name_active("fp-unversioned")  # a rollout names it after its ForwardPass resource
    assert engine.active_forward_pass.label == "fp-unversioned" == manager.listing()["active"]["forwardPass"]
    assert forward_pass_identity(engine, engine.stats()) == ("fp-unversioned", now.digest)
    manager.rollback()
    assert engine.active_forward_pass == start and engine.block_manager.tag == start.cache_format
    assert forward_pass_identity(engine, engine.stats()) == ("stock", start.digest)


def test_run_with_deadline():
    assert run_with_deadline(lambda: 7, 5.0, "quick") == 7
    with pytest.raises(ZeroDivisionError):
        run_with_deadline(lambda: 1 / 0, 5.0, "raises")
    with pytest.raises(DeadlineExceeded, match="slow did not finish within 0.1 s"):
        run_with_deadline(lambda: time.sleep(2), 0.1, "slow")


def test_the_forward_pass_lifecycle_does_not_import_the_verifier():
    """The verifier imports the lifecycle (loading, deadline, weights guard, paged driver), never
    the other way round: statically, and at run time through a reload's code paths."""
    for path in sorted(FORWARD_PASS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.startswith("shapeshift.engine.verify")]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}; the verifier imports the lifecycle, not back"
    script = ("import sys\n"
              "from shapeshift.engine.forward_pass import swap, smoke, importer\n"
              "importer.load_bundle(None).unload()\n"
              "print(sorted(m for m in sys.modules if m.startswith('shapeshift.engine.verify')))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONSAFEPATH": "1"}, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
