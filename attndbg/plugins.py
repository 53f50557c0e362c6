"""Plugins named in an environment variable, "NAME=pkg.module:attr,...": ATTNDBG_BACKENDS and
ATTNDBG_DETECTORS read the same way; and `load`, the one import of a "pkg.module:attr" string
(those variables' entries, the built-in tables of both registries, a Detector's hooks).

Free of torch, and nothing is imported to validate a value, so that every command, `--help`
included, can refuse a malformed one in one line before it starts.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any


def installed(group: str) -> tuple[EntryPoint, ...]:
    """The entry points of `group` that the distributions on sys.path declare. Read once per
    sys.path: importlib.metadata scans every distribution's metadata on each call (12 ms here), and
    the registries ask per step and per plan (a third of a metadata-only check's time was this)."""
    return _installed(group, tuple(sys.path))


@functools.lru_cache(maxsize=16)
def _installed(group: str, path: tuple[str, ...]) -> tuple[EntryPoint, ...]:
    return tuple(entry_points(group=group))


def entry_point(group: str, name: str) -> EntryPoint | None:
    """The installed entry point of `group` called `name`, if any."""
    return next((ep for ep in installed(group) if ep.name == name), None)


def registered_names(builtin: list[str], group: str, environment: PluginVariable) -> list[str]:
    """A registry's names in the order it looks them up: the built-in ones, then the entry points of
    `group` (sorted), then those `environment` names; each once, the first one winning."""
    names = list(builtin)
    names += sorted(ep.name for ep in installed(group) if ep.name not in names)
    names += [name for name in environment.named() if name not in names]
    return names


def load(target: str) -> Any:
    """The object "pkg.module:attr" names, its module imported now. ImportError when the module
    cannot be imported, AttributeError when it has no such attribute or `target` names none."""
    module, colon, attr = target.partition(":")
    if not colon or not attr:
        raise AttributeError(f"{target!r} names no attribute: expected pkg.module:attr")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class PluginVariable:
    variable: str  # "ATTNDBG_DETECTORS"
    noun: str  # what a NAME is, for messages: "detector"
    form: str  # the expected form, for messages: "KIND=pkg.module:attr"

    def named(self) -> dict[str, str]:
        """NAME -> "pkg.module:attr"; a malformed entry raises KeyError naming it."""
        named = {}
        for entry in filter(None, (e.strip() for e in os.environ.get(self.variable, "").split(","))):
            name, _, target = entry.partition("=")
            if not name.strip() or ":" not in target:
                raise KeyError(f"{self.variable}: expected {self.form}, got {entry!r}")
            named[name.strip()] = target.strip()
        return named

    def problem(self) -> str | None:
        """What is wrong with the variable, if anything: a malformed entry or a module that cannot be
        found (looked up without importing it)."""
        try:
            named = self.named()
        except KeyError as e:
            return str(e.args[0])
        for name, target in named.items():
            module = target.partition(":")[0]
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return f"{self.variable}: {self.noun} {name!r} names module {module!r}, which cannot be found"
        return None
