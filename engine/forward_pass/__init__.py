"""The forward-pass lifecycle: bundles, importing, recipes, hot reload."""
