"""Shared test helpers (graph builders, file builders). Importable as `helpers` under pytest."""
