"""The text of a repro script: header, the library (our Triton kernels' source for triton), the
step's tensors, the library calls (eager, or a CUDA graph's build / load_plan / forward), the
inline float64 reference and the verdict. A pure function of what script.py hands it."""

from __future__ import annotations

from dataclasses import dataclass

from attndbg import __version__
from attndbg.backends.base import Padding, ScriptLibrary
from attndbg.trace.schema import Trace

@dataclass(frozen=True)
class GraphParts:
    load: list[str]  # load_plan's calls (outside the graph)
    forward: list[str]  # forward's calls (captured)
    padding: Padding
    used: int  # rows of the static buffers this batch uses (real tokens, then padded ones)
    static_mla: bool  # the static V views K (MLA's latent cache)


def _indent(lines: list[str], empty: str = "pass") -> str:
    return "\n".join(f"    {line}" for line in lines) if lines else f"    {empty}"


def _graph_section(defs: list[str], build: list[str], output: str, g: GraphParts) -> str:
    v_static = 'S["k_new"][..., : X["v_new"].shape[-1]]' if g.static_mla else 'T["S_v_new"].to(DEVICE)'
    v_cache = 'S["k_cache"][..., : X["v_cache"].shape[-1]]' if g.static_mla else 'X["v_cache"].clone()'
    write_v = "" if g.static_mla else '\n    raw(S["v_cache"]).index_copy_(0, LOC, raw(S["v_new"]))'
    return f'''# ===== the CUDA graph, padded to capture_bs={g.padding.capture_bs} as the engine padded it =====
# Static inputs: the real rows, then the padded requests' rows (garbage queries, padded seq_len
# {g.padding.fill_value}); each row's new K/V goes to LOC (out_cache_loc, then the padded rows' slots).
S = {{"q": T["S_q"].to(DEVICE), "k_new": T["S_k_new"].to(DEVICE)}}
S["v_new"] = {v_static}
S["k_cache"] = X["k_cache"].clone()
S["v_cache"] = {v_cache}
LOC = T["LOC"].to(DEVICE)
USED = {g.used}  # rows of the static buffers this batch uses


def raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


# The graph's static buffers and wrappers, as the adapter's graph state builds them.
{chr(10).join(defs)}


def load_plan():  # outside the graph: the padded plan into the static buffers
{_indent(g.load, "pass  # the adapter copies it in place (torch copies, no library call): the buffers above hold it")}


def forward():  # what the engine captures: this step's KV write, then attention on static buffers
    raw(S["k_cache"]).index_copy_(0, LOC, raw(S["k_new"])){write_v}
{_indent(g.forward)}


try:  # every library call: an error or a fault in any of them is the crash this script looks for
{_indent(build)}
    load_plan()
    if DEVICE == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        {output}.fill_(float("nan"))  # what the replay must write
        load_plan()  # engines plan again before each replay, into the same buffers
        graph.replay()
        torch.cuda.synchronize()
    else:
        forward()  # no GPU: the same sequence, eagerly, on the same static buffers
except Exception as error:  # noqa: BLE001
    crashed(error)
static_out = {output}
out = static_out[: X["q"].shape[0]].double().cpu()
padded_nonfinite = int((~torch.isfinite(static_out[X["q"].shape[0] : USED])).sum())
'''


def _eager_section(defs: list[str], calls: list[str], output: str) -> str:
    return f"""# ===== the library calls, as the adapter makes them =====
{chr(10).join(defs)}
try:  # an error or a fault in any of them is the crash this script looks for
{_indent(calls)}
    if DEVICE == "cuda":
        torch.cuda.synchronize()
except Exception as error:  # noqa: BLE001
    crashed(error)
out = {output}[: X["q"].shape[0]].double().cpu()
padded_nonfinite = None
"""


def render(
    trace: Trace,
    backend: str,
    library: ScriptLibrary,
    *,
    defs: list[str],
    calls: list[str],
    output: str,
    plan_source: str,
    source_name: str,
    data: str | None,
    graph: GraphParts | None = None,
) -> str:
    m, b = trace.model, trace.batch
    what = f"{b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} kv_lens={b.kv_lens.tolist()[:16]}"
    if graph is not None:
        what += f", replayed in a CUDA graph at capture_bs={graph.padding.capture_bs} (padded seq_len {graph.padding.fill_value})"
    loader = (
        f'DATA = "{data}"\nT = torch.load(io.BytesIO(base64.b64decode(DATA)), weights_only=True)'
        if data is not None
        else 'T = torch.load(Path(__file__).with_suffix(".pt"), weights_only=True)'
    )
    gpu = (
        f'if not torch.cuda.is_available():\n    print("could not run here: no CUDA GPU ({library.label} runs only on NVIDIA GPUs)")\n    sys.exit(2)\n'
        if library.needs_gpu
        else ""
    )
    section = _graph_section(defs, calls, output, graph) if graph is not None else _eager_section(defs, calls, output)
    crash = trace.source.crash
    return TEMPLATE.format(
        source=source_name or "a trace",
        step=trace.source.step,
        what=what,
        backend=backend,
        plan_source=plan_source,
        attndbg=__version__,
        library=library.label,
        setup=library.setup,
        imports=_indent(library.imports.splitlines()),
        install=library.install,
        prelude=f"\n{library.prelude}\n" if library.prelude else "",
        gpu=gpu,
        crashed=repr(crash),
        crashed_doc=f"\nWhere it was recorded, the call crashed ({crash or 'no error was logged'}): the script makes it in a child\nprocess, so a crash that kills the process is reported too.\n" if crash is not None else "",
        loader=loader,
        section=section,
        sm_scale=repr(m.sm_scale),
        logit_cap=repr(m.logit_cap),
        group=m.gqa_group,
        version=library.version,
    )


