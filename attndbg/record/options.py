"""What to record: sampling of steps and layers, tensors or metadata only, and a size cap.

The options travel to engine processes (schedulers, TP workers) through one environment
variable holding JSON, so every process that imports an engine records with the same rules.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

ENV_VAR = "ATTNDBG_RECORD"


class OptionError(ValueError):
    """A record option the user wrote wrongly; the message names the option."""


@dataclass(frozen=True)
class RecordOptions:
    out_dir: str
    every: int = 1  # record every N-th step
    first_step: int = 0  # --steps A:B records steps A <= step < B
    last_step: int | None = None
    layers: tuple[int, ...] = ()  # layers whose tensors are recorded; empty = metadata only
    max_bytes: int = 2 << 30  # stop recording (not the engine) once the directory holds this much
    engines: tuple[str, ...] | None = None  # the engines to hook by name (record/engines.py); None: every one
    writer: str = "process"  # "process": save in a child process (off the engine's GIL); "thread": in-process
    file_prefix: str = ""  # step files are named f"{file_prefix}step_000012.pt" ("run2_" with --append)
    problems_file: str = ""  # where each process notes why it stopped recording (record/problems.py); "" = nowhere
    # Flight recorder (record/flight.py): keep the last `ring` steps in host memory and write them
    # only when a trigger fires (0: write every step as it comes).
    ring: int = 0
    when: tuple[str, ...] = ()  # extra triggers, as the user wrote them: "nan", "accept<0.2"
    spool_dir: str = ""  # where ring processes leave their ring at exit, for `record` to keep on a failed exit
    extra: dict[str, str] = field(default_factory=dict)

    def wants_step(self, step: int) -> bool:
        if step < self.first_step or (self.last_step is not None and step >= self.last_step):
            return False
        return (step - self.first_step) % self.every == 0

    def wants_layer(self, layer: int) -> bool:
        return layer in self.layers

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> RecordOptions | None:
        raw = (environ if environ is not None else os.environ).get(ENV_VAR)
        if not raw:
            return None
        data = json.loads(raw)
        data["layers"] = tuple(data.get("layers", ()))
        data["engines"] = tuple(data["engines"]) if data.get("engines") is not None else None
        data["when"] = tuple(data.get("when", ()))
        return RecordOptions(**data)


def parse_steps(text: str | None) -> tuple[int, int | None]:
    """'A:B' -> (A, B); 'A:' -> (A, None); ':B' -> (0, B); None -> everything."""
    if text is None:
        return 0, None
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        a = int(first) if first else 0
        b = int(last) if last else None
    except ValueError:
        raise OptionError(f"--steps: expected A:B (e.g. 10:20), got {text!r}") from None
    if a < 0 or (b is not None and b <= a):
        raise OptionError(f"--steps: need 0 <= A < B, got {text!r}")
    return a, b


def parse_layers(text: str | None) -> tuple[int, ...]:
    """'0,3,5' or 'all' is not allowed (tensors of every layer would swamp the disk): explicit ids."""
    if not text:
        return ()
    try:
        layers = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise OptionError(f"--layers: expected comma-separated layer ids (e.g. 0,5), got {text!r}") from None
    if any(layer < 0 for layer in layers):
        raise OptionError(f"--layers: layer ids are >= 0, got {text!r}")
    return layers


def parse_size(text: str, option: str = "--max-size") -> int:
    """'500M', '2G', '123456' -> bytes; `option` names the flag in the error."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B")
    try:
        if t and t[-1] in units:
            value = int(float(t[:-1]) * units[t[-1]])
        else:
            value = int(t)
    except (ValueError, OverflowError):  # OverflowError: 'infG'
        raise OptionError(f"{option}: expected bytes like 500M or 2G, got {text!r}") from None
    if value <= 0:
        raise OptionError(f"{option}: must be positive, got {text!r}")
    return value
