"""What a library defect is reported with: the library and its installed release, the step's shape
as the kernels took it, and one `attndbg repro` command that reproduces it standalone.

DESIGN.md "Findings": a finding is a claim about someone's code, and a library defect is declared
on a standalone call of the library. The command writes a script that makes only the library's
calls (the adapter's own, captured: attndbg/repro) on the step's data, checks them against an
inline float64 reference and exits 1 when it reproduces. The kernels detector's findings and the
check engine's crash findings (checks/crashes.py) both carry this, so a crash and a wrong answer
are named the same way.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from attndbg.backends.base import Backend, KernelError, LibraryRelease
from attndbg.backends.capabilities import dtype_words
from attndbg.backends.options import BackendOptions
from attndbg.replay.variants import Graph, Recorded, Variant
from attndbg.trace.schema import AttentionKind, Plan, Trace

# Plan scalars that only repeat the model (the shape names those already).
_MODEL_SCALARS = frozenset({"page_size", "window_left", "sliding_window", "logits_soft_cap"})


@dataclass(frozen=True)
class LibraryDefect:
    backend: str  # the adapter ("flashinfer")
    library: LibraryRelease  # what it called ("FlashInfer 0.7.2.post1")
    shape: str  # the step as the kernels took it
    repro: str  # the command that reproduces it standalone

    def data(self) -> dict[str, Any]:
        """For a finding's machine-readable data (--json)."""
        return {
            "backend": self.backend,
            "library": self.library.name,
            "version": self.library.version,
            "shape": self.shape,
            "repro": self.repro,
        }


def library_defect(trace: Trace, path: str, backend: Backend, *, variant: Variant, plan: Plan | None, options: BackendOptions) -> LibraryDefect:
    """The defect report of `backend`'s run (`variant`, with `plan` when known) of the step at `path`.
    A merge step (trace.merge) plans nothing and is scripted by no repro: its shape is the merge's,
    and the command that shows it again is its replay on that backend."""
    if trace.merge is not None:
        command = shlex.join(["attndbg", "replay", path, "--backend", backend.name, *(w for spec in options.specs(backend.name) for w in ("--backend-option", spec))])
        return LibraryDefect(backend=backend.name, library=backend.library(), shape=trace.merge.words(), repro=command)
    if plan is None:
        plan = _derived_plan(backend, trace)
    return LibraryDefect(
        backend=backend.name,
        library=backend.library(),
        shape=shape_words(trace, plan),
        repro=repro_command(trace, path, backend.name, variant=variant, options=options),
    )


def shape_words(trace: Trace, plan: Plan | None = None) -> str:
    """'DECODE bs 2, 4:4 heads, head_dim 80, page 1, bf16, KV 37-91; path decode, use_tensor_cores true'."""
    m, b = trace.model, trace.batch
    parts = [f"{b.forward_mode.value} bs {b.batch_size}"]
    if m.attention is AttentionKind.MLA:
        parts.append(f"MLA {m.num_qo_heads} heads, kv_lora_rank {m.kv_lora_rank}, rope {m.qk_rope_head_dim}")
    else:
        parts.append(f"{m.num_qo_heads}:{m.num_kv_heads} heads")
        parts.append(f"head_dim {m.head_dim}" + (f"/{m.v_head_dim}" if m.v_head_dim != m.head_dim else ""))
    parts.append(f"page {m.page_size}")
    parts.append(dtype_words({m.q_dtype}) + (f", KV {dtype_words({m.kv_dtype})}" if m.kv_dtype != m.q_dtype else ""))
    kv = b.kv_lens.tolist()
    parts.append(f"KV {min(kv)}-{max(kv)}" if kv and min(kv) != max(kv) else f"KV {kv[0] if kv else 0}")
    if int(b.num_tokens) != b.batch_size:
        parts.append(f"{int(b.num_tokens)} query tokens")
    if trace.is_tree_verify:
        parts.append(f"tree topk {trace.spec.topk}, {trace.spec.draft_token_num} draft tokens")
    if m.sliding_window >= 0:
        parts.append(f"window {m.sliding_window}")
    if m.logit_cap > 0:
        parts.append(f"soft-cap {m.logit_cap:g}")
    words = ", ".join(parts)
    path = [f"{k} {_word(v)}" for k, v in sorted((plan.scalars if plan else {}).items()) if k not in _MODEL_SCALARS and isinstance(v, (bool, str))]
    return f"{words}; {', '.join(path)}" if path else words


def repro_command(trace: Trace, path: str, backend: str, *, variant: Variant, options: BackendOptions) -> str:
    """`attndbg repro ... && python ...`: the script of `backend`'s `variant` run of the step. A
    graph run is scripted as the engine's graph replay where the step was recorded as one (repro
    replays the recorded padding); otherwise eagerly."""
    graph = isinstance(variant, Graph) and trace.graph is not None and trace.graph.is_graph_replay
    plan = "recorded" if isinstance(variant, Recorded) else "derived"
    suffix = "_graph" if graph else ""
    script = f"repro_{backend}_step{trace.source.step}{suffix}.py"
    words = ["attndbg", "repro", path, "--backend", backend, "--plan", plan, "--graph" if graph else "--eager"]
    for spec in options.specs(backend):
        words += ["--backend-option", spec]
    words += ["-o", script]
    return f"{shlex.join(words)} && python {shlex.quote(script)}"


def _derived_plan(backend: Backend, trace: Trace) -> Plan | None:
    """The plan the adapter derives for the step (it names the kernel path), when it can derive one."""
    try:
        return backend.derive_plan(trace)
    except (ValueError, KernelError):  # a step it cannot plan: the shape is named without the path
        return None


def _word(value: bool | str) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else value
