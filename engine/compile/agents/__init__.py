"""Search agents: coordinate sweep, evolutionary, model-based (Optuna TPE) and an LLM coding agent.

`make_agents(names, ...)` builds them by name for the loop and the CLI.
"""

from __future__ import annotations

from typing import Any

from ..board import Board
from ..search_space import SearchSpace
from .base import Agent, AgentWorker, GarbageCandidate, check_candidate, scored, submit
from .bayes import BayesAgent
from .evolve import EvolveAgent
from .llm import LLMAgent, extract_module
from .sweep import SweepAgent

AGENT_CLASSES: dict[str, type[Agent]] = {
    "sweep": SweepAgent,
    "evolve": EvolveAgent,
    "bayes": BayesAgent,
    "llm": LLMAgent,
}


def make_agents(names: list[str], space: SearchSpace, board: Board, seed: int = 0,
                llm: dict[str, Any] | None = None) -> list[Agent]:
    """Agents by name; `llm` holds the LLM agent's keyword arguments (base_url, model, ...)."""
    agents: list[Agent] = []
    for name in names:
        if name not in AGENT_CLASSES:
            raise ValueError(f"unknown agent {name!r}; choose from {', '.join(AGENT_CLASSES)}")
        if name == "llm":
            if not llm:
                raise ValueError("agent 'llm' needs --llm-url and --llm-model")
            agents.append(LLMAgent(space, board, seed, **llm))
        else:
            agents.append(AGENT_CLASSES[name](space, board, seed))
    return agents


__all__ = ["AGENT_CLASSES", "Agent", "AgentWorker", "BayesAgent", "EvolveAgent", "GarbageCandidate", "LLMAgent",
           "SweepAgent", "check_candidate", "extract_module", "make_agents", "scored", "submit"]
