"""LLM coding agent: asks any OpenAI-compatible chat endpoint for a faster forward.py.

Data flow:
    raw source of the current best module (the stock forward.py at first) + the board's
    leaderboard and recent failures --prompt--> POST {base_url}/chat/completions
    (model name, bearer key read from a file such as a mounted Secret)
    --reply--> fenced code blocks extracted -> the one defining build() -> syntax check
    -> Candidate(recipe of the current best, source = the new module)

Replies are untrusted: no code block, a block that does not parse, a module without
``build``, an HTTP error or a timeout are each logged to the board as a note and the agent
returns nothing this round (the worker backs off and asks again later). The candidate's
code is never run here; it is measured and verified like any other.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

try:  # the LLM agent is optional; GPU hosts without httpx can run the offline agents
    import httpx
except ImportError:  # pragma: no cover - exercised only where httpx is absent
    httpx = None

from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.search_space import SearchSpace
from shapeshift.engine.compile.agents.base import Agent, scored

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

SYSTEM_PROMPT = (
    "You rewrite the forward pass of an LLM inference engine to make it faster on the "
    "given model, traffic and hardware. The module must keep its interface: "
    "build(model_config, weights, recipe) returns an object whose forward(input_ids, positions, "
    "ctx, kv_cache) returns float32 logits [num_seqs, vocab] of each sequence's last new token, "
    "writes K/V into the paged cache exactly as before, and computes the same numbers (it is "
    "checked token by token against the original, with fresh inputs, and rejected otherwise). "
    "Reply with the complete new module in one ```python code block, then one line saying why it is faster."
)


class ReplyError(ValueError):
    """The endpoint's reply holds no usable module."""


_HTTP_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError,) if httpx is not None else ()


def extract_module(reply: str) -> str:
    """The module in a chat reply: the fenced block that defines build() (python blocks first).

    Raises ReplyError naming what was wrong. A reply without fences is accepted only if the
    whole text parses as a module defining build().
    """
    if not isinstance(reply, str) or not reply.strip():
        raise ReplyError("empty reply")
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
    if not blocks:
        blocks = [("", reply)]
    blocks.sort(key=lambda b: b[0] not in ("python", "py"))  # python-tagged first
    problems = []
    for lang, body in blocks:
        try:
            tree = ast.parse(body)
        except SyntaxError as exc:
            problems.append(f"{lang or 'untagged'} block does not parse (line {exc.lineno}: {exc.msg})")
            continue
        if not any(isinstance(node, ast.FunctionDef) and node.name == "build" for node in tree.body):
            problems.append(f"{lang or 'untagged'} block defines no top-level build()")
            continue
        return body if body.endswith("\n") else body + "\n"
    raise ReplyError("; ".join(problems) or "no code block")


class LLMAgent(Agent):
    name = "llm"

    def __init__(self, space: SearchSpace, board: Board, seed: int = 0, *, base_url: str, model: str,
                 api_key_file: str | Path | None = None, stock_source: str, context: str = "",
                 timeout_s: float = 120.0, max_tokens: int = 8192, temperature: float = 0.7):
        super().__init__(space, board, seed)
        if not base_url:
            raise ValueError("LLM agent needs --llm-url (an OpenAI-compatible base URL such as http://host:8000/v1)")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = ""
        if api_key_file:
            path = Path(api_key_file)
            if not path.is_file():
                raise ValueError(f"LLM key file {path} does not exist (mount the Secret there or fix --llm-key-file)")
            self.api_key = path.read_text().strip()
        self.stock_source = stock_source
        self.context = context
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.calls = 0
        self.garbage = 0

    # ------------------------------------------------------------------ prompt
    def _prompt(self) -> tuple[str, dict[str, Any], str | None]:
        results = scored(self.board, self.space)
        best_code = next((s for s in results if s.source is not None and not s.failed), None)
        best = results[0] if results else None
        base_source = best_code.source if best_code is not None else self.stock_source
        recipe = best.recipe if best is not None and not best.failed else self.space.default()
        lines = [f"{i + 1}. {s.throughput:.1f} tok/s by {s.agent} ({'custom source' if s.source else 'stock source'}),"
                 f" recipe {s.recipe}" for i, s in enumerate([r for r in results if not r.failed][:5])]
        failures = [n.get("text", "") for n in self.board.entries("result") if n.get("status") != "ok"][-3:]
        parts = [
            self.context,
            "Leaderboard so far (fast tier, output tokens/s):\n" + ("\n".join(lines) or "(nothing measured yet)"),
        ]
        if failures:
            parts.append("Recent rejected candidates:\n" + "\n".join(f"- {f[:300]}" for f in failures))
        parts.append("The current module:\n```python\n" + base_source + "```")
        return "\n\n".join(p for p in parts if p), recipe, (best_code.digest if best_code else None)

    def chat(self, user_text: str) -> str:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_text}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.rng.randrange(1 << 30),
        }
        self.calls += 1
        if httpx is None:
            raise ReplyError("the llm agent needs the httpx package (pip install httpx)")
        resp = httpx.post(f"{self.base_url}/chat/completions", json=body, headers=headers, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise ReplyError(f"endpoint answered HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            data = resp.json()
            content = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ReplyError(f"reply is not an OpenAI chat completion ({type(exc).__name__}: {exc})") from None
        if not isinstance(content, str):
            raise ReplyError(f"reply content is {type(content).__name__}, not text")
        return content

    def propose(self, n: int = 1) -> list[Candidate]:
        prompt, recipe, parent = self._prompt()
        try:
            reply = self.chat(prompt)
            source = extract_module(reply)
        except (ReplyError, *_HTTP_ERRORS) as exc:
            self.garbage += 1
            self.board.note(self.name, f"LLM reply skipped: {exc}", garbage=True)
            return []
        why = reply.split("```")[-1].strip().splitlines()
        note = (why[0] if why else "")[:200] or "LLM rewrite of the forward pass"
        cand = Candidate(recipe, source, self.name, note, parent)
        fresh = self.fresh([cand])
        if not fresh:
            self.board.note(self.name, f"LLM returned a module already tried ({cand.short})")
        return fresh
