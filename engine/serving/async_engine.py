"""Asyncio front of the synchronous `LLMEngine`.

Data flow:

    HTTP handler (event loop)                      engine thread
    -------------------------                      -------------
    submit() -- admission check (bounded) -->  commands queue (add / abort / call)
                                                   |  drained between steps
                                                   v
                                               engine.add_request / abort_request
                                               engine.step() -> [RequestOutput]
    RequestStream (asyncio.Queue) <-- loop.call_soon_threadsafe(put_nowait, output)
    async for output in stream                     metrics: TTFT, ITL, e2e, gauges

The `LLMEngine` is not thread-safe, so exactly one thread (this module's) ever
calls into it; HTTP handlers only enqueue commands and read their own
per-request asyncio queue. Each request remembers the event loop it was
submitted from, so the engine thread can wake the right loop.

Admission is bounded: at most `max_num_seqs + max_waiting` requests are in
flight (submitted and not yet finished, aborted or failed). The engine runs at
most `max_num_seqs` of them at once, so everything beyond that is waiting, and
the waiting line never exceeds `max_waiting`. A submit over the bound raises
`EngineOverloadedError` at once (HTTP 429) instead of queueing without end.

Failures: a `ValueError` from `add_request` fails that request alone
(`RequestRejectedError`, HTTP 400). An exception from `step()` fails every
request in the engine (`EngineStepError`, HTTP 500), aborts them in the engine
and the loop keeps serving new requests. Only a bug in this loop itself ends
the thread; then `is_healthy()` is False and submits raise `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("shapeshift.engine.serving.async_engine")

# After this many consecutive failing steps the engine counts as unhealthy
# (so a liveness probe can restart a wedged server); one good step resets it.
UNHEALTHY_AFTER_STEP_FAILURES = 5
# How long the idle loop blocks on the command queue before re-checking the stop flag.
IDLE_POLL_SECONDS = 0.2


class EngineOverloadedError(RuntimeError):
    """The waiting line is full; the client should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; nothing can be served (HTTP 503)."""


class EngineStepError(RuntimeError):
    """The engine failed while this request was in it (HTTP 500)."""


class RequestRejectedError(ValueError):
    """The engine refused the request as given (HTTP 400); `param` names the field if known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class _RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_time: float  # time.monotonic() at submit
    first_token_time: float | None = None
    last_token_time: float | None = None
    scheduled_time: float | None = None  # start of the step that first scheduled it


_END = object()  # stream sentinel after a failure was delivered


