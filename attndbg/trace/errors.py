"""The error every trace-layer check raises; no torch here, so the CLI can catch it without
importing torch for commands that never touch a tensor (`--version`, `--help`, `synth --list`)."""

from __future__ import annotations


def printable(text: str, limit: int | None = None) -> str:
    """`text` on one line whatever it holds: a newline, a tab or an escape sequence in a file name or
    a stored string is shown escaped (`\\n`), never printed raw; cut at `limit` characters."""
    out = text if text.isprintable() else text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return out if limit is None or len(out) <= limit else out[: limit - 3] + "..."


class TraceError(ValueError):
    """A trace that cannot be used. `str()` is the one-line message shown to users: the path, field
    and message with control characters escaped (they come from file names and the file's content)."""

    def __init__(self, field: str, message: str, path: str | None = None):
        self.field = field
        self.message = message
        self.path = path
        super().__init__(printable(f"{path + ': ' if path else ''}{field}: {message}"))

    def in_file(self, path: str) -> "TraceError":
        return type(self)(self.field, self.message, path)
