"""Tokenizer: text <-> token ids, chat templates, incremental detokenization.

Data flow: an HF-style folder (tokenizer.json, tokenizer_config.json, optional
chat_template.jinja, generation_config.json) -> ``Tokenizer`` (a `tokenizers`
library tokenizer plus a jinja2 chat template). Random presets get a generated
byte-level tokenizer (``build_byte_level_tokenizer``) so they serve text too.
``IncrementalDetokenizer`` turns a growing list of ids into text deltas without
splitting multi-byte characters. For a byte-level decoder (the GPT-2 byte alphabet,
SmolLM2 and the random presets) decoding is "concatenate each token's bytes, then
decode UTF-8 with U+FFFD for invalid bytes", so ``Tokenizer.byte_decoding_table``
gives every id its bytes once and the detokenizer works on bytes per token instead
of calling the tokenizer's decode twice.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A ChatML template for presets that ship no template of their own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BYTE_LEVEL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _bytes_to_unicode() -> dict[int, str]:
    """Map every byte to a printable unicode char (the byte-level BPE alphabet).

    Printable latin-1 bytes map to themselves; the rest are shifted above 255 so the
    vocabulary holds no whitespace or control characters.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    mapping = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def build_byte_level_tokenizer() -> tokenizers.Tokenizer:
    """A deterministic byte-level tokenizer: ids 0..255 are bytes, then special tokens."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    model = tokenizers.models.BPE(vocab=vocab, merges=[])
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_LEVEL_SPECIAL_TOKENS))
    return tok


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the chat template and eos ids."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids or [])
        if eos_token is not None:
            eos_id = tokenizer.token_to_id(eos_token)
            if eos_id is not None and eos_id not in ids:
                ids.append(eos_id)
        self.eos_token_ids: list[int] = ids
        self._template = None
        self._byte_table: ByteDecodingTable | None = None
        self._byte_table_built = False

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, folder: str | Path, extra_eos_token_ids: list[int] | None = None) -> Tokenizer:
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: the model folder needs a tokenizer.json "
                "(save one with transformers' tokenizer.save_pretrained)")
        tok = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if template is None and (folder / "chat_template.json").is_file():
            template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        eos_ids = list(extra_eos_token_ids or [])
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            for i in ([gen_eos] if isinstance(gen_eos, int) else (gen_eos or [])):
                if i not in eos_ids:
                    eos_ids.append(i)
        return cls(tok, chat_template=template, bos_token=_token_content(cfg.get("bos_token")),
                   eos_token=_token_content(cfg.get("eos_token")), eos_token_ids=eos_ids)

    @classmethod
    def byte_level(cls) -> Tokenizer:
        tok = build_byte_level_tokenizer()
        return cls(tok, chat_template=CHATML_TEMPLATE, bos_token=None, eos_token="<|im_end|>",
                   eos_token_ids=[tok.token_to_id("<|endoftext|>")])

    def to_wire(self) -> dict[str, Any]:
        """Everything this tokenizer is, as JSON (for a process of the engine's own, from_wire)."""
        return {"tokenizer": self._tok.to_str(), "chat_template": self.chat_template, "bos_token": self.bos_token,
                "eos_token": self.eos_token, "eos_token_ids": list(self.eos_token_ids)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_str(d["tokenizer"]), chat_template=d.get("chat_template"),
                   bos_token=d.get("bos_token"), eos_token=d.get("eos_token"), eos_token_ids=d.get("eos_token_ids"))

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (HF layout) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))
        cfg = {"chat_template": self.chat_template, "bos_token": self.bos_token,
               "eos_token": self.eos_token, "tokenizer_class": "PreTrainedTokenizerFast"}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def byte_decoding_table(self) -> ByteDecodingTable | None:
        """Each id's bytes under ``decode(..., skip_special_tokens=True)``, or None when the
        decoder is not a plain byte-level one (then only ``decode`` is exact). Built once."""
        if not self._byte_table_built:
            self._byte_table = ByteDecodingTable.build(self._tok)
            self._byte_table_built = True
        return self._byte_table

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render the chat template; encode the result with ``add_special_tokens=False``."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use a plain completion")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template error: {message}")

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     **extra)


def utf8_replace(data: bytes) -> str:
    """UTF-8 with one U+FFFD per maximal invalid subpart: what the tokenizers library's
    lossy byte decoding produces (tests/engine/test_detokenizer.py pins the equality)."""
    return data.decode("utf-8", "replace")


