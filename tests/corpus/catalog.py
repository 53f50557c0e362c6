"""Every bug of the corpus, in table order (engine, then family)."""

from __future__ import annotations

from pathlib import Path

from attndbg.trace import io
from tests.corpus import (
    flashinfer_dumps,
    flashinfer_merges,
    flashinfer_wrappers,
    not_expressible,
    sglang_draft_modes,
    sglang_graph_padding,
    sglang_kv_lists,
    sglang_merges,
    sglang_trtllm_mla,
    sglang_window_lists,
    vllm_builder_lists,
    vllm_graph_padding,
    vllm_host_hints,
)
from tests.corpus.bug import RealBug

FAMILIES = (
    sglang_graph_padding,
    sglang_kv_lists,
    sglang_window_lists,
    sglang_draft_modes,
    sglang_trtllm_mla,
    sglang_merges,
    vllm_graph_padding,
    vllm_host_hints,
    vllm_builder_lists,
    flashinfer_wrappers,
    flashinfer_merges,
    flashinfer_dumps,
    not_expressible,
)
BUGS: tuple[RealBug, ...] = tuple(bug for family in FAMILIES for bug in family.BUGS)
ENCODED: tuple[RealBug, ...] = tuple(bug for bug in BUGS if bug.write is not None)


def holds_output(recording: Path) -> bool:
    """Whether a recording holds the engine's output (recorded with its layers, `record --layers`):
    an output-level bug, which diagnosis can name by reproducing that output."""
    # A step may hold a layer's inputs without its output (an imported run whose output has no
    # truth to be compared with): that is not an output-level bug.
    return any(layer.output is not None for entry in io.read_manifest(recording) for layer in io.load(recording / entry.file).tensors.values())


def by_id(bug_id: str) -> RealBug:
    for bug in BUGS:
        if bug.id == bug_id:
            return bug
    raise KeyError(f"no bug {bug_id!r} in the corpus ({', '.join(b.id for b in BUGS)})")


assert len({bug.id for bug in BUGS}) == len(BUGS), "duplicate bug ids"
