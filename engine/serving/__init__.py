"""The engine's HTTP face: OpenAI-compatible server, request models, async front, admin API, metrics."""
