"""The `shapeshift` console command: help without torch, option mapping, dispatch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server_harness import shapeshift_command

ENV = {**os.environ, "PYTHONSAFEPATH": "1"}


def test_help_lists_subcommands(tmp_path):
    out = subprocess.run(shapeshift_command() + ["--help"], capture_output=True, text=True, env=ENV,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("serve", "import-smollm2", "operator"):
        assert name in out.stdout


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["import-smollm2", "--help"]])
def test_help_does_not_import_torch(tmp_path, argv):
    code = ("import sys\nfrom shapeshift.engine.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = [m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules]\n"
            "assert not heavy, heavy\nprint('OK')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr


def test_serve_options_map_to_engine_config():
    from shapeshift.engine.cli import build_parser, engine_config_kwargs
    from shapeshift.engine.core.config import EngineConfig

    args = build_parser().parse_args([
        "serve", "--model", "tiny-llama", "--port", "9001", "--max-num-seqs", "3", "--max-model-len", "512",
        "--dtype", "float32", "--device", "cpu", "--max-waiting", "7", "--no-prefix-caching", "--decode-steps", "4",
        "--overlap-decode", "--chunk-graph-max-batch", "0"])
    config = EngineConfig(**engine_config_kwargs(args))
    assert config.decode_steps == 4 and config.overlap_decode is True and config.chunk_graph_max_batch == 0
    assert (config.model, config.max_num_seqs, config.max_model_len, config.dtype, config.device) == \
        ("tiny-llama", 3, 512, "float32", "cpu")
    assert config.enable_prefix_caching is False
    assert args.max_waiting == 7 and args.port == 9001
    # Unset options keep EngineConfig's defaults.
    defaults = EngineConfig(**engine_config_kwargs(build_parser().parse_args(["serve", "--model", "m"])))
    assert defaults.max_num_seqs == EngineConfig(model="m").max_num_seqs
    assert defaults.decode_steps == 1 and defaults.overlap_decode is False
    assert defaults.chunk_graph_max_batch == EngineConfig(model="m").chunk_graph_max_batch


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--model", "tiny-llama", "--port", "70000"], "TCP port"),
    (["serve", "--model", "tiny-llama", "--max-num-seqs", "0"], "positive integer"),
    (["serve", "--model", "tiny-llama", "--dtype", "int3"], "invalid choice"),
    (["serve", "--port", "8000"], "--model"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_message(argv, needle, tmp_path):
    out = subprocess.run(shapeshift_command() + argv, capture_output=True, text=True, env=ENV, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 2
    assert needle in out.stderr


def test_invalid_engine_settings_are_reported(tmp_path):
    out = subprocess.run(shapeshift_command() + ["serve", "--model", "tiny-llama", "--block-size", "3"],
                         capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert "block_size must be a power of two" in out.stderr


def test_operator_subcommand_dispatches_to_operator_main(tmp_path):
    """`shapeshift operator --help` reaches shapeshift.operator.main:main, which owns its arguments."""
    import importlib.util

    if importlib.util.find_spec("shapeshift.operator.main") is None:
        pytest.skip("shapeshift.operator.main is not in the tree yet")
    out = subprocess.run(shapeshift_command() + ["operator", "--help"], capture_output=True, text=True, env=ENV,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "operator" in (out.stdout + out.stderr).lower()


def _serve(args: list[str], tmp_path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(shapeshift_command() + ["serve", *args], capture_output=True, text=True, env=ENV,
                          cwd=tmp_path, timeout=timeout)


def _folder_without_tokenizer(tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 512}')
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.mark.parametrize("case,needle", [
    ("unknown-preset", "neither a preset"),
    ("no-tokenizer", "no tokenizer.json"),
    ("cuda-without-gpu", "no CUDA GPU is visible"),
    ("context-too-long", "use at most 4096"),
    ("port-taken", "pick another --port"),
])
def test_user_errors_are_one_line_and_exit_2_before_loading(case, needle, tmp_path):
    import socket

    holder = None
    args = ["--model", "tiny-llama", "--device", "cpu", "--port", "0"]
    if case == "unknown-preset":
        args = ["--model", "tiny-llama-typo"]
    elif case == "no-tokenizer":
        args = ["--model", _folder_without_tokenizer(tmp_path)]
    elif case == "cuda-without-gpu":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here")
        args = ["--model", "tiny-llama", "--device", "cuda"]
    elif case == "context-too-long":
        args = ["--model", "tiny-llama", "--device", "cpu", "--max-model-len", "100000"]
    elif case == "port-taken":
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        args = ["--model", "tiny-llama", "--device", "cpu", "--port", str(holder.getsockname()[1])]
    try:
        out = _serve(args, tmp_path)
    finally:
        if holder is not None:
            holder.close()
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith("shapeshift serve: "), out.stderr
    assert needle in lines[0]
    assert "Traceback" not in out.stderr
    assert "loaded" not in out.stderr.lower()


def test_version(tmp_path):
    from shapeshift.engine.provenance import package_version

    out = subprocess.run(shapeshift_command() + ["--version"], capture_output=True, text=True, env=ENV,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"shapeshift {package_version()}"


def test_context_length_comes_from_the_model_bounded_by_the_kv_cache():
    from shapeshift.engine.serving.preflight import check_model, choose_max_model_len

    info = check_model("tiny-llama")
    common = dict(device="cpu", dtype=None, block_size=16, gpu_memory_utilization=0.9)
    assert choose_max_model_len(info, None, num_kv_blocks=None, **common)[0] == info.max_position_embeddings
    chosen, why = choose_max_model_len(info, None, num_kv_blocks=10, **common)
    assert chosen == (10 - 1) * 16 and "--num-kv-blocks 10" in why and "holds 160 tokens" in why
    assert choose_max_model_len(info, 300, num_kv_blocks=None, **common) == (300, "--max-model-len")


def test_an_imported_preset_not_yet_on_disk_serves_its_own_context_length(tmp_path, monkeypatch):
    """smollm2-135m before `shapeshift import-smollm2`: the preset's config gives the context length
    (8192), not the engine's 2048, and the KV cache still bounds it."""
    from shapeshift.engine.models.presets import PRESETS
    from shapeshift.engine.serving.preflight import check_model, choose_max_model_len

    monkeypatch.setenv("SHAPESHIFT_CACHE", str(tmp_path))  # an empty cache: nothing imported
    assert not (PRESETS["smollm2-135m"].folder() / "config.json").exists()
    info = check_model("smollm2-135m")
    assert info.max_position_embeddings == 8192 and not info.is_random
    assert info.weight_bytes > 100e6 * 4  # ~135 M float32 parameters, as the import writes them
    common = dict(device="cpu", dtype=None, block_size=16, gpu_memory_utilization=0.9)
    assert choose_max_model_len(info, None, num_kv_blocks=None, **common) == \
        (8192, "the model's max_position_embeddings (8192)")
    assert choose_max_model_len(info, None, num_kv_blocks=100, **common)[0] == 99 * 16
    with pytest.raises(ValueError, match="max_position_embeddings=8192"):
        choose_max_model_len(info, 9000, num_kv_blocks=None, **common)
