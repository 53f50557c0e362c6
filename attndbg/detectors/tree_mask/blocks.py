"""A verify request's tree mask, explained: a request's true FULL block (prefix visible, drafts see
their ancestors), a KV column named for a reader, and the sentences that explain a wrong mask
element and a hidden prefix. Shared by the tree-mask detector's checks of the spec's mask
(spec.py) and of the mask the recorded plan's kernel reads (recorded.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attndbg.trace import tree
from attndbg.trace.schema import Trace


def tree_block(trace: Trace, b: int) -> Tensor:
    """[n, prefix + n] the FULL block without a window: prefix True, draft part = ancestors."""
    prefix = int(trace.batch.prefix_lens[b])
    n = trace.spec.draft_token_num
    block = torch.ones(n, prefix + n, dtype=torch.bool)
    block[:, prefix:] = tree.ancestor_matrix(trace.spec.parents[b])
    return block


def describe_column(trace: Trace, b: int, column: int) -> str:
    prefix = int(trace.batch.prefix_lens[b])
    return f"KV column {column}" + (f" = draft token {column - prefix}" if column >= prefix else " (prefix)")


def prefix_hidden_cause(how: str) -> str:
    """The mask-prefix-hidden cause, for the spec's mask and for the mask the plan's kernel reads:
    `how` says how this mask hides prefix columns; the rule it breaks is the same (SGLang's FULL
    layout fills each block's prefix part True: engines.md A3)."""
    return f"{how}; every draft token must see the whole prefix"


def mismatch_cause(trace: Trace, b: int, row: int, column: int, found: bool, found_draft: Tensor | None) -> str:
    """One sentence for a wrong (row, column) of request b's tree mask."""
    prefix = int(trace.batch.prefix_lens[b])
    parents = trace.spec.parents[b]
    anc = tree.ancestor_matrix(parents)
    if found_draft is not None and not torch.equal(found_draft, anc):
        if torch.equal(found_draft, anc.T):
            return "the mask is transposed: rows and columns swapped (a key's descendants instead of a query's ancestors)"
        causal = torch.tril(torch.ones_like(anc))
        if torch.equal(found_draft, causal):
            return "the mask is causal by token index, not the draft tree: every draft token sees all earlier drafts"
        for c in range(trace.batch.batch_size):
            if c != b and torch.equal(found_draft, tree.ancestor_matrix(trace.spec.parents[c])) and not torch.equal(anc, found_draft):
                return f"request {b}'s block holds request {c}'s tree: the per-request blocks are written at the wrong offsets or in the wrong order"
    if column < prefix:
        if found:
            return "a prefix column older than the sliding window is visible: the mask ignores the window"
        return "a prefix column is hidden: the FULL layout's prefix part must be all True"
    j = column - prefix
    if found:
        if j > 0 and int(parents[j]) == int(parents[row]) and j != row:
            return f"draft token {row} sees its sibling {j}: the mask marks a sibling as an ancestor (e.g. a next-sibling link followed as a parent link)"
        return f"draft token {row} sees draft token {j}, which is not its ancestor: the mask was built from the wrong parent list"
    if j == row:
        return f"draft token {row} cannot see itself: the mask's diagonal is missing"
    return f"draft token {row} cannot see its ancestor {j}: its ancestor chain is cut (a wrong parent index)"
