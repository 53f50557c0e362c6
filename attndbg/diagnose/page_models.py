"""Mistakes of a paged KV length: the kernel's KV length is (pages - 1) * page_size + last_page_len
(FlashInfer's paged_kv_t::get_length, the layout vLLM's and SGLang's FlashInfer metadata feed), so
a wrong last_page_len moves it by up to a page.

    last page dropped   last_page_len 0: `seq_len % page_size` without the full page's case (a full
                        last page gives 0, not page_size), or a zeroed last_page_len buffer: the
                        kernel reads every page but the last

A last_page_len too large makes the kernel read slots past the request's row (unwritten, or another
request's when page_size is 1, vLLM #31282): their contents are not in the step's recorded KV rows,
so that direction is judged on the plan (invariants' kv-last-page-len), not reproduced here.
"""

from __future__ import annotations

from collections.abc import Iterator

from attndbg.diagnose.base import Candidate, MistakeModel, PartialStates, with_rows
from attndbg.trace.schema import ForwardMode, Trace


def last_page_size(states: PartialStates) -> int | None:
    """Tokens per page where the step's kernel takes a last_page_len: the recorded plan's page size
    when its layout reads one (FlashInfer's kv_last_page_len), the model's when no plan says how the
    kernel gets its lengths; None for a plan whose kernel takes none (slot lists, cache_seqlens)."""
    reading = states.plan
    if states.trace.plan is None:
        return states.trace.model.page_size
    layout = reading.layout
    if layout is None or layout.length is None or "last_page_len" not in layout.length:
        return None
    return int(reading.scalars["page_size"].value)


class LastPageDropped(MistakeModel):
    """A paged step whose kernel got last_page_len 0 for a request and read every page of its row
    but the last: the request's queries at the end of the shorter row (FlashInfer aligns a request's
    queries with the end of its KV), each seeing up to a page fewer keys. Page size 1 is a key off
    by one (key-off-by-one's, as is a last page of one key); requests with fewer remaining keys than queries are left out (their
    queries would see nothing: a kernel writes 0 there, the reference no row)."""

    name = "last-page-dropped"
    cause = (
        "The kernel's KV length came from a last_page_len of 0, (pages - 1) * page_size + 0: `seq_len % page_size` "
        "without its full-page case (a full last page must give page_size, as FlashInfer's layout requires) or a "
        "zeroed last_page_len buffer, so the request's last page of keys was never read."
    )

    def applies(self, trace: Trace) -> bool:
        batch = trace.batch
        return not trace.is_tree_verify and not batch.selective and batch.forward_mode is not ForwardMode.IDLE

    def candidates(self, states: PartialStates, requests: list[int]) -> Iterator[Candidate]:
        page = last_page_size(states)
        if page is None or page <= 1:
            return
        trace = states.trace
        batch = trace.batch
        rows = [batch.request_slots(b) for b in range(batch.batch_size)]
        dropped: dict[int, int] = {}
        for b in requests:
            kv, queries = int(batch.kv_lens[b]), int(batch.extend_lens[b])
            kept = (kv - 1) // page * page  # every page but the last, whole or partial
            if queries == 0 or kept < queries or kv - kept <= 1:
                continue  # one key dropped is key-off-by-one's claim
            rows[b], dropped[b] = rows[b][:kept], kv - kept
        if not dropped:
            return
        output = states.under(("last-page-dropped", page), with_rows(trace, rows, [r.numel() for r in rows]))
        for b, keys in dropped.items():
            kv = int(batch.kv_lens[b])
            yield Candidate(
                request=b,
                output=output[states.rows(b)].double(),
                summary="attention over all pages but the last (the kernel given last_page_len 0)",
                detail=f"request {b}, kv {kv} read as {kv - keys} (page {page}, its last {keys} keys dropped)",
                params={"page_size": page, "kv": kv, "read": kv - keys},
            )
