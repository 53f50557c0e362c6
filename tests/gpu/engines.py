"""What the GPU tests that run a live engine need, asked once in one place."""

from __future__ import annotations

import importlib


def continuous_batching_missing() -> str | None:
    """Why transformers' continuous batching cannot run here, or None (the adapter needs >= 5.20)."""
    try:
        generation = importlib.import_module("transformers.generation")
    except ImportError as e:
        return f"needs transformers >= 5.20 with continuous batching ({e})"
    return None if hasattr(generation, "ContinuousBatchingConfig") else "needs transformers >= 5.20 (no ContinuousBatchingConfig)"
