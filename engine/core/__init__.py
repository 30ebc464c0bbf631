"""The serving core: config, sequences, KV blocks, scheduler, runner, attention, sampling, LLMEngine."""
