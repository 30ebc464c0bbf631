"""Search agents: coordinate sweep, evolutionary, model-based (Optuna TPE) and an LLM coding agent.

`make_agents(names, ...)` builds them by name for the loop and the CLI.
"""

from __future__ import annotations

from typing import Any

from shapeshift.engine.compile.board import Board
from shapeshift.engine.compile.search_space import SearchSpace
from shapeshift.engine.compile.agents.base import Agent, AgentWorker, GarbageCandidate, check_candidate, scored, submit
from shapeshift.engine.compile.agents.evolve import EvolveAgent
from shapeshift.engine.compile.agents.llm import LLMAgent, extract_module
from shapeshift.engine.compile.agents.sweep import SweepAgent

AGENT_NAMES = ("sweep", "evolve", "bayes", "llm")


def __getattr__(name: str):
    # optuna is imported only when the model-based agent is used (GPU hosts may lack it).
    if name == "BayesAgent":
        from shapeshift.engine.compile.agents.bayes import BayesAgent

        return BayesAgent
    raise AttributeError(name)


def agent_class(name: str) -> type[Agent]:
    if name == "bayes":
        from shapeshift.engine.compile.agents.bayes import BayesAgent

        return BayesAgent
    return {"sweep": SweepAgent, "evolve": EvolveAgent, "llm": LLMAgent}[name]


def make_agents(names: list[str], space: SearchSpace, board: Board, seed: int = 0,
                llm: dict[str, Any] | None = None) -> list[Agent]:
    """Agents by name; `llm` holds the LLM agent's keyword arguments (base_url, model, ...).

    A name given n times makes n instances (a CompileRun agent's `replicas`): the k-th (from 2)
    is called `<name>-<k>` on the board and draws from its own seed, so they propose apart."""
    agents: list[Agent] = []
    made: dict[str, int] = {}
    for name in names:
        if name not in AGENT_NAMES:
            raise ValueError(f"unknown agent {name!r}; choose from {', '.join(AGENT_NAMES)}")
        index = made.get(name, 0)
        made[name] = index + 1
        if name == "llm":
            if not llm:
                raise ValueError("agent 'llm' needs --llm-url and --llm-model")
            agent = LLMAgent(space, board, seed + index, **llm)
        else:
            agent = agent_class(name)(space, board, seed + index)
        if index:
            agent.name = f"{name}-{index + 1}"
        agents.append(agent)
    return agents


__all__ = ["AGENT_NAMES", "Agent", "AgentWorker", "BayesAgent", "EvolveAgent", "GarbageCandidate", "LLMAgent",
           "SweepAgent", "check_candidate", "extract_module", "make_agents", "scored", "submit"]
