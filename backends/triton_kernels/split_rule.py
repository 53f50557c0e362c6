"""How the split-KV decode kernel (decode.py) cuts a request's KV into splits, without Triton:
how long each split is, how many get no KV.

Kept apart from the kernel so that code reasoning about splits (the split-merge detector, the
mistake models) imports the kernel's own rule, not a copy, and does not import Triton.
"""

# Split lengths are rounded up to a multiple of this many tokens (SGLang's value).
MIN_BLOCK_KV = 32


def split_length(length: int, splits: int) -> int:
    """Tokens per split, the kernel's rule: cdiv(cdiv(length, splits), MIN_BLOCK_KV) * MIN_BLOCK_KV."""
    if splits <= 0:
        return 0
    chunk = -(-length // splits)
    return -(-chunk // MIN_BLOCK_KV) * MIN_BLOCK_KV


def empty_splits(length: int, splits: int) -> int:
    """Splits of a request that get no KV under that rule."""
    per_split = split_length(length, splits)
    return splits - (-(-length // per_split) if per_split else 0) if splits > 0 else 0
