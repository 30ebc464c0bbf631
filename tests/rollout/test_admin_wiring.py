"""The admin API as `shapeshift serve` wires it: on with --admin-token-file (401 without the
token, a reload works), absent (404) and logged as disabled without a token, refused at
start when the token file is missing."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from rollout_harness import (CANDIDATES, ServerProcess, complete, forward_pass_info, shapeshift_command,
                             wait_for)
from shapeshift.engine.forward_pass.bundle import create_bundle, load_manifest, stock_bundle_dir

TOKEN = "wiring-admin-token"


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("admin-flag")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    server = ServerProcess(["--admin-token-file", str(token_file)], tmp / "serve.log").start()
    yield server, tmp
    server.stop()


def test_admin_calls_need_the_token(admin_server):
    server, _ = admin_server
    base = server.base_url
    assert httpx.get(base + "/admin/forward-passes").status_code == 401
    assert httpx.get(base + "/admin/forward-passes", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(base + "/admin/forward-passes", json={"path": "/nowhere"}).status_code == 401
    assert httpx.post(base + "/admin/forward-passes/rollback", json={"steps": 1}).status_code == 401
    ok = httpx.get(base + "/admin/forward-passes", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    assert ok.json()["active"]["digest"] == load_manifest(stock_bundle_dir()).digest
    assert "rollout" not in ok.json()  # no annotations file given


def test_reload_through_the_cli_started_server(admin_server):
    server, tmp = admin_server
    base = server.base_url
    folder = tmp / "fused-mlp"
    manifest = create_bundle(CANDIDATES / "good_fused_mlp", {}, folder, name="fused-mlp")
    r = httpx.post(base + "/admin/forward-passes", json={"path": str(folder), "expectedDigest": manifest.digest},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["digest"] == manifest.digest
    wait_for(lambda: forward_pass_info(base)["sha256"] == manifest.digest, 10, "the new sha256 in /metrics")
    assert complete(base, "after the reload").status_code == 200
    back = httpx.post(base + "/admin/forward-passes/rollback", json={"steps": 1},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert back.status_code == 200 and back.json()["name"] == "stock"
    assert forward_pass_info(base)["sha256"] == load_manifest(stock_bundle_dir()).digest


def test_without_a_token_admin_routes_are_absent_and_logged(tmp_path):
    server = ServerProcess([], tmp_path / "serve.log").start()
    try:
        r = httpx.get(server.base_url + "/admin/forward-passes", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 404
        assert httpx.post(server.base_url + "/admin/forward-passes", json={"path": "/x"}).status_code == 404
        assert complete(server.base_url, "serving anyway").status_code == 200
        assert "hot reload is disabled" in server.log_text()
        # The stock pass is still reported by its bundle digest.
        assert forward_pass_info(server.base_url)["sha256"] == load_manifest(stock_bundle_dir()).digest
    finally:
        server.stop()


def test_missing_token_file_is_refused_at_start(tmp_path):
    out = subprocess.run(shapeshift_command() + ["serve", "--model", "tiny-llama", "--admin-token-file",
                                                 str(tmp_path / "absent")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1"})
    assert out.returncode == 2
    assert "no admin token found" in out.stderr and "absent" in out.stderr
