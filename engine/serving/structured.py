"""`response_format` json_object / json_schema / structural_tag through xgrammar's constrained decoding.

Data flow: the server's tokenizer -> `StructuredOutput` (once per server, lazily: an
xgrammar `TokenizerInfo` from the vocabulary and a `GrammarCompiler` that caches compiled
grammars) -> per request `compile(response_format)` -> per choice `JsonConstraint` set as
`SamplingParams.constraint` -> each sampling step the sampler calls
`mask_logits(row, history)`: the matcher accepts the tokens the sequence gained since the
last step, fills its bitmask of allowed next tokens, and the row's other logits become
-inf. Once the JSON is complete only the stop tokens (the engine's EOS ids) stay allowed.

xgrammar is optional: without it `available()` is False and the server refuses json
formats with a 400 that says to install it.
"""

from __future__ import annotations

import json
import threading
from typing import Any


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def _vocab_type(tokenizer: Any) -> Any:
    """xgrammar's name for how token strings spell bytes, read from tokenizer.json's decoder."""
    import xgrammar as xgr

    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


class StructuredOutput:
    """The tokenizer's xgrammar view and compiler, shared by every request of one server."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        raw = tokenizer._tok  # the `tokenizers.Tokenizer` behind engine/models/tokenizer.Tokenizer
        vocab = [raw.id_to_token(i) or "" for i in range(raw.get_vocab_size(with_added_tokens=True))]
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(vocab, _vocab_type(raw), vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._lock = threading.Lock()

    def compile(self, kind: str, schema: Any = None, compact: bool = False) -> Any:
        """A compiled grammar for `json_object` (any JSON object), `json_schema` (``schema``) or
        `structural_tag` (``schema`` is its format);
        ``compact``: no whitespace but one space after ',' and ':' (tool-call arguments, where a
        model would otherwise be free to pad the JSON until max_tokens)."""
        with self._lock:
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "structural_tag":  # ``schema``: the structural tag's format
                return self._compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": schema}))
            return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=not compact)

    def constraint(self, compiled: Any) -> "JsonConstraint":
        return JsonConstraint(compiled, self.vocab_size)


class JsonConstraint:
    """One sequence's grammar state (see the module docstring); not shared between sequences."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size
        self._accepted = 0  # output tokens fed to the matcher

    def mask_logits(self, row: Any, history: Any) -> None:
        """row: [V] float32 logits of this sequence's next token, masked in place."""
        tokens = history.token_ids
        for token in tokens[history.num_prompt_tokens + self._accepted:]:
            self._accepted += 1
            if not self._matcher.is_terminated():
                self._matcher.accept_token(token)
        if self._matcher.is_terminated():
            return  # the sequence went on past its stop token (ignore_eos): nothing left to constrain
        self._matcher.fill_next_token_bitmask(self._bitmask)
        mask = self._bitmask.to(row.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(row.unsqueeze(0), mask, vocab_size=self._vocab_size)
