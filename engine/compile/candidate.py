"""What the compile loop searches over: a candidate forward pass.

A `Candidate` is a recipe (knob name -> value: recipe knobs that the forward pass's
`build()` reads, and engine knobs such as batch and chunk sizes) plus, optionally, the
full source of a forward-pass module that replaces the stock `forward.py` (a "source
edit"). Its `digest` is the sha256 of a canonical JSON of both, so two agents proposing
the same thing are recognised as one trial and a restarted run can tell what it already
measured.

    agent -> Candidate(recipe, source?) --digest--> board entries / dedup / bundle name
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no spaces) used for digests."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"value {value!r} of type {type(value).__name__} cannot be written to JSON")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Candidate:
    """One point the loop can measure.

    recipe: knob -> value (JSON-able). source: forward.py text, None = the stock module.
    agent / note / parent: who proposed it, why, and which digest it was derived from.
    """

    recipe: Mapping[str, Any]
    source: str | None = None
    agent: str = "unknown"
    note: str = ""
    parent: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def source_digest(self) -> str | None:
        return None if self.source is None else sha256_text(self.source)

    @property
    def digest(self) -> str:
        return sha256_text(canonical_json({"recipe": dict(self.recipe), "source": self.source_digest}))

    @property
    def short(self) -> str:
        return self.digest[:12]

    def with_recipe(self, **changes: Any) -> "Candidate":
        return Candidate({**self.recipe, **changes}, self.source, self.agent, self.note, self.parent)

    def to_entry(self) -> dict[str, Any]:
        """The board form: the recipe inline, the source inline too (so a crash loses nothing)."""
        return {
            "digest": self.digest,
            "recipe": dict(self.recipe),
            "source_digest": self.source_digest,
            "source": self.source,
            "agent": self.agent,
            "note": self.note,
            "parent": self.parent,
        }

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> "Candidate":
        return cls(recipe=dict(entry.get("recipe") or {}), source=entry.get("source"),
                   agent=entry.get("agent", "unknown"), note=entry.get("note", ""),
                   parent=entry.get("parent"))
