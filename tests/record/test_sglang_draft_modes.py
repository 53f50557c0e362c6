"""The draft model's extend steps, each recorded by its own SGLang mode's conventions through the
installed hooks (real ForwardBatch, EagleDraftExtendInput, ReqToTokenPool, Triton ForwardMetadata):

- DRAFT_EXTEND_V2 (spec v2): every request runs its whole verify window (the spec input's
  num_tokens_per_req) whatever it accepted; seq_lens = prefix + window. A correct step checks
  clean, small and server-shaped; one whose seq_lens and extend_seq_lens follow the classic
  convention (the accepted tokens) is recorded as the window it ran and judged by it.
- DRAFT_EXTEND (SGL-classic, spec v1): the accepted tokens are the query.

Checks run on metadata only (the reference backend): they are what judges a mode's lengths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from attndbg.checks.run import check_steps
from attndbg.checks.selection import parse_only
from attndbg.detector_api.context import CheckOptions
from attndbg.trace import io
from tests.corpus import sglang_engine as sg

I64, I32 = torch.int64, torch.int32
WINDOW = 4
ROWS = {1: list(range(10, 23)), 3: list(range(30, 41)), 6: list(range(50, 67))}
PREFIX, ACCEPTED = [9, 5, 12], [3, 1, 2]


def triton_eager_extend(made: Any, fb: Any) -> None:
    """Triton's eager metadata of an extend-like step (DRAFT_EXTEND_V2 and the classic draft extend
    take init_forward_metadata's extend branch in SGLang 0.5.23): prefix lists over
    extend_prefix_lens (the new K/V come from the kernel's inputs), qo_indptr = cumsum(extend_seq_lens)."""
    indptr, indices = sg.kv_lists(made, fb, fb.extend_prefix_lens.to(I64))
    qo = torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens.to(I64), 0), (1, 0)).to(I32)
    made.forward_metadata = sg.env.TritonForwardMetadata(None, None, int(fb.extend_seq_lens.max()), None, indptr, indices, qo, None, None, None, None, None, None)


def record(out: Path, fb: Any, rows: dict[int, list[int]] = ROWS, *, pool_slots: int | None = None) -> Any:
    with sg.recording(out) as session:
        layer = sg.layer()  # noqa: F841
        made = sg.backend(sg.CorpusTriton, rows, triton_eager_extend)
        if pool_slots is not None:
            made.token_to_kv_pool.size = pool_slots
        sg.record_eager(session, made, fb)
    [entry] = io.read_manifest(out)
    return io.load(out / entry.file)


def findings(path: Path) -> list:
    reports = list(check_steps(str(path), parse_only(None), CheckOptions(backends=("reference",))))
    assert all(r.checked for r in reports), [r.error for r in reports]
    return [f for r in reports for f in r.findings]


def with_v1_lengths(fb: Any, accepted: list[int]) -> Any:
    """The classic convention's lengths on a V2 step: seq_lens = prefix + accepted,
    extend_seq_lens = accepted (the window's tokens, slots and positions unchanged)."""
    prefix = fb.extend_prefix_lens.to(I64)
    fb.seq_lens = prefix + torch.tensor(accepted, dtype=I64)
    fb.seq_lens_cpu = fb.seq_lens.clone()
    fb.seq_lens_sum = int(fb.seq_lens.sum())
    fb.extend_seq_lens = torch.tensor(accepted, dtype=I32)
    fb.extend_seq_lens_cpu = list(accepted)
    return fb


def test_v2_step_is_its_window(tmp_path: Path) -> None:
    trace = record(tmp_path / "rec", sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED))
    batch = trace.batch
    assert batch.prefix_lens.tolist() == PREFIX
    assert batch.extend_lens.tolist() == [WINDOW] * 3  # accepted 3, 1, 2: the window runs whole
    assert batch.kv_lens.tolist() == [13, 9, 16]
    assert batch.seq_lens_raw.tolist() == [13, 9, 16]
    assert batch.positions.tolist() == [*range(9, 13), *range(5, 9), *range(12, 16)]
    assert batch.out_cache_loc.tolist() == [*range(19, 23), *range(35, 39), *range(62, 66)]
    assert batch.slot_ids.tolist() == [*range(10, 23), *range(30, 39), *range(50, 66)]
    assert trace.plan.tensors["qo_indptr"].tolist() == [0, 4, 8, 12]
    assert findings(tmp_path / "rec") == []


def test_v2_server_shaped_step_checks_clean(tmp_path: Path) -> None:
    """64 requests, prefixes up to 3000 columns, window 8, ragged acceptance."""
    g = torch.Generator().manual_seed(7)
    window, bs = 8, 64
    prefix = torch.randint(1, 3000, (bs,), generator=g).tolist()
    accepted = torch.randint(1, window + 1, (bs,), generator=g).tolist()
    rows, slot = {}, 1
    for r, p in enumerate(prefix, start=1):
        rows[r] = list(range(slot, slot + p + window))
        slot += p + window
    trace = record(tmp_path / "rec", sg.draft_extend_v2_batch(rows, prefix, window, accepted), rows, pool_slots=slot)
    assert trace.batch.extend_lens.tolist() == [window] * bs and trace.batch.prefix_lens.tolist() == prefix
    assert findings(tmp_path / "rec") == []


def test_v2_step_with_v1_lengths_is_judged_by_the_window(tmp_path: Path) -> None:
    fb = with_v1_lengths(sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED), ACCEPTED)
    trace = record(tmp_path / "rec", fb)  # recorded, not refused: the wrong lengths are evidence
    assert trace.batch.extend_lens.tolist() == [WINDOW] * 3
    assert trace.batch.seq_lens_raw.tolist() == [12, 6, 14]
    found = {(f"{f.kind.value}/{f.check}", f.location.field): f for f in findings(tmp_path / "rec")}
    seq_lens = found[("invariants/seq-lens", "batch.seq_lens_raw[0]")]
    assert (seq_lens.data["expected"], seq_lens.data["found"]) == (13, 12)
    qo = found[("invariants/qo-lens", "plan.qo_indptr[1]")]
    assert (qo.data["expected"], qo.data["found"]) == (WINDOW, 3)
    for finding in (seq_lens, qo):
        assert "DRAFT_EXTEND_V2 its whole verify window" in finding.cause


def test_classic_draft_extend_runs_the_accepted_tokens(tmp_path: Path) -> None:
    fb = sg.extend_batch(ROWS, PREFIX, ACCEPTED)
    fb.forward_mode = sg.env.ClassicForwardMode.DRAFT_EXTEND
    trace = record(tmp_path / "rec", fb)
    assert trace.batch.extend_lens.tolist() == ACCEPTED
    assert trace.batch.seq_lens_raw.tolist() == [12, 6, 14]
    assert trace.batch.positions.tolist() == [9, 10, 11, 5, 12, 13]
    assert findings(tmp_path / "rec") == []


def test_v2_step_without_its_window_is_not_guessed(tmp_path: Path) -> None:
    fb = sg.draft_extend_v2_batch(ROWS, PREFIX, WINDOW, ACCEPTED)
    fb.spec_info.num_tokens_per_req = -1  # the dataclass default: never set by the worker
    with pytest.raises(RuntimeError, match="num_tokens_per_req"):
        record(tmp_path / "rec", fb)
