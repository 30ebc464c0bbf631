"""Engine outputs into API shapes: finish reasons, JSON-safe logprobs, SSE frames, and the
interleaving of several choices' streams (n > 1, list prompts) into one.

Data flow: `RequestStream`s of one HTTP request -> `merge` -> (choice index, RequestOutput)
in arrival order -> the server's chunk builders (`finish_reason`, `logprob_at`, `top_at`)
-> `sse` frames.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from shapeshift.engine.serving.async_engine import RequestStream


def finish_reason(out: Any) -> str | None:
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def finite(value: float) -> float | None:
    # None (JSON null) for NaN and infinities, which JSON cannot spell.
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def logprob_at(out: Any, i: int) -> float | None:
    # RequestOutput.logprobs holds one value per token of `new_token_ids`;
    # None (JSON null) where the engine gave none.
    lps = out.logprobs
    if lps is None or i >= len(lps) or lps[i] is None:
        return None
    return finite(lps[i])


def top_at(out: Any, i: int) -> list[tuple[int, float]]:
    # A logprob with top_logprobs is a sampling.TokenLogprob carrying the alternatives.
    lps = out.logprobs
    if lps is None or i >= len(lps):
        return []
    return list(getattr(lps[i], "top", None) or [])


async def prepend(first: Any, stream: RequestStream) -> AsyncIterator[Any]:
    yield first
    if first.finished:
        return
    async for out in stream:
        yield out


async def merge(started: list[tuple[int, Any, RequestStream]]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) from every choice's stream, in the order they arrive."""
    if len(started) == 1:
        index, first, stream = started[0]
        async for out in prepend(first, stream):
            yield index, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, first: Any, stream: RequestStream) -> None:
        try:
            async for out in prepend(first, stream):
                await queue.put((index, out))
        except BaseException as exc:  # delivered to the consumer, which re-raises it
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(*item)) for item in started]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
