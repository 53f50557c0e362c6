"""Engine attention backends by the name a trace's `source.backend` carries: the adapter that
reproduces each (adapters declare the names they answer to, `Backend.engine_names`), and what the
kernels of the ones no adapter reproduces need of padded rows. The one place the detectors learn
anything about an engine's backend from its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from attndbg.backends import registry
from attndbg.backends.base import Backend, FillRequirement
from attndbg.backends.host_hints import HostHint
from attndbg.trace.schema import ForwardMode, Trace


@dataclass(frozen=True)
class ByKvCache:
    """A requirement that depends on the KV cache's dtype: one library's FP8 decode kernel is not
    its bf16 one (FlashMLA's FP8 path faults where its bf16 path does not, vLLM #35969)."""

    fp8: FillRequirement
    other: FillRequirement

    def pick(self, kv_dtype: str | None) -> FillRequirement:
        return self.fp8 if kv_dtype is not None and kv_dtype.startswith("float8") else self.other


# Engine backends no adapter here reproduces, by the name the engine reports (SGLang's
# `--attention-backend` names, vLLM's AttentionBackendEnum names). Sources: ../shared/reference/
# engines.md A4.0 (get_cuda_graph_seq_len_fill_value per SGLang backend), B2 and "padding semantics"
# (vLLM pads requests with seq_len 0, query_len 0, block-table rows of NULL_BLOCK_ID or -1), and
# each entry's own. A name in neither this table nor an adapter's `engine_names` has no known
# requirement: its padded rows are not judged, and the verdict line names it (`unknown_name`).
UNADAPTED: dict[str, FillRequirement | ByKvCache] = {
    "ascend": FillRequirement(0, "SGLang's Ascend backend declares fill value 0"),
    # vLLM pads requests with seq_len 0 and query_len 0; its unified Triton attention launches
    # work per query block, so a padded request (no query tokens) is read by no program.
    "TRITON_ATTN": FillRequirement(0, "vLLM's unified Triton attention reads nothing of a request without query tokens (vLLM pads with seq_len 0)"),
    "FLASHMLA": ByKvCache(
        fp8=FillRequirement(
            1,
            "FlashMLA's FP8 decode kernel computes n_block = -1 from a padded seq_len 0 and reads block_table[-1], and a "
            "padded block id -1 gives a negative KV offset: an illegal memory access under graph replay (vLLM #35969, "
            "issue #33664; the builder clamps seq_lens >= 1 and block ids >= 0)",
            out_of_bounds=True,
        ),
        other=FillRequirement(0, "vLLM pads with seq_len 0, which FlashMLA's bf16 decode takes (vLLM #35969: the fault is its FP8 path's)"),
    ),
    # vLLM's Triton MLA decode (triton_decode_attention, SGLang's split-KV design): stage 1 writes
    # nothing for an empty row and stage 2 divides by the softmax sum.
    "TRITON_MLA": FillRequirement(
        1, "vLLM's Triton MLA decode divides by the softmax sum in stage 2: a padded seq_len 0 gives 0/0 = NaN rows (vLLM #57017, fix #57094)"
    ),
    # vLLM's FlashAttention MLA calls flash_attn_varlen_func like FLASH_ATTN (seqused_k = 0 is taken).
    "FLASH_ATTN_MLA": FillRequirement(0, "FlashAttention-3's MLA path takes seqused_k = 0 like its MHA path (vLLM pads with 0)"),
}


# Attention implementations that compute each row in one pass, whatever its length: PyTorch's own
# (transformers' `sdpa`, `eager`, `paged|sdpa`, `paged|eager`, `flex_attention`), by a word of the name.
UNSPLIT_ATTENTION = ("sdpa", "eager", "flex")


def merges_nothing(engine_backend: str) -> bool:
    """Whether `engine_backend` computes every row in one softmax (no partial states to merge)."""
    return any(word in engine_backend.lower() for word in UNSPLIT_ATTENTION)


def adapters() -> list[type[Backend]]:
    """Every registered adapter's class, built-in ones first. One that cannot be imported (a
    third-party adapter whose package is broken or missing) answers to no name: `attndbg
    backends` is where it is reported."""
    classes = []
    for name in registry.backend_names():
        try:
            classes.append(registry.adapter_class(name))
        except (ImportError, AttributeError):
            continue
    return classes


def adapter_for(engine_backend: str) -> type[Backend] | None:
    """The adapter that reproduces the engine backend named `engine_backend`, if any."""
    return next((cls for cls in adapters() if engine_backend in cls.engine_names), None)


def host_hints(engine_backend: str) -> tuple[HostHint, ...]:
    """The host-side hints the kernels of `engine_backend` read, as the adapter that reproduces it
    declares them (none where no adapter answers to the name)."""
    cls = adapter_for(engine_backend)
    return cls.host_hints.get(engine_backend, ()) if cls is not None else ()


def fill_requirement(engine_backend: str, kv_dtype: str | None = None) -> FillRequirement | None:
    """What the kernels of `engine_backend` need of padded requests (`kv_dtype`: the step's KV
    cache dtype, where the requirement depends on it): its adapter's declaration, else this
    module's table, else (an adapter that declares none, under its own name) the seq_len it pads
    with; None when nothing is known of it."""
    cls = adapter_for(engine_backend)
    if cls is not None:
        own = cls.engine_names[engine_backend] or cls.fill_requirement
        if own is not None:
            return own
    if engine_backend in UNADAPTED:
        need = UNADAPTED[engine_backend]
        return need.pick(kv_dtype) if isinstance(need, ByKvCache) else need
    try:
        cls = cls or registry.adapter_class(engine_backend)
    except (KeyError, ImportError, AttributeError):
        return None
    return FillRequirement(cls.cuda_graph_fill_value, f"the {engine_backend} adapter pads with seq_len {cls.cuda_graph_fill_value}")


def fill_requirements() -> dict[str, FillRequirement]:
    """Every engine backend name with a declared requirement: adapters' first, then the table."""
    known: dict[str, FillRequirement] = {}
    for cls in adapters():
        for name, own in cls.engine_names.items():
            need = own or cls.fill_requirement
            if need is not None:
                known.setdefault(name, need)
    for name, need in UNADAPTED.items():
        known.setdefault(name, need.other if isinstance(need, ByKvCache) else need)
    return known


def unknown_name(trace: Trace) -> str | None:
    """The engine backend that ran `trace`, when no adapter answers to its name and nothing here
    says what its kernels need of padded rows (None otherwise): a CUDA-graph step padded for it
    has its padded rows judged by no kernel's rules, which the verdict says."""
    backend = trace.source.backend
    return backend if fill_requirement(backend, trace.model.kv_dtype) is None else None


def kernels_elsewhere(trace: Trace) -> str | None:
    """"<engine backend>: why" when the adapter answering to the step's engine backend reads its
    plans but runs none of its kernels here (Backend.kernels_elsewhere); None otherwise."""
    backend = trace.source.backend
    cls = adapter_for(backend)
    why = cls.kernels_elsewhere.get(backend) if cls is not None else None
    return f"{backend}: {why}" if why else None


def merge_path(trace: Trace) -> str | None:
    """The merge of partial states in the path the recording backend runs for this step, if any:
    split-KV decode, else what the adapter reproducing that backend declares (Backend.merge_path)."""
    backend = trace.source.backend
    if merges_nothing(backend):
        return None  # one softmax over the whole row: nothing is merged
    if trace.batch.forward_mode is ForwardMode.DECODE:
        return "split-KV decode (partial states of KV splits merged by their LSEs)"
    adapter = adapter_for(backend)
    return adapter.merge_path(trace) if adapter is not None else None


def step_requirements(trace: Trace) -> dict[str, FillRequirement]:
    """What each attndbg adapter whose declared capabilities cover this step needs of padded
    requests (its declaration, else the seq_len it pads with): the backends this step could run on,
    by attndbg's names, for a finding's text. Engine names no adapter reproduces are not among them."""
    needs: dict[str, FillRequirement] = {}
    for cls in adapters():
        if cls.name == "reference":  # float64 from the batch: no kernel, no padded rows to take
            continue
        try:
            covered = registry.create(cls.name).capabilities().gap(trace) is None
        except (ImportError, TypeError, ValueError):  # a third-party adapter that cannot be built here
            continue
        if covered:
            needs[cls.name] = cls.fill_requirement or FillRequirement(cls.cuda_graph_fill_value, f"the {cls.name} adapter pads with seq_len {cls.cuda_graph_fill_value}")
    return needs
