"""The annotation contract and the artifact fetcher, without an engine: the downwardAPI file
format (Go-quoted values), what counts as stock, and fetch bounds (size, stalls, schemes)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout_harness import ArtifactServer
from shapeshift.engine.rollout.agent import ArtifactFetcher, AttemptFailed, RolloutSettings
from shapeshift.engine.contracts.pod_annotations import (ANNOTATION_FORWARD_PASS, ANNOTATION_FORWARD_PASS_ARTIFACT,
                                                ANNOTATION_FORWARD_PASS_SHA256, DesiredForwardPass,
                                                DownwardAPIFormatError, format_downward_api_map,
                                                parse_downward_api_map)

# What the kubelet writes (Go fmt %q of each value, keys sorted), including escapes.
KUBELET_TEXT = (
    'kubectl.kubernetes.io/last-applied-configuration="{\\"apiVersion\\":\\"v1\\",\\"kind\\":\\"Pod\\"}\\n"\n'
    'note="tab\\there \\\\ back\\x01 caf\\u00e9 \\U0001f600 \\377"\n'
    'shapeshift.dev/forward-pass="fused-qkv-v3"\n'
    'shapeshift.dev/forward-pass-artifact="http://store.svc:8080/fp/ab.tar.gz"\n'
    'shapeshift.dev/forward-pass-sha256="' + "ab" * 32 + '"'
)


def test_parses_the_kubelet_format():
    parsed = parse_downward_api_map(KUBELET_TEXT)
    assert parsed["kubectl.kubernetes.io/last-applied-configuration"] == '{"apiVersion":"v1","kind":"Pod"}\n'
    assert parsed["note"] == "tab\there \\ back\x01 café \U0001f600 \ufffd"  # \377 alone is invalid UTF-8
    desired = DesiredForwardPass.from_annotations(parsed)
    assert desired == DesiredForwardPass("fused-qkv-v3", "ab" * 32, "http://store.svc:8080/fp/ab.tar.gz")
    assert not desired.is_stock and desired.problems() == []


def test_format_round_trips():
    values = {"a/b": 'quote " backslash \\ newline \n nul \x00 del \x7f é \u2028', "empty": ""}
    text = format_downward_api_map(values)
    assert text.splitlines()[0].startswith("a/b=")  # sorted keys, one line each
    assert parse_downward_api_map(text) == values


@pytest.mark.parametrize("text", ['key=unquoted', 'key="open', 'key="bad \\q escape"', 'no equals sign',
                                  'key="inner " quote"', 'key="\\xZZ"'])
def test_malformed_lines_raise_naming_the_line(text):
    with pytest.raises(DownwardAPIFormatError, match="annotations:1"):
        parse_downward_api_map(text)


@pytest.mark.parametrize("annotations,stock", [
    ({}, True),
    ({ANNOTATION_FORWARD_PASS: ""}, True),
    ({ANNOTATION_FORWARD_PASS: "stock"}, True),
    ({ANNOTATION_FORWARD_PASS: "stock", ANNOTATION_FORWARD_PASS_SHA256: "ab" * 32}, False),
    ({ANNOTATION_FORWARD_PASS: "fp-1", ANNOTATION_FORWARD_PASS_SHA256: "ab" * 32,
      ANNOTATION_FORWARD_PASS_ARTIFACT: "/v/fp.tar.gz"}, False),
])
def test_what_counts_as_stock(annotations, stock):
    desired = DesiredForwardPass.from_annotations(annotations)
    assert desired.is_stock is stock
    if stock:
        assert desired.to_annotations() == {}


def test_a_pass_without_a_valid_digest_cannot_be_acted_on():
    missing = DesiredForwardPass("fp-1", "", "/v/fp.tar.gz").problems()
    assert missing and ANNOTATION_FORWARD_PASS_SHA256 in missing[0]
    bad = DesiredForwardPass("fp-1", "xyz", "/v/fp.tar.gz").problems()
    assert bad and "64 hex" in bad[0]


def test_protocol_imports_without_torch():
    code = ("import sys; import shapeshift.engine.contracts.pod_annotations; "
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules; print('OK')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


# ------------------------------------------------------------------ fetcher


def fetcher(tmp_path: Path, **overrides) -> ArtifactFetcher:
    return ArtifactFetcher(RolloutSettings(annotations_file=tmp_path / "annotations", cache_dir=tmp_path / "cache",
                                           **overrides))


def test_download_is_cached_by_digest(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    (root / "a.tar.gz").write_bytes(b"x" * 1000)
    with ArtifactServer(root) as store:
        f = fetcher(tmp_path)
        path = f.fetch(f"{store.base_url}/a.tar.gz", "ab" * 32)
        assert path == tmp_path / "cache" / f"{'ab' * 32}.tar.gz" and path.read_bytes() == b"x" * 1000
    # Served from the cache once the store is gone; discard() forgets it.
    assert f.fetch("http://127.0.0.1:9/a.tar.gz", "ab" * 32) == path
    f.discard("ab" * 32)
    with pytest.raises(AttemptFailed) as err:
        f.fetch("http://127.0.0.1:9/a.tar.gz", "ab" * 32)
    assert err.value.result == "fetch_error"
    assert not list((tmp_path / "cache").glob(".*partial"))


def test_oversized_download_is_a_fetch_error(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    (root / "big.tar.gz").write_bytes(b"x" * 5000)
    with ArtifactServer(root) as store:
        with pytest.raises(AttemptFailed, match="limit 4096") as err:
            fetcher(tmp_path, max_artifact_bytes=4096).fetch(f"{store.base_url}/big.tar.gz", "cd" * 32)
    assert err.value.result == "fetch_error"
    assert not list((tmp_path / "cache").iterdir())  # no partial file left behind


class _StallingHandler(http.server.BaseHTTPRequestHandler):
    """Sends headers and a few bytes, then goes silent (a hung artifact store)."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(b"x" * 10)
        self.wfile.flush()
        time.sleep(5)

    def log_message(self, *args) -> None:
        pass


