"""The judge is sound: a NaN or Inf in a KV slot a row may not see never reaches that row.

The float64 reference (and the low-precision one that sizes tolerances, and every mistake model,
all computed by backends/reference.py) gathers whole KV rows and masks scores: a value outside a
row's window, masked by the tree, past the row's causal length, in a padded column (gathered from
slot 0, the dummy slot padded tokens write) must weigh nothing, and 0 x NaN must not make it weigh
NaN. Each mode plants NaN, then Inf, in every slot the first row of its request may not see (and in
slot 0 and the pool's unused slots): the rows that see none of them must be bit for bit what they are on clean
data, and a row that sees one is not finite (it really reads it).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attndbg.backends import reference
from attndbg.backends.base import AttentionInputs
from attndbg.replay.data import build_inputs
from attndbg.trace.schema import DTYPES, Trace
from attndbg.trace.visibility import visibility
from tests.factories import make_trace

SMALL = ("heads=4:2", "head_dim=32")
MODES = {
    "decode-window": ("window-decode", *SMALL, "kv_lens=10,100,300", "window=31"),
    "decode-padded-graph": ("decode-gqa", *SMALL, "kv_lens=3,40,90", "capture_bs=8"),
    "extend-causal": ("extend-prefix", *SMALL, "prefix_lens=0,40,129", "extend_lens=37,5,20"),
    "extend-window": ("window", *SMALL, "prefix_lens=100,10", "extend_lens=30,50", "window=31"),
    "mixed": ("mixed", *SMALL),
    "verify-tree": ("verify", *SMALL, "prefix_lens=20,75,130"),
    "verify-tree-window": ("verify", *SMALL, "prefix_lens=20,75,130", "window=40"),
    "selective": ("selective", *SMALL),
    "mla-decode": ("mla-decode", "heads=4", "kv_lens=1,40,300"),
}


def _invisible_to_first_rows(trace: Trace) -> tuple[set[int], list[torch.Tensor]]:
    """Slots the first row of their request may not see (outside its window, masked by the tree,
    past its causal length), and each request's [rows, kv] visibility."""
    batch = trace.batch
    slots: set[int] = set()
    seen = []
    for b in range(batch.batch_size):
        visible = visibility(trace, b)
        seen.append(visible)
        row = batch.request_slots(b)
        slots |= set(row[~visible[0]].tolist()) if visible.shape[0] else set()
    return slots, seen


def _poisoned(inputs: AttentionInputs, slots: list[int], value: float) -> AttentionInputs:
    k = inputs.k_cache.clone()
    index = torch.tensor(slots, dtype=torch.int64)
    k[index] = value
    latent = inputs.v_cache.data_ptr() == inputs.k_cache.data_ptr()  # MLA: values are the keys' latent part
    v = k[..., : inputs.v_cache.shape[-1]] if latent else inputs.v_cache.clone()
    if not latent:
        v[index] = value
    return replace(inputs, k_cache=k, v_cache=v)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("mode", list(MODES))
def test_poison_a_row_may_not_see_never_reaches_it(mode: str, value: float) -> None:
    trace = make_trace(*MODES[mode])
    inputs = build_inputs(trace)
    invisible, seen = _invisible_to_first_rows(trace)
    used = {int(s) for b in range(trace.batch.batch_size) for s in trace.batch.request_slots(b).tolist()}
    unused = set(range(inputs.k_cache.shape[0])) - used
    assert 0 in unused  # slot 0: the dummy slot, and what the reference's padded columns gather
    poison = sorted(invisible | unused)
    bad = _poisoned(inputs, poison, value)
    batch = trace.batch
    clean_rows, dirty_rows, exercised = [], [], False
    longest = int(batch.kv_lens.max())
    for b in range(batch.batch_size):
        row_poisoned = torch.tensor([s in invisible for s in batch.request_slots(b).tolist()])
        for r in range(int(batch.extend_lens[b])):
            t = int(batch.qo_indptr[b]) + r
            if bool((seen[b][r] & row_poisoned).any()):
                dirty_rows.append(t)
            else:
                clean_rows.append(t)
                # Its own KV row holds poison it must not read, or its gather is padded with slot 0's.
                exercised |= bool(row_poisoned.any()) or int(batch.kv_lens[b]) < longest
    assert clean_rows and exercised, "the spec plants no poison a row gathers but may not see"
    for dtype in (torch.float64, DTYPES[trace.model.q_dtype]):
        want = reference.attention(trace, inputs, dtype)
        got = reference.attention(trace, bad, dtype)
        rows = torch.tensor(clean_rows)
        assert torch.equal(got.output[rows], want.output[rows]), f"{dtype}: poison reached rows that may not see it"
        assert torch.equal(got.lse[rows], want.lse[rows])
        for t in dirty_rows:
            assert not bool(torch.isfinite(got.output[t]).all()), f"{dtype}: row {t} sees poison yet is finite"


def test_a_mistake_models_partial_states_and_masks_read_only_their_own_columns() -> None:
    """The mistake models (attndbg/diagnose) are the same reference under another visibility: a
    split's partial state over columns [start, end) (split models) and a wrong mask's columns
    (mask models, `visible=`). Poison outside what the model lets a row read stays out of it."""
    trace = make_trace("window-decode", *SMALL, "kv_lens=10,100,300", "window=31")
    inputs = build_inputs(trace)
    batch = trace.batch
    # Split models: each request over the first half of its columns only.
    columns = torch.stack([torch.zeros_like(batch.kv_lens), batch.kv_lens // 2], 1)
    outside = [int(s) for b in range(batch.batch_size) for s in batch.request_slots(b)[int(columns[b, 1]) :].tolist()]
    want = reference.attention(trace, inputs, torch.float64, columns=columns)
    got = reference.attention(trace, _poisoned(inputs, outside + [0], float("nan")), torch.float64, columns=columns)
    assert torch.equal(got.output, want.output) and torch.equal(got.lse, want.lse)

    # Mask models: a kernel that ignored the window sees every column but the last of each row.
    def all_but_last(b: int, rows: slice) -> torch.Tensor:
        kv = int(batch.kv_lens[b])
        return (torch.arange(kv) < kv - 1)[None, :].expand(int(batch.extend_lens[b]), kv)[rows]

    last = [int(batch.request_slots(b)[-1]) for b in range(batch.batch_size)]
    want = reference.attention(trace, inputs, torch.float64, visible=all_but_last)
    got = reference.attention(trace, _poisoned(inputs, last + [0], float("inf")), torch.float64, visible=all_but_last)
    assert torch.equal(got.output, want.output) and torch.equal(got.lse, want.lse)
