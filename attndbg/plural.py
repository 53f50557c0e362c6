"""Counted nouns in messages: '1 step', '3 steps', '0 steps', never 'step(s)'."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun it counts; `plural` where adding an s is wrong ('process', 'processes')."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
