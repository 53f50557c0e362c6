"""`--max-memory`: a step whose data would need more than the bound is refused before allocating,
with the number and the field that makes it big; the same step under
a larger bound, and the small steps beside it, still replay and check."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attndbg import machine
from attndbg.replay.data import check_fits, footprint
from attndbg.trace import io
from attndbg.trace.errors import TraceError
from tests.cli.helpers import invoke, one_line_error
from tests.factories import make_trace

SMALL = ("decode-mha", "heads=2:1", "head_dim=32", "kv_lens=3,9")
POOL_SLOTS = 2**16  # 2 KV heads of 32 x fp16, K and V: 8 MiB of pool, a few KiB of everything else
CPU = torch.device("cpu")


def _big_pool():
    trace = make_trace(*SMALL, plan=True)
    return trace, replace(trace, batch=replace(trace.batch, kv_cache_size=POOL_SLOTS))


def test_the_footprint_counts_the_pool_the_reference_and_the_graph_copy() -> None:
    small, big = _big_pool()
    need = footprint(big, CPU)
    assert need.pool == POOL_SLOTS * 1 * (32 + 32) * 2 == 8 << 20
    assert need.reference > 0 and need.draws > 0 and need.graph == 0
    assert footprint(big, CPU, cuda_graph=True).graph == need.pool  # the harness clones the cache
    assert footprint(small, CPU).reference == need.reference  # the reference reads the batch, not the pool
    check_fits(big, CPU, max_bytes=need.total)  # exactly enough is enough
    with pytest.raises(TraceError) as refused:
        check_fits(big, CPU, max_bytes=need.total - 1)
    assert refused.value.field == "batch.kv_cache_size" and f"= {POOL_SLOTS} slots" in refused.value.message
    with pytest.raises(TraceError, match="CUDA-graph copy of the pool 8.0 MiB"):
        check_fits(big, CPU, max_bytes=need.total, cuda_graph=True)


def test_a_long_row_is_named_by_its_kv_lens() -> None:
    trace = make_trace("decode-mha", "heads=8:8", "head_dim=64", "kv_lens=3,20000")
    with pytest.raises(TraceError) as refused:
        check_fits(trace, CPU, max_bytes=1 << 20)
    assert refused.value.field == "batch.kv_lens" and "longest KV row 20000" in refused.value.message


def test_replay_and_check_of_one_file_over_max_memory_exit_2_with_the_numbers(tmp_path: Path) -> None:
    _, big = _big_pool()
    path = str(io.save(big, tmp_path / "big.pt"))
    assert invoke("replay", path, "--backend", "reference").exit_code == 0  # fits what the machine has
    assert invoke("replay", path, "--backend", "reference", "--max-memory", "64M").exit_code == 0
    device = "cuda" if machine.cuda_available() else "cpu"  # where the step's data would live
    needles = ("big.pt: batch.kv_cache_size: = 65536 slots", f"needs 8.0 MiB on {device} (KV pool 8.0 MiB", "more than --max-memory 1.0 MiB; not replayed")
    one_line_error(invoke("replay", path, "--backend", "reference", "--max-memory", "1M"), *needles)
    one_line_error(invoke("check", path, "--only", "split-merge", "--backend", "triton", "--max-memory", "1M"), *needles)
    one_line_error(invoke("replay", path, "--max-memory", "lots"), "--max-memory: expected bytes like 500M or 2G, got 'lots'")
    one_line_error(invoke("check", path, "--max-memory", "0"), "--max-memory: must be positive")


def test_in_a_recording_only_the_step_over_max_memory_is_not_checked(tmp_path: Path) -> None:
    """Through worker processes (--jobs 2): the bound travels in CheckOptions."""
    small, big = _big_pool()
    rec = tmp_path / "rec"
    for step, trace in enumerate([small, big, small]):
        io.append_to_recording(rec, replace(trace, source=replace(trace.source, step=step)))
    result = invoke("check", str(rec), "--only", "split-merge", "--backend", "triton", "--jobs", "2", "--max-memory", "1M", columns=400)
    assert result.exit_code == 3, result.output  # nothing found, one step not checked
    assert "step_000001.pt: batch.kv_cache_size: = 65536 slots" in result.output and "more than --max-memory 1.0 MiB" in result.output
    assert "checked 2 of 3 steps" in result.output
    assert invoke("check", str(rec), "--only", "split-merge", "--backend", "triton", "--max-memory", "16M").exit_code == 0


def _card(monkeypatch: pytest.MonkeyPatch, *, free: int, total: int, held: int, cached: int, share: float | None) -> None:
    """A CUDA card as the allocator and the driver would report it, on a machine without one."""
    from attndbg.replay import memory_share

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: cached)
    monkeypatch.setattr(memory_share, "_share", share)


def test_a_workers_room_is_its_share_less_what_it_holds_and_counts_its_own_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The card's free memory counts the other workers' caches and this one's unused cache as taken:
    a worker's room is its share less what it holds, and alone on the card, free plus its cache."""
    from attndbg.replay import memory_share

    cuda, gib = torch.device("cuda"), 1 << 30
    _card(monkeypatch, free=1 * gib, total=80 * gib, held=2 * gib, cached=6 * gib, share=0.9 / 8)
    assert memory_share.room(cuda) == min(1 * gib + 4 * gib, int(0.9 / 8 * 80 * gib) - 2 * gib)
    _card(monkeypatch, free=1 * gib, total=80 * gib, held=2 * gib, cached=6 * gib, share=None)
    assert memory_share.room(cuda) == 5 * gib  # free, and the 4 GiB cached but not held


def test_a_step_over_a_workers_share_but_within_the_card_is_handed_back_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from attndbg.replay import memory_share

    cuda = torch.device("cuda")
    _, big = _big_pool()
    need = footprint(big, cuda).total
    # Over a share of 0.6 of the need, within the workers' part (10.8 needs): OverShare, to be checked alone.
    _card(monkeypatch, free=100 * need, total=12 * need, held=0, cached=0, share=0.05)
    with pytest.raises(memory_share.OverShare) as handed_back:
        check_fits(big, cuda)
    assert "left in this worker's share of cuda" in handed_back.value.message
    # The same step over the workers' whole part (0.9 of the card): refused as not fitting.
    _card(monkeypatch, free=100 * need, total=need, held=0, cached=0, share=0.1)
    with pytest.raises(TraceError) as refused:
        check_fits(big, cuda)
    assert type(refused.value) is TraceError
    # Alone (no share): the card's room decides.
    _card(monkeypatch, free=need, total=2 * need, held=0, cached=0, share=None)
    check_fits(big, cuda)
