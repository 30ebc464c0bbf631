"""Forward-pass bundles shipped with the engine (loaded by path, see engine/forward_pass/importer.py)."""
