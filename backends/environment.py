"""Adapters named in the environment: ATTNDBG_BACKENDS="NAME=pkg.module:Class,...".

An adapter still in development can be tried without packaging it (check's worker processes
inherit the variable). Kept apart from the registry, and free of torch, so that every command,
`--help` included, can refuse a malformed value in one line before it starts. Read the way
ATTNDBG_DETECTORS is (attndbg/plugins.py).
"""

from __future__ import annotations

from attndbg.plugins import PluginVariable

ENVIRONMENT = PluginVariable("ATTNDBG_BACKENDS", "backend", "NAME=pkg.module:Class")
VARIABLE = ENVIRONMENT.variable
