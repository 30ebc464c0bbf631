"""A deadline for candidate code: build() and the smoke check run on a worker thread.

Hot reload and the verifier call a candidate's code through ``run_with_deadline``, so a
candidate that hangs is refused instead of stalling the caller.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

# The harness's own worker threads, by identity: the verifier's thread check exempts these,
# never a thread because of its name (a candidate can name its threads anything).
HARNESS_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


class DeadlineExceeded(TimeoutError):
    pass


def run_with_deadline(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run ``fn`` in a daemon worker thread; raise DeadlineExceeded if it outlives ``timeout_s``.

    Python cannot kill a thread: a hung candidate's thread stays blocked in the
    background (harmless when it waits on a lock or sleeps; a busy loop keeps one
    core). Compile workers that run untrusted code at scale should verify in a
    subprocess for hard isolation.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # delivered to the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=target, name=f"shapeshift-{what}", daemon=True)
    HARNESS_THREADS.add(worker)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise DeadlineExceeded(f"{what} did not finish within {timeout_s:.1f} s (hung?)")
    if "error" in result:
        raise result["error"]
    return result.get("value")