class ByteDecodingTable:
    """Per-id bytes of a byte-level tokenizer, for decoding without the tokenizer.

    ``token_bytes[id]``: the bytes the ByteLevel decoder makes of that id (empty for a
    special token, which decode skips). ``whole_text[id]``: its text when the bytes alone
    decode to non-empty text that does not end in U+FFFD (a complete piece a detokenizer
    can emit as is), else None. Ids at or past ``len(token_bytes)`` decode to nothing.
    """

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.whole_text: list[str | None] = []
        for data in token_bytes:
            text = utf8_replace(data)
            self.whole_text.append(text if text and not text.endswith("\ufffd") else None)

    @classmethod
    def build(cls, tok: tokenizers.Tokenizer) -> ByteDecodingTable | None:
        # Only a bare ByteLevel decoder maps tokens to bytes independently of each other
        # (no Sequence, Metaspace, Strip or ByteFallback step that looks at neighbours).
        if type(tok.decoder) is not tokenizers.decoders.ByteLevel:
            return None
        size = tok.get_vocab_size(with_added_tokens=True)
        byte_to_char = _bytes_to_unicode()
        alphabet = set(byte_to_char.values())
        # alphabet char -> the latin-1 char of its byte, so translate + encode("latin-1") gives the bytes
        to_latin1 = str.maketrans({char: chr(byte) for byte, char in byte_to_char.items()})
        special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
        token_bytes: list[bytes] = []
        for i in range(size):
            token = tok.id_to_token(i)
            if token is None or i in special:
                token_bytes.append(b"")
            elif alphabet.issuperset(token):
                token_bytes.append(token.translate(to_latin1).encode("latin-1"))
            else:  # a token outside the byte alphabet (an added token) decodes as its own UTF-8
                token_bytes.append(token.encode())
        table = cls(token_bytes)
        # Guard against a tokenizers version that decodes some id differently: every id
        # alone must decode as the table says, else the table is not used at all.
        decoded = tok.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
        if any(text != utf8_replace(data) for text, data in zip(decoded, token_bytes)):
            return None
        return table


class IncrementalDetokenizer:
    """Text deltas for a growing id list; holds back text that ends mid-character.

    Decoding only a short window (``prefix_offset:``) keeps the cost per token constant;
    the window starts a few tokens back because byte-level tokenizers need left context
    to decide where a character or a leading space begins. A delta is the window's text
    past the text of its first part (``prefix_offset:read_offset``), emitted once the
    window's text grows and does not end in U+FFFD.

    With a byte-decoding table the same deltas come from bytes. After the first delta the
    window's first part is the tokens of the last delta, and UTF-8 decoding ends their
    bytes with no character half read (the delta ended in a whole character; at worst the
    part holds only that character's last bytes, each a complete invalid subpart), so
    decoding the window splits there: its new text is exactly the decoded bytes of the
    tokens since the last delta (``pending``). Until the first delta the window's first
    part is the prompt's tail, which may end mid-character, so those steps decode the
    window with the tokenizer as described above.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        table = tokenizer.byte_decoding_table() if hasattr(tokenizer, "byte_decoding_table") else None
        self._table = table
        # Bytes of the tokens since the last delta; None until the first delta (or always,
        # without a table): then ``ids`` and the offsets are the state.
        self.pending: bytes | None = None

    def step(self, new_ids: list[int]) -> str:
        if len(new_ids) == 1:
            return self.step_one(new_ids[0])
        if self.pending is None:
            return self._step_by_decoding(new_ids)
        token_bytes = self._table.token_bytes
        return self._emit(self.pending + b"".join(token_bytes[t] for t in new_ids if t < len(token_bytes)))

    def step_one(self, token: int) -> str:
        """``step([token])``, the scheduler's per-token call."""
        pending = self.pending
        if pending is None:
            return self._step_by_decoding([token])
        table = self._table
        if token >= len(table.token_bytes):
            return ""  # decode skips ids outside the vocabulary, so nothing changes
        if not pending:
            text = table.whole_text[token]
            if text is not None:
                return text
        return self._emit(pending + table.token_bytes[token])

    def _emit(self, pending: bytes) -> str:
        text = utf8_replace(pending)
        if text and not text.endswith("\ufffd"):
            self.pending = b""
            return text
        self.pending = pending
        return ""

    def _step_by_decoding(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if self._table is not None:
                self.pending = b""  # from here on bytes, not ids and offsets (see the class docstring)
            return delta
        return ""
