"""The measured engine, in the candidate's own process: the side of engine/verify/measured_engine.py
that runs there.

The compile loop measures a candidate by replaying traffic through an engine that runs it. That
engine lives here, in the candidate's process (forked from the clean zygote of
engine/verify/candidate_process.py), never in the compile worker: the candidate's code can reach
everything in the process it runs in, and the worker holds the verifier, the reference outputs,
the settings and the clocks. The worker drives the replay (what to submit, when) and times it
from outside; this side serves it, on the serving loop itself.

Data flow (one op per message, JSON + raw bytes, engine/verify/wire.py):

    engine.init  weights mapped (memfd / CUDA IPC), EngineConfig, tokenizer, bundle path
                 --> LLMEngine over those weights, the stock pass, then a hot reload of the
                     candidate (ForwardPassManager: build, smoke, deadlines) --> ok | stage, error
    engine.serve the serving loop (engine/serving/async_engine.py, the thread serving runs steps
                 on, so the candidate is called as it is when it serves), until "end":
                 add (requests) --> out (each step's outputs, batched) | error (a failed request)
                 end --> ended
    engine.state --> unfinished?, prefix-cache queried / hit tokens, the KV tag
    engine.tag   set the block manager's tag (a flush of the prefix cache)
    engine.fresh an empty prefix cache: a new block manager and scheduler over the same KV tensors
    engine.routing --> the active pass's expert-routing counts (MoE) or none
    engine.observe --> functions patched, threads started, processes started since init
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch


def child_processes() -> list[int]:
    """Pids of this process's children (every thread's), from /proc: a candidate that hands its
    work to a process of its own would hide it from the clock that times this one."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for tid in tasks:
        try:
            pids += [int(p) for p in Path(f"/proc/self/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return sorted(set(pids))


class MeasuredEngineChild:
    """The engine the worker measures, built over the weights it shares."""

    def __init__(self) -> None:
        self.eng: Any = None
        self.weights: dict[str, torch.Tensor] = {}
        self.mapped: dict[str, int] = {}
        self.threads_before: set[int | None] = set()

    def init(self, h: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        from shapeshift.engine.core.config import EngineConfig, ModelConfig
        from shapeshift.engine.core.llm_engine import LLMEngine
        from shapeshift.engine.forward_pass.importer import ReloadError
        from shapeshift.engine.forward_pass.swap import ForwardPassManager
        from shapeshift.engine.models.loader import LoadedModel
        from shapeshift.engine.models.tokenizer import Tokenizer

        self.weights = weights
        self.mapped = {n: t.data_ptr() for n, t in weights.items()}
        model_config = ModelConfig(**h["model_config"])
        loaded = LoadedModel(h["model_name"], model_config, weights, Tokenizer.from_wire(h["tokenizer"]),
                             "shared by the compile worker")

        class SharedWeightsEngine(LLMEngine):
            def _load_model(self, config: EngineConfig) -> LoadedModel:
                return loaded

        self.eng = SharedWeightsEngine(EngineConfig(**h["engine_config"]))
        manager = ForwardPassManager(self.eng, build_timeout_s=float(h["build_timeout_s"]),
                                     smoke_timeout_s=float(h["build_timeout_s"]), swap_log_level=logging.DEBUG)
        self.threads_before = {t.ident for t in threading.enumerate()}
        try:
            manager.reload(h["bundle"])
        except ReloadError as exc:
            return {"ok": False, "stage": exc.stage, "error": str(exc).split(": ", 1)[-1]}
        except BaseException as exc:  # noqa: BLE001 - reported to the worker
            return {"ok": False, "stage": "build", "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        gc.disable()  # a collection inside a replay would read as the candidate's time (as the worker does)
        return {"ok": True, "num_blocks": self.eng.block_manager.num_blocks, "name": self.eng.forward_pass_name}

    def serve(self, sock: Any) -> None:
        """The serving loop over this engine while the worker replays: its requests submitted as a
        server submits them, each step's outputs sent back as they stream (one message a batch)."""
        import asyncio

        from shapeshift.engine.core.sampling import SamplingParams
        from shapeshift.engine.serving.async_engine import AsyncEngine
        from shapeshift.engine.verify.wire import recv, send

        async def main() -> None:
            loop = asyncio.get_running_loop()
            served = AsyncEngine(self.eng, max_waiting=1 << 20).start()
            inbox: asyncio.Queue = asyncio.Queue()
            outbox: list[list[Any]] = []
            tasks: set[asyncio.Task] = set()

            def flush() -> None:
                if outbox:
                    batch = list(outbox)
                    outbox.clear()
                    send(sock, {"ev": "out", "outputs": batch})

            async def stream(rid: str, prompt: list[int], params: dict[str, Any]) -> None:
                try:
                    async for out in served.submit(rid, prompt, SamplingParams(**params)):
                        if not outbox:
                            loop.call_soon(flush)  # after every output this step delivered is in
                        outbox.append([rid, [int(t) for t in out.new_token_ids], bool(out.finished),
                                       out.finish_reason])
                except Exception as exc:  # noqa: BLE001 - the request failed in the engine
                    flush()
                    send(sock, {"ev": "error", "rid": rid, "error": f"{type(exc).__name__}: {exc}"})

            def read() -> None:
                while True:
                    try:
                        h, _, _ = recv(sock)
                    except (EOFError, OSError):
                        h = {"op": "end"}
                    loop.call_soon_threadsafe(inbox.put_nowait, h)
                    if h.get("op") == "end":
                        return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            while True:
                h = await inbox.get()
                if h.get("op") == "end":
                    break
                for rid, prompt, params in h.get("add", []):
                    task = loop.create_task(stream(str(rid), [int(t) for t in prompt], params))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            for task in list(tasks):
                task.cancel()
            served.stop()
            reader.join(5)
            flush()

        asyncio.run(main())
        send(sock, {"ev": "ended"})

    def state(self) -> dict[str, Any]:
        bm = self.eng.block_manager
        return {"ok": True, "unfinished": bool(self.eng.has_unfinished_requests()),
                "queried": int(bm.prefix_cache_queried_tokens), "hit": int(bm.prefix_cache_hit_tokens),
                "tag": str(getattr(bm, "tag", ""))}

    def routing(self) -> dict[str, Any]:
        from shapeshift.engine.replay.routing import routing_snapshot

        counts = routing_snapshot(self.eng)
        return {"ok": True, "counts": None if counts is None else {str(k): [int(c) for c in v]
                                                                   for k, v in counts.items()}}

    def observe(self) -> dict[str, Any]:
        from shapeshift.engine.forward_pass.patch_guard import harness_patched, patched_functions

        threads = sorted(t.name for t in threading.enumerate() if t.ident not in self.threads_before)
        replaced = sorted(n for n, t in self.weights.items() if t.data_ptr() != self.mapped.get(n))
        return {"ok": True, "patched": patched_functions() + harness_patched(), "threads": threads,
                "replaced_weights": replaced,
                "processes": child_processes()}

    def handle(self, op: str, h: dict[str, Any], weights: dict[str, torch.Tensor] | None,
               sock: Any = None) -> dict[str, Any] | None:
        """The reply to one op (None: the op sent its own replies, engine.serve)."""
        from shapeshift.engine.replay.driver import fresh_engine_cache

        if op == "engine.init":
            assert weights is not None
            return self.init(h, weights)
        if self.eng is None:
            return {"ok": False, "error": "engine.init first"}
        if op == "engine.serve":
            self.serve(sock)
            return None
        if op == "engine.state":
            return self.state()
        if op == "engine.tag":
            self.eng.block_manager.set_tag(str(h["tag"]))
            return {"ok": True}
        if op == "engine.fresh":
            fresh_engine_cache(self.eng)
            gc.collect()
            return {"ok": True}
        if op == "engine.routing":
            return self.routing()
        if op == "engine.observe":
            return self.observe()
        return {"ok": False, "error": f"unknown op {op!r}"}
