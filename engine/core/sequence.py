"""A request's state as it moves through the scheduler.

Data flow: ``LLMEngine.add_request`` -> ``Sequence`` (WAITING) -> scheduled in chunks
(``num_computed_tokens`` = tokens whose KV is in the cache; ``block_table`` = the cache
blocks holding them) -> RUNNING while decoding -> FINISHED (or back to WAITING when
preempted: its blocks are freed and its tokens recomputed later).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from shapeshift.engine.core.sampling import SamplingParams

_arrival = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: Any = None  # torch.Generator for seeded requests
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks committed
    num_cached_tokens: int = 0  # prefix-cache hit at the first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    # Text state (filled by the scheduler when it has a tokenizer).
    detokenizer: Any = None
    # The text so far as pieces (see ``text`` and ``append_text``), not a str grown per token.
    # Left out of ==: the text follows from token_ids, which are compared.
    _text_pieces: list[str] = field(default_factory=list, repr=False, compare=False)
    num_text_emitted: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival))

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        pieces = self._text_pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    @text.setter
    def text(self, text: str) -> None:
        self._text_pieces = [text] if text else []

    def append_text(self, piece: str) -> None:
        """``text += piece`` without copying the text every token (``+=`` on an attribute copies
        all of it: ~26 us a step for 128 sequences of 6,000 characters); the pieces are joined
        every _TEXT_PIECES_JOINED_AT of them and when the text is read."""
        pieces = self._text_pieces
        pieces.append(piece)
        if len(pieces) >= _TEXT_PIECES_JOINED_AT:
            pieces[:] = ["".join(pieces)]


# A piece is a str object of ~50 bytes: an unbounded list would cost memory; a join every 64
# pieces costs ~1/64 of a copy of the text per token.
_TEXT_PIECES_JOINED_AT = 64
