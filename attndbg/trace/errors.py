"""The error every trace-layer check raises; no torch here, so the CLI can catch it without
importing torch for commands that never touch a tensor (`--version`, `--help`, `synth --list`)."""

from __future__ import annotations


class TraceError(ValueError):
    """A trace that cannot be used. `str()` is the one-line message shown to users."""

    def __init__(self, field: str, message: str, path: str | None = None):
        self.field = field
        self.message = message
        self.path = path
        super().__init__(f"{path + ': ' if path else ''}{field}: {message}")

    def in_file(self, path: str) -> "TraceError":
        return TraceError(self.field, self.message, path)
