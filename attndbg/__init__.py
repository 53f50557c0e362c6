"""attndbg: record, replay, diff and explain LLM attention backends."""
__version__ = "0.1.0"
