"""Adapters named in the environment: ATTNDBG_BACKENDS="NAME=pkg.module:Class,...".

An adapter still in development can be tried without packaging it (check's worker processes
inherit the variable). Kept apart from the registry, and free of torch, so that every command,
`--help` included, can refuse a malformed value in one line before it starts.
"""

from __future__ import annotations

import importlib.util
import os

VARIABLE = "ATTNDBG_BACKENDS"


def named_adapters() -> dict[str, str]:
    """NAME -> "pkg.mod:Class" from ATTNDBG_BACKENDS; a malformed entry raises KeyError naming it."""
    named = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(VARIABLE, "").split(","))):
        name, _, target = entry.partition("=")
        if not name.strip() or ":" not in target:
            raise KeyError(f"{VARIABLE}: expected NAME=pkg.module:Class, got {entry!r}")
        named[name.strip()] = target.strip()
    return named


def problem() -> str | None:
    """What is wrong with ATTNDBG_BACKENDS, if anything: a malformed entry or a module that cannot
    be found (looked up without importing it)."""
    try:
        named = named_adapters()
    except KeyError as e:
        return str(e.args[0])
    for name, target in named.items():
        module = target.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{VARIABLE}: backend {name!r} names module {module!r}, which cannot be found"
    return None
