"""This process's part of a GPU's memory, when check workers share the card.

Several check workers on one GPU each keep to a share of its memory (`take`): a caching allocator
keeps what it once allocated, so without shares the first workers to meet a large step hold the
card and every later worker's step is refused as not fitting (measured on an H200: 754 of 1,000
server-shaped steps refused with 8 workers). The room a step may use (`room`) is then this
process's share less what it holds, not the card's free memory, which counts the other workers'
caches and this process's own unused cache as taken. A step over the share that fits the card
(`fits_alone`), or that ran out of memory in a worker, is checked alone: its worker takes the
workers' whole part of the card while the others wait with their caches emptied (checks/workers.py).
"""

from __future__ import annotations

import torch

from attndbg.trace.errors import TraceError

# The part of each GPU the check's workers take together; the rest is for CUDA contexts and the
# kernel libraries' own workspaces, which live outside the caching allocator.
WORKERS_PART = 0.9

_share: float | None = None  # None: the process has the card to itself (one process, --jobs 1)


def take(share: float | None) -> None:
    """Keep this process to `share` of its GPU's memory (None: no limit of ours); the caching
    allocator frees its cache and retries before it would pass the share."""
    global _share
    _share = share
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # a smaller share must not start above its limit
        torch.cuda.set_per_process_memory_fraction(1.0 if share is None else share)


def share() -> float | None:
    return _share


def room(device: torch.device) -> int:
    """Bytes a new allocation on `device` (a CUDA device) may take now: the card's free memory and
    this process's unused cache, at most its share less what it holds."""
    free, total = torch.cuda.mem_get_info(device)
    held, cached = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    bytes_ = free + cached - held
    if _share is not None:
        bytes_ = min(bytes_, int(_share * total) - held)
    return max(0, bytes_)


def shared() -> bool:
    """Whether this process keeps to a share smaller than the workers' whole part (a step it
    cannot fit may be checked again alone)."""
    return _share is not None and _share < WORKERS_PART


def out_of_memory(error: BaseException) -> bool:
    """A CUDA allocation that failed: over this worker's share, or on a card the other workers'
    caches and CUDA contexts filled (their contexts and kernel modules live outside any share)."""
    return isinstance(error, torch.cuda.OutOfMemoryError)


def fits_alone(device: torch.device, need: int) -> bool:
    """Whether `need` bytes, over this worker's share, would fit in the workers' whole part of the
    card: then the step is worth checking alone rather than refusing."""
    if not shared() or device.type != "cuda":
        return False
    total = torch.cuda.mem_get_info(device)[1]
    return need <= int(WORKERS_PART * total) - torch.cuda.memory_allocated(device)


class OverShare(TraceError):
    """The step does not fit this worker's share of the GPU but fits the workers' whole part: its
    worker hands it back, to be checked alone (not a verdict on the step)."""
