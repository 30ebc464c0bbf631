"""The candidate's process: the zygote every candidate's process is forked from, and the serve
loop that answers the verifier (engine/verify/isolated.py holds the verifier's side).

Data flow: zygote_main (started with spawn; imports torch and the engine, warms the host's
kernels, never runs candidate code) --fork per request--> child_main: init (map the weights,
load_bundle, build) | kv (map a KV cache) | forward (inputs -> fp.forward -> logits, the inputs it
changed, the previous output if it changed, seconds) | forward_concurrently (several calls, each in
a thread of its own released at one barrier -> their logits) | observe (patched functions, new threads,
replaced weights) | probe (CUDA IPC check) | engine.* (the measured engine:
engine/verify/measured_child.py); every reply JSON + raw bytes (engine/verify/wire.py).
"""

from __future__ import annotations

import os
import socket
import threading
from collections import OrderedDict
from typing import Any

import torch

from shapeshift.engine.core.kv_cache import KVCache
from shapeshift.engine.forward_pass.importer import ReloadError
from shapeshift.engine.forward_pass.paged_driver import PagedDriver
from shapeshift.engine.verify.wire import CTX_TENSORS, DTYPES, from_cuda_handle, map_fd, pack, recv, send, unpack, view


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:  # noqa: BLE001 - not Linux: the EOF on the socket still ends it
        pass


def _warm_up() -> None:
    """Pay the first-call costs of the host's kernels once, here, instead of in every child: the
    stock pass on a tiny random model, one prefill and one decode, in float32 and bfloat16, on one
    thread (no thread pool exists to be broken by the forks)."""
    try:
        from shapeshift.engine.core.config import ModelConfig
        from shapeshift.engine.forward_pass.importer import load_stock
        from shapeshift.engine.forward_pass.paged_driver import Seq
        from shapeshift.engine.models.loader import random_weights
        from shapeshift.engine.models.presets import PRESETS

        torch.set_num_threads(1)
        cfg = ModelConfig.from_hf(PRESETS["tiny-llama"].hf_config)
        stock = load_stock()
        with torch.inference_mode():
            for dtype in (torch.float32, torch.bfloat16):
                weights = random_weights(cfg, seed=0, dtype=dtype, device="cpu")
                fp = stock.module.build(cfg, weights, dict(stock.recipe))
                PagedDriver(cfg, dtype, "cpu", num_blocks=8).greedy(fp, [Seq(list(range(1, 20)))], 2)
        stock.unload()
    except Exception:  # noqa: BLE001 - a warm-up only: the children pay the cost instead
        pass


def zygote_main(fd: int) -> None:
    import signal

    # No parent-death signal here: it would follow the thread that started the zygote, not the
    # verifier's process. When the verifier exits its end of the socket closes and this loop ends.
    sock = socket.socket(fileno=fd)
    # What every candidate's process needs, imported once here (never any candidate code).
    from shapeshift.engine.forward_pass import patch_guard  # noqa: F401,I001  (captures the references first)
    from shapeshift.engine.core import attention, config  # noqa: F401
    from shapeshift.engine.forward_pass import importer  # noqa: F401
    from shapeshift.engine.verify.anticheat import HARNESS_MODULES as VERIFIER

    # The verifier's modules as they are before any candidate runs in a child (measured_child.py
    # reports what a candidate changed of them: a measurement in such a process is no result).
    patch_guard.capture_harness(VERIFIER)
    _warm_up()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    while True:
        try:
            header, _, fds = recv(sock)
        except (EOFError, OSError):
            os._exit(0)
        if header.get("op") == "ping":
            send(sock, {"ok": True})
            continue
        if header.get("op") != "fork" or len(fds) != 2:
            for f in fds:
                os.close(f)
            continue
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.dup2(fds[1], 1)
                os.dup2(fds[1], 2)
                os.close(fds[1])
                child_main(fds[0], int(header.get("threads") or 1))
            finally:
                os._exit(0)
        for f in fds:
            os.close(f)
        send(sock, {"pid": pid})


# ------------------------------------------------------------------ the child


