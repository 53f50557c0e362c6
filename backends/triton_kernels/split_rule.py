"""How the split-KV decode kernel (decode.py) cuts a request's KV into splits, without Triton.

Kept apart from the kernel so that code reasoning about splits (the split-merge detector, the
mistake models) imports the kernel's own constant, not a copy, and does not import Triton.
"""

# Split lengths are rounded up to a multiple of this many tokens (SGLang's value).
MIN_BLOCK_KV = 32
