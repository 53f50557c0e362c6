"""Write a standalone reproduction script of one step: `attndbg repro`.

The script needs torch and the kernel library only (never attndbg): it rebuilds the step's tensors
(embedded when small, else in a `.pt` of plain tensors beside it), makes the library calls the
adapter makes (captured from the adapter's own run, capture.py), compares the output with a float64
reference computed inline from the KV slots each query row sees (attndbg's visibility, written
out as data), prints the failing rows and the versions, and exits 1 when it reproduces (a row
beyond tolerance, or NaN/Inf where the reference is finite), 0 when not.

For the triton backend the "library" is our Triton kernels (SGLang's decode/extend design as we
ship them): their source is copied into the script, so it runs with torch and triton alone.
"""

from __future__ import annotations

import base64
import inspect
import io as bytes_io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attndbg import __version__
from attndbg.backends import registry
from attndbg.backends.base import AttentionInputs
from attndbg.replay.data import build_inputs
from attndbg.replay.plan_guard import real_requests_only
from attndbg.repro.capture import CUDA_TAG, Call, capture
from attndbg.trace.schema import Plan, Trace
from attndbg.trace.visibility import visibility

# Tensors up to this many bytes (saved) are embedded in the script as base64; larger go beside it.
EMBED_BYTES = 256 * 1024
INPUTS = ("q", "k_new", "v_new", "k_cache", "v_cache")


@dataclass(frozen=True)
class Repro:
    text: str  # the script
    tensors: dict[str, torch.Tensor]  # what it loads
    embedded: bool  # the tensors are in the script (else in `<script>.pt` beside it)
    plan_source: str  # "recorded" or "derived"


def _kernel_source() -> str:
    """Our Triton kernels as one module's source: split_rule, common, decode, extend, with their
    imports of each other and of attndbg removed (a stand-in for attndbg.machine's mode)."""
    from attndbg.backends.triton_kernels import common, decode, extend, split_rule

    shim = (
        "class TritonMode(enum.Enum):\n"
        "    COMPILED = 'compiled'\n"
        "    INTERPRETER = 'interpreter'\n\n\n"
        "def select_triton_mode():\n"
        "    return TritonMode.INTERPRETER if os.environ.get('TRITON_INTERPRET') == '1' else TritonMode.COMPILED\n"
    )
    parts = [shim]
    for module in (split_rule, common, decode, extend):
        source = inspect.getsource(module)
        source = re.sub(r"^from (__future__|\.|attndbg)[^\n]*(\([^)]*\))?\n", "", source, flags=re.M)
        parts.append(f"# ---- attndbg backends/triton_kernels/{Path(module.__file__).name} ----\n{source}")
    return "\n\n".join(parts)


class _Writer:
    """Names every tensor the calls use and renders arguments as Python expressions."""

    def __init__(self, inputs: AttentionInputs, plan: Plan, on_device: bool):
        self.inputs = {name: getattr(inputs, name) for name in INPUTS}
        self.plan_names = {id(t): name for name, t in plan.tensors.items()}
        self.on_device = on_device  # every tensor to the device (Triton: its kernels take no host tensors)
        self.saved: dict[str, torch.Tensor] = {}
        self.lines: list[str] = []
        self.names: dict[int, str] = {}  # id(tensor) -> variable

    def tensor(self, t: torch.Tensor, hint: str) -> str:
        if id(t) in self.names:
            return self.names[id(t)]
        for name, base in self.inputs.items():
            if t is base:
                return f'X["{name}"]'
        for name, base in self.inputs.items():
            if t.numel() and base.numel() and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                return f'X["{name}"].as_strided({tuple(t.shape)}, {tuple(t.stride())}, {t.storage_offset()})'
        # Where the adapter's caller keeps it: the plan's own tensors on the host (the runner hands
        # plans over as derived or recorded), what the adapter moved or made on the GPU there.
        device = "DEVICE" if self.on_device or getattr(t, CUDA_TAG, False) or id(t) not in self.plan_names else '"cpu"'
        if id(t) in self.plan_names:
            hint = self.plan_names[id(t)]
        elif t.dtype == torch.uint8 and getattr(t, CUDA_TAG, False):
            hint = "workspace"
        var = re.sub(r"\W", "_", hint)
        while var in self.saved or var in self.names.values():
            var += "_"
        flat = t.flatten()
        if t.numel() > 64 and (torch.isnan(flat).all() or bool((flat == flat[0]).all())):
            value = "float('nan')" if torch.isnan(flat[0]) else repr(flat[0].item())
            self.lines.append(f"{var} = torch.full({tuple(t.shape)}, {value}, dtype={t.dtype}, device={device})")
        else:
            self.saved[var] = t.detach().clone()
            self.lines.append(f'{var} = T["{var}"].to({device})')
        self.names[id(t)] = var
        return var

    def value(self, v: Any, hint: str) -> str:
        if isinstance(v, torch.Tensor):
            return self.tensor(v, hint)
        if isinstance(v, (tuple, list)):
            inner = ", ".join(self.value(x, f"{hint}_{i}") for i, x in enumerate(v))
            return f"({inner},)" if isinstance(v, tuple) else f"[{inner}]"
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, float) and not math.isfinite(v):
            return f"float('{v}')"
        if hasattr(v, "record"):  # a wrapper object made by an earlier call
            return v.name
        return repr(v)

    def call(self, index: int, call: Call) -> None:
        short = call.target.rsplit(".", 1)[-1]
        args = [self.value(a, f"{short}_arg{i}") for i, a in enumerate(call.args)]
        args += [f"{k}={self.value(v, k)}" for k, v in call.kwargs.items()]
        text = f"{call.target}({', '.join(args)})"
        result = call.result
        if hasattr(result, "record"):
            self.lines.append(f"{result.name} = {text}")
        elif isinstance(result, tuple):
            self.lines.append(f"r{index} = {text}")
            for j, t in enumerate(result):
                self.names[id(t)] = f"r{index}[{j}]"
        else:
            self.lines.append(text)