TEMPLATE = '''#!/usr/bin/env python3
"""Standalone reproduction of {source}, step {step}: {what}
through {backend} ({plan_source} plan), written by attndbg {attndbg}.

Needs only torch and {library}. It rebuilds the step's tensors, calls the library exactly as
attndbg's {backend} adapter does, and compares the output with a float64 reference computed here
from the KV slots each query row sees. Exit 1: it reproduces (the library call crashed, rows
beyond tolerance, NaN/Inf where the reference is finite, or NaN/Inf in a CUDA graph's padded
rows); 0: it does not; 2: it cannot run here (a package or the GPU it needs is missing). The last
line names the symptom: crash, nan-inf, mismatch or none.
{crashed_doc}"""

from __future__ import annotations

import base64
import enum
import io
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
{setup}
try:
{imports}
except ImportError as missing:
    print(f"could not run here: {{missing}} ({install})")
    sys.exit(2)
{prelude}
{gpu}
CRASHED = {crashed}  # where the step was recorded, the call crashed with this error (None: it did not)
if CRASHED is not None and os.environ.get("REPRO_IN_CHILD") != "1":
    # In a child process: a crash that kills it (a segfault, an abort) is reported here.
    child = subprocess.run([sys.executable, os.path.abspath(__file__)], env={{**os.environ, "REPRO_IN_CHILD": "1"}})
    if child.returncode < 0:
        print(f"reproduced: the library call killed the process ({{signal.Signals(-child.returncode).name}})")
        print("symptom: crash")
        sys.exit(1)
    sys.exit(child.returncode)


def crashed(error):
    first = (str(error).strip().splitlines() or [""])[0][:300]
    print(f"reproduced: the library call crashed: {{type(error).__name__}}: {{first}}")
    if CRASHED is not None:
        print(f"where the step was recorded it crashed too: {{CRASHED or 'no error was logged'}}")
    print("symptom: crash")
    sys.exit(1)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SM_SCALE = {sm_scale}
LOGIT_CAP = {logit_cap}
GQA_GROUP = {group}

{loader}
X = {{name: T[name].to(DEVICE) for name in ("q", "k_new", "v_new", "k_cache", "v_cache")}}

{section}

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
nonfinite = ~torch.isfinite(out).all(-1) & torch.isfinite(reference).all(-1)
bad = (error > tolerance) | nonfinite

gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
print(f"torch {{torch.__version__}}, CUDA {{torch.version.cuda}}, {library} {{{version}}}, GPU {{gpu}}")
if CRASHED is not None:
    print(f"note: where the step was recorded the call crashed ({{CRASHED or 'no error was logged'}}); here it returned")
rows = bad.any(-1).nonzero().flatten().tolist()
for t in rows[:10]:
    h = int((error[t] - tolerance[t]).nan_to_num(float("inf")).argmax())
    print(f"FAIL request {{int(T['REQUEST'][t])}} row {{int(T['ROW'][t])}} (step row {{t}}) head {{h}}: "
          f"max abs error {{float(error[t, h]):.3e}}, tolerance {{float(tolerance[t, h]):.3e}}")
if padded_nonfinite is not None:
    print(f"padded rows: {{padded_nonfinite}} NaN/Inf output values")
if rows:
    print(f"reproduced: {{len(rows)}} of {{out.shape[0]}} rows fail the float64 reference")
    print(f"symptom: {{'nan-inf' if bool(nonfinite.any()) else 'mismatch'}}")
    sys.exit(1)
if padded_nonfinite:
    print(f"reproduced: the real {{out.shape[0]}} rows pass, but the graph's padded rows hold {{padded_nonfinite}} NaN/Inf values")
    print("symptom: nan-inf")
    sys.exit(1)
print(f"not reproduced: all {{out.shape[0]}} rows within tolerance of the float64 reference")
print("symptom: none")
sys.exit(0)
'''
