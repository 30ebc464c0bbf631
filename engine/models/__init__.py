"""Model loading: presets, safetensors loader, tokenizer, the SmolLM2 import."""
