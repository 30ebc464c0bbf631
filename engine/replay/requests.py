"""Requests from a traffic profile: the one generator behind every replay.

Data flow:

    TrafficProfile (or a saved list of request shapes) + seed
      --sample_shapes--> [{prompt_len, output_len, shared_prefix_len, arrival_s}]
      --make_requests--> [ReplayRequest(prompt_token_ids, max_tokens, arrival_s)]
         lengths clipped to the engine's max_model_len (output to a quarter of it), the
         shared prefix as one fixed token string, a later turn of a session (a shape's
         `continues`) the earlier turn's whole prompt, the rest each request's own; tokens are
         spans of real text (engine/replay/corpus.py, the model's tokenizer) where the
         engine has a tokenizer, else random token ids; EOS ids avoided; same seed -> same
         requests

Used by the replay driver (engine/replay/driver.py), the measurement tiers and the compile
loop's evaluator (engine/compile/evaluator.py), so every measurement replays the same kind
of request. The profile is duck-typed (``sample_requests(n, seed)``, ``concurrency``,
``arrival_rate``, ``name``, ``scaled``): no pydantic or numpy needed here.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ReplayRequest:
    """One request as replayed: its prompt, exact output length (ignore_eos) and, for open-loop
    replay, when it arrives (seconds from the start)."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float | None = None
    shared_prefix_len: int = 0


def sample_shapes(profile: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """Request shapes (plain dicts) from a profile's own sampler."""
    return [{"prompt_len": s.prompt_len, "output_len": s.output_len, "shared_prefix_len": s.shared_prefix_len,
             "arrival_s": s.arrival_s, **({"continues": s.continues, "reused_len": s.reused_len}
                                          if getattr(s, "continues", None) is not None else {})}
            for s in profile.sample_requests(n, seed)]


def save_shapes(path: str | Path, profile: Any, n: int, seed: int, scale: float = 1.0) -> None:
    """Write sampled shapes to JSON so machines without pydantic can replay the same requests."""
    if scale != 1.0:
        profile = profile.scaled(scale)
    data = {"profile": profile.name, "seed": seed, "concurrency": profile.concurrency,
            "arrival_rate": profile.arrival_rate, "scale": scale, "shapes": sample_shapes(profile, n, seed)}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_shapes(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def make_requests(shapes: list[dict[str, Any]], seed: int, vocab_size: int, max_model_len: int,
                  avoid_token_ids: set[int] | frozenset[int] = frozenset(),
                  text_tokens: list[int] | None = None) -> list[ReplayRequest]:
    """Token ids for request shapes: one shared prefix string, the rest each request's own, all
    from ``seed``. ``text_tokens`` (a tokenized corpus): every string is a span of it from a
    random offset; None: random token ids."""
    rng = random.Random(seed)
    usable = [t for t in range(min(vocab_size, 1 << 16)) if t not in avoid_token_ids]

    def draw(n: int) -> list[int]:
        if not text_tokens:
            return [rng.choice(usable) for _ in range(n)]
        out: list[int] = []
        while len(out) < n:  # a span from a random offset, wrapping into another when the corpus ends
            start = rng.randrange(len(text_tokens))
            out += text_tokens[start:start + n - len(out)]
        return out

    longest_prefix = max((s["shared_prefix_len"] for s in shapes), default=0)
    shared = draw(longest_prefix)
    out: list[ReplayRequest] = []
    for s in shapes:
        max_tokens = max(1, min(int(s["output_len"]), max_model_len // 4))
        prompt_len = max(1, min(int(s["prompt_len"]), max_model_len - max_tokens - 1))
        prefix = shared[:min(int(s["shared_prefix_len"]), prompt_len - 1)] if s["shared_prefix_len"] else []
        earlier = s.get("continues")
        if earlier is not None and 0 <= int(earlier) < len(out):
            # a later turn of a session: the earlier turn's prompt (as clipped), then its own part
            prefix = out[int(earlier)].prompt_token_ids[:min(int(s.get("reused_len") or 0), prompt_len - 1)]
        tail = draw(prompt_len - len(prefix))
        out.append(ReplayRequest(prompt_token_ids=prefix + tail, max_tokens=max_tokens, arrival_s=s.get("arrival_s"),
                                 shared_prefix_len=len(prefix)))
    return out


def requests_from_profile(profile: Any, engine: Any, n: int, seed: int,
                          token_seed: int | None = None) -> list[ReplayRequest]:
    """``n`` requests from ``profile`` sized for ``engine`` (its vocabulary, max_model_len, EOS ids).

    ``token_seed`` (default: ``seed``) draws the prompts' tokens apart from their shapes: the
    same traffic (lengths, prefix sharing, arrivals) with fresh prompts, so a repeated
    measurement compares like with like and nothing can be answered from a memo of the last one.
    """
    eos = set(getattr(engine.model_config, "eos_token_ids", []) or [])
    tokenizer = getattr(engine, "tokenizer", None)
    text = None
    if tokenizer is not None:
        from shapeshift.engine.replay.corpus import corpus_tokens

        text = corpus_tokens(tokenizer, eos, engine.model_config.vocab_size)
    return make_requests(sample_shapes(profile, n, seed), seed if token_seed is None else token_seed,
                         engine.model_config.vocab_size, engine.config.max_model_len, eos, text)