def test_stalled_download_times_out(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StallingHandler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(AttemptFailed) as err:
            fetcher(tmp_path, connect_timeout_s=0.5).fetch(
                f"http://127.0.0.1:{httpd.server_address[1]}/slow.tar.gz", "ef" * 32)
        assert time.monotonic() - t0 < 4.0
        assert err.value.result == "fetch_error" and "download failed" in str(err.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("artifact,result", [
    ("s3://bucket/fp.tar.gz", "refused"),
    ("relative/path.tar.gz", "refused"),
    ("file://otherhost/fp.tar.gz", "refused"),
    ("", "refused"),
    ("/definitely/not/here.tar.gz", "fetch_error"),
    ("file:///definitely/not/here.tar.gz", "fetch_error"),
])
def test_unusable_artifact_locations(tmp_path, artifact, result):
    with pytest.raises(AttemptFailed) as err:
        fetcher(tmp_path).fetch(artifact, "ab" * 32)
    assert err.value.result == result


def test_a_local_artifact_this_process_may_not_read_is_unreadable(tmp_path, monkeypatch):
    """What file modes do to a non-root engine (the cluster test runs one: test_rollout_faults.py)."""
    archive = tmp_path / "fp.tar.gz"
    archive.write_bytes(b"x")

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(AttemptFailed) as err:
        fetcher(tmp_path).fetch(str(archive), "ab" * 32)
    assert err.value.result == "unreadable"
    assert f"artifact {archive}: Permission denied: {archive}" in str(err.value)
    monkeypatch.undo()
    monkeypatch.setattr("os.listdir", denied)
    with pytest.raises(AttemptFailed, match="make the store readable") as err:
        fetcher(tmp_path).fetch(str(tmp_path), "ab" * 32)
    assert err.value.result == "unreadable"


def test_local_paths_are_used_in_place(tmp_path):
    archive = tmp_path / "fp.tar.gz"
    archive.write_bytes(b"x")
    assert fetcher(tmp_path).fetch(str(archive), "ab" * 32) == archive
    assert fetcher(tmp_path).fetch(f"file://{archive}", "ab" * 32) == archive


def test_pod_template_pieces_point_the_engine_at_the_annotations():
    from shapeshift.engine.contracts.pod_annotations import (DEFAULT_ANNOTATIONS_FILE, podinfo_volume, podinfo_volume_mount,
                                                    serve_args)

    volume, mount = podinfo_volume(), podinfo_volume_mount()
    assert volume["name"] == mount["name"]
    item = volume["downwardAPI"]["items"][0]
    assert item["fieldRef"]["fieldPath"] == "metadata.annotations"
    assert f"{mount['mountPath']}/{item['path']}" == DEFAULT_ANNOTATIONS_FILE
    assert serve_args() == ["--desired-forward-pass-file", DEFAULT_ANNOTATIONS_FILE]
