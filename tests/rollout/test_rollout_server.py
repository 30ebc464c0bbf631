"""A real `shapeshift serve` following its pod annotations file: candidates roll out under
load, bad artifacts are refused while the old pass keeps serving, http:// artifacts work,
and writing the previous pass (or nothing: stock) rolls back.

The tests run in file order on one server, each writing the annotations it needs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from rollout_harness import (CANDIDATES, ArtifactServer, Load, ServerProcess, _QuietHandler, complete, desire,
                             forward_pass_info, gauge, reloads, wait_for, write_annotations)
from shapeshift.engine.forward_pass.bundle import create_bundle, load_manifest, stock_bundle_dir
from shapeshift.engine.contracts.pod_annotations import DesiredForwardPass

TOKEN = "rollout-admin-token"
ROLLOUT_TIMEOUT_S = 90.0  # annotation written -> server reports the pass (tiny model on 2 busy cores)
RETRY_BACKOFF_S = 2.0


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout")
    annotations = tmp / "podinfo" / "annotations"
    annotations.parent.mkdir()
    write_annotations(annotations, {"kubernetes.io/config.seen": "2025-01-01T00:00:00Z"})
    (tmp / "token").write_text(TOKEN + "\n")
    # Token through the environment fallback (the flag is covered in test_admin_wiring.py).
    server = ServerProcess(["--desired-forward-pass-file", str(annotations),
                            "--forward-pass-cache-dir", str(tmp / "cache"),
                            "--rollout-poll-interval", "0.2", "--rollout-retry-backoff", str(RETRY_BACKOFF_S),
                            "--artifact-fetch-timeout", "30"],
                           tmp / "serve.log", env={"SHAPESHIFT_ADMIN_TOKEN_FILE": str(tmp / "token")}).start()
    shared = tmp / "shared-volume"  # stands in for the volume the compile worker publishes to
    shared.mkdir()
    yield {"server": server, "annotations": annotations, "tmp": tmp, "shared": shared}
    server.stop()


def listing(base: str) -> dict:
    r = httpx.get(base + "/admin/forward-passes", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def stock_digest() -> str:
    return load_manifest(stock_bundle_dir()).digest


def good_archive(shared: Path) -> tuple[Path, str]:
    """The stock source with a changed recipe (fused q/k/v GEMM): a different bundle digest,
    the same math, and no dependence on the stock module's internals."""
    path = shared / "fused-qkv.tar.gz"
    if not path.exists():
        create_bundle(stock_bundle_dir(), {"fuse_qkv": True}, path, name="fused-qkv")
    return path, load_manifest(path).digest


def debug(server: ServerProcess) -> str:
    try:
        status = json.dumps(listing(server.base_url).get("rollout"), indent=1)
    except Exception as exc:  # the failure message must not fail itself
        status = repr(exc)
    return f"rollout status: {status}\nserver log:\n{server.log_tail()}"


def test_starts_on_stock_in_sync(rollout):
    base = rollout["server"].base_url
    info = forward_pass_info(base)
    assert info == {"model": "tiny-llama", "name": "stock", "sha256": stock_digest()}
    wait_for(lambda: gauge(base, "shapeshift_forward_pass_in_sync") == 1, 10, "in_sync=1 on stock")
    status = listing(base)["rollout"]
    assert status["desired"]["stock"] is True and status["inSync"] is True
    assert status["active"] == {"name": "stock", "sha256": stock_digest()}
    # Nothing was loaded: no attempt counted, the no-op reconcile is the last status.
    assert all(reloads(base, r) == 0 for r in ("success", "digest_mismatch", "fetch_error", "refused"))
    assert gauge(base, "shapeshift_forward_pass_last_reload_status", result="success") == 1