def _seen(trace: Trace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row, the KV slots it sees ([T, most] int64, -1 past the end), its request and its row within it."""
    batch = trace.batch
    rows: list[torch.Tensor] = []
    request, within = [], []
    for b in range(batch.batch_size):
        visible = visibility(trace, b)
        slots = batch.request_slots(b)
        for r in range(visible.shape[0]):
            rows.append(slots[visible[r]])
            request.append(b)
            within.append(r)
    most = max([r.numel() for r in rows], default=0)
    seen = torch.full((len(rows), most), -1, dtype=torch.int64)
    for t, r in enumerate(rows):
        seen[t, : r.numel()] = r
    return seen, torch.tensor(request, dtype=torch.int64), torch.tensor(within, dtype=torch.int64)


def build(trace: Trace, backend_name: str, *, plan_source: str | None = None, layer: int | None = None, source_name: str = "") -> Repro:
    """The script for `trace`'s step on `backend_name`: the recorded plan when the trace holds one
    of this backend (`plan_source` None or "recorded"), else the one the adapter derives."""
    backend = registry.create(backend_name)
    reason = backend.unsupported_reason(trace)
    if reason:
        raise ValueError(f"{backend_name} cannot run this step: {reason}")
    recorded = trace.plan is not None and trace.plan.backend == backend_name
    if plan_source == "recorded" and not recorded:
        raise ValueError(f"the trace holds no plan recorded by {backend_name}")
    use_recorded = recorded and plan_source != "derived"
    plan = real_requests_only(trace, trace.plan) if use_recorded else backend.derive_plan(trace)
    inputs = build_inputs(trace, layer=layer, device="cpu")
    calls = capture(backend, trace, inputs, plan)
    result_holder: dict[str, Any] = {}
    writer = _Writer(inputs, plan, on_device=backend_name == "triton")
    for i, call in enumerate(calls):
        writer.call(i, call)
        if call.target.endswith((".run", "merge_state")):
            result_holder["last"] = call.result
    if backend_name == "triton":
        # The kernels write the output in place: the tensor handed as `o`/`o_extend`.
        output = next(writer.names[id(c.kwargs[k])] for c in calls for k in ("o", "o_extend") if k in c.kwargs)
    else:
        output = writer.names[id(result_holder["last"][0])]
    seen, request, within = _seen(trace)
    tensors = {**{name: getattr(inputs, name).contiguous() for name in INPUTS}, **writer.saved, "SEEN": seen, "REQUEST": request, "ROW": within}
    buffer = bytes_io.BytesIO()
    torch.save(tensors, buffer)
    embedded = buffer.tell() <= EMBED_BYTES
    text = _render(trace, backend_name, writer.lines, output, "recorded" if use_recorded else "derived", source_name, base64.b64encode(buffer.getvalue()).decode() if embedded else None)
    return Repro(text=text, tensors=tensors, embedded=embedded, plan_source="recorded" if use_recorded else "derived")


def write(repro: Repro, path: str | Path) -> list[Path]:
    """The script at `path` (and its tensors beside it when not embedded); the files written."""
    path = Path(path)
    path.write_text(repro.text, encoding="utf-8")
    written = [path]
    if not repro.embedded:
        torch.save(repro.tensors, path.with_suffix(".pt"))
        written.append(path.with_suffix(".pt"))
    return written


def _render(trace: Trace, backend: str, calls: list[str], output: str, plan_source: str, source_name: str, data: str | None) -> str:
    m, b = trace.model, trace.batch
    library = "triton" if backend == "triton" else "flashinfer"
    what = f"{b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} kv_lens={b.kv_lens.tolist()[:16]}"
    loader = (
        f'DATA = "{data}"\nT = torch.load(io.BytesIO(base64.b64decode(DATA)), weights_only=True)'
        if data is not None
        else 'T = torch.load(Path(__file__).with_suffix(".pt"), weights_only=True)'
    )
    if backend == "triton":
        header = 'if not torch.cuda.is_available():\n    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: the Triton interpreter runs the kernels on the CPU\n\nimport triton\nimport triton.language as tl\n'
        library_code = f"\n# ===== our Triton kernels, as attndbg ships them (backends/triton_kernels) =====\n\n{_kernel_source()}\n\n\nclass decode:  # the kernels' modules, as the adapter calls them\n    decode_attention_fwd = staticmethod(decode_attention_fwd)\n\n\nclass extend:\n    extend_attention_fwd = staticmethod(extend_attention_fwd)\n"
        version = "triton.__version__"
    else:
        header = "import flashinfer\n"
        library_code = ""
        version = "getattr(flashinfer, '__version__', 'unknown')"
    return TEMPLATE.format(
        source=source_name or "a trace",
        step=trace.source.step,
        what=what,
        backend=backend,
        plan_source=plan_source,
        attndbg=__version__,
        library=library,
        header=header,
        library_code=library_code,
        loader=loader,
        calls="\n".join(calls),
        output=output,
        sm_scale=repr(m.sm_scale),
        logit_cap=repr(m.logit_cap),
        group=m.gqa_group,
        version=version,
    )


TEMPLATE = '''#!/usr/bin/env python3
"""Standalone reproduction of {source}, step {step}: {what}
through {backend} ({plan_source} plan), written by attndbg {attndbg}.

Needs only torch and {library}. It rebuilds the step's tensors, calls {library} exactly as
attndbg's {backend} adapter does, and compares the output with a float64 reference computed here
from the KV slots each query row sees. Exit 1: it reproduces (rows beyond tolerance, or NaN/Inf
where the reference is finite); 0: it does not.
"""

from __future__ import annotations

import base64
import enum
import io
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
{header}{library_code}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SM_SCALE = {sm_scale}
LOGIT_CAP = {logit_cap}
GQA_GROUP = {group}

{loader}
X = {{name: T[name].to(DEVICE) for name in ("q", "k_new", "v_new", "k_cache", "v_cache")}}

# ===== the library calls, as the adapter makes them =====
{calls}
if DEVICE == "cuda":
    torch.cuda.synchronize()
out = {output}[: X["q"].shape[0]].double().cpu()


# ===== the float64 reference: query row t sees KV slots SEEN[t] (-1: no more) =====
def attend(dtype):
    q, k, v = (X[name].cpu().to(dtype) for name in ("q", "k_cache", "v_cache"))
    result = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=dtype)
    for t in range(q.shape[0]):
        slots = T["SEEN"][t][T["SEEN"][t] >= 0]
        if slots.numel() == 0:
            continue
        keys = k[slots].repeat_interleave(GQA_GROUP, dim=1)  # [n, Hq, Dk]
        values = v[slots].repeat_interleave(GQA_GROUP, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[t], keys) * SM_SCALE
        if LOGIT_CAP > 0:
            logits = LOGIT_CAP * torch.tanh(logits / LOGIT_CAP)
        result[t] = torch.einsum("hn,nhd->hd", torch.softmax(logits.float(), -1).to(dtype), values)
    return result.double()


reference = attend(torch.float64)
low = attend(X["q"].dtype)  # the same math in the run's dtype: its error sets the tolerance
eps = torch.finfo(X["q"].dtype).eps
tolerance = 2 * (low - reference).abs().amax(-1) + eps * reference.abs().amax(-1) + 1e-6
error = (out - reference).abs().amax(-1)
bad = (error > tolerance) | (~torch.isfinite(out).all(-1) & torch.isfinite(reference).all(-1))

gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
print(f"torch {{torch.__version__}}, CUDA {{torch.version.cuda}}, {library} {{{version}}}, GPU {{gpu}}")
rows = bad.any(-1).nonzero().flatten().tolist()
for t in rows[:10]:
    h = int((error[t] - tolerance[t]).nan_to_num(float("inf")).argmax())
    print(f"FAIL request {{int(T['REQUEST'][t])}} row {{int(T['ROW'][t])}} (step row {{t}}) head {{h}}: "
          f"max abs error {{float(error[t, h]):.3e}}, tolerance {{float(tolerance[t, h]):.3e}}")
if rows:
    print(f"reproduced: {{len(rows)}} of {{out.shape[0]}} rows fail the float64 reference")
    sys.exit(1)
print(f"not reproduced: all {{out.shape[0]}} rows within tolerance of the float64 reference")
sys.exit(0)
'''
