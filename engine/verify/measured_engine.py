"""A candidate measured in its own process: the engine that runs it lives there, the replay and
the clocks stay in the compile worker.

The compile loop's tiers replay traffic through an engine running the candidate. A candidate's
code can reach everything in the process it runs in: the verifier's comparisons and
tolerances, the reference outputs, the settings, the clocks, and the state every later
candidate is judged by. So its engine is built in a child forked from the clean zygote
(engine/verify/isolated.py), over the worker's weights (a memfd copy on the host, the worker's
own tensors through CUDA IPC), and the worker's replay driver (engine/replay/driver.py) drives
it through this proxy: there the serving loop (engine/serving/async_engine.py) runs the engine,
so the candidate is called exactly as it is when it serves (its thread, its call stack), and
each step's outputs stream back as they are made. What the driver sees of time is the
worker's own, read as the outputs arrive: wall time read here, or on the host the child's CPU time read from outside
(the kernel's clock of that process: every thread of it counts, and the candidate cannot set
it). The tokens it produced come back with every step, to be checked against the reference's
on the same requests; the weights copy is checked after every replay; what the child observes
of itself (functions patched, threads and processes started) is asked after every replay.

Data flow:

    EngineEvaluator._activate --IsolatedEngine(reference engine, config, bundle).start()-->
      zygote --fork--> child: engine.init (measured_child.py: LLMEngine over the shared
      weights, stock pass, hot reload of the candidate)
    run_once(proxy, requests, clock=proxy.cpu_clock | perf_counter)
      add_request --engine.serve, add--> the serving loop there; step <-- out (one step's outputs)
      block_manager.* / fresh_cache --end, then engine.state / tag / fresh-->
    proxy.weights_changed() / observe() after each replay; close() kills the child
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from shapeshift.engine.forward_pass.importer import ReloadError
from shapeshift.engine.forward_pass.weights_guard import WeightsBaseline
from shapeshift.engine.verify.isolated import CandidateError, IsolatedCandidate, _zygote
from shapeshift.engine.verify.wire import recv, send

_CPUCLOCK_SCHED = 2  # Linux: the process CPU clock of a pid is ((~pid) << 3) | CPUCLOCK_SCHED


def process_cpu_clock(pid: int):
    """A clock reading another process's CPU time (seconds, every thread of it), from outside."""
    clock_id = ((~pid) << 3) | _CPUCLOCK_SCHED
    gettime = time.clock_gettime
    gettime(clock_id)  # fails now (ProcessLookupError / OSError) rather than mid-replay
    return lambda: gettime(clock_id)


