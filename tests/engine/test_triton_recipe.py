"""The stock forward pass with its Triton knobs (kernels/) equals the torch reference.

Runs in a subprocess: on the CPU, Triton's interpreter must be switched on before
triton is first imported (TRITON_INTERPRET=1), which this test process cannot undo.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from harness.case_processes import CaseProcesses, selected_cases

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine
    from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES
    from shapeshift.engine.core.sampling import SamplingParams

    preset, device = sys.argv[1], sys.argv[2]
    recipe = NAMED_RECIPES["triton"]  # what `serve --recipe auto` serves on CUDA, dense and MoE alike
    base = dict(model=preset, device=device, dtype="float32", max_num_seqs=4, max_model_len=64,
                block_size=4, max_num_batched_tokens=16)
    ref = LLMEngine(EngineConfig(**base))
    tri = LLMEngine(EngineConfig(**base, forward_pass_recipe=recipe))
    prompts = [[3 + (5 * i + j) % 250 for j in range(n)] for i, n in enumerate([5, 11, 3])]
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    diff = (ref.prompt_logits(prompts[1]) - tri.prompt_logits(prompts[1])).abs().max().item()
    print(json.dumps({"ref": ref.generate(prompts, p), "triton": tri.generate(prompts, p),
                      "max_logit_diff": diff, "graphs": len(tri.runner.graphs)}))
''')


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def case_processes(request):
    """The selected presets' subprocesses, side by side (one a core): each is one Python
    interpreting kernels on the CPU. Each test waits for its own (harness/case_processes.py)."""
    device = _device()
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    cases = selected_cases(request, "test_triton_knobs_match_torch_reference", ["preset"])
    runs = CaseProcesses(lambda case: [sys.executable, "-c", SCRIPT, case[0], device], cases, env, timeout=600)
    yield runs
    runs.close()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-moe"])
def test_triton_knobs_match_torch_reference(preset, case_processes):
    proc = case_processes.result((preset,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["ref"]
    assert result["max_logit_diff"] < 1e-4
    assert len({tuple(t) for t in result["ref"]}) == 3  # distinct continuations: a real comparison
