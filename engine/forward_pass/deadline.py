"""A deadline for candidate code: build() and the smoke check run on a worker thread.

Hot reload and the verifier call a candidate's code through ``run_with_deadline``, so a
candidate that hangs is refused instead of stalling the caller.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


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
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise DeadlineExceeded(f"{what} did not finish within {timeout_s:.1f} s (hung?)")
    if "error" in result:
        raise result["error"]
    return result.get("value")
