"""What every adapter that drives a FlashInfer wrapper shares at run time (flashinfer, fa3, mla).

The float workspace and its size, the graph state built on it, the wait before every wrapper
`plan()`, the note shown while a first kernel compiles, and how a library's exception reads: a
failed JIT build is KernelUnsupported, anything else a KernelError. Its neighbours hold the other
FlashInfer concepts: flashinfer_modules.py names the JIT modules a call loads, flashinfer_jit.py
builds them. No adapter imports another for these (tests/test_import_graph.py).

flashinfer itself is never imported here: this module imports on a machine without it.
"""

from __future__ import annotations

import functools

import torch

from attndbg import numerics
from attndbg.backends import flashinfer_jit
from attndbg.backends import script_calls
from attndbg.backends.base import AttentionResult, GraphState, KernelError, KernelUnsupported
from attndbg.trace.schema import Model

# FlashInfer's recommended float workspace (split-KV partial outputs); zeroed before first use.
WORKSPACE_BYTES = 128 * 1024 * 1024
# All-ones bytes read as NaN in fp32, fp16 and bf16: what scratch holds before a replay.
NAN_BYTE = 0xFF

# Measured on the H200 (FlashInfer 0.7.2): 7-60 s per kernel, then served from ~/.cache/flashinfer.
FIRST_USE_NOTE = "FlashInfer compiles each kernel on first use (7-60 s each, cached on disk for later runs)"


@functools.cache
def compiling_note() -> str:
    """FIRST_USE_NOTE, and how to skip the compiling where FlashInfer's prebuilt package is not
    installed (asked once per process: the runner asks on every run)."""
    hint = flashinfer_jit.prebuilt_hint()
    return FIRST_USE_NOTE + (f"; {hint}" if hint else "")


# What the kernels these adapters call raise on bad arguments or a refused launch: FlashInfer's C++
# and TVM-FFI checks surface as RuntimeError/ValueError, its argument checks as
# ValueError/NotImplementedError; fa3's other implementations and FlashMLA raise the same.
KERNEL_ERRORS = (RuntimeError, ValueError, NotImplementedError)

# How a failed JIT build reads. FlashInfer compiles each kernel variant on first use; its run_ninja
# (flashinfer/jit/cpp_ext.py) raises RuntimeError("Ninja build failed. Ninja output:\n<log>") from
# the CalledProcessError. Versions that built through torch.utils.cpp_extension raised
# "Error building extension '<name>'".
JIT_FAILURE_PREFIXES = ("Ninja build failed", "Error building extension")
REASON_CHARS = 200


def _kernel_error(e: BaseException) -> KernelError:
    first = (str(e).strip().splitlines() or [""])[0]
    return KernelError(f"{type(e).__name__}: {first[:300]}")


def compile_failure(e: BaseException) -> str | None:
    """When `e` is a failed JIT build: its first line, and the compiler's first error line from the
    build log when there is one (the first line alone says only that ninja failed). Else None."""
    lines = str(e).strip().splitlines()
    if not isinstance(e, RuntimeError) or not lines or not lines[0].startswith(JIT_FAILURE_PREFIXES):
        return None
    error = next((line.strip() for line in lines[1:] if "error" in line.lower()), None)
    return lines[0][:REASON_CHARS] + (f"; {error[:REASON_CHARS]}" if error else "")


def library_error(e: BaseException, model: Model, library: str = "FlashInfer") -> KernelError:
    """A library exception as a KernelError; a kernel that does not compile for this model is
    KernelUnsupported (a configuration the library lacks, like a head_dim it has no template for)."""
    reason = compile_failure(e)
    if reason is None:
        return _kernel_error(e)
    dims = str(model.head_dim) if model.head_dim == model.v_head_dim else f"{model.head_dim}/{model.v_head_dim}"
    return KernelUnsupported(f"{library} does not compile head_dim {dims} ({reason})")


# What a repro script of a FlashInfer adapter (flashinfer, fa3, mla) asks for when `import
# flashinfer` fails, and how it prints the version (Backend.script_library).
SCRIPT_INSTALL = "pip install flashinfer-python"
SCRIPT_VERSION = "getattr(flashinfer, '__version__', 'unknown')"


def wait_for_pending_plans() -> None:
    """Call before every FlashInfer wrapper plan() (flashinfer's, fa3's and mla's).

    plan() writes its schedule into the wrapper's pinned host buffer, then queues a cudaMemcpyAsync
    from it to the GPU (scheduler.cuh) that torch's caching host allocator knows nothing of. Until
    that copy has run, the buffer must not be written again, but the next plan() writes it: the
    same wrapper re-planned (a graph state's load_plan), or a new wrapper handed the same pinned
    block once the last one was dropped (each eager run makes its own). fa3 and mla guarded their
    plans this way already; FlashInfer's own did not. Waiting for the stream lets every earlier
    copy land; check synchronises after each run anyway, so it costs little.

    Not shown to be the cause of the false cascade-row findings seen on server shapes: bench/flashinfer_cascade_rows.py --churn
    (the GPU busy while wrappers are made, planned and dropped) passed with and without this wait
    on the H100, as did every shape of that issue run alone.

    Nothing to wait for while `attndbg repro` records a script's calls (script_calls.py): no GPU is used.
    """
    if script_calls.scripting():
        return
    torch.cuda.current_stream().synchronize()


class FlashInferGraphState(GraphState):
    """What every graph state built on a FlashInfer wrapper owns (flashinfer, fa3, mla).

    The float workspace the wrapper schedules split-KV partials in: the graph owns it, so nothing an
    eager run does between replays can move or reuse it. Static outputs, NaN until a kernel writes
    them: the output, the kernel's LSE (base 2) and ours (natural log)."""

    def __init__(self, *, max_tokens: int, num_heads: int, v_head_dim: int, q_dtype: torch.dtype):
        cuda = "cuda"
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cuda)
        self.out = torch.full((max_tokens, num_heads, v_head_dim), float("nan"), dtype=q_dtype, device=cuda)
        self.lse_base2 = torch.full((max_tokens, num_heads), float("nan"), dtype=torch.float32, device=cuda)
        self.lse = torch.full((max_tokens, num_heads), float("nan"), dtype=torch.float32, device=cuda)

    def result(self, tokens: int) -> AttentionResult:
        """After the wrapper wrote `out`/`lse_base2[:tokens]`: the result, LSE in natural log."""
        torch.mul(self.lse_base2[:tokens], numerics.LN2, out=self.lse[:tokens])
        return AttentionResult(output=self.out[:tokens], lse=self.lse[:tokens])

    def poison_scratch(self) -> None:
        # The float workspace holds only split-KV partials (tmp_v/tmp_s, partial_o/partial_lse),
        # written before they are read; the plan lives in each wrapper's int workspace, left alone.
        self.workspace.fill_(NAN_BYTE)
