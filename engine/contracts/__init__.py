"""Typed, torch-free contracts that cross a process boundary; imported by the operator and the engine."""
