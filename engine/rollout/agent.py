"""Engine-side rollout agent: run the forward pass the pod's annotations ask for.

Data flow (one daemon thread, one tick every ``poll_interval_s``):

    annotations file (downwardAPI volume; the kubelet rewrites it when annotations change)
      --parse_downward_api_map--> DesiredForwardPass(name, sha256, artifact)
      --changed since the last tick, or a failed attempt's backoff expired?--> attempt:
          already active                      -> nothing to load (renamed if the resource is)
          held in the manager's history       -> re-activated on the engine thread (no fetch)
          stock                               -> the engine's own stock bundle
          otherwise: ArtifactFetcher.fetch    -> local folder / .tar.gz, or a download into
                                                 the cache dir (size bound, timeouts)
                     ForwardPassManager.prepare (this thread: open_bundle checks every file and
                                                 the sha256 on a private copy BEFORE anything is
                                                 imported; then import, build, smoke)
                     ForwardPassManager.commit  (engine thread, between two steps)
      --> metrics: reloads_total{result}, last_reload_status{result}, in_sync (the info
          label follows the engine's active_forward_pass); status() for /admin/forward-passes

A failed attempt leaves the old pass serving; it is retried after an exponential
backoff (``retry_initial_s`` doubling up to ``retry_max_s``) and at once when the
annotations change. Results: see ``rollout_protocol.RELOAD_RESULTS``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shapeshift.engine.forward_pass.bundle import MAX_BUNDLE_BYTES, BundleError, BundleTamperedError, load_manifest, stock_bundle_dir
from shapeshift.engine.forward_pass.importer import ReloadError
from shapeshift.engine.forward_pass.swap import ForwardPassManager
from shapeshift.engine.contracts.pod_annotations import (RESULT_DIGEST_MISMATCH, RESULT_FETCH_ERROR, RESULT_REFUSED, RESULT_SUCCESS,
                               RESULT_UNREADABLE, DesiredForwardPass, DownwardAPIFormatError,
                               parse_downward_api_map)

logger = logging.getLogger("shapeshift.engine.rollout")


def default_cache_dir() -> Path:
    """$SHAPESHIFT_CACHE/forward-passes (default ~/.cache/shapeshift/forward-passes)."""
    root = os.environ.get("SHAPESHIFT_CACHE") or str(Path.home() / ".cache" / "shapeshift")
    return Path(root) / "forward-passes"


@dataclass
class RolloutSettings:
    annotations_file: Path
    cache_dir: Path = field(default_factory=default_cache_dir)
    poll_interval_s: float = 1.0
    retry_initial_s: float = 10.0
    retry_max_s: float = 300.0
    connect_timeout_s: float = 10.0  # connect, and every read that stalls
    fetch_timeout_s: float = 120.0  # a whole download
    max_artifact_bytes: int = MAX_BUNDLE_BYTES
    max_cached_artifacts: int = 8
    engine_call_timeout_s: float = 300.0  # waiting for the engine thread to run a swap

    def __post_init__(self) -> None:
        self.annotations_file = Path(self.annotations_file)
        self.cache_dir = Path(self.cache_dir)
        for name in ("poll_interval_s", "retry_initial_s", "retry_max_s", "connect_timeout_s", "fetch_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout setting {name} must be > 0, got {getattr(self, name)}")
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError(f"rollout retry_max_s ({self.retry_max_s}) is below retry_initial_s "
                             f"({self.retry_initial_s})")


class AttemptFailed(Exception):
    """One rollout attempt failed; ``result`` is its RELOAD_RESULTS value."""

    def __init__(self, result: str, message: str) -> None:
        super().__init__(message)
        self.result = result


def unreadable(artifact: str, exc: PermissionError) -> AttemptFailed:
    """The artifact (or a file or folder of it) is there, but this process may not read it."""
    return AttemptFailed(RESULT_UNREADABLE, f"artifact {artifact}: {exc.strerror or exc}: {exc.filename} (the "
                                            f"engine runs as uid {os.getuid()}; make the store readable to it)")


# ---------------------------------------------------------------------- fetching


class ArtifactFetcher:
    """Brings an artifact URI to a local path the bundle tooling can open.

    Local paths (absolute, or file://) are used in place: folders and archives are
    copied privately by the loader anyway. http(s) archives are downloaded into
    ``cache_dir/<sha256>.tar.gz`` (reused while their digest checks out).
    """

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings

    def fetch(self, artifact: str, sha256: str) -> Path:
        if not artifact:
            raise AttemptFailed(RESULT_REFUSED, "annotation shapeshift.dev/forward-pass-artifact is empty and "
                                                f"no pass with sha256 {sha256[:12]} is held in memory; "
                                                "set the artifact's location")
        parsed = urllib.parse.urlparse(artifact)
        if parsed.scheme in ("http", "https"):
            return self._download(artifact, sha256)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise AttemptFailed(RESULT_REFUSED, f"artifact {artifact}: file:// URIs must name a local path "
                                                    "(file:///path), not a host")
            return self._local(Path(urllib.parse.unquote(parsed.path)), artifact)
        if parsed.scheme == "" and artifact.startswith("/"):
            return self._local(Path(artifact), artifact)
        raise AttemptFailed(RESULT_REFUSED, f"artifact {artifact!r}: unsupported location; use an absolute path "
                                            "on a shared volume, file:///path, or an http(s):// URL of a .tar.gz")

    def _local(self, path: Path, artifact: str) -> Path:
        try:
            if not path.exists():
                raise AttemptFailed(RESULT_FETCH_ERROR, f"artifact {artifact}: {path} does not exist (is the shared "
                                                        "volume mounted in the engine container?)")
            if path.is_file():
                size = path.stat().st_size
                if size > self.settings.max_artifact_bytes:
                    raise AttemptFailed(RESULT_FETCH_ERROR, f"artifact {artifact}: {size} bytes, more than the "
                                                            f"limit {self.settings.max_artifact_bytes}")
                path.open("rb").close()
            else:
                os.listdir(path)
        except PermissionError as exc:
            raise unreadable(artifact, exc) from exc
        return path

    def cached_path(self, sha256: str) -> Path:
        return self.settings.cache_dir / f"{sha256}.tar.gz"

    def discard(self, sha256: str) -> None:
        """Forget a cached download (its contents did not verify)."""
        self.cached_path(sha256).unlink(missing_ok=True)

    def _download(self, url: str, sha256: str) -> Path:
        s = self.settings
        dest = self.cached_path(sha256)
        if dest.is_file():
            os.utime(dest)  # most recently used: evicted last
            return dest
        s.cache_dir.mkdir(parents=True, exist_ok=True)
        partial = s.cache_dir / f".{sha256}.{os.getpid()}.{threading.get_ident()}.partial"
        deadline = time.monotonic() + s.fetch_timeout_s
        total = 0
        try:
            request = urllib.request.Request(url, headers={"User-Agent": "shapeshift-engine",
                                                           "Accept": "application/gzip, */*"})
            # `timeout` bounds the connect and every blocking read; the deadline bounds the whole.
            with urllib.request.urlopen(request, timeout=s.connect_timeout_s) as response:
                declared = response.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > s.max_artifact_bytes:
                    raise AttemptFailed(RESULT_FETCH_ERROR, f"artifact {url}: Content-Length {declared} is more "
                                                            f"than the limit {s.max_artifact_bytes} bytes")
                with open(partial, "wb") as out:
                    while True:
                        if time.monotonic() > deadline:
                            raise AttemptFailed(RESULT_FETCH_ERROR, f"artifact {url}: download took longer than "
                                                                    f"{s.fetch_timeout_s:.0f} s ({total} bytes)")
                        chunk = response.read(1 << 16)
                        if not chunk:
                            break
                        total += len(chunk)
                        if total > s.max_artifact_bytes:
                            raise AttemptFailed(RESULT_FETCH_ERROR, f"artifact {url}: more than the limit "
                                                                    f"{s.max_artifact_bytes} bytes")
                        out.write(chunk)
            os.replace(partial, dest)
        except AttemptFailed:
            raise
        except urllib.error.HTTPError as exc:
            raise AttemptFailed(RESULT_FETCH_ERROR, f"artifact {url}: HTTP {exc.code} {exc.reason}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AttemptFailed(RESULT_FETCH_ERROR, f"artifact {url}: download failed: {reason}") from exc
        finally:
            partial.unlink(missing_ok=True)
        self._evict(keep=dest)
        logger.info("fetched %s (%d bytes) into %s", url, total, dest)
        return dest

    def _evict(self, keep: Path) -> None:
        cached = sorted((p for p in self.settings.cache_dir.glob("*.tar.gz") if p != keep),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in cached[max(self.settings.max_cached_artifacts - 1, 0):]:
            old.unlink(missing_ok=True)


# ---------------------------------------------------------------------- the agent


@dataclass
class Attempt:
    result: str
    message: str
    unix_time: float
    duration_s: float
    desired: DesiredForwardPass

    def to_dict(self) -> dict[str, Any]:
        return {"result": self.result, "message": self.message, "unixTime": round(self.unix_time, 3),
                "durationSeconds": round(self.duration_s, 4), "desired": _desired_dict(self.desired)}


def _desired_dict(d: DesiredForwardPass) -> dict[str, Any]:
    return {"stock": d.is_stock, "forwardPass": d.name, "sha256": d.sha256, "artifact": d.artifact}


class RolloutAgent:
    """Keeps the engine on the forward pass its pod annotations name (see module docstring)."""

    def __init__(self, async_engine: Any, manager: ForwardPassManager, metrics: Any,
                 settings: RolloutSettings, *, fetcher: ArtifactFetcher | None = None) -> None:
        self.async_engine = async_engine
        self.engine = getattr(async_engine, "engine", async_engine)
        self.manager = manager
        self.metrics = metrics
        self.settings = settings
        self.fetcher = fetcher or ArtifactFetcher(settings)
        self.stock_digest = self._stock_digest()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shapeshift-rollout", daemon=True)
        self._state_lock = threading.Lock()  # guards the fields status() reads
        self._desired: DesiredForwardPass | None = None
        self._file_text: str | None = None  # the annotations file's text at the last poll
        self._file_desired: DesiredForwardPass | None = None  # what that text asks for, once parsed
        self._file_error: str | None = None
        self._last: Attempt | None = None
        self._failures = 0
        self._next_retry_at: float | None = None  # monotonic; None: nothing to retry
        self._warned_missing = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RolloutAgent":
        if not self._thread.is_alive():
            self._thread.start()
            logger.info("forward-pass rollout: following %s (poll every %.1f s)", self.settings.annotations_file,
                        self.settings.poll_interval_s)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the watcher must survive anything one tick throws
                logger.exception("forward-pass rollout tick failed; retrying at the next poll")
            self._stop.wait(self.settings.poll_interval_s)

    # ------------------------------------------------------------------ one tick
    def tick(self) -> Attempt | None:
        """Read the annotations; attempt a rollout when they changed or a retry is due."""
        desired = self._read_desired()
        if desired is None:  # unreadable this time: keep what runs, wait for a change
            self._update_in_sync()
            return None
        now = time.monotonic()
        with self._state_lock:
            changed = desired != self._desired
            if changed:
                self._desired, self._failures, self._next_retry_at = desired, 0, None
            due = changed or (self._next_retry_at is not None and now >= self._next_retry_at)
        attempt = self._attempt(desired) if due else None
        self._update_in_sync()
        return attempt

    def _read_desired(self) -> DesiredForwardPass | None:
        path = self.settings.annotations_file
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            if not self._warned_missing:
                logger.warning("forward-pass rollout: %s does not exist; running the stock pass until it "
                               "appears (mount the pod's annotations there with a downwardAPI volume)", path)
                self._warned_missing = True
            text = ""
        except OSError as exc:
            logger.warning("forward-pass rollout: cannot read %s: %s", path, exc)
            return None
        if text == self._file_text:
            # Unchanged since the last poll: the same answer without parsing again (a pod's
            # annotations file can hold large values, e.g. kubectl's last-applied-configuration).
            # Malformed content was reported once already.
            return None if self._file_error is not None else self._file_desired
        self._file_text = text
        try:
            annotations = parse_downward_api_map(text, str(path))
        except DownwardAPIFormatError as exc:
            self._file_error = str(exc)
            message = f"cannot parse the annotations file: {exc}; keeping the current forward pass"
            logger.error("forward-pass rollout: %s", message)
            # Nothing to retry: the same text stays broken until the kubelet writes a new one.
            self._record(Attempt(RESULT_REFUSED, message, time.time(), 0.0, self._desired or DesiredForwardPass()),
                         count=True, retry=False)
            return None
        self._file_error = None
        self._file_desired = DesiredForwardPass.from_annotations(annotations)
        return self._file_desired

    def _target_digest(self, desired: DesiredForwardPass) -> str:
        return self.stock_digest if desired.is_stock else desired.sha256

    def _update_in_sync(self) -> None:
        with self._state_lock:
            desired, file_error = self._desired, self._file_error
        in_sync = (desired is not None and file_error is None and not desired.problems()
                   and self.engine.active_forward_pass.digest == self._target_digest(desired))
        self.metrics.forward_pass_in_sync.set(1 if in_sync else 0)

    # ------------------------------------------------------------------ attempts
    def _attempt(self, desired: DesiredForwardPass) -> Attempt:
        started_unix, t0 = time.time(), time.perf_counter()
        counted = True
        try:
            problems = desired.problems()
            if problems:
                raise AttemptFailed(RESULT_REFUSED, "; ".join(problems))
            message, counted = self._reconcile(desired)
            result = RESULT_SUCCESS
        except AttemptFailed as exc:
            result, message = exc.result, str(exc)
        except Exception as exc:  # the engine thread is gone, a swap timed out...
            result, message = RESULT_REFUSED, f"{type(exc).__name__}: {exc}"
        attempt = Attempt(result, message, started_unix, time.perf_counter() - t0, desired)
        self._record(attempt, count=counted)
        return attempt

    def _record(self, attempt: Attempt, *, count: bool, retry: bool = True) -> None:
        with self._state_lock:
            self._last = attempt
            if attempt.result == RESULT_SUCCESS or not retry:
                self._failures, self._next_retry_at = 0, None
            else:
                self._failures += 1
                backoff = min(self.settings.retry_initial_s * 2 ** (self._failures - 1), self.settings.retry_max_s)
                self._next_retry_at = time.monotonic() + backoff
        if count:
            self.metrics.record_reload(attempt.result, attempt.unix_time)
        else:
            self.metrics.set_last_reload_status(attempt.result, attempt.unix_time)
        if attempt.result == RESULT_SUCCESS:
            logger.info("forward-pass rollout: %s (%s, %.2f s)", attempt.desired.describe(), attempt.message,
                        attempt.duration_s)
        else:
            retry_in = self._retry_in_s()
            when = "when the annotations change" if retry_in is None else \
                f"in {retry_in:.0f} s or when the annotations change"
            logger.warning("forward-pass rollout of %s failed [%s]: %s; the current pass keeps serving; "
                           "next attempt %s", attempt.desired.describe(), attempt.result, attempt.message, when)

    def _reconcile(self, desired: DesiredForwardPass) -> tuple[str, bool]:
        """Make ``desired`` active. Returns (what happened, whether it counts as a reload)."""
        digest = self._target_digest(desired)
        resource = desired.name or None
        reactivated = self._on_engine_thread(lambda: self._activate_held(digest, resource))
        if reactivated is not None:
            return reactivated
        fetched = not (desired.is_stock or digest == self.stock_digest)  # stock, possibly pinned by its digest
        if fetched:
            path = self.fetcher.fetch(desired.artifact, digest)
            source = desired.artifact
        else:
            path, source = stock_bundle_dir(), "the engine's stock bundle"
        try:  # opening verifies every file and the digest before any of the bundle's code is imported
            prepared = self.manager.prepare(path, digest, resource=resource)
        except PermissionError as exc:  # a file of a bundle folder this process may not read
            raise unreadable(source, exc) from exc
        except ReloadError as exc:
            bundle_error = exc.__cause__ if exc.stage == "open" else None
            if fetched and isinstance(bundle_error, BundleTamperedError):
                if path == self.fetcher.cached_path(digest):
                    self.fetcher.discard(digest)  # fetch again next time
                raise AttemptFailed(RESULT_DIGEST_MISMATCH, f"artifact {source}: {bundle_error}") from exc
            if fetched and isinstance(bundle_error, BundleError):
                raise AttemptFailed(RESULT_REFUSED, f"artifact {source}: {bundle_error}") from exc
            raise AttemptFailed(RESULT_REFUSED, f"{source}: {exc}") from exc
        result = self._on_engine_thread(lambda: self.manager.commit(prepared))
        return (f"loaded from {source} in {sum(result.timings_s.values()):.2f} s "
                f"(KV cache {result.kv['outcome']} ({result.kv['reason']}), preempted={result.preempted})", True)

    def _activate_held(self, digest: str, resource: str | None) -> tuple[str, bool] | None:
        """On the engine thread: the active pass, or one in the manager's history, if its digest
        is ``digest``; None when it must be loaded."""
        history = self.manager.history
        index = next((i for i in range(len(history) - 1, -1, -1) if history[i].identity.digest == digest), None)
        if index is None:
            return None
        steps = len(history) - 1 - index
        if steps == 0:
            message, counted = "already active", False
        else:
            self.manager.rollback(steps)
            message, counted = f"re-activated from memory ({steps} step(s) back in history)", True
        self.manager.name_active(resource)
        return message, counted

    def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        call = getattr(self.async_engine, "call_blocking", None)
        if call is None:  # a bare LLMEngine: the caller owns it
            return fn()
        return call(lambda _engine: fn(), timeout=self.settings.engine_call_timeout_s)

    def _stock_digest(self) -> str:
        """The digest the stock pass is known by: the startup record's when the engine started
        on it (what it reports), else the stock bundle's manifest."""
        first = self.manager.history[0].identity
        try:
            if Path(first.source).resolve() == stock_bundle_dir().resolve():
                return first.digest
        except OSError:
            pass
        try:
            return load_manifest(stock_bundle_dir()).digest
        except BundleError:
            return first.digest

    # ------------------------------------------------------------------ reporting
    def _retry_in_s(self) -> float | None:
        if self._next_retry_at is None:
            return None
        return max(self._next_retry_at - time.monotonic(), 0.0)

    def status(self) -> dict[str, Any]:
        """What the agent follows and how its last attempt went (for /admin/forward-passes)."""
        with self._state_lock:
            desired, last, failures, file_error = self._desired, self._last, self._failures, self._file_error
            retry_in = self._retry_in_s()
        active = self.engine.active_forward_pass
        return {
            "annotationsFile": str(self.settings.annotations_file),
            "desired": None if desired is None else _desired_dict(desired),
            "fileError": file_error,
            "active": {"name": active.label, "sha256": active.digest},
            "inSync": bool(desired is not None and file_error is None
                           and active.digest == self._target_digest(desired)),
            "lastAttempt": None if last is None else last.to_dict(),
            "consecutiveFailures": failures,
            "nextRetryInSeconds": None if retry_in is None else round(retry_in, 1),
        }