class RequestStream:
    """Async iterator over one request's `RequestOutput`s; ends after the finished one.

    Raises `RequestRejectedError`, `EngineStepError` or `EngineDeadError` if
    the request fails. Call `abort()` when the consumer goes away early.
    """

    def __init__(self, engine: "AsyncEngine", state: _RequestState) -> None:
        self._engine = engine
        self._state = state
        self.finished = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        item = await self._state.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Ask the engine to drop this request (idempotent, safe after it finished)."""
        if not self.finished:
            self.finished = True
            self._engine._enqueue(("abort", self._state.request_id))


class AsyncEngine:
    """Runs `engine.step()` on one background thread and streams outputs to asyncio callers."""

    def __init__(self, engine: Any, *, max_waiting: int, metrics: Any = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        if metrics is not None and getattr(engine, "forward_pass", None) is not None:
            from shapeshift.engine.core.expert_routing import counts_of

            if counts_of(engine.forward_pass) is not None:  # a MoE model: its routing, read at each scrape
                metrics.watch_expert_routing(lambda: counts_of(engine.forward_pass))

        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards _in_flight and _pending_adds
        self._in_flight = 0
        self._pending_adds = 0
        self._states: dict[str, _RequestState] = {}  # engine thread only
        self._unscheduled: set[str] = set()  # in _states, not yet seen running (engine thread only)
        self._stop = threading.Event()
        self._fatal: BaseException | None = None
        self._closed = False  # set (under _lock) once the loop stops taking requests
        self._consecutive_step_failures = 0
        self._thread = threading.Thread(target=self._run, name="shapeshift-engine-loop", daemon=True)

    @property
    def max_num_seqs(self) -> int:
        """The engine's batch width as it is now (a hot-reloaded forward pass may change it)."""
        return int(self.engine.config.max_num_seqs)

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_waiting

    # ----------------------------------------------------------- lifecycle

    def start(self) -> "AsyncEngine":
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight fail with `EngineDeadError`."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def is_healthy(self) -> tuple[bool, str]:
        """(healthy, reason): the loop thread runs and its steps are not failing repeatedly."""
        if self._fatal is not None:
            return False, f"engine loop died: {self._fatal!r}"
        if not self._thread.is_alive():
            return False, "engine loop is not running"
        if self._consecutive_step_failures >= UNHEALTHY_AFTER_STEP_FAILURES:
            return False, f"engine step failed {self._consecutive_step_failures} times in a row"
        return True, "ok"

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    # ---------------------------------------------------------- submitting

    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any,
               arrival_time: float | None = None) -> RequestStream:
        """Admit a request (or raise `EngineOverloadedError` / `EngineDeadError` at once).

        Must be called from a running event loop; outputs are delivered to it.
        """
        loop = asyncio.get_running_loop()
        state = _RequestState(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
            loop=loop, queue=asyncio.Queue(),
            arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        # Check and enqueue under the lock the loop takes when it closes, so no
        # request can slip into the queue after the final drain and wait forever.
        with self._lock:
            if self._closed or self._stop.is_set():
                healthy, reason = self.is_healthy()
                raise EngineDeadError(reason if not healthy else "engine loop is stopping")
            if self._in_flight >= self.capacity:
                raise EngineOverloadedError(
                    f"server is at capacity: {self._in_flight} requests in flight "
                    f"(max_num_seqs={self.max_num_seqs} running + max_waiting={self.max_waiting} waiting); "
                    "retry later")
            self._in_flight += 1
            self._pending_adds += 1
            self._enqueue(("add", state))
        return RequestStream(self, state)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result.

        This is the hook for operations that must not overlap a step (a
        forward-pass swap, a stats snapshot).
        """
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(("call", fn, future))
        return await asyncio.wrap_future(future)

    def call_blocking(self, fn: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """`call` for plain threads (no event loop): run `fn(engine)` between two steps, wait for it.

        Raises `EngineDeadError` if the loop is not running, `TimeoutError` after `timeout`
        seconds (the call may still run later; callers use generous timeouts).
        """
        if threading.current_thread() is self._thread:
            return fn(self.engine)  # already between steps
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(("call", fn, future))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"engine thread did not run the call within {timeout} s") from None

    def _enqueue(self, command: tuple) -> None:
        self._commands.put(command)

    # --------------------------------------------------------- engine side

    def _run(self) -> None:
        try:
            self._publish_stats()
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                self._step_once()
        except BaseException as exc:  # a bug here must not leave callers hanging
            self._fatal = exc
            logger.error("engine loop died:\n%s", traceback.format_exc())
        finally:
            with self._lock:
                self._closed = True
            reason = repr(self._fatal) if self._fatal is not None else "server is shutting down"
            self._fail_all(EngineDeadError(f"engine loop stopped: {reason}"), abort_in_engine=False)
            self._fail_pending_commands(EngineDeadError(f"engine loop stopped: {reason}"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_SECONDS) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish_stats()

    def _handle_command(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1])
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            fn, future = command[1], command[2]
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # delivered to the awaiting caller
                    future.set_exception(exc)
        # "wake" only interrupts the idle wait.

    def _add(self, state: _RequestState) -> None:
        with self._lock:
            self._pending_adds -= 1
        try:
            self.engine.add_request(state.request_id, state.prompt_token_ids, state.params)
        except ValueError as exc:
            self._finish(state, RequestRejectedError(str(exc), getattr(exc, "param", None)), status="invalid")
            return
        except Exception as exc:
            logger.error("add_request failed for %s:\n%s", state.request_id, traceback.format_exc())
            self._finish(state, EngineStepError(f"engine failed to accept the request: {exc!r}"),
                         status="error")
            return
        self._states[state.request_id] = state
        self._unscheduled.add(state.request_id)
        if self.metrics is not None:
            self.metrics.prompt_tokens.observe(len(state.prompt_token_ids))
            self.metrics.prompt_tokens_total.inc(len(state.prompt_token_ids))

    def _abort(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        self._unscheduled.discard(request_id)
        if state is None:
            return  # finished already, or failed before it reached the engine
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.error("abort_request failed for %s:\n%s", request_id, traceback.format_exc())
        self._release(status="abort")
        self._deliver(state, _END)

    def _step_once(self) -> None:
        step_start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._consecutive_step_failures += 1
            logger.error("engine step failed; failing %d request(s):\n%s",
                         len(self._states), traceback.format_exc())
            self._fail_all(EngineStepError(f"engine step failed: {exc!r}"), abort_in_engine=True)
            if self.engine.has_unfinished_requests():
                # The engine could not drop its requests; do not spin at full speed.
                time.sleep(0.1)
            return
        self._consecutive_step_failures = 0
        # Publish before delivering: a client that scrapes /metrics right after
        # its response must already see this step's counters.
        self._publish_stats()
        now = time.monotonic()
        if self._unscheduled:
            self._mark_scheduled(outputs, step_start)
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            self._record_token_timing(state, out, now)
            if out.finished:
                del self._states[out.request_id]
                if self.metrics is not None:
                    self.metrics.generation_tokens.observe(len(out.output_token_ids))
                    self.metrics.e2e_request_latency.observe(now - state.arrival_time)
                    self.metrics.observe_phases(state.arrival_time, state.scheduled_time, state.first_token_time, now)
                status = out.finish_reason if out.finish_reason in ("stop", "length") else "abort"
                self._release(status=status)
            self._deliver(state, out)

    def _mark_scheduled(self, outputs: list[Any], step_start: float) -> None:
        """Stamp requests this step scheduled for the first time (running now, or already out)."""
        scheduler = getattr(self.engine, "scheduler", None)
        running = scheduler.running if scheduler is not None else []
        seen = {seq.request_id for seq in running} | {o.request_id for o in outputs}
        for request_id in self._unscheduled & seen:
            state = self._states.get(request_id)
            if state is not None:
                state.scheduled_time = step_start
        self._unscheduled -= seen
        self._unscheduled &= self._states.keys()

    def _record_token_timing(self, state: _RequestState, out: Any, now: float) -> None:
        n_new = len(out.new_token_ids)
        if n_new == 0:
            return
        if self.metrics is not None:
            self.metrics.generation_tokens_total.inc(n_new)
            if state.first_token_time is None:
                self.metrics.time_to_first_token.observe(now - state.arrival_time)
                n_gaps, since = n_new - 1, now
            else:
                n_gaps, since = n_new, state.last_token_time
            # Several tokens in one output share the step's gap evenly.
            for _ in range(n_gaps):
                self.metrics.inter_token_latency.observe((now - since) / max(n_new, 1))
        if state.first_token_time is None:
            state.first_token_time = now
        state.last_token_time = now

    def _fail_all(self, error: BaseException, *, abort_in_engine: bool) -> None:
        states, self._states = self._states, {}
        for state in states.values():
            if abort_in_engine:
                try:
                    self.engine.abort_request(state.request_id)
                except Exception:
                    logger.error("abort_request failed for %s:\n%s", state.request_id, traceback.format_exc())
            self._finish(state, error, status="error")

    def _fail_pending_commands(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                with self._lock:
                    self._pending_adds -= 1
                self._finish(command[1], error, status="error")
            elif command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(error)

    def _finish(self, state: _RequestState, item: Any, status: str) -> None:
        self._release(status=status)
        self._deliver(state, item)

    def _release(self, status: str) -> None:
        with self._lock:
            self._in_flight -= 1
        if self.metrics is not None:
            self.metrics.count_request(status)

    @staticmethod
    def _deliver(state: _RequestState, item: Any) -> None:
        try:
            state.loop.call_soon_threadsafe(state.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is closed; nobody is listening

    def _publish_stats(self) -> None:
        if self.metrics is None:
            return
        try:
            stats = self.engine.stats()
        except Exception:
            logger.error("engine.stats() failed:\n%s", traceback.format_exc())
            return
        with self._lock:
            pending = self._pending_adds
        self.metrics.update_from_stats(stats, pending_admissions=pending)
        name, sha256 = forward_pass_identity(self.engine, stats)
        self.metrics.set_forward_pass(name, sha256)


def forward_pass_identity(engine: Any, stats: Any) -> tuple[str, str]:
    """(name, sha256) of the active forward pass, from ``engine.active_forward_pass``: the
    ForwardPass name a rollout gave it, else the module's name; the bundle's digest. Read on
    every publish so a hot swap shows at once. An engine without one reports
    `EngineStats.forward_pass_name` and an unknown digest.
    """
    active = getattr(engine, "active_forward_pass", None)
    if active is not None:
        return str(active.label), str(active.digest)
    return str(getattr(stats, "forward_pass_name", None) or "unknown"), "unknown"