class _Child:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fp: Any = None
        self.weights: dict[str, torch.Tensor] = {}
        self.mapped: dict[str, int] = {}  # weight name -> data pointer as mapped
        self.kvs: dict[int, KVCache] = {}
        self.buffers: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.last: torch.Tensor | None = None
        self.last_sent: torch.Tensor | None = None
        self.device = torch.device("cpu")
        self.threads_before = {t.ident for t in threading.enumerate()}
        from shapeshift.engine.verify.measured_child import MeasuredEngineChild

        self.engine = MeasuredEngineChild()

    def sync(self) -> None:
        if self.device.type == "cuda":
            from shapeshift.engine.forward_pass.patch_guard import _cuda_synchronize

            _cuda_synchronize(self.device)

    def map_weights(self, h: dict[str, Any], fds: list[int]) -> None:
        """Select the device and map the verifier's weights (a memfd copy, or CUDA IPC handles)."""
        self.device = torch.device(h["device"])
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": set_device needs an index (torch raises ValueError)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        w = h["weights"]
        with torch.inference_mode(False):  # plain tensors, as an engine's weights are where it serves
            if w["kind"] == "memfd":
                base = map_fd(fds[0], w["nbytes"])
                os.close(fds[0])
                for name, (offset, shape, dtype) in w["tensors"].items():
                    self.weights[name] = view(base, offset, shape, DTYPES[dtype])
            else:
                for name, d in w["tensors"].items():
                    self.weights[name] = from_cuda_handle(d)
        self.mapped = {n: t.data_ptr() for n, t in self.weights.items()}

    def init(self, h: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        from shapeshift.engine.core.config import ModelConfig
        from shapeshift.engine.forward_pass.importer import load_bundle

        self.map_weights(h, fds)
        model_config = ModelConfig(**h["model_config"])
        stage = "open"
        try:
            loaded = load_bundle(h["bundle"], allow_unmanifested=True)
            stage = "build"
            self.fp = loaded.module.build(model_config, self.weights, dict(loaded.recipe))
            if not callable(getattr(self.fp, "forward", None)):
                raise ReloadError("build", f"build() returned {type(self.fp).__name__} without forward()")
        except BaseException as exc:  # noqa: BLE001 - reported to the verifier
            return {"ok": False, "stage": getattr(exc, "stage", stage), "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "cache_format": loaded.cache_format, "name": loaded.name}

    def attach_kv(self, h: dict[str, Any], fds: list[int]) -> None:
        layers = h["layers"]
        dtype = DTYPES[h["dtype"]]
        if h["kind"] == "memfd":
            base = map_fd(fds[0], h["nbytes"])
            os.close(fds[0])
            views = [view(base, off, h["shape"], dtype) for off in h["offsets"]]
        else:
            views = [from_cuda_handle(d) for d in h["tensors"]]
        self.kvs[h["id"]] = KVCache(k=views[:layers], v=views[layers:], block_size=h["block_size"],
                                    num_blocks=h["num_blocks"])

    def buffer(self, key: tuple, value: torch.Tensor) -> torch.Tensor:
        """One buffer per verifier buffer (address, shape, dtype): reuse is seen as it would be in-process."""
        buf = self.buffers.get(key)
        if buf is None:
            buf = value.to(self.device, copy=True)
            self.buffers[key] = buf
            while len(self.buffers) > 512:
                self.buffers.popitem(last=False)
        else:
            buf.copy_(value)
            self.buffers.move_to_end(key)
        return buf

    @staticmethod
    def context(h: dict[str, Any], bufs: dict[str, torch.Tensor]) -> Any:
        from shapeshift.engine.core.attention import AttentionContext

        s = h["scalars"]
        return AttentionContext(is_prefill=bool(s["is_prefill"]), max_query_len=int(s["max_query_len"]),
                                max_context_len=int(s["max_context_len"]),
                                query_start_loc_cpu=s["query_start_loc_cpu"], context_lens_cpu=s["context_lens_cpu"],
                                **{f: bufs[f] for f in CTX_TENSORS})

    def forward(self, h: dict[str, Any], blobs: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        from shapeshift.engine.forward_pass.patch_guard import perf_counter

        kv = self.kvs[h["kv"]]
        received = {name: unpack(d, blobs) for name, d in h["tensors"].items()}
        bufs = {name: self.buffer((name, d["key"], tuple(d["shape"]), d["dtype"]), received[name])
                for name, d in h["tensors"].items()}
        if "prev_out" in h and self.last is not None:  # the verifier changed (poisoned) the last output
            new = unpack(h["prev_out"], blobs)
            if tuple(new.shape) == tuple(self.last.shape):
                self.last.copy_(new.to(self.last.device))
                self.last_sent = self.last.detach().clone()
        actx = self.context(h, bufs)
        self.sync()
        t0 = perf_counter()
        out = self.fp.forward(bufs["input_ids"], bufs["positions"], actx, kv)
        self.sync()
        seconds = perf_counter() - t0
        reply: dict[str, Any] = {"ok": True, "seconds": seconds, "changed": {}}
        back: list[bytes] = []
        now = {"input_ids": bufs["input_ids"], "positions": bufs["positions"],
               **{f: getattr(actx, f) for f in CTX_TENSORS}}
        for name, value in now.items():
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(received[name].shape) \
                    or not torch.equal(value.detach().cpu(), received[name]):
                if isinstance(value, torch.Tensor):
                    reply["changed"][name] = pack(value, back)
                else:
                    reply["changed"][name] = {"not_tensor": type(value).__name__}
        if self.last is not None and self.last_sent is not None and not torch.equal(self.last, self.last_sent):
            reply["prev_changed"] = pack(self.last, back)
        if isinstance(out, torch.Tensor):
            reply["logits"] = pack(out, back)
            self.last, self.last_sent = out, out.detach().clone()
        else:
            reply["not_tensor"] = type(out).__name__
            self.last = self.last_sent = None
        return reply, back

    def forward_concurrently(self, h: dict[str, Any], blobs: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """Each call in a thread of its own, all released together at a barrier (two callers of one
        served pass: the engine's loop and a hot reload's smoke check on the incumbent, say)."""
        calls = []
        for c in h["calls"]:
            bufs = {name: unpack(d, blobs).to(self.device) for name, d in c["tensors"].items()}
            calls.append((bufs, self.context(c, bufs), self.kvs[c["kv"]]))
        start = threading.Barrier(len(calls))
        outs: list[Any] = [None] * len(calls)
        errors: list[str] = []

        def run(i: int) -> None:
            bufs, actx, kv = calls[i]
            with torch.inference_mode():  # thread-local: as the serve loop's
                try:
                    if self.device.type == "cuda":
                        torch.cuda.set_device(self.device)  # the current device is per thread too
                    start.wait()
                    outs[i] = self.fp.forward(bufs["input_ids"], bufs["positions"], actx, kv)
                except BaseException as exc:  # noqa: BLE001 - the candidate's error, reported as text
                    errors.append(f"{type(exc).__name__}: {exc}")
                    start.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.sync()
        self.last = self.last_sent = None
        if errors:
            return {"ok": False, "error": errors[0]}, []
        back: list[bytes] = []
        logits = [pack(o, back) if isinstance(o, torch.Tensor) else {"not_tensor": type(o).__name__} for o in outs]
        return {"ok": True, "logits": logits}, back

    def observe(self) -> dict[str, Any]:
        from shapeshift.engine.forward_pass.patch_guard import patched_functions

        threads = sorted(t.name for t in threading.enumerate() if t.ident not in self.threads_before)
        replaced = sorted(n for n, t in self.weights.items() if t.data_ptr() != self.mapped.get(n))
        return {"patched": patched_functions(), "threads": threads, "replaced_weights": replaced}


def child_main(fd: int, threads: int) -> None:
    import faulthandler

    faulthandler.enable()
    _die_with_parent()
    torch.set_num_threads(max(1, threads))
    sock = socket.socket(fileno=fd)
    child = _Child(sock)
    with torch.inference_mode():  # as the runner calls passes
        while True:
            try:
                h, blobs, fds = recv(sock)
            except (EOFError, OSError):
                return
            op = h.get("op")
            back: list[bytes] = []
            try:
                if op == "init":
                    reply = child.init(h, fds)
                elif op == "kv":
                    child.attach_kv(h, fds)
                    continue
                elif op == "drop_kv":
                    for i in h["ids"]:
                        child.kvs.pop(i, None)
                    continue
                elif op == "forward":
                    for i in h.get("drop_kv", []):
                        child.kvs.pop(i, None)
                    reply, back = child.forward(h, blobs)
                elif op == "forward_concurrently":
                    for i in h.get("drop_kv", []):
                        child.kvs.pop(i, None)
                    reply, back = child.forward_concurrently(h, blobs)
                elif op == "observe":
                    reply = child.observe()
                elif op.startswith("engine."):  # the measured engine (engine/verify/measured_child.py)
                    if op == "engine.init":
                        child.map_weights(h, fds)
                    reply = child.engine.handle(op, h, child.weights if op == "engine.init" else None, sock)
                    if reply is None:  # it answered for itself
                        continue
                elif op == "probe":  # CUDA IPC works here: read the verifier's tensor, write it
                    t = from_cuda_handle(h["tensor"])
                    reply = {"ok": True, "sum": float(t.sum())}
                    t.add_(1)
                    torch.cuda.synchronize(t.device)
                else:
                    return
            except BaseException as exc:  # noqa: BLE001 - the candidate's error, reported as text
                reply, back = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
            try:
                send(sock, reply, back)
            except (OSError, TypeError, ValueError):
                return
