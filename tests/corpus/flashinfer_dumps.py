"""Wrong FlashInfer plans a user brings as a level-10 dump (FLASHINFER_LOGLEVEL=10), imported with
`attndbg import flashinfer` as the user would: the plan's arguments exactly as the caller passed
them, the wrong ones included.

- flashinfer-ai/flashinfer#3176 (2026-04; the plan-time check is #3503): plan() flattened and
  packed a custom mask of the wrong shape without checking it against sum(q_len x kv_len). A
  (10, 15) mask for one request of q_len 10, kv_len 20 packs to 19 bytes where the kernel reads 25:
  it read 50 bits past the buffer (max abs diff 1.3 against the right mask, no error).

The dumps are written as FlashInfer 0.7.2's api_logging.py writes them (tests/interop/fi_dumps.py),
the run's output what the kernel computes reading the mask at plan()'s offsets.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from attndbg.interop.flashinfer_steps import import_dump
from attndbg.interop.recording import write_recording
from tests.corpus.bug import Capability, RealBug
from tests.interop import fi_dumps


def dump_dir(recording: Path) -> Path:
    """Where the dump a recording is imported from lies: beside it, as the user keeps it."""
    return recording.with_name(f"{recording.name}-dump")


def _imported(out: Path, write: Callable[[fi_dumps.DumpWriter], None]) -> None:
    """The dump written as FlashInfer writes it, then imported as `attndbg import flashinfer` does."""
    dump = dump_dir(out)
    writer = fi_dumps.DumpWriter(dump)
    write(writer)
    log = writer.log if writer.log.exists() else None
    write_recording(import_dump(dump, log), str(out), overwrite=True)


def write_3176(bug: Path, twin: Path) -> None:
    _imported(bug, lambda w: fi_dumps.write_mask_shape(w, columns=15))
    _imported(twin, lambda w: fi_dumps.write_mask_shape(w, columns=20))


BUGS = (
    RealBug(
        id="flashinfer-3176",
        title="Custom mask shape never validated: a (10, 15) mask for qo 10, kv 20 read 50 bits past the buffer",
        links=("https://github.com/flashinfer-ai/flashinfer/issues/3176", "https://github.com/flashinfer-ai/flashinfer/pull/3503"),
        date="2026-06",
        engine="FlashInfer",
        mode="TARGET_VERIFY",
        mechanism="BatchPrefillWithPagedKVCacheWrapper.plan flattened and packed a mask of the wrong shape without checking it "
        "against sum(q_len x kv_len); the kernel read past it (max abs diff 1.3, no error)",
        encoding="a FlashInfer level-10 dump of a paged prefill wrapper's plan() and run(): one request of q_len 10 over kv_len 20 "
        "(a tree of 10 tokens over a prefix of 10), planned with a flat custom_mask of 10 x 15 = 150 elements (the tree over a "
        "prefix of 5); the run's output as the kernel computes it reading 200 bits at plan()'s offsets. Imported with attndbg's "
        "importer: a verify step whose draft tree is not known (the mask does not fit its blocks), the mask kept as given",
        expected=("tree-mask/mask-length",),
        keywords=("past the buffer", "#3176"),
        capabilities=(Capability.PACKED_MASK,),
        twin_note="the same dump with the (10, 20) mask the step needs: its tree read from it, the output the tree's",
        write=write_3176,
    ),
)