def test_good_candidate_rolls_out_under_load(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    archive, digest = good_archive(rollout["shared"])
    success_before = reloads(base, "success")
    with Load(base) as load:
        time.sleep(0.5)
        desire(rollout["annotations"], DesiredForwardPass("fused-qkv-v1", digest, str(archive)))
        took = wait_for(lambda: forward_pass_info(base)["sha256"] == digest, ROLLOUT_TIMEOUT_S,
                        "the candidate's sha256 in shapeshift_forward_pass_info", lambda: debug(server))
        time.sleep(0.5)
    assert not load.errors, load.errors[:3]
    assert load.statuses and set(load.statuses) == {200} and len(load.statuses) >= 5, load.statuses
    assert forward_pass_info(base)["name"] == "fused-qkv-v1"  # the ForwardPass resource's name
    body = listing(base)
    assert body["active"]["digest"] == digest and body["active"]["forwardPass"] == "fused-qkv-v1"
    assert body["active"]["name"] == "stock"  # the module's own name stays visible
    assert body["rollout"]["inSync"] is True and body["rollout"]["lastAttempt"]["result"] == "success"
    assert reloads(base, "success") == success_before + 1
    assert gauge(base, "shapeshift_forward_pass_in_sync") == 1
    print(f"rollout of a local .tar.gz reported after {took:.2f} s")


def test_digest_mismatch_refused_and_not_retried_in_a_hot_loop(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    active = forward_pass_info(base)
    other = rollout["shared"] / "stock-fused.tar.gz"
    real = create_bundle(stock_bundle_dir(), {"fuse_qkv": True, "fuse_gate_up": True}, other, name="stock-fused")
    claimed = "ab" * 32  # the ForwardPass pins a digest the artifact does not have
    assert real.digest != claimed
    mismatches = reloads(base, "digest_mismatch")
    with Load(base, clients=2) as load:
        desire(rollout["annotations"], DesiredForwardPass("stock-fused-v1", claimed, str(other)))
        wait_for(lambda: reloads(base, "digest_mismatch") == mismatches + 1, 30, "a digest_mismatch count",
                 lambda: debug(server))
        # When the server started each attempt (its own clock: the test's polling delays do not blur it).
        first_failure = gauge(base, "shapeshift_forward_pass_last_reload_timestamp_seconds")
        assert forward_pass_info(base) == active  # the old pass keeps serving
        # The agent polls every 0.2 s, but a retry waits for the backoff. The server stamps attempts
        # with the host's wall clock, so the test can tell when it reads the count: a loaded machine
        # may see the first failure late, and a read after the backoff would prove nothing here (the
        # spacing is checked on the server's stamps below).
        time.sleep(max(0.0, first_failure + RETRY_BACKOFF_S * 0.6 - time.time()))
        count = reloads(base, "digest_mismatch")
        if time.time() - first_failure < RETRY_BACKOFF_S * 0.9:
            assert count == mismatches + 1
        wait_for(lambda: reloads(base, "digest_mismatch") >= mismatches + 2, RETRY_BACKOFF_S * 5,
                 "a retry after the backoff", lambda: debug(server))
        retried_after = gauge(base, "shapeshift_forward_pass_last_reload_timestamp_seconds") - first_failure
    assert retried_after >= RETRY_BACKOFF_S * 0.9, retried_after
    # Backoff doubles: 2 s then 4 s, so at most one more attempt in this short window.
    assert reloads(base, "digest_mismatch") <= mismatches + 3
    assert not load.errors and set(load.statuses) == {200}, load.errors[:3]
    assert forward_pass_info(base) == active
    assert gauge(base, "shapeshift_forward_pass_last_reload_status", result="digest_mismatch") == 1
    assert gauge(base, "shapeshift_forward_pass_last_reload_status", result="success") == 0
    assert gauge(base, "shapeshift_forward_pass_in_sync") == 0
    status = listing(base)["rollout"]
    assert status["lastAttempt"]["result"] == "digest_mismatch" and claimed in status["lastAttempt"]["message"]
    assert status["consecutiveFailures"] >= 2 and status["nextRetryInSeconds"] > 0
    assert complete(base, "still serving").status_code == 200


def test_tampered_bundle_is_refused_before_its_code_runs(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    active = forward_pass_info(base)
    folder = rollout["shared"] / "tampered"
    manifest = create_bundle(CANDIDATES / "good_fused_mlp", {}, folder, name="fused-mlp")
    marker = rollout["tmp"] / "tampered-code-ran"
    with open(folder / "forward.py", "a") as f:  # changed after its manifest was written
        f.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    mismatches = reloads(base, "digest_mismatch")
    desire(rollout["annotations"], DesiredForwardPass("fused-mlp-v1", manifest.digest, f"file://{folder}"))
    wait_for(lambda: reloads(base, "digest_mismatch") == mismatches + 1, 30, "a digest_mismatch count",
             lambda: debug(server))
    assert not marker.exists()
    assert forward_pass_info(base) == active
    assert "forward.py" in listing(base)["rollout"]["lastAttempt"]["message"]


def test_missing_artifact_is_a_fetch_error(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    active = forward_pass_info(base)
    errors = reloads(base, "fetch_error")
    with ArtifactServer(rollout["shared"]) as store:
        desire(rollout["annotations"], DesiredForwardPass("gone-v1", "cd" * 32, f"{store.base_url}/gone.tar.gz"))
        wait_for(lambda: reloads(base, "fetch_error") == errors + 1, 30, "a fetch_error count", lambda: debug(server))
    assert forward_pass_info(base) == active
    assert "HTTP 404" in listing(base)["rollout"]["lastAttempt"]["message"]


def test_http_artifact_rolls_out(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    store_root = rollout["tmp"] / "store"
    store_root.mkdir()
    manifest = create_bundle(stock_bundle_dir(), {"fuse_qkv": True, "fuse_gate_up": True},
                             store_root / "stock-fused.tar.gz", name="stock-fused")
    _QuietHandler.requests_seen.clear()
    with ArtifactServer(store_root) as store, Load(base, clients=2) as load:
        url = f"{store.base_url}/stock-fused.tar.gz"
        desire(rollout["annotations"], DesiredForwardPass("stock-fused-v1", manifest.digest, url))
        wait_for(lambda: forward_pass_info(base)["sha256"] == manifest.digest, ROLLOUT_TIMEOUT_S,
                 "the http artifact's sha256 in shapeshift_forward_pass_info", lambda: debug(server))
    assert not load.errors and set(load.statuses) == {200}, load.errors[:3]
    assert "/stock-fused.tar.gz" in _QuietHandler.requests_seen
    assert (rollout["tmp"] / "cache" / f"{manifest.digest}.tar.gz").is_file()  # kept in the cache dir
    assert forward_pass_info(base)["name"] == "stock-fused-v1"
    assert listing(base)["rollout"]["inSync"] is True


def test_rollback_to_previous_pass_reactivates_it_without_fetching(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    archive, digest = good_archive(rollout["shared"])
    archive.unlink()  # the pass is still held in memory: nothing needs fetching
    success_before = reloads(base, "success")
    with Load(base, clients=2) as load:
        desire(rollout["annotations"], DesiredForwardPass("fused-qkv-v1", digest, str(archive)))
        wait_for(lambda: forward_pass_info(base)["sha256"] == digest, ROLLOUT_TIMEOUT_S,
                 "the previous pass re-activated", lambda: debug(server))
    assert not load.errors and set(load.statuses) == {200}, load.errors[:3]
    assert reloads(base, "success") == success_before + 1
    assert "re-activated from memory" in listing(base)["rollout"]["lastAttempt"]["message"]


def test_empty_annotations_switch_back_to_stock(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    with Load(base, clients=2) as load:
        write_annotations(rollout["annotations"], {"kubernetes.io/config.seen": "2025-01-01T00:00:00Z"})
        wait_for(lambda: forward_pass_info(base)["sha256"] == stock_digest(), ROLLOUT_TIMEOUT_S,
                 "the stock pass back", lambda: debug(server))
    assert not load.errors and set(load.statuses) == {200}, load.errors[:3]
    assert forward_pass_info(base)["name"] == "stock"
    body = listing(base)
    assert body["active"]["digest"] == stock_digest() and body["rollout"]["inSync"] is True
    assert gauge(base, "shapeshift_forward_pass_in_sync") == 1


def test_malformed_annotations_file_keeps_the_pass_and_is_reported(rollout):
    server, base = rollout["server"], rollout["server"].base_url
    active = forward_pass_info(base)
    refused = reloads(base, "refused")
    rollout["annotations"].write_text('shapeshift.dev/forward-pass="unterminated\n')
    wait_for(lambda: reloads(base, "refused") == refused + 1, 30, "a refused count", lambda: debug(server))
    time.sleep(1.0)  # the same broken text is reported once, not every poll
    assert reloads(base, "refused") == refused + 1
    assert forward_pass_info(base) == active
    status = listing(base)["rollout"]
    assert "not a double-quoted string" in status["fileError"]
    assert status["lastAttempt"]["result"] == "refused" and "cannot parse" in status["lastAttempt"]["message"]
    assert complete(base, "still serving").status_code == 200
    write_annotations(rollout["annotations"], {})
    wait_for(lambda: gauge(base, "shapeshift_forward_pass_in_sync") == 1, 30, "in sync again once the file parses")
