"""Run a parametrized test's subprocesses side by side, one a CPU core.

The Triton-interpreter tests (tests/engine/test_fast_recipe.py, test_triton_recipe.py) run each
case in a subprocess of its own (TRITON_INTERPRET must be set before triton is first imported),
and each subprocess is one single-threaded Python interpreting kernels for seconds to minutes.
CaseProcesses starts the cases this session selected, up to one a core (at most four), when the
first of them is asked for; each test then waits for its own case's process and checks its
output as it did when it ran the process itself. A case asked for that was not started (a
selection this missed) starts then; processes still running at the end are killed.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from typing import Callable, Hashable, Iterable

import pytest


def selected_cases(request: pytest.FixtureRequest, test_name: str, argnames: Iterable[str]) -> list[tuple]:
    """The parameter tuples (in argnames' order) of test_name's items in this session's selection,
    in collection order, leaving out those a skip or true skipif mark skips."""
    argnames = tuple(argnames)
    cases = []
    for item in request.session.items:
        if item.module is not request.module or getattr(item, "originalname", None) != test_name:
            continue
        if any(True for _ in item.iter_markers("skip")) or any(
                mark.args and all(bool(a) for a in mark.args) for mark in item.iter_markers("skipif")):
            continue
        cases.append(tuple(item.callspec.params[name] for name in argnames))
    return cases


class CaseProcesses:
    def __init__(self, command: Callable[[Hashable], list[str]], cases: Iterable[Hashable], env: dict[str, str],
                 timeout: float, workers: int | None = None):
        self._command, self._env, self._timeout = command, env, timeout
        self._queue = list(dict.fromkeys(cases))
        self._workers = workers or max(1, min(4, len(os.sched_getaffinity(0))))
        self._running: dict[Hashable, tuple[subprocess.Popen, object, object, float]] = {}
        self._done: dict[Hashable, subprocess.CompletedProcess | subprocess.TimeoutExpired] = {}

    def _start(self, case: Hashable) -> None:
        if case in self._queue:
            self._queue.remove(case)
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(self._command(case), stdout=out, stderr=err, text=True, env=self._env)
        self._running[case] = (proc, out, err, time.monotonic())

    def _collect(self) -> None:
        """Move finished processes to _done, kill one past its timeout, and fill the free slots."""
        for case, (proc, out, err, started) in list(self._running.items()):
            if proc.poll() is None and time.monotonic() - started > self._timeout:
                proc.kill()
                proc.wait()
                out.close(), err.close()
                del self._running[case]
                self._done[case] = subprocess.TimeoutExpired(proc.args, self._timeout)  # raised to its test
                continue
            if proc.returncode is not None:
                out.seek(0), err.seek(0)
                self._done[case] = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
                out.close(), err.close()
                del self._running[case]
        while self._queue and len(self._running) < self._workers:
            self._start(self._queue[0])

    def result(self, case: Hashable) -> subprocess.CompletedProcess:
        """case's finished process (its stdout and stderr as text), started now if it was not."""
        if case not in self._done and case not in self._running:
            self._start(case)
        while True:
            self._collect()
            if case in self._done:
                done = self._done.pop(case)
                if isinstance(done, subprocess.TimeoutExpired):
                    raise done
                return done
            time.sleep(0.2)

    def close(self) -> None:
        self._queue.clear()
        for proc, out, err, _ in self._running.values():
            proc.kill()
            proc.wait()
            out.close(), err.close()
        self._running.clear()
