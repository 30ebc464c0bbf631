"""Real text for replayed prompts, tokenized by the model's own tokenizer.

    the Python standard library's pydoc_data.topics (the language reference's topics: about
      460 thousand characters of English prose and code, on every Python install, so nothing
      is downloaded) --tokenizer.encode--> one token stream per tokenizer (cached)
      --requests.make_requests(text_tokens=)--> prompts cut from it at random offsets

Random token ids exercise no model the way traffic does (a mixture-of-experts router sends
them to other experts than text; the kernels tuned on them are tuned for the wrong inputs);
text through the model's tokenizer is the nearest real data a compile run has without
sampling its deployment's own prompts.
"""

from __future__ import annotations

from typing import Any

CORPUS_NAME = "python-stdlib:pydoc_data.topics"
# Characters tokenized: enough for every prompt a replay cuts (spans start at random offsets and
# wrap), short enough to tokenize in well under a second with a pure-Python byte tokenizer.
CORPUS_CHARS = 100_000
# Tokenizers that encode this alike share one cached stream (every engine has its own
# tokenizer object; the tiers of one model would otherwise tokenize the corpus once each).
_PROBE = "Shapeshift replays text: caf\u00e9, na\u00efve, \u65e5\u672c\u8a9e, 3.14159, <tag> {x: [1, 2]}\n\tdef f(): pass"
_cache: dict[tuple[Any, ...], list[int]] = {}


def corpus_text() -> str:
    """The corpus: every topic of pydoc_data.topics, in sorted order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:CORPUS_CHARS]


def corpus_tokens(tokenizer: Any, avoid_token_ids: set[int] | frozenset[int] = frozenset(),
                  vocab_size: int | None = None) -> list[int]:
    """The corpus as `tokenizer`'s token ids (no special tokens), without `avoid_token_ids` (EOS)
    and ids at or above `vocab_size`; cached per tokenizer (the list is shared: do not modify it)."""
    avoid = frozenset(avoid_token_ids)
    key = (type(tokenizer).__name__, tuple(tokenizer.encode(_PROBE, add_special_tokens=False)), avoid, vocab_size)
    if key not in _cache:
        ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
        _cache[key] = [t for t in ids if t not in avoid and (vocab_size is None or t < vocab_size)]
    return _cache[key]
