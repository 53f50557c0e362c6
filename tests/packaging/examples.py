"""The examples a user can paste: every ```bash block of README.md and docs/*.md, and the Example(s)
section of every command's --help. How a line says what it needs (docs/architecture.md, "Development"):

- a trailing comment `# exit N...` gives its exit code, 0 otherwise;
- `# GPU...`: it needs a GPU; without one it must fail cleanly (exit 3, no traceback, the GPU named);
- `# needs ...`: it needs what the wheel does not bring (a live engine, a model, another tool's
  files); it is skipped, and the comment is the reason;
- `<!-- not an example: REASON -->` on the line before a block leaves the whole block out.

A block is run in a fresh empty folder, its lines in order, as a user pasting it would.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^\s*```(?P<language>[\w+-]*)\s*$")
NOT_AN_EXAMPLE = re.compile(r"^<!-- not an example: (?P<reason>.+) -->$")
# A comment starts at a `#` after whitespace; the examples quote no `#`.
COMMENT = re.compile(r"\s#\s?(?P<comment>.*)$")
EXIT = re.compile(r"^exit (?P<code>\d+)\b")
# Shell languages that would also read as pasteable commands: the docs write those as ```bash, so
# that no example escapes the test by its fence.
SHELL_LANGUAGES = {"sh", "shell", "console", "zsh", "bash"}


class Needs(enum.Enum):
    NOTHING = "runs here"
    GPU = "needs a GPU"
    ELSEWHERE = "needs what the wheel does not bring"


@dataclass(frozen=True)
class Line:
    command: str
    comment: str
    needs: Needs
    exit_code: int  # expected when it runs here


@dataclass(frozen=True)
class Block:
    where: str  # "README.md:42", "attndbg check --help"
    lines: tuple[Line, ...]
    skipped: str | None = None  # why the whole block is not run


def parse_line(text: str) -> Line:
    match = COMMENT.search(text)
    command = text[: match.start()].strip() if match else text.strip()
    comment = match.group("comment").strip() if match else ""
    if comment.startswith("GPU"):
        return Line(command, comment, Needs.GPU, 3)
    if comment.startswith("needs "):
        return Line(command, comment, Needs.ELSEWHERE, 0)
    code = EXIT.match(comment)
    return Line(command, comment, Needs.NOTHING, int(code.group("code")) if code else 0)


def _lines(texts: list[str]) -> tuple[Line, ...]:
    """Commands of a block: blank lines and whole-line comments dropped, `\\` continuations joined."""
    joined: list[str] = []
    pending = ""
    for text in texts:
        if not pending and (not text.strip() or text.lstrip().startswith("#")):
            continue
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        joined.append(pending + text)
        pending = ""
    return tuple(parse_line(text) for text in joined)


def markdown_blocks(path: Path, root: Path) -> list[Block]:
    """Every ```bash block of one page. A fence of another shell language is an error (ValueError):
    it would be an example the test never runs."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence or not fence.group("language"):
            index += 1
            continue
        language, start = fence.group("language"), index
        end = next(i for i in range(start + 1, len(lines)) if FENCE.match(lines[i]))
        where = f"{path.relative_to(root)}:{start + 1}"
        if language in SHELL_LANGUAGES - {"bash"}:
            raise ValueError(f"{where}: a ```{language} block; write commands as ```bash (docs/architecture.md)")
        if language == "bash":
            before = lines[start - 1].strip() if start else ""
            marker = NOT_AN_EXAMPLE.match(before)
            blocks.append(Block(where, _lines(lines[start + 1 : end]), marker.group("reason") if marker else None))
        index = end + 1
    return blocks


def help_block(command: str, help_text: str) -> Block | None:
    """The lines under `Example:` or `Examples:` in a command's --help, up to the next blank line."""
    lines = help_text.splitlines()
    heading = next((i for i, text in enumerate(lines) if text.strip() in ("Example:", "Examples:")), None)
    if heading is None:
        return None
    examples = []
    for text in lines[heading + 1 :]:
        if not text.strip():
            break
        examples.append(text.strip())
    return Block(f"{command} --help", _lines(examples))
