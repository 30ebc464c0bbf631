"""Fixtures for the server tests: a shared `shapeshift serve` subprocess, a reference engine,
an `openai` client pointed at the server, and the environment of the CLI clients (guidellm,
lm-eval) that hack/setup.sh builds beside the main one."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from server_harness import MAX_MODEL_LEN, MAX_NUM_SEQS, MODEL, NUM_KV_BLOCKS, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # With a tool-call parser, for tool_choice "auto" (test_server_tool_parsers.py); the 400 of "auto"
    # without one is checked on test_server_access.py's server.
    proc = ServerProcess(["--max-num-seqs", str(MAX_NUM_SEQS), "--tool-call-parser", "hermes"],
                         tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def reference_engine():
    """An in-process LLMEngine with the server's settings, for greedy reference outputs."""
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=MODEL, device="cpu", max_model_len=MAX_MODEL_LEN,
                                  num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS))


@pytest.fixture()
def openai_client(server: ServerProcess):
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    yield client
    client.close()


@pytest.fixture(scope="session")
def clients_venv() -> Path:
    """$SHAPESHIFT_CACHE/clients-venv: guidellm and lm-eval, kept out of the main environment
    (hack/setup.sh says why). Missing, it fails the test that needs it, so CI cannot pass by skipping."""
    from harness.tools import cache_dir

    venv = cache_dir() / "clients-venv"
    missing = [name for name in ("guidellm", "lm_eval") if not (venv / "bin" / name).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found in {venv}: run hack/setup.sh (it builds that environment)")
    return venv
