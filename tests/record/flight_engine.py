"""The live test engine with a fault put in on purpose, for the flight recorder's tests.

transformers' continuous batching (attndbg/examples/transformers_generate.py) with one of two faults at the k-th
step that serves real requests (transformers' warm-up steps, `__warmup_*` requests, do not count;
step 0 is the prefill), put in just before `compute_batch` runs it, so that the hooks see it as
the engine's own:
- `--corrupt-step K`: request 0's first KV read index points past the cache's token view, as a
  wrong index from an engine would: the gather faults (an IndexError on the CPU, a device-side
  assert or an illegal memory access on a GPU, where under CUDA graphs the replay reads it);
- `--nan-step K`: the attention-mask entry of request 0's query row for its first key becomes NaN,
  so at step K the attention output of that request alone carries NaN (in every layer: the mask is
  one bias all layers read), under CUDA graphs too. Not a cached key or value: transformers' sdpa
  path attends each query over every key of the step, masked by an additive bias
  (`build_attention_mask`: 0 or finfo.min), so one NaN key makes every row NaN on a GPU (NaN +
  finfo.min and 0 x NaN stay NaN); a mask row is read by its own query alone.

Run under `attndbg record` (the startup hook installs the recorder when the model runner is
imported, before the fault is wrapped around it):
  attndbg record --ring 8 -o rec -- python tests/record/flight_engine.py --corrupt-step 4
Prints the generated tokens as JSON on the last line, or the error's first line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attndbg.examples import transformers_generate as live  # noqa: E402

PAST_THE_CACHE = 1 << 20  # rows past the token view's end: never a row of the test model's cache


def _real_step(runner: Any) -> bool:
    """The batch serves real requests (transformers' warm-up uses `__warmup_*` ones)."""
    io = runner.inputs_and_outputs
    pairs = getattr(io, "io_pairs", None)
    host = pairs[io.current_pair].host_io if pairs is not None else io
    return any(not str(r.state.request_id).startswith("__warmup_") for r in host.requests_in_batch)


def inject(*, corrupt_step: int | None = None, nan_step: int | None = None) -> Any:
    """Wrap ModelRunner.compute_batch (over attndbg's hook, if installed) to put the fault in at
    the k-th real step; returns a function that removes the wrapper."""
    from transformers.generation.continuous_batching import model_runner

    inner = model_runner.ModelRunner.compute_batch
    seen = [0]

    def compute_batch(self: Any, model: Any, batch_data: dict[str, Any]) -> Any:
        if _real_step(self):
            step = seen[0]
            seen[0] += 1
            read = batch_data["read_index"][0] if batch_data.get("read_index") else None
            if step == corrupt_step and read is not None and read.numel():
                with _ordered(read.device):
                    read[0] = _token_view(batch_data["cache"], 0).shape[0] + PAST_THE_CACHE
            if step == nan_step:
                entry = _first_mask_entry(batch_data)
                with _ordered(entry.device):
                    entry.fill_(float("nan"))
        return inner(self, model, batch_data)

    model_runner.ModelRunner.compute_batch = compute_batch

    def remove() -> None:
        model_runner.ModelRunner.compute_batch = inner

    return remove


@contextlib.contextmanager
def _ordered(device: torch.device) -> Iterator[None]:
    """On a GPU, the fault's write lands after the engine's copy of the step's inputs (which may
    run on a stream of its own) and before the step's kernels (on the compute stream): a device
    sync on each side, at the planted step only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_mask_entry(batch_data: dict[str, Any]) -> torch.Tensor:
    """The mask entry (a view) of the batch's first query row, request 0's, for its first key."""
    mask = batch_data.get("attention_mask")
    if isinstance(mask, dict):  # one mask per layer type (sliding-window models): the full one
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if mask is None or not mask.is_floating_point():
        raise SystemExit(f"--nan-step needs transformers' additive attention mask in batch_data, got {type(mask).__name__}")
    # Request 0's queries and keys start the batch (cu_seq_lens_q[0] == cu_seq_lens_k[0] == 0).
    return mask[..., 0, 0]


def _token_view(cache: Any, layer: int) -> torch.Tensor:
    return cache.layer_to_allocator[layer]._kv_token_views[layer][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corrupt-step", type=int)
    parser.add_argument("--nan-step", type=int)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--cuda-graph", action="store_true")
    args = parser.parse_args()
    import transformers.generation.continuous_batching.model_runner  # noqa: F401 - attndbg's hook installs on this import

    inject(corrupt_step=args.corrupt_step, nan_step=args.nan_step)
    model = live.tiny_llama(dtype=getattr(torch, args.dtype), device=args.device)
    print(json.dumps(live.generate(model, max_new_tokens=args.new_tokens, cuda_graph=args.cuda_graph)), flush=True)
    if args.device != "cpu":
        torch.cuda.synchronize()  # a fault not surfaced yet surfaces here (and exits non-zero)


if __name__ == "__main__":
    main()
