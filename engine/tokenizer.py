"""Tokenizer: text <-> token ids, chat templates, incremental detokenization.

Data flow: an HF-style folder (tokenizer.json, tokenizer_config.json, optional
chat_template.jinja, generation_config.json) -> ``Tokenizer`` (a `tokenizers`
library tokenizer plus a jinja2 chat template). Random presets get a generated
byte-level tokenizer (``build_byte_level_tokenizer``) so they serve text too.
``IncrementalDetokenizer`` turns a growing list of ids into text deltas without
splitting multi-byte characters.
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


class IncrementalDetokenizer:
    """Text deltas for a growing id list; holds back text that ends mid-character.

    Decoding only a short window (``prefix_offset:``) keeps the cost per token constant;
    the window starts a few tokens back because byte-level tokenizers need left context
    to decide where a character or a leading space begins.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""