@dataclasses.dataclass
class RemoteOutput:
    """One request's part of an engine step, as the replay driver reads it."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class _RemoteBlockManager:
    """What the replay driver reads of the block manager: the prefix-cache counts and the tag."""

    def __init__(self, engine: "IsolatedEngine") -> None:
        self._engine = engine
        self.num_blocks = 0

    @property
    def prefix_cache_queried_tokens(self) -> int:
        return self._engine._state()["queried"]

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self._engine._state()["hit"]

    @property
    def tag(self) -> str:
        return self._engine._state()["tag"]

    def set_tag(self, tag: str) -> None:
        self._engine._op({"op": "engine.tag", "tag": tag}, "the prefix-cache tag")


class IsolatedEngine(IsolatedCandidate):
    """The engine a candidate is measured on, in the candidate's process; as the replay driver
    (run_once) and the evaluator see an engine: config, model_config, weights (the worker's),
    dtype, device, tokenizer, block_manager, add_request, step, has_unfinished_requests."""

    def __init__(self, reference: Any, config: Any, bundle: str | Path, timeout_s: float) -> None:
        super().__init__(bundle, reference.model_config, reference.weights, reference.dtype, reference.device,
                         timeout_s)
        self.config = dataclasses.replace(config, forward_pass=None, forward_pass_recipe=None,
                                          num_kv_blocks=config.num_kv_blocks or reference.block_manager.num_blocks)
        self.tokenizer = reference.tokenizer
        self.model_name = getattr(reference, "model_name", "model")
        self.block_manager = _RemoteBlockManager(self)
        # The copy the child maps (host) is checked against its own contents from now on; on
        # CUDA the child maps the worker's tensors, which the worker's own baseline checks.
        self._copy_baseline = WeightsBaseline(self.weights) if self.device.type != "cuda" else None
        self._adds: list[list[Any]] = []
        self.serving = False  # in the serving loop there (between a replay's first request and its end)
        self.steps = 0  # output batches received
        self.started_processes: list[int] = []  # children of the candidate's process, last observed
        self.cpu_clock: Any = None

    def start(self, build_timeout_s: float) -> None:
        """Fork the process, build the engine there and hot-reload the candidate into it. Raises
        ReloadError (open, import, build, smoke), DeadlineExceeded or CandidateDied."""
        t0 = time.perf_counter()
        self.pid, self.sock, self.stderr = _zygote().fork(torch.get_num_threads(), max(300.0, build_timeout_s))
        self.cpu_clock = process_cpu_clock(self.pid)
        fds, self._weights_fds = self._weights_fds, []
        header = {"op": "engine.init", "bundle": str(self.bundle), "device": str(self.device),
                  "model_config": dataclasses.asdict(self.model_config), "weights": self._weights_msg,
                  "engine_config": dataclasses.asdict(self.config), "tokenizer": self.tokenizer.to_wire(),
                  "model_name": self.model_name, "build_timeout_s": build_timeout_s}
        try:
            reply = self._call(header, fds=fds, timeout_s=2 * build_timeout_s + 60.0, what="engine build")[0]
        finally:
            for fd in fds:
                os.close(fd)
        self.start_s = time.perf_counter() - t0
        if not reply.get("ok"):
            raise ReloadError(reply.get("stage", "build"), reply.get("error", "build failed"))
        self.block_manager.num_blocks = int(reply.get("num_blocks", 0))
        self.name = str(reply.get("name") or self.name)

    def _op(self, header: dict[str, Any], what: str) -> dict[str, Any]:
        self._end_serving()
        reply = self._call(header, what=what)[0]
        if not reply.get("ok"):
            raise CandidateError(reply.get("error", f"{what} failed"))
        return reply

    def _state(self) -> dict[str, Any]:
        return self._op({"op": "engine.state"}, "engine state")

    # ---------------------------------------------------------------- serving, as run_once drives it
    def _send(self, header: dict[str, Any], what: str) -> None:
        with self._wire(what) as sock:
            send(sock, header)

    def _receive(self, what: str) -> dict[str, Any]:
        with self._wire(what) as sock:
            return recv(sock)[0]

    def _end_serving(self) -> None:
        """Back from the serving loop to one op at a time (the replay is over: nothing in flight)."""
        if not self.serving:
            return
        self.serving = False
        self._adds = []
        self._send({"op": "end"}, "the end of a replay")
        while self._receive("the end of a replay").get("ev") != "ended":
            pass

    def has_unfinished_requests(self) -> bool:
        return self._state()["unfinished"]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        """Submitted to the serving loop there (sent with the next step: one message for the
        requests that arrive together)."""
        if not self.serving:
            self._send({"op": "engine.serve"}, "the start of a replay")
            self.serving = True
        self._adds.append([request_id, [int(t) for t in prompt_token_ids],
                           {"max_tokens": params.max_tokens, "temperature": params.temperature,
                            "ignore_eos": params.ignore_eos}])

    def step(self) -> list[RemoteOutput]:
        """The outputs of the serving loop's next step there, as they arrive here."""
        if self._adds:
            adds, self._adds = self._adds, []
            self._send({"op": "add", "add": adds}, "a request's submission")
        msg = self._receive("an engine step")
        if msg.get("ev") == "error":
            raise CandidateError(f"request {msg.get('rid')} failed in the engine: {msg.get('error')}")
        if msg.get("ev") != "out":
            raise CandidateError(f"unexpected message from the measuring process: {str(msg)[:200]}")
        self.steps += 1
        return [RemoteOutput(str(rid), [int(t) for t in toks], bool(done), reason)
                for rid, toks, done, reason in msg["outputs"]]

    def fresh_cache(self) -> None:
        self._op({"op": "engine.fresh"}, "cache reset")

    def routing_snapshot(self) -> dict[int, list[int]] | None:
        counts = self._op({"op": "engine.routing"}, "routing counts")["counts"]
        return None if counts is None else {int(k): list(v) for k, v in counts.items()}

    # ---------------------------------------------------------------- checks after a replay
    def weights_changed(self) -> list[str]:
        """Weights of the copy the child maps that differ from their contents at the start."""
        return self._copy_baseline.changed(self.weights) if self._copy_baseline is not None else []

    def observe(self) -> dict[str, Any]:
        return self._op({"op": "engine.observe"}, "observe")

    def tells(self) -> list[str]:
        """What the candidate did in its process that makes its measurement no result."""
        seen = self.observe()
        self.started_processes = [int(p) for p in seen.get("processes") or []]
        out = []
        if seen.get("patched"):
            out.append("measured.no_patching: the candidate replaced "
                       f"{', '.join(seen['patched'][:8])} in the measuring process")
        if seen.get("processes"):
            out.append(f"measured.no_processes: the candidate started process(es) {seen['processes'][:4]}, "
                       "whose time the measuring clock does not see")
        if seen.get("replaced_weights"):
            out.append(f"weights: the candidate replaced {', '.join(seen['replaced_weights'][:4])} in its process")
        return out


class MeasuringProcesses:
    """The candidates' measuring processes of each tier, kept while the comparisons of a run still
    alternate between them (the incumbent's stays up across the run; the oldest others are closed
    beyond ``keep`` a tier). One per (bundle, engine settings): a candidate that differs only in
    engine knobs gets an engine of its own, built with them."""

    def __init__(self, keep: int = 3, build_timeout_s: float = 120.0, step_timeout_s: float = 120.0) -> None:
        from collections import OrderedDict

        self.keep = keep
        self.build_timeout_s = build_timeout_s
        self.step_timeout_s = step_timeout_s
        self._tiers: dict[str, OrderedDict[tuple[str, str], IsolatedEngine]] = {}
        self.starts: list[float] = []  # seconds from fork to a candidate ready to measure, per start

    def engine(self, tier: str, reference: Any, config: Any, bundle: str | Path) -> IsolatedEngine:
        import json
        from collections import OrderedDict

        key = (str(bundle), json.dumps(dataclasses.asdict(config), sort_keys=True, default=str))
        procs = self._tiers.setdefault(tier, OrderedDict())
        eng = procs.get(key)
        if eng is not None and not eng.dead:
            procs.move_to_end(key)
            return eng
        if eng is not None:
            self.discard(tier, eng)
        while len(procs) >= self.keep:  # room first: the processes a tier holds at once stay bounded
            procs.popitem(last=False)[1].close()
        eng = IsolatedEngine(reference, config, bundle, self.step_timeout_s)
        try:
            eng.start(self.build_timeout_s)
        except BaseException:
            eng.close()
            raise
        self.starts.append(eng.start_s)
        procs[key] = eng
        return eng

    def check(self, tier: str, eng: Any) -> list[str]:
        """After a replay on `eng` (a measuring process; anything else: nothing to check): its weights
        copy unchanged, nothing it did there (functions patched, processes started) that voids the
        measurement. A process with problems is closed; the problems are returned."""
        if not isinstance(eng, IsolatedEngine) or eng.dead:
            return []
        try:
            problems = eng.tells()
        except Exception as exc:  # noqa: BLE001 - the process died or hung since the replay
            problems = [f"measured: the candidate's process did not answer after the replay ({exc})"]
        for pid in eng.started_processes:  # what it started dies with it
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        changed = eng.weights_changed()
        if changed:
            problems.append(f"weights: the candidate changed the engine's weights ({', '.join(changed[:4])}); "
                            "its process is discarded")
        if problems:
            self.discard(tier, eng)
        return problems

    def discard(self, tier: str, eng: IsolatedEngine) -> None:
        procs = self._tiers.get(tier, {})
        for key in [k for k, v in procs.items() if v is eng]:
            del procs[key]
        eng.close()

    def close(self, tier: str | None = None) -> None:
        for name in [tier] if tier is not None else list(self._tiers):
            for eng in self._tiers.pop(name, {}).values():
                eng.close()


def isolation_problem(isolate: bool | None, device: str) -> str:
    """Why candidates cannot be measured in processes of their own ("" when they can): turned off
    (``isolate`` False), or CUDA IPC not working on this device (checked once, with no candidate
    code anywhere). ``isolate`` None: wherever it can run."""
    if isolate is False:
        return "isolate_measurement is off"
    if not str(device).startswith("cuda"):
        return ""
    from shapeshift.engine.verify.isolated import cuda_ipc_problem

    why = cuda_ipc_problem(torch.device(device)) or ""
    if why:
        import logging

        logging.getLogger(__name__).warning("candidates are measured in the compile worker's process: %s", why)
    return why
