"""One real historical bug of the corpus: where it was reported and fixed, how it is encoded, and
what a detector that catches it should say.

`write(bug_dir, twin_dir)` records the bug's step(s) and the correct twin's into two recording
folders (manifest.jsonl + one trace per step), the way `attndbg record` writes them: through the
SGLang recorder's hooks, the vLLM recorder's converter, or the FlashInfer dump importer (a merge
step, which none of them writes, as the trace format holds the library's merge call). A bug the
recorder cannot express has no `write`, and `not_expressible` says what the trace lacks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Writer = Callable[[Path, Path], None]


class Capability(enum.Enum):
    """What would catch the bug: the capabilities the checks lack (or ALREADY: a check that exists)."""

    EVERY_PLAN = "every plan the engine holds (every wrapper, both FA3 verify calls, every layer group)"
    PADDED_ROWS = "padded rows against the declared padding"
    SPLITS_VS_CAPTURE = "split counts, buffer widths and block-table width against the capture"
    HOST_HINTS = "host-side hints (max_seq_len, max_query_len) against the batch, replayed both ways"
    CROSS_FIELDS = "cross-field consistency inside one engine's metadata"
    PACKED_MASK = "packed mask bits as the kernel reads them"
    VERIFY_GEOMETRY = "verify geometry (topk > 1 sizing, mask row stride)"
    PLAN_INFO = "FlashInfer's plan info from the int workspace"
    BACKEND_NAMES = "every engine backend name mapped to an adapter and its fill rules"
    FORWARD_MODES = "every forward mode judged by its own conventions (draft modes too)"
    WINDOW_VERIFY = "sliding-window verify layouts"
    KERNEL_RUN = "every kernel of the step run against the reference (library defects found by replay)"
    STALE_OUTPUT = "mistake model: an output independent of this step's inputs"
    STRIDE_MODEL = "mistake model: a mask or LSE read with another stride"
    SPLIT_MODEL = "mistake model: a wrong split count"
    PAGE_MODEL = "mistake model: a KV length off by a page"
    STALE_PLAN = "mistake model: a plan left from an earlier batch"
    ALREADY = "a check that exists today"


@dataclass(frozen=True)
class RealBug:
    """A bug from the SGLang, vLLM, FlashInfer or TensorRT-LLM tracker, with its encoding."""

    id: str  # "<tracker>-<number>", the fix's number
    title: str  # what went wrong, in one line
    links: tuple[str, ...]  # the fix first, then the issue and related threads
    date: str  # of the fix (YYYY-MM)
    engine: str  # engine (or library) and its backend, as the step names them
    mode: str  # forward mode(s) of the encoded step, and "graph" when it is a CUDA-graph replay
    mechanism: str  # the wrong field or value and how it showed, from the fix
    encoding: str  # what the recorded step holds and through which recorder path it was written
    expected: tuple[str, ...]  # "class/check" of a finding that names this bug (any of them)
    keywords: tuple[str, ...]  # words of a finding's cause or a reproduction's mechanism that name the mechanism
    capabilities: tuple[Capability, ...]  # what would catch it, where today's checks do not
    write: Writer | None = None
    not_expressible: str = ""  # why the recorder cannot express it (only without `write`)
    twin_note: str = ""  # what the correct twin is, where it is not simply the fixed code's step

    def __post_init__(self) -> None:
        if (self.write is None) == (not self.not_expressible):
            raise ValueError(f"{self.id}: a bug has either a writer or a not-expressible reason")
