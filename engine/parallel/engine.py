"""ParallelLLMEngine: one engine replica spread over the ranks of a model-parallel group.

Data flow: every rank builds the same engine (weights loaded once, then cut to its
share by ``shard_weights``; the ``parallel`` forward pass; a KV cache holding only its
KV heads, sized identically on every rank; CUDA graphs captured in lockstep, since each
graph holds collectives). The replica's driver (its mp_rank 0) owns the scheduler:
``step()`` is the ordinary ``schedule -> runner.run -> postprocess``, except that
``runner.run(batch)`` first broadcasts a compact copy of the batch (per sequence: the
token window it computes, its length, its block table) over the replica's gloo control
group (``ControlChannel``: one broadcast of a fixed buffer per step). The other ranks sit in ``follow()``: receive a batch, rebuild light sequences
from it and call the same ``ModelRunner.run`` (same eager/graph choice, same
collectives in the same order), discarding the sampled tokens. ``shutdown()`` on the
driver releases the followers.

Usage, in every rank's process (``launch`` or torchrun starts them):
    state = init_parallel(layout, rank, world_size)
    engine = ParallelLLMEngine(EngineConfig(model=...))
    if engine.is_driver:
        try: ... engine.add_request(...); engine.step() ...  (the LLMEngine API)
        finally: engine.shutdown()
    else:
        engine.follow()
``serve_rank`` wraps exactly that. Swapping the forward pass at run time is not
supported here (the followers would need the new bundle too).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from shapeshift.engine.core.config import EngineConfig, ModelConfig
from shapeshift.engine.forward_pass.importer import LoadedBundle
from shapeshift.engine.core.llm_engine import LLMEngine
from shapeshift.engine.models.loader import LoadedModel, load_model
from shapeshift.engine.core.runner import ModelRunner
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.core.scheduler import RunnerOutput, ScheduledBatch
from shapeshift.engine.core.sequence import Sequence

from shapeshift.engine.parallel import process_group
from shapeshift.engine.parallel.layout import ParallelLayout
from shapeshift.engine.parallel.sharding import shard_weights

PARALLEL_BUNDLE_DIR = Path(__file__).resolve().parent.parent / "forward_passes" / "parallel"

# Followers only need the forward pass; greedy params make their discarded sampling an argmax.
_FOLLOWER_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class SeqStep:
    """What a follower needs of one scheduled sequence."""

    start: int  # num_computed_tokens before this step
    tokens: list[int]  # token_ids[start:start + num_new]
    num_tokens: int
    block_table: list[int]


@dataclass
class StepMessage:
    command: str  # "run" | "prompt_logits" | "stop"
    seqs: list[SeqStep]


class _TokenWindow:
    """The slice of a sequence's token ids that one step reads, indexed by absolute
    position (what ``ModelRunner.prepare_*`` index), without shipping the whole history."""

    def __init__(self, offset: int, tokens: list[int], length: int) -> None:
        self.offset, self.tokens, self.length = offset, tokens, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1 or start < self.offset or stop > self.offset + len(self.tokens):
                raise IndexError(f"positions {start}:{stop} are outside the step's window "
                                 f"{self.offset}:{self.offset + len(self.tokens)}")
            return self.tokens[start - self.offset:stop - self.offset]
        position = index + self.length if index < 0 else index
        if not self.offset <= position < self.offset + len(self.tokens):
            raise IndexError(f"position {position} is outside the step's window")
        return self.tokens[position - self.offset]


def encode_batch(batch: ScheduledBatch, command: str) -> StepMessage:
    seqs = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        seqs.append(SeqStep(start=start, tokens=list(seq.token_ids[start:start + n]), num_tokens=seq.num_tokens,
                            block_table=list(seq.block_table)))
    return StepMessage(command=command, seqs=seqs)


def decode_batch(message: StepMessage) -> ScheduledBatch:
    seqs = []
    for i, s in enumerate(message.seqs):
        seq = Sequence(request_id=f"follower-{i}", prompt_token_ids=[], params=_FOLLOWER_PARAMS,
                       token_ids=_TokenWindow(s.start, s.tokens, s.num_tokens),  # type: ignore[arg-type]
                       num_computed_tokens=s.start, block_table=s.block_table)
        seqs.append(seq)
    return ScheduledBatch(seqs=seqs, num_new_tokens=[len(s.tokens) for s in message.seqs])


class ControlChannel:
    """Driver -> followers messages over the replica's gloo group, one broadcast per
    message in the common case: a fixed buffer carries [length int64 | pickled message];
    a message longer than the buffer follows in a second broadcast of its exact size.
    (``broadcast_object_list`` always needs two, and their latency is the driver's
    per-step cost of having followers.)"""

    CAPACITY = 32 * 1024

    def __init__(self, state: process_group.ParallelState) -> None:
        self.src = state.driver_rank
        self.group = state.control_group
        self.buffer = torch.zeros(self.CAPACITY, dtype=torch.uint8)
        self.view = self.buffer.numpy()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.view[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
        fits = len(data) <= self.CAPACITY - 8
        if fits:
            self.view[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        dist.broadcast(self.buffer, src=self.src, group=self.group)
        if not fits:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=self.src, group=self.group)

    def receive(self) -> Any:
        dist.broadcast(self.buffer, src=self.src, group=self.group)
        length = int.from_bytes(self.view[:8].tobytes(), "little")
        if length <= self.CAPACITY - 8:
            return pickle.loads(self.view[8:8 + length].tobytes())
        big = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(big, src=self.src, group=self.group)
        return pickle.loads(big.numpy().tobytes())


class _DrivingRunner:
    """The driver's runner: broadcasts each batch to the followers, then runs it."""

    def __init__(self, runner: ModelRunner, state: process_group.ParallelState) -> None:
        self.runner = runner
        self.channel = ControlChannel(state)
        self.num_sends = 0
        self.send_seconds = 0.0  # host time spent broadcasting batches (what the followers cost the driver)

    def send(self, command: str, batch: ScheduledBatch | None = None) -> None:
        start = time.perf_counter()
        message = StepMessage(command, []) if batch is None else encode_batch(batch, command)
        self.channel.send(message)
        self.num_sends += 1
        self.send_seconds += time.perf_counter() - start

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        self.send("run", batch)
        return self.runner.run(batch)

    def prompt_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        self.send("prompt_logits", batch)
        return self.runner.prompt_logits(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class ParallelLLMEngine(LLMEngine):
    """``LLMEngine`` whose forward pass is spread over a replica's ranks (see module docstring)."""

    default_bundle_dir = PARALLEL_BUNDLE_DIR

    def __init__(self, config: EngineConfig, state: process_group.ParallelState | None = None) -> None:
        state = state or process_group.current()
        if state is None:
            raise RuntimeError("ParallelLLMEngine needs torch.distributed set up: call "
                               "shapeshift.engine.parallel.process_group.init_parallel(layout) in each rank first")
        self.state = state
        self.layout: ParallelLayout = state.layout
        self._stopped = False
        # LLMEngine's construction, through the hooks below: weights sharded between loading
        # and building the pass, a KV cache of the rank's KV heads with the replica's block count.
        super().__init__(dataclasses.replace(config, device=str(state.device)))
        self._local_runner = self.runner  # every rank captured the same graphs in the same order
        if self.is_driver and self._has_followers:
            self.runner = _DrivingRunner(self.runner, state)

    def _decode_lookahead(self, batch: ScheduledBatch) -> int:
        # Followers replay what the driver broadcasts one step at a time; multi-step decode
        # would need the k-step command on the control channel. Until then: one step.
        return 1

    def _load_model(self, config: EngineConfig) -> LoadedModel:
        loaded = load_model(config)
        self.layout.validate(loaded.model_config)
        loaded.weights = shard_weights(loaded.weights, loaded.model_config, self.layout, self.state.coords)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the unsharded tensors are gone; size the KV cache without them
        return loaded

    def _kv_cache_model_config(self) -> ModelConfig:
        return self.layout.rank_model_config(self.model_config)  # local KV heads

    @property
    def is_driver(self) -> bool:
        return self.state.is_driver

    @property
    def _has_followers(self) -> bool:
        return self.layout.model_parallel_size > 1

    def _agree_on_num_blocks(self, num_blocks: int) -> int:
        """Every rank's cache must hold the driver's block ids: take the replica's minimum."""
        if not self._has_followers:
            return num_blocks
        t = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.state.control_group)
        return int(t.item())

    # ------------------------------------------------------------------ followers
    def follow(self) -> int:
        """Follower loop: run every batch the driver broadcasts until it stops; returns steps run."""
        if self.is_driver:
            raise RuntimeError("follow() runs on the non-driver ranks; the driver calls step()")
        steps = 0
        channel = ControlChannel(self.state)
        while True:
            message: StepMessage = channel.receive()
            if message.command == "stop":
                return steps
            batch = decode_batch(message)
            if message.command == "run":
                self._local_runner.run(batch)
            elif message.command == "prompt_logits":
                self._local_runner.prompt_logits(batch)
            else:
                raise RuntimeError(f"unknown command {message.command!r} from the driver")
            steps += 1

    def shutdown(self) -> None:
        """Driver: release the followers (idempotent)."""
        if self.is_driver and self._has_followers and not self._stopped:
            self._stopped = True
            self.runner.send("stop")

    # ------------------------------------------------------------------ unsupported here
    def set_forward_pass(self, bundle: LoadedBundle, forward_pass: Any | None = None) -> None:
        raise NotImplementedError("swapping the forward pass of a parallel engine is not supported: every rank would "
                                  "need the new bundle; restart the replica with EngineConfig.forward_pass instead")


def serve_rank(rank: int, world_size: int, layout: ParallelLayout, config: EngineConfig,
               drive: Callable[[ParallelLLMEngine], Any]) -> Any:
    """One rank's whole life: init, build the engine, drive (driver) or follow (others).

    Returns ``drive(engine)``'s result on each replica's driver and None elsewhere.
    """
    state = process_group.init_parallel(layout, rank, world_size)
    engine = ParallelLLMEngine(config, state)
    if not engine.is_driver:
        engine.follow()
        return None
    try:
        return drive(engine)
    finally:
        engine.shutdown()
