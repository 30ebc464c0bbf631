"""Process groups for parallel serving, and a local launcher.

Data flow: ``launch(fn, world_size)`` spawns one process per rank (torch.multiprocessing,
"spawn") with MASTER_ADDR/MASTER_PORT set -> each process calls
``init_parallel(layout, rank, world_size)``: NVLink multicast switched off in the
environment, ``torch.distributed`` initialised (NCCL on CUDA with one GPU per process,
gloo on CPU), then the groups this rank talks to are created -> a ``ParallelState``
stored as this process's current state (``current()``), which the parallel forward
pass and ``ParallelLLMEngine`` read -> each rank's return value travels back to the
parent (tensors as numpy arrays) -> ``launch`` returns them in rank order, or raises
with the failing rank's traceback.

Groups per replica (layout.py explains the degrees):
  mp_group       every rank of the replica: sums partial expert outputs
  tp_group       ranks splitting one copy of the attention: o_proj/down_proj all-reduce,
                 vocabulary all-gather
  control_group  gloo over the replica's ranks, also on CUDA: the driver broadcasts each
                 step's batch as a small pickled object without a device synchronisation
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from shapeshift.engine.parallel.layout import LayoutError, ParallelLayout, RankCoords

# Shared multi-GPU hosts: NVLink SHARP / multicast objects are a host-wide resource that
# other tenants' jobs may hold; collectives must not depend on them.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

DEFAULT_TIMEOUT_S = 600.0


def disable_nvlink_multicast() -> None:
    """Set the multicast-off variables (before any process group or NCCL communicator)."""
    os.environ.update(MULTICAST_OFF_ENV)


@dataclass
class ParallelState:
    layout: ParallelLayout
    coords: RankCoords
    backend: str  # "nccl" | "gloo"
    device: torch.device
    mp_group: Any  # torch ProcessGroup of the replica
    tp_group: Any
    control_group: Any  # gloo
    driver_rank: int  # global rank that schedules for this replica (its mp_rank 0)

    @property
    def rank(self) -> int:
        return self.coords.rank

    @property
    def is_driver(self) -> bool:
        return self.coords.rank == self.driver_rank


_STATE: ParallelState | None = None


def current() -> ParallelState | None:
    """This process's parallel state, or None when it runs single-process."""
    return _STATE


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(layout: ParallelLayout, rank: int | None = None, world_size: int | None = None,
                  device: str | torch.device | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelState:
    """Initialise torch.distributed for this rank and create its groups.

    ``rank``/``world_size`` default to the RANK/WORLD_SIZE environment (torchrun);
    ``device`` defaults to ``cuda:<LOCAL_RANK or rank % gpus>`` when CUDA is present, else CPU.
    """
    global _STATE
    disable_nvlink_multicast()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size != layout.world_size:
        raise LayoutError(f"layout {layout.name} needs {layout.world_size} processes, {world_size} were started")
    if not layout.is_executable:
        raise LayoutError(f"layout {layout.name}: pipeline parallelism (pp > 1) is ranked by the cost model "
                          "but not executed by this engine; use pp=1")
    if device is None:
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError("MASTER_PORT is not set: start ranks through launch() or torchrun")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    coords = layout.coords(rank)
    mp, tp = layout.model_parallel_size, layout.tp
    mine: dict[str, Any] = {}
    # Every rank must create every group, in the same order, even those it is not in.
    for dp_rank in range(layout.dp):
        for pp_rank in range(layout.pp):
            ranks = layout.replica_ranks(dp_rank, pp_rank)
            mp_group = dist.new_group(ranks, timeout=timeout)
            control = dist.new_group(ranks, backend="gloo", timeout=timeout) if backend != "gloo" else mp_group
            tp_groups = [mp_group] if tp == mp else [dist.new_group(ranks[a * tp:(a + 1) * tp], timeout=timeout)
                                                     for a in range(mp // tp)]
            if rank in ranks:
                mine = {"mp_group": mp_group, "control_group": control,
                        "tp_group": tp_groups[coords.mp_rank // tp], "driver_rank": ranks[0]}
    _STATE = ParallelState(layout=layout, coords=coords, backend=backend, device=device, **mine)
    return _STATE


def destroy_parallel() -> None:
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher
def _to_portable(value: Any) -> Any:
    """Tensors -> numpy (shared-memory tensors would die with the child process)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _to_portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_portable(v) for v in value)
    return value


def _child(rank: int, world_size: int, port: int, threads: int, fn: Callable[..., Any], args: tuple,
           results: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    disable_nvlink_multicast()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", _to_portable(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_parallel()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
           threads_per_process: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return the results
    in rank order. ``fn`` must be importable (module level) and call ``init_parallel`` itself."""
    import queue as queue_mod

    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, threads_per_process, fn, args, results),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(got) + len(errors) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"parallel launch of {getattr(fn, '__name__', fn)} over {world_size} processes "
                                   f"did not finish within {timeout_s:.0f} s (ranks done: {sorted(got)})")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got and r not in errors]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died with exit codes "
                                       f"{[procs[r].exitcode for r in dead]} before reporting a result")
                continue
            if status == "ok":
                got[rank] = payload
            else:
                errors[rank] = payload
                break  # the others are likely blocked in a collective with the failed rank
        if errors:
            rank, tb = sorted(errors.items())[0]
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [got[r] for r in range(world_size)]
